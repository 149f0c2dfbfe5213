"""The config switch: which backward schedule runs, and whether determinism is required.

Sources, highest first (the first one that says something wins, field by field):

1. the call's keyword arguments (``schedule=``, ``deterministic=``);
2. the innermost ``dash_config(...)`` context, then process-wide ``configure(...)``;
3. the model config: a ``dash_attention`` entry in ``config.json``, e.g.
   ``{"schedule": "shift", "deterministic": true}``, so a checkpoint records how it was trained;
4. environment: ``DASH_SCHEDULE``, ``DASH_DETERMINISTIC`` (1/0/true/false/on/off), and
   ``FLASH_ATTENTION_DETERMINISTIC=1`` (what transformers' ``enable_full_determinism`` sets);
5. ``torch.are_deterministic_algorithms_enabled()`` (only ever turns determinism on);
6. the default: deterministic, schedule ``auto``.

Determinism is the default (DESIGN.md rule 8). Asking for ``atomic`` with determinism required
by any source other than the default is an error, never a silent downgrade.
"""
import contextlib
import os
import threading
from dataclasses import dataclass

import torch

SCHEDULES = {
    "auto": "pick a deterministic schedule per shape from a fixed, committed rule (never timed at run time)",
    "atomic": "atomic adds of dQ partials: fastest reference point, NOT deterministic",
    "ascending": "FA3's deterministic baseline: Q tiles ascending, dQ adds in KV order",
    "spt": "FA3/FA4 causal order: Q tiles ascending, dQ adds in descending KV order (shortest wait first)",
    "descending": "DASH: Q tiles visited in descending order, dQ adds in KV order",
    "shift": "DASH: cyclic shift of the Q-tile order inside groups of KV tiles (symmetric pairs for causal)",
    "split": "no cross-program reduction: dQ recomputed by Q-stationary programs",
}
DETERMINISTIC_SCHEDULES = ("ascending", "spt", "descending", "shift", "split")
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

    def describe(self) -> str:
        concrete = f" -> {self.concrete_schedule}" if self.concrete_schedule and self.concrete_schedule != self.schedule else ""
        return (f"schedule={self.schedule}{concrete} (from {self.schedule_source}), "
                f"deterministic={self.deterministic} (from {self.deterministic_source})")


def check_schedule(value, source: str) -> str:
    if not isinstance(value, str) or value not in SCHEDULES:
        raise ValueError(f"schedule={value!r} (from {source}) is not a schedule; allowed: {', '.join(SCHEDULES)}")
    return value


def check_deterministic(value, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"deterministic={value!r} (from {source}) is not a boolean; allowed: True/False "
                     f"(or in the environment one of {', '.join(_TRUE + _FALSE)})")


# Process-wide defaults set by configure(), and a per-thread stack of dash_config() contexts.
_process_defaults = {"schedule": None, "deterministic": None}
_local = threading.local()


def _context_stack():
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def configure(*, schedule=None, deterministic=None):
    """Set process-wide defaults (None leaves a field as it is). Returns the previous defaults."""
    previous = dict(_process_defaults)
    if schedule is not None:
        _process_defaults["schedule"] = check_schedule(schedule, "configure()")
    if deterministic is not None:
        _process_defaults["deterministic"] = check_deterministic(deterministic, "configure()")
    return previous


def reset_config():
    """Forget what configure() set."""
    _process_defaults.update(schedule=None, deterministic=None)


@contextlib.contextmanager
def dash_config(*, schedule=None, deterministic=None):
    """Within the block, calls use this schedule / determinism unless a call's kwargs say otherwise."""
    entry = {"schedule": None if schedule is None else check_schedule(schedule, "dash_config()"),
             "deterministic": None if deterministic is None else check_deterministic(deterministic, "dash_config()")}
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
    if not isinstance(entry, dict) or set(entry) - {"schedule", "deterministic"}:
        raise ValueError(f"model config dash_attention={entry!r} must be a dict with keys 'schedule' and/or "
                         "'deterministic'")
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


def resolve_config(*, schedule=None, deterministic=None, model_config=None) -> ResolvedConfig:
    """Resolve the switch for one call. ``auto`` stays ``auto`` here; the API turns it into a
    concrete schedule once it knows the shape."""
    sched, sched_src = _first("schedule", schedule, model_config, check_schedule)
    det, det_src = _first("deterministic", deterministic, model_config, check_deterministic)
    if sched is None:
        sched = "auto" if det is not False else "atomic"
        sched_src = "default" if det is not False else f"default for deterministic=False (from {det_src})"
    if det is None:
        det = sched != "atomic"
        det_src = "default" if det else f"default for schedule='atomic' (from {sched_src})"
    if det and sched == "atomic":
        raise ValueError(f"schedule='atomic' (from {sched_src}) is not deterministic, but deterministic=True "
                         f"(from {det_src}). Pick a deterministic schedule ({', '.join(DETERMINISTIC_SCHEDULES)}, "
                         "or 'auto'), or turn determinism off explicitly.")
    return ResolvedConfig(sched, det, sched_src, det_src)


_last = threading.local()


def last_resolved():
    """The ResolvedConfig of this thread's most recent ``flash_attention`` call (None before any)."""
    return getattr(_last, "config", None)


def _remember(config: ResolvedConfig):
    _last.config = config
