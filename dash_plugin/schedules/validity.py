"""Validity checks of a schedule, on the CPU. `validate_schedule` raises ScheduleError naming the
first violation; the kernel tables are only ever built from schedules that pass (tests prove it
over a grid of shapes).

Checked per sequence:
1. coverage: each (Q tile, KV tile) pair inside the mask is visited exactly once by the
   KV-stationary workers, and no pair outside it; every KV tile owns exactly one segment;
2. ranks: for every dQ tile the ranks of its contributors are a permutation of 0..k-1;
3. waits: a wait (rank r waits for rank r-1 of the same dQ tile) points to an earlier-launched
   worker or stays inside the worker's group, and groups have at most `max_group` workers, so any
   cycle of waits lies inside one group that can be co-resident;
4. within a group the waits are acyclic once all members run (checked by the simulator:
   `simulate(..., num_sms=None)` never deadlocks).
"""
from __future__ import annotations

from .builders import MAX_GROUP, SequenceSchedule
from .schedule import Schedule


class ScheduleError(AssertionError):
    pass


def _contributions(seq: SequenceSchedule):
    """(q tile) -> list of (rank, worker index, step index)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for w, worker in enumerate(seq.workers):
        if worker.kind != "kv":
            continue
        for t, (_kv, q, r) in enumerate(worker.steps):
            out.setdefault(q, []).append((r, w, t))
    return out


def check_coverage(seq: SequenceSchedule) -> None:
    geo = seq.geometry
    seen = set()
    owned = []
    for worker in seq.workers:
        if worker.kind != "kv":
            continue
        for seg in worker.segments:
            owned.append(seg.kv)
            for q in seg.q_tiles:
                if (q, seg.kv) in seen:
                    raise ScheduleError(f"pair (q={q}, kv={seg.kv}) visited twice")
                seen.add((q, seg.kv))
    if sorted(owned) != list(range(geo.num_kv_tiles)):
        raise ScheduleError(f"KV tiles owned by segments {sorted(owned)} != 0..{geo.num_kv_tiles - 1}")
    want = {(q, j) for j, (lo, hi) in enumerate(geo.kv_range) for q in range(lo, hi + 1)}
    if seen != want:
        extra, missing = sorted(seen - want)[:3], sorted(want - seen)[:3]
        raise ScheduleError(f"visited pairs differ from the mask: extra {extra}, missing {missing}")


def check_ranks(seq: SequenceSchedule) -> None:
    geo = seq.geometry
    for q, lst in _contributions(seq).items():
        ranks = sorted(r for r, _w, _t in lst)
        if ranks != list(range(len(lst))):
            raise ScheduleError(f"dQ tile {q}: ranks {ranks} are not a permutation of 0..{len(lst) - 1}")
        lo, hi = geo.q_range[q]
        if len(lst) != hi - lo + 1:
            raise ScheduleError(f"dQ tile {q}: {len(lst)} contributors, mask says {hi - lo + 1}")


def check_waits(seq: SequenceSchedule, max_group: int = MAX_GROUP) -> None:
    sizes: dict[int, list[int]] = {}
    for w, worker in enumerate(seq.workers):
        sizes.setdefault(worker.group, []).append(w)
    for g, members in sizes.items():
        if members != list(range(members[0], members[0] + len(members))):
            raise ScheduleError(f"group {g} is not a run of consecutive workers: {members}")
    for q, lst in _contributions(seq).items():
        by_rank = sorted(lst)
        for (_r0, w0, _t0), (_r1, w1, _t1) in zip(by_rank, by_rank[1:]):
            # worker w1 waits for worker w0
            g0, g1 = seq.workers[w0].group, seq.workers[w1].group
            if w0 > w1 and g0 != g1:
                raise ScheduleError(f"dQ tile {q}: worker {w1} (group {g1}) waits for later "
                                    f"worker {w0} of another group {g0}")
            if w0 > w1 and len(sizes[g1]) > max_group:
                raise ScheduleError(f"group {g1} has a cyclic wait and {len(sizes[g1])} workers "
                                    f"> max_group {max_group}")


def sequential_safe(seq: SequenceSchedule) -> bool:
    """True iff every wait points to an earlier-launched worker (or the same worker), so the
    workers can run one after another in launch order (the Triton interpreter does that)."""
    for lst in _contributions(seq).values():
        by_rank = sorted(lst)
        for (_r0, w0, _t0), (_r1, w1, _t1) in zip(by_rank, by_rank[1:]):
            if w0 > w1:
                return False
    return True


def validate_schedule(schedule: Schedule, max_group: int = MAX_GROUP) -> None:
    """Raise ScheduleError unless every sequence of `schedule` is valid."""
    for b, seq in enumerate(schedule.sequences):
        try:
            check_coverage(seq)
            if schedule.ordered:
                check_ranks(seq)
                check_waits(seq, max_group)
        except ScheduleError as e:
            raise ScheduleError(f"{schedule.name}, sequence {b} ({seq.variant}): {e}") from None
