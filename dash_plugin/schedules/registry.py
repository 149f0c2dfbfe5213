"""The schedule registry: every backward schedule, declared once.

An entry says what the schedule does (one line), whether it is deterministic, which kernel mode
runs it (ordered: dQ adds behind semaphores; atomic; split: reduction-free), which backends
implement it, and which builder (builders.py) gives its visits and ranks. Everything else reads
this module: the config switch and the input checks (which names exist, which are
deterministic), the schedule model and the launch plan (builder, mode), `dash-bench` and
`dash-schedule` (their lists), the docs tables (tests/test_registry.py compares them) and the
tests (parametrised from `names()`).

Adding a schedule is a builder plus one `ScheduleSpec` below, or `register(...)` at run time
(tests/test_toy_schedule.py); docs/DESIGN.md, "Adding a schedule".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import builders

# Kernel modes: how the KV-stationary backward programs hand in their dQ partials.
ATOMIC = "atomic"     # atomic adds in arrival order: fast, not deterministic
ORDERED = "ordered"   # adds in the schedule's rank order, one semaphore per dQ tile
SPLIT = "split"       # no dQ adds: Q-stationary programs recompute dQ (reduction-free)
KERNEL_MODES = (ATOMIC, ORDERED, SPLIT)

# `auto` is not a schedule but a rule (auto.py) that picks a deterministic one per shape.
AUTO = "auto"
AUTO_DESCRIPTION = ("picks a deterministic schedule per shape from a fixed, committed rule "
                    "(never a timing taken at run time)")

BUILTIN_BACKENDS = ("reference", "triton")
WITH_HOPPER = BUILTIN_BACKENDS + ("hopper",)   # the KV-stationary schedules the Hopper kernel runs


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    description: str        # one line: --help texts, the docs tables, error messages
    deterministic: bool     # False only for the atomic mode
    kernel_mode: str        # one of KERNEL_MODES
    build: Callable         # (SeqGeometry, group_size | None) -> SequenceSchedule
    backends: tuple[str, ...] = BUILTIN_BACKENDS   # backends that implement it

    @property
    def ordered(self) -> bool:
        """dQ adds in rank order behind semaphores: needs the kernel tables."""
        return self.kernel_mode == ORDERED

    @property
    def reduction_free(self) -> bool:
        return self.kernel_mode == SPLIT


_SPECS: dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add a schedule (a name not taken yet). Determinism follows from the mode: only atomic adds
    depend on arrival order."""
    if not spec.name or spec.name == AUTO or spec.name in _SPECS:
        raise ValueError(f"schedule name {spec.name!r} is empty, reserved or taken; taken: {', '.join(_SPECS)}")
    if spec.kernel_mode not in KERNEL_MODES:
        raise ValueError(f"schedule {spec.name!r}: kernel_mode={spec.kernel_mode!r}; allowed: {', '.join(KERNEL_MODES)}")
    if spec.deterministic != (spec.kernel_mode != ATOMIC):
        raise ValueError(f"schedule {spec.name!r}: deterministic={spec.deterministic} contradicts kernel_mode="
                         f"{spec.kernel_mode!r} (only the atomic mode is not deterministic)")
    _SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _SPECS.pop(name)


def get(name) -> ScheduleSpec:
    """The entry of a concrete schedule; ValueError naming the allowed ones otherwise."""
    spec = _SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"schedule must be one of {', '.join(_SPECS)}; got {name!r}")
    return spec


def names(*, deterministic: bool | None = None) -> tuple[str, ...]:
    """Registered schedule names in declaration order (optionally only the (non-)deterministic ones)."""
    return tuple(n for n, s in _SPECS.items() if deterministic is None or s.deterministic == deterministic)


def specs() -> tuple[ScheduleSpec, ...]:
    return tuple(_SPECS.values())


def check_call(schedule, deterministic: bool, where: str) -> ScheduleSpec:
    """The check of a concrete (schedule, deterministic) pair that reaches an op or a backend:
    `where` prefixes the message (e.g. "dash::bwd: "). deterministic=False means "not required",
    so any schedule may run with it."""
    if schedule == AUTO or schedule not in _SPECS:
        raise ValueError(f"{where}schedule={schedule!r}; a concrete schedule is needed here, one of "
                         f"{', '.join(_SPECS)} (the API resolves 'auto')")
    spec = _SPECS[schedule]
    if deterministic and not spec.deterministic:
        raise ValueError(f"{where}schedule={schedule!r} is not deterministic but deterministic=True")
    return spec


# The built-in orders whose waits may be cyclic inside a group of co-resident programs (a plan's
# group_size > 1): they need up to builders.MAX_GROUP programs resident at once.
MAY_WAIT_CYCLICALLY = ("shift", "arrival")

for _spec in (
    ScheduleSpec("atomic", "atomic adds of dQ partials: the fastest reference point, NOT deterministic",
                 False, ATOMIC, builders.build_atomic, WITH_HOPPER),
    ScheduleSpec("ascending", "FA3's deterministic baseline: Q tiles ascending, dQ adds in KV order",
                 True, ORDERED, builders.build_ascending, WITH_HOPPER),
    ScheduleSpec("spt", "FA3/FA4 causal order: Q tiles ascending, dQ adds in descending KV order "
                 "(shortest wait first)", True, ORDERED, builders.build_spt, WITH_HOPPER),
    ScheduleSpec("descending", "DASH: Q tiles visited in descending order, so short causal columns finish "
                 "early; dQ adds in KV order", True, ORDERED, builders.build_descending, WITH_HOPPER),
    ScheduleSpec("shift", "DASH: cyclic shift of the Q-tile order inside groups of KV tiles, so no two "
                 "writers want one dQ tile at once (symmetric KV-tile pairs for causal)",
                 True, ORDERED, builders.build_shift, WITH_HOPPER),
    ScheduleSpec("arrival", "causal: Q tiles ascending, longest KV tile launched first (beyond 64 KV tiles: "
                 "groups of 64, the top group first), dQ adds in arrival order inside a head (no two "
                 "writers reach a dQ tile at one step)",
                 True, ORDERED, builders.build_arrival, WITH_HOPPER),
    ScheduleSpec("split", "no cross-program reduction: dQ recomputed by Q-stationary programs "
                 "(7 matrix products instead of 5)", True, SPLIT, builders.build_split),
):
    register(_spec)
