"""The config switch: which backward schedule runs, whether determinism is required, and which
kernel backend runs it.

Sources, highest first (the first one that says something wins, field by field):

1. the call's keyword arguments (``schedule=``, ``deterministic=``, ``backend=``);
2. the innermost ``dash_config(...)`` context, then process-wide ``configure(...)``;
3. the model config: a ``dash_attention`` entry in ``config.json``, e.g.
   ``{"schedule": "shift", "deterministic": true}``, so a checkpoint records how it was trained;
4. environment: ``DASH_SCHEDULE``, ``DASH_BACKEND``, ``DASH_DETERMINISTIC`` (1/0/true/false/on/off),
   and ``FLASH_ATTENTION_DETERMINISTIC=1`` (what transformers' ``enable_full_determinism`` sets);
5. ``torch.are_deterministic_algorithms_enabled()`` (only ever turns determinism on);
6. the default: deterministic, schedule ``auto``, backend ``auto``.

Determinism is the default (docs/DESIGN.md, "Determinism rules", rule 8). Asking for ``atomic``
with determinism required by any source other than the default is an error, never a silent
downgrade. Schedule names come from the schedule registry, backend names from the backend
registry (dash_plugin/schedules/registry.py, kernels/backends.py).
"""
import contextlib
import os
import threading
from dataclasses import dataclass

import torch

from .kernels import backends
from .schedules import registry

# The built-in schedules (name -> one line) and the deterministic ones, as registered at import;
# the checks below read the registry itself, so schedules registered later are accepted too.
SCHEDULES = {registry.AUTO: registry.AUTO_DESCRIPTION, **{s.name: s.description for s in registry.specs()}}
DETERMINISTIC_SCHEDULES = registry.names(deterministic=True)
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


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

    def describe(self) -> str:
        def arrow(value, concrete):
            return f" -> {concrete}" if concrete and concrete != value else ""
        return (f"schedule={self.schedule}{arrow(self.schedule, self.concrete_schedule)} (from {self.schedule_source}), "
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
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"deterministic={value!r} (from {source}) is not a boolean; allowed: True/False "
                     f"(or in the environment one of {', '.join(_TRUE + _FALSE)})")


# Process-wide defaults set by configure(), and a per-thread stack of dash_config() contexts.
_process_defaults = {"schedule": None, "deterministic": None, "backend": None}
_local = threading.local()


def _context_stack():
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


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
    """Within the block, calls use this schedule / determinism / backend unless a call's kwargs say otherwise."""
    entry = {"schedule": None if schedule is None else check_schedule(schedule, "dash_config()"),
             "deterministic": None if deterministic is None else check_deterministic(deterministic, "dash_config()"),
             "backend": None if backend is None else check_backend(backend, "dash_config()")}
    stack = _context_stack()
    stack.append(entry)
    try:
        yield
    finally:
        stack.remove(entry)


def _model_entry(model_config):
    if model_config is None:
        return {}
    entry = model_config.get("dash_attention") if isinstance(model_config, dict) else getattr(model_config, "dash_attention", None)
    if entry is None:
        return {}
    if not isinstance(entry, dict) or set(entry) - {"schedule", "deterministic", "backend"}:
        raise ValueError(f"model config dash_attention={entry!r} must be a dict with keys among 'schedule', "
                         "'deterministic' and 'backend'")
    return entry


def _candidates(field, kwarg, model_config):
    """(value, source) pairs for one field, highest precedence first; None values say nothing."""
    yield kwarg, "call argument"
    for entry in reversed(_context_stack()):
        yield entry[field], "dash_config() context"
    yield _process_defaults[field], "configure()"
    yield _model_entry(model_config).get(field), "model config dash_attention"
    if field == "schedule":
        yield os.environ.get("DASH_SCHEDULE") or None, "env DASH_SCHEDULE"
    elif field == "backend":
        yield os.environ.get("DASH_BACKEND") or None, "env DASH_BACKEND"
    else:
        yield os.environ.get("DASH_DETERMINISTIC") or None, "env DASH_DETERMINISTIC"
        if os.environ.get("FLASH_ATTENTION_DETERMINISTIC") == "1":
            yield True, "env FLASH_ATTENTION_DETERMINISTIC=1"
        if torch.are_deterministic_algorithms_enabled():
            yield True, "torch.use_deterministic_algorithms(True)"


def _first(field, kwarg, model_config, check):
    for value, source in _candidates(field, kwarg, model_config):
        if value is not None:
            return check(value, source), source
    return None, "default"


def resolve_config(*, schedule=None, deterministic=None, backend=None, model_config=None) -> ResolvedConfig:
    """Resolve the switch for one call. ``auto`` stays ``auto`` here; the API turns it into a
    concrete schedule and backend once it knows the shape and the inputs."""
    sched, sched_src = _first("schedule", schedule, model_config, check_schedule)
    det, det_src = _first("deterministic", deterministic, model_config, check_deterministic)
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
                          backend_source=back_src)


_last = threading.local()


def last_resolved():
    """The ResolvedConfig of this thread's most recent ``flash_attention`` call (None before any)."""
    return getattr(_last, "config", None)


def _remember(config: ResolvedConfig):
    _last.config = config
