"""The config switch: which backward schedule runs, whether determinism is required, and which
kernel backend runs it.

Sources, highest first (the first one that says something wins, field by field):

1. the call's keyword arguments (``schedule=``, ``deterministic=``, ``backend=``);
2. the innermost ``dash_config(...)`` context, then process-wide ``configure(...)``;
3. the model config: a ``dash_attention`` entry in ``config.json``, e.g.
   ``{"schedule": "shift", "deterministic": true}``, so a checkpoint records how it was trained;
4. environment: ``DASH_SCHEDULE``, ``DASH_BACKEND``, ``DASH_DETERMINISTIC``, and
   ``FLASH_ATTENTION_DETERMINISTIC`` (what transformers' ``enable_full_determinism`` sets);
5. ``torch.are_deterministic_algorithms_enabled()``;
6. the default: deterministic, schedule ``auto``, backend ``auto``.

The rules for ``deterministic``:

- Arguments (call, ``dash_config``, ``configure``, the model config) take real bools only:
  ``True`` or ``False``; anything else (``"false"``, ``1``) is an error.
- Environment variables take ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case, spaces
  around ignored); unset or empty says nothing; anything else is an error naming the variable,
  raised whenever the switch is resolved.
- ``DASH_DETERMINISTIC`` turns determinism on or off. ``FLASH_ATTENTION_DETERMINISTIC`` and the
  torch flag only ever turn it on: their "off" is their own library's default, not a request.
- When the deciding source turns determinism off while a lower one asked for it (e.g.
  ``DASH_DETERMINISTIC=0`` under ``torch.use_deterministic_algorithms(True)``), a ``UserWarning``
  names both; the higher source still wins.
- Asking for ``atomic`` with determinism required by any source other than the default is an
  error, never a silent downgrade (docs/DESIGN.md, "Determinism rules", rule 8).

``dash_config`` contexts belong to the running thread and asyncio task (``contextvars``): a
task's context never leaks into another task. Inside ``torch.compile`` (which cannot read
context variables) the switch is read when the graph is traced, from the thread's most recently
entered or left context, and the compiled graph is guarded on it: concurrent asyncio tasks that
call a compiled function should pass the switch as arguments.

Schedule names come from the schedule registry, backend names from the backend registry
(dash_plugin/schedules/registry.py, kernels/backends.py).
"""
import contextlib
import contextvars
import os
import threading
import warnings
from dataclasses import dataclass, replace

import torch

from .kernels import backends
from .schedules import registry

# The built-in schedules (name -> one line) and the deterministic ones, as registered at import;
# the checks below read the registry itself, so schedules registered later are accepted too.
SCHEDULES = {registry.AUTO: registry.AUTO_DESCRIPTION, **{s.name: s.description for s in registry.specs()}}
DETERMINISTIC_SCHEDULES = registry.names(deterministic=True)
ENV_TRUE = ("1", "true", "yes", "on")
ENV_FALSE = ("0", "false", "no", "off")
_TORCH_FLAG = "torch.use_deterministic_algorithms(True)"


@dataclass(frozen=True)
class ResolvedConfig:
    """What one call resolved to, and which source decided each field."""
    schedule: str
    deterministic: bool
    schedule_source: str
    deterministic_source: str
    concrete_schedule: str = ""  # what ``auto`` turned into for the call's shape ("" until known)
    backend: str = backends.AUTO
    backend_source: str = "default"
    concrete_backend: str = ""   # the backend that ran ("" until known)
    backend_passed_over: tuple = ()   # "backend: why not" for each faster backend auto passed over
    # The order the backward's launch plan runs where the named one does not apply to the shape
    # ("" where it does), e.g. "descending (fallback: not a causal mask)" for arrival on a full mask.
    plan_fallback: str = ""

    def describe(self) -> str:
        def arrow(value, concrete):
            return f" -> {concrete}" if concrete and concrete != value else ""
        fallback = f" [its launch plan runs {self.plan_fallback}]" if self.plan_fallback else ""
        return (f"schedule={self.schedule}{arrow(self.schedule, self.concrete_schedule)} (from {self.schedule_source})"
                f"{fallback}, "
                f"deterministic={self.deterministic} (from {self.deterministic_source}), "
                f"backend={self.backend}{arrow(self.backend, self.concrete_backend)} (from {self.backend_source}"
                + "".join(f"; {why}" for why in self.backend_passed_over) + ")")


def check_schedule(value, source: str) -> str:
    allowed = (registry.AUTO,) + registry.names()
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"schedule={value!r} (from {source}) is not a schedule; allowed: {', '.join(allowed)}")
    return value


def check_backend(value, source: str) -> str:
    allowed = (backends.AUTO,) + backends.names()
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"backend={value!r} (from {source}) is not a backend; allowed: {', '.join(allowed)}")
    return value


def check_deterministic(value, source: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"deterministic={value!r} (from {source}) is not a bool; allowed: True, False "
                     "(environment variables take 1/0, true/false, yes/no, on/off)")


def env_flag(name: str):
    """A yes/no environment variable: True, False, or None when unset or empty. Any other value
    is an error naming the variable."""
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if not word:
        return None
    if word in ENV_TRUE + ENV_FALSE:
        return word in ENV_TRUE
    allowed = ", ".join(w for pair in zip(ENV_TRUE, ENV_FALSE) for w in pair)
    raise ValueError(f"{name}={raw!r} is not a yes/no value; allowed: {allowed} (any case)")


# Process-wide defaults set by configure(), and the dash_config() stack of the running thread and
# asyncio task. torch.compile cannot read a ContextVar: traced code reads `_traced.stack`, the
# thread's copy of the stack as the last dash_config() entered or left it, and guards on it.
_process_defaults = {"schedule": None, "deterministic": None, "backend": None}
_stack = contextvars.ContextVar("dash_config_stack", default=())
_traced = threading.local()


def _context_stack() -> tuple:
    if torch.compiler.is_compiling():
        return getattr(_traced, "stack", ())
    return _stack.get()


def configure(*, schedule=None, deterministic=None, backend=None):
    """Set process-wide defaults (None leaves a field as it is). Returns the previous defaults."""
    previous = dict(_process_defaults)
    if schedule is not None:
        _process_defaults["schedule"] = check_schedule(schedule, "configure()")
    if deterministic is not None:
        _process_defaults["deterministic"] = check_deterministic(deterministic, "configure()")
    if backend is not None:
        _process_defaults["backend"] = check_backend(backend, "configure()")
    return previous


def reset_config():
    """Forget what configure() set."""
    _process_defaults.update(schedule=None, deterministic=None, backend=None)


@contextlib.contextmanager
def dash_config(*, schedule=None, deterministic=None, backend=None):
    """Within the block, calls use this schedule / determinism / backend unless a call's kwargs say
    otherwise. The block belongs to the running thread and asyncio task (see the module doc)."""
    entry = {"schedule": None if schedule is None else check_schedule(schedule, "dash_config()"),
             "deterministic": None if deterministic is None else check_deterministic(deterministic, "dash_config()"),
             "backend": None if backend is None else check_backend(backend, "dash_config()")}
    token = _stack.set(_stack.get() + (entry,))
    _traced.stack = _stack.get()
    try:
        yield
    finally:
        _stack.reset(token)
        _traced.stack = _stack.get()


def _model_entry(model_config):
    if model_config is None:
        return {}
    if isinstance(model_config, (str, bytes, int, float, bool, list, tuple, set)):   # a config object or a dict is meant
        raise ValueError(f"model_config={model_config!r} must be a model config (an object or a dict with an "
                         "optional 'dash_attention' entry), or None")
    entry = model_config.get("dash_attention") if isinstance(model_config, dict) else getattr(model_config, "dash_attention", None)
    if entry is None:
        return {}
    if not isinstance(entry, dict) or set(entry) - {"schedule", "deterministic", "backend"}:
        raise ValueError(f"model config dash_attention={entry!r} must be a dict with keys among 'schedule', "
                         "'deterministic' and 'backend'")
    return entry


_ENV = {"schedule": "DASH_SCHEDULE", "backend": "DASH_BACKEND"}


def _candidates(field, kwarg, model_config):
    """(value, source) pairs for one field, highest precedence first; None values say nothing."""
    yield kwarg, "call argument"
    for entry in reversed(_context_stack()):
        yield entry[field], "dash_config() context"
    yield _process_defaults[field], "configure()"
    yield _model_entry(model_config).get(field), "model config dash_attention"
    if field != "deterministic":
        # stripped as env_flag strips the yes/no variables: a shell's stray space is no error
        yield os.environ.get(_ENV[field], "").strip() or None, f"env {_ENV[field]}"
        return
    yield env_flag("DASH_DETERMINISTIC"), "env DASH_DETERMINISTIC"
    # These two only turn determinism on: their "off" is their own library's default.
    yield env_flag("FLASH_ATTENTION_DETERMINISTIC") or None, "env FLASH_ATTENTION_DETERMINISTIC"
    yield torch.are_deterministic_algorithms_enabled() or None, _TORCH_FLAG


_ENV_READ = (*_ENV.values(), "DASH_DETERMINISTIC", "FLASH_ATTENTION_DETERMINISTIC")   # what _candidates reads


def _sources(field, kwarg, model_config, check):
    """Every source that says something about `field`, highest first, as checked (value, source)
    pairs: a malformed value is an error even where a higher source decides."""
    return [(check(value, source), source) for value, source in _candidates(field, kwarg, model_config)
            if value is not None]


def _first(field, kwarg, model_config, check):
    said = _sources(field, kwarg, model_config, check)
    return said[0] if said else (None, "default")


@torch.compiler.assume_constant_result   # torch.compile cannot trace warnings.warn: it runs once, when traced
def warn_user(message: str, stacklevel: int = 4) -> bool:
    """A UserWarning (the default filter shows it once per place; default place: the caller of
    flash_attention), also from code torch.compile traces."""
    warnings.warn(message, UserWarning, stacklevel=stacklevel)
    return True


def _turned_off_warning(said):
    """The deciding source turns determinism off while a lower one asked for it: what to say (else None)."""
    if not said or said[0][0] is not False:
        return None
    asked = next((source for value, source in said[1:] if value), None)
    if asked is None:
        return None
    return (f"dash_plugin: deterministic=False (from {said[0][1]}) overrides deterministic=True (from {asked}): "
            "the attention backward may not be bit-reproducible")


def resolve_config(*, schedule=None, deterministic=None, backend=None, model_config=None) -> ResolvedConfig:
    """Resolve the switch for one call. ``auto`` stays ``auto`` here; the API turns it into a
    concrete schedule and backend once it knows the shape and the inputs."""
    key = None if torch.compiler.is_compiling() else _inputs_key(schedule, deterministic, backend, model_config)
    try:
        hit = _resolved.get(key)   # None is never a key
    except TypeError:   # an argument that does not hash: _resolve refuses it or resolves it uncached
        key = hit = None
    if hit is None:
        hit = _resolve(schedule, deterministic, backend, model_config)
        if key is not None:
            if len(_resolved) >= _RESOLVED_MAX:
                _resolved.clear()
            _resolved[key] = hit
    resolved, warning = hit
    if warning is not None:
        warn_user(warning)
    return resolved


# resolve_config's answers by everything they depend on (_inputs_key): a call costs a lookup
# instead of walking every source of every field (about a fifth of the API's host time per call,
# scripts/host_overhead.py). Values are (ResolvedConfig, warning or None); errors are not kept.
_resolved: dict = {}
_RESOLVED_MAX = 256


def _inputs_key(schedule, deterministic, backend, model_config):
    """Everything _resolve reads, as a tuple (it may hold an argument that does not hash: the
    lookup finds that out). The environment is read on every call, so a variable set between
    calls takes effect as before. True == 1 and hash alike: the types are kept apart, so
    deterministic=1 is still refused."""
    return (schedule, deterministic, backend,
            tuple((field, value, type(value)) for field, value in _model_entry(model_config).items()),
            tuple(tuple(entry.values()) for entry in _context_stack()), tuple(_process_defaults.values()),
            tuple(map(os.environ.get, _ENV_READ)), torch.are_deterministic_algorithms_enabled(),
            type(schedule), type(deterministic), type(backend))


def _resolve(schedule, deterministic, backend, model_config):
    """(ResolvedConfig, the warning the deciding sources call for or None), from every source."""
    sched, sched_src = _first("schedule", schedule, model_config, check_schedule)
    said = _sources("deterministic", deterministic, model_config, check_deterministic)
    det, det_src = said[0] if said else (None, "default")
    warning = _turned_off_warning(said)
    back, back_src = _first("backend", backend, model_config, check_backend)
    if sched is None:
        sched = "auto" if det is not False else "atomic"
        sched_src = "default" if det is not False else f"default for deterministic=False (from {det_src})"
    deterministic_schedule = sched == registry.AUTO or registry.get(sched).deterministic
    if det is None:
        det = deterministic_schedule
        det_src = "default" if det else f"default for schedule={sched!r} (from {sched_src})"
    if det and not deterministic_schedule:
        raise ValueError(f"schedule={sched!r} (from {sched_src}) is not deterministic, but deterministic=True "
                         f"(from {det_src}). Pick a deterministic schedule "
                         f"({', '.join(registry.names(deterministic=True))}, or 'auto'), or turn determinism off "
                         "explicitly.")
    return ResolvedConfig(sched, det, sched_src, det_src, backend=back or backends.AUTO,
                          backend_source=back_src), warning


_last = threading.local()


def last_resolved():
    """The ResolvedConfig of this thread's most recent ``flash_attention`` call that got as far as
    choosing its backend (a call refused before that leaves the previous one; None before any)."""
    pending = getattr(_last, "pending", None)
    if pending is not None:
        config, ran, plan = pending
        if plan is not None:   # (function, arguments) that name the plan's fallback order
            ran = dict(ran, plan_fallback=plan[0](*plan[1:]))
        _last.config, _last.pending = replace(config, **ran), None
    return getattr(_last, "config", None)


def _remember(config: ResolvedConfig, plan: tuple | None = None, **ran):
    """Remember a call's config with the fields `ran` filled in (concrete schedule and backend), and
    `plan`, a (function, *arguments) that gives the plan's fallback order. The ResolvedConfig is
    built when last_resolved() asks: most calls are never asked about, and building it
    (dataclasses.replace, a launch plan) costs host time."""
    _last.pending = (config, ran, plan)
