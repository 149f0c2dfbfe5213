"""Schedule builders: which Q tiles each worker visits, in what order, and each dQ tile's
addition order (the ranks). This module is the single source of truth; the kernel tables
(`tables.py`), the DAG simulator (`simulate.py`) and the pictures (`gantt.py`) all read the
`Schedule` built here.

One rank rule for every ordered schedule (see docs/schedules/README.md):
workers are numbered in launch order and split into groups of consecutive workers; the
contributions to a dQ tile are ranked by (group, lock-step arrival step, worker index).
So earlier groups always add first (a wait never points to a later group), and inside a group
the ranks equal the order of arrival when every stage costs the same (nobody waits).
For singleton groups this is the plain KV order: ascending/descending get rank = j - jlo_i,
SPT (workers launched from the last KV tile down) gets rank = jhi_i - j.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .geometry import SeqGeometry, make_geometry

ORDERED_SCHEDULES = ("ascending", "spt", "descending", "shift")
ALL_SCHEDULES = ("atomic", "ascending", "spt", "descending", "shift", "split")

# Largest group of workers whose waits may form cycles (shift). Rank math never sees the SM
# count; this constant only has to be <= the programs that are surely resident at once on the
# smallest supported GPU: H20 has 78 SMs, one program per SM, so 64 leaves a margin of 14 SMs
# (e.g. for an sm_margin or another stream). Why that suffices: docs/schedules/README.md.
MAX_GROUP = 64


@dataclass(frozen=True)
class Segment:
    kv: int                       # KV tile owned by this segment
    q_tiles: tuple[int, ...]      # Q tiles in visit order
    ranks: tuple[int, ...] | None  # rank of each contribution; None: no ordered dQ add


@dataclass(frozen=True)
class Worker:
    """One program of one (sequence, KV head): one or two segments run back to back."""

    segments: tuple[Segment, ...]
    group: int          # workers of one group may wait on each other cyclically
    kind: str = "kv"    # "kv": KV-stationary; "q": Q-stationary dQ program (split)

    @property
    def steps(self) -> list[tuple[int, int, int | None]]:
        """(kv tile, q tile, rank) per step, over all segments in order."""
        out = []
        for seg in self.segments:
            ranks = seg.ranks if seg.ranks is not None else (None,) * len(seg.q_tiles)
            out.extend((seg.kv, q, r) for q, r in zip(seg.q_tiles, ranks))
        return out

    @property
    def num_steps(self) -> int:
        return sum(len(s.q_tiles) for s in self.segments)


@dataclass(frozen=True)
class SequenceSchedule:
    geometry: SeqGeometry
    workers: tuple[Worker, ...]
    variant: str     # what was built, e.g. "shift-cyclic", "descending (fallback: odd N)"
    group_size: int  # largest group with cyclic waits possible (1: waits only point backwards)


@dataclass(frozen=True)
class Schedule:
    name: str
    sequences: tuple[SequenceSchedule, ...]
    block_m: int
    block_n: int
    causal: bool
    window_left: int
    window_right: int
    group_size: int | None  # as requested (None: default rule)

    @property
    def ordered(self) -> bool:
        return self.name in ORDERED_SCHEDULES

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(s.variant for s in self.sequences)


# ----------------------------------------------------------------------------- input checks

def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def normalize_args(schedule, seqlens_q, seqlens_k, block_m, block_n, causal, window_left,
                   window_right, group_size):
    """Validate arguments; return them with lists as tuples and windows as -1 / >= 0."""
    if schedule not in ALL_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(ALL_SCHEDULES)}; got {schedule!r}")
    if isinstance(seqlens_q, int) or isinstance(seqlens_k, int):
        raise TypeError("seqlens_q and seqlens_k must be lists of ints (one per sequence); "
                        f"got {seqlens_q!r}, {seqlens_k!r}")
    sq = tuple(_check_int(f"seqlens_q[{b}]", s, 0) for b, s in enumerate(seqlens_q))
    sk = tuple(_check_int(f"seqlens_k[{b}]", s, 0) for b, s in enumerate(seqlens_k))
    if len(sq) == 0 or len(sq) != len(sk):
        raise ValueError("seqlens_q and seqlens_k must be non-empty and of equal length; got "
                         f"{len(sq)} and {len(sk)}")
    _check_int("block_m", block_m, 1)
    _check_int("block_n", block_n, 1)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    _check_int("window_left", window_left, -(1 << 62))
    _check_int("window_right", window_right, -(1 << 62))
    wl = -1 if window_left < 0 else window_left
    wr = -1 if window_right < 0 else window_right
    if causal:
        if wr > 0:
            raise ValueError(f"causal=True needs window_right 0 or -1 (it means window_right=0); "
                             f"got window_right={window_right}")
        wr = 0
    if group_size is not None:
        _check_int("group_size", group_size, 1)
    return schedule, sq, sk, block_m, block_n, wr == 0 and wl < 0, wl, wr, group_size


# ----------------------------------------------------------------------------- rank rule

def assign_ranks(geo: SeqGeometry, plan: list[tuple[int, list[tuple[int, list[int]]]]]
                 ) -> tuple[Worker, ...]:
    """Turn a plan [(group, [(kv, q_tiles), ...]) per worker in launch order] into workers
    with ranks: per dQ tile, contributions sorted by (group, step within worker, worker)."""
    keys: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for w, (group, segs) in enumerate(plan):
        step = 0
        for s, (_kv, qs) in enumerate(segs):
            for k, q in enumerate(qs):
                keys.setdefault(q, []).append((group, step, w, s, k))
                step += 1
    ranks = [[[0] * len(qs) for _kv, qs in segs] for _g, segs in plan]
    for q, lst in keys.items():
        lst.sort()
        for r, (_g, _t, w, s, k) in enumerate(lst):
            ranks[w][s][k] = r
    return tuple(
        Worker(tuple(Segment(kv, tuple(qs), tuple(ranks[w][s])) for s, (kv, qs) in enumerate(segs)),
               group)
        for w, (group, segs) in enumerate(plan))


def default_group_size(units: int) -> int:
    """G for `units` co-waiting workers (KV tiles, or pairs for causal shift): the whole
    head when it fits in MAX_GROUP, else the fewest equal groups that fit. Depends only on
    the number of tiles, never on the GPU."""
    if units <= 0:
        return 1
    groups = -(-units // MAX_GROUP)
    return -(-units // groups)


# ----------------------------------------------------------------------------- builders

def _kv_range(geo, j):
    lo, hi = geo.kv_range[j]
    return list(range(lo, hi + 1))


def _plan_ascending(geo):
    return [(j, [(j, _kv_range(geo, j))]) for j in range(geo.num_kv_tiles)]


def _plan_descending(geo):
    return [(j, [(j, _kv_range(geo, j)[::-1])]) for j in range(geo.num_kv_tiles)]


def _plan_spt(geo):
    # Launched from the last KV tile down (FA3 SPT); with singleton groups the rank rule then
    # gives rank = jhi_i - j, and every wait points to an earlier-launched worker.
    n = geo.num_kv_tiles
    return [(w, [(n - 1 - w, _kv_range(geo, n - 1 - w))]) for w in range(n)]


def _plan_shift_cyclic(geo, g):
    """Full mask: groups of g consecutive KV tiles; member l visits lo + ((l + t) mod L)."""
    plan = []
    n = geo.num_kv_tiles
    for j0 in range(0, n, g):
        for j in range(j0, min(j0 + g, n)):
            lo, hi = geo.kv_range[j]
            length = hi - lo + 1
            l = j - j0
            plan.append((j0 // g, [(j, [lo + (l + t) % length for t in range(length)])]))
    return plan


def _plan_shift_symmetric(geo, g):
    """Causal, N even: pair p owns KV p (big side) then KV N-1-p (small side); groups of g
    pairs. Big side: the group's rectangle (rows from the first row of its last big side to the
    end) cyclically shifted by the member index, then its private triangle ascending. Small
    side: its rows from the last one down."""
    n = geo.num_kv_tiles
    pairs = n // 2
    plan = []
    for p0 in range(0, pairs, g):
        members = range(p0, min(p0 + g, pairs))
        r0 = geo.kv_range[members[-1]][0]
        for p in members:
            lo, hi = geo.kv_range[p]
            rlen = hi - r0 + 1
            l = p - p0
            big = [r0 + (l + t) % rlen for t in range(rlen)] + list(range(lo, r0))
            small = _kv_range(geo, n - 1 - p)[::-1]
            plan.append((p0 // g, [(p, big), (n - 1 - p, small)]))
    return plan


def symmetric_shift_fallback_reason(geo: SeqGeometry) -> str | None:
    """Why the causal symmetric shift does not apply to this sequence (None: it applies)."""
    n = geo.num_kv_tiles
    if not geo.is_causal:
        return "window mask (symmetric pairing needs a plain causal mask)"
    if geo.seqlen_q != geo.seqlen_k:
        return f"seqlen_q {geo.seqlen_q} != seqlen_k {geo.seqlen_k}"
    if geo.block_n % geo.block_m != 0:
        return f"block_n {geo.block_n} not a multiple of block_m {geo.block_m}"
    if n < 2 or n % 2 != 0:
        return f"odd number of KV tiles ({n})"
    return None


def _build_sequence(name: str, geo: SeqGeometry, group_size: int | None) -> SequenceSchedule:
    n = geo.num_kv_tiles
    if name in ("ascending", "atomic"):
        plan, variant = _plan_ascending(geo), name
    elif name == "descending":
        plan, variant = _plan_descending(geo), name
    elif name == "spt":
        plan, variant = _plan_spt(geo), name
    elif name == "shift":
        if geo.is_full:
            g = group_size or default_group_size(n)
            m = geo.num_q_tiles
            if n <= 1:
                plan, variant = _plan_ascending(geo), "ascending (fallback: one KV tile)"
            elif m < min(g, n):
                # the cyclic order needs at least as many Q tiles as co-running KV tiles
                plan, variant = _plan_ascending(geo), f"ascending (fallback: {m} Q tiles < group {min(g, n)})"
            else:
                plan = _plan_shift_cyclic(geo, g)
                return SequenceSchedule(geo, assign_ranks(geo, plan), "shift-cyclic", min(g, n))
        else:
            reason = symmetric_shift_fallback_reason(geo)
            if reason is None:
                g = group_size or default_group_size(n // 2)
                plan = _plan_shift_symmetric(geo, g)
                return SequenceSchedule(geo, assign_ranks(geo, plan), "shift-symmetric", min(g, n // 2))
            plan, variant = _plan_descending(geo), f"descending (fallback: {reason})"
    elif name == "split":
        return _build_split(geo)
    else:  # pragma: no cover - normalize_args rejects it
        raise ValueError(name)
    workers = assign_ranks(geo, plan)
    if name == "atomic":
        workers = tuple(Worker(tuple(Segment(s.kv, s.q_tiles, None) for s in w.segments), w.group)
                        for w in workers)
    return SequenceSchedule(geo, workers, variant, 1)


def _build_split(geo: SeqGeometry) -> SequenceSchedule:
    """No cross-worker reduction: KV-stationary programs write dK/dV only, then Q-stationary
    programs recompute their row's scores and sum dQ on chip (ascending KV)."""
    kv = [Worker((Segment(j, tuple(_kv_range(geo, j)), None),), j) for j in range(geo.num_kv_tiles)]
    q = [Worker((Segment(-1, (i,) * (hi - lo + 1), None),), geo.num_kv_tiles + i, "q")
         for i, (lo, hi) in enumerate(geo.q_range)]
    return SequenceSchedule(geo, tuple(kv + q), "split", 1)


@lru_cache(maxsize=256)
def _build_cached(name, seqlens_q, seqlens_k, block_m, block_n, window_left, window_right,
                  group_size, causal):
    seqs = []
    cache: dict[tuple[int, int], SequenceSchedule] = {}
    for sq, sk in zip(seqlens_q, seqlens_k):
        if (sq, sk) not in cache:  # varlen batches often repeat lengths
            geo = make_geometry(sq, sk, block_m, block_n, window_left, window_right)
            cache[(sq, sk)] = _build_sequence(name, geo, group_size)
        seqs.append(cache[(sq, sk)])
    return Schedule(name, tuple(seqs), block_m, block_n, causal, window_left, window_right,
                    group_size)


def build_schedule(schedule: str, *, seqlens_q, seqlens_k, block_m: int, block_n: int,
                   causal: bool = False, window_left: int = -1, window_right: int = -1,
                   group_size: int | None = None) -> Schedule:
    """Build (cached per shape) the schedule `schedule` for a batch of sequences.

    Dense batches pass one length pair. GQA and the number of heads do not change the
    schedule: every (KV head, query head) repeats the same per-sequence plan.
    """
    name, sq, sk, bm, bn, causal_n, wl, wr, g = normalize_args(
        schedule, seqlens_q, seqlens_k, block_m, block_n, causal, window_left, window_right,
        group_size)
    return _build_cached(name, sq, sk, bm, bn, wl, wr, g, causal_n)
