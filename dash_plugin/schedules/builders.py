"""Per-sequence schedule builders: which Q tiles each worker visits, in what order, and each dQ
tile's addition order (the ranks). One builder per schedule; the registry (registry.py) names
which builder a schedule uses, and `schedule.build_schedule` runs it for every sequence of a
batch. The kernel tables (`tables.py`), the launch plan (`plan.py`), the DAG simulator
(`simulate.py`) and the pictures (`gantt.py`) all read the schedules built here.

One rank rule for every ordered schedule (see docs/schedules/README.md):
workers are numbered in launch order and split into groups of consecutive workers; the
contributions to a dQ tile are ranked by (group, lock-step arrival step, worker index).
So earlier groups always add first (a wait never points to a later group), and inside a group
the ranks equal the order of arrival when every stage costs the same (nobody waits).
For singleton groups this is the plain KV order: ascending/descending get rank = j - jlo_i,
SPT (workers launched from the last KV tile down) gets rank = jhi_i - j.

A builder takes (geometry of one sequence, requested group size or None) and returns a
`SequenceSchedule`; a new ordered schedule only has to list each worker's visits and call
`ordered_sequence` (docs/DESIGN.md, "Adding a schedule").
"""
from __future__ import annotations

from dataclasses import dataclass

from .geometry import SeqGeometry

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


def is_fallback(variant: str) -> bool:
    """Whether a built variant is a fallback order, built where the named one does not apply
    (its name says so and why: "descending (fallback: not a causal mask)")."""
    return "(fallback: " in variant


@dataclass(frozen=True)
class SequenceSchedule:
    geometry: SeqGeometry
    workers: tuple[Worker, ...]
    variant: str     # what was built, e.g. "shift-cyclic", "descending (fallback: odd N)"
    group_size: int  # largest group with cyclic waits possible (1: waits only point backwards)


# ----------------------------------------------------------------------------- rank rule

# Visits of a sequence, worker by worker in launch order: [(group, [(kv tile, [q tiles in visit
# order]) per segment]) per worker].
Visits = list[tuple[int, list[tuple[int, list[int]]]]]


def assign_ranks(geo: SeqGeometry, visits: Visits) -> tuple[Worker, ...]:
    """Turn visits into workers with ranks: per dQ tile, contributions sorted by (group, step
    within worker, worker)."""
    keys: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for w, (group, segs) in enumerate(visits):
        step = 0
        for s, (_kv, qs) in enumerate(segs):
            for k, q in enumerate(qs):
                keys.setdefault(q, []).append((group, step, w, s, k))
                step += 1
    ranks = [[[0] * len(qs) for _kv, qs in segs] for _g, segs in visits]
    for q, lst in keys.items():
        lst.sort()
        for r, (_g, _t, w, s, k) in enumerate(lst):
            ranks[w][s][k] = r
    return tuple(
        Worker(tuple(Segment(kv, tuple(qs), tuple(ranks[w][s])) for s, (kv, qs) in enumerate(segs)),
               group)
        for w, (group, segs) in enumerate(visits))


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


def _visits_ascending(geo):
    return [(j, [(j, _kv_range(geo, j))]) for j in range(geo.num_kv_tiles)]


def _visits_descending(geo):
    return [(j, [(j, _kv_range(geo, j)[::-1])]) for j in range(geo.num_kv_tiles)]


def _visits_spt(geo):
    # Launched from the last KV tile down (FA3 SPT); with singleton groups the rank rule then
    # gives rank = jhi_i - j, and every wait points to an earlier-launched worker.
    n = geo.num_kv_tiles
    return [(w, [(n - 1 - w, _kv_range(geo, n - 1 - w))]) for w in range(n)]


def arrival_launch(n: int, g: int) -> list[int]:
    """KV tile of each launch slot under `arrival`: groups of g consecutive KV tiles counted from
    the last one down, the top group launched first, each group from its first KV tile up (the
    bottom group takes what is left). With g >= n: the plain ascending launch."""
    return [max(n - (s // g + 1) * g, 0) + s % g for s in range(n)]


def _visits_arrival(geo, g):
    """Ascending visits, launched by `arrival_launch`: under a causal mask KV tile j reaches row
    m at step m - lo_j, later for every lower j, so at each row the tiles of a higher group
    arrive first and the rank rule's (group, step, worker) gives each dQ tile's adds in arrival
    order, nobody waiting in lock-step. Every wait points to a tile of a group launched earlier
    or to a later tile of its own group (co-resident)."""
    return [(s // g, [(j, _kv_range(geo, j))]) for s, j in enumerate(arrival_launch(geo.num_kv_tiles, g))]


def _visits_shift_cyclic(geo, g):
    """Full mask: groups of g consecutive KV tiles; member l visits lo + ((l + t) mod L)."""
    visits = []
    n = geo.num_kv_tiles
    for j0 in range(0, n, g):
        for j in range(j0, min(j0 + g, n)):
            lo, hi = geo.kv_range[j]
            length = hi - lo + 1
            l = j - j0
            visits.append((j0 // g, [(j, [lo + (l + t) % length for t in range(length)])]))
    return visits


def _visits_shift_symmetric(geo, g):
    """Causal, N even: pair p owns KV p (big side) then KV N-1-p (small side); groups of g
    pairs. Big side: the group's rectangle (rows from the first row of its last big side to the
    end) cyclically shifted by the member index, then its private triangle ascending. Small
    side: its rows from the last one down."""
    n = geo.num_kv_tiles
    pairs = n // 2
    visits = []
    for p0 in range(0, pairs, g):
        members = range(p0, min(p0 + g, pairs))
        r0 = geo.kv_range[members[-1]][0]
        for p in members:
            lo, hi = geo.kv_range[p]
            rlen = hi - r0 + 1
            l = p - p0
            big = [r0 + (l + t) % rlen for t in range(rlen)] + list(range(lo, r0))
            small = _kv_range(geo, n - 1 - p)[::-1]
            visits.append((p0 // g, [(p, big), (n - 1 - p, small)]))
    return visits


# The fallback reason where a sequence has no keys (a packed batch may hold empty sequences).
NO_KV_TILES = "no KV tiles (no keys)"


def symmetric_shift_fallback_reason(geo: SeqGeometry) -> str | None:
    """Why the causal symmetric shift does not apply to this sequence (None: it applies)."""
    n = geo.num_kv_tiles
    if n == 0:   # first: nothing to pair whatever the mask (0 is no odd count)
        return NO_KV_TILES
    if not geo.is_causal:
        return "window mask (symmetric pairing needs a plain causal mask)"
    if geo.seqlen_q != geo.seqlen_k:
        return f"seqlen_q {geo.seqlen_q} != seqlen_k {geo.seqlen_k}"
    if geo.block_n % geo.block_m != 0:
        return f"block_n {geo.block_n} not a multiple of block_m {geo.block_m}"
    if n % 2 != 0:
        return f"odd number of KV tiles ({n})"
    return None


def ordered_sequence(geo: SeqGeometry, visits: Visits, variant: str,
                     group_size: int = 1) -> SequenceSchedule:
    """The sequence of an ordered schedule from its visits, ranked by the rank rule. `group_size`
    is the largest group whose waits may be cyclic (1: every wait points to an earlier-launched
    worker)."""
    return SequenceSchedule(geo, assign_ranks(geo, visits), variant, group_size)


# ----------------------------------------------------------------------------- one per schedule

def build_ascending(geo: SeqGeometry, group_size: int | None = None) -> SequenceSchedule:
    return ordered_sequence(geo, _visits_ascending(geo), "ascending")


def build_descending(geo: SeqGeometry, group_size: int | None = None) -> SequenceSchedule:
    return ordered_sequence(geo, _visits_descending(geo), "descending")


def build_spt(geo: SeqGeometry, group_size: int | None = None) -> SequenceSchedule:
    return ordered_sequence(geo, _visits_spt(geo), "spt")


def build_shift(geo: SeqGeometry, group_size: int | None = None) -> SequenceSchedule:
    """DASH shift: the cyclic shift for full masks, the symmetric pairs for causal masks, each with
    the fallbacks of docs/schedules/README.md (the variant names the one taken)."""
    n = geo.num_kv_tiles
    if geo.is_full:
        g = group_size or default_group_size(n)
        m = geo.num_q_tiles
        if n <= 1:
            return ordered_sequence(geo, _visits_ascending(geo),
                                    f"ascending (fallback: {'one KV tile' if n else NO_KV_TILES})")
        if m < min(g, n):
            # the cyclic order needs at least as many Q tiles as co-running KV tiles
            return ordered_sequence(geo, _visits_ascending(geo),
                                    f"ascending (fallback: {m} Q tiles < group {min(g, n)})")
        return ordered_sequence(geo, _visits_shift_cyclic(geo, g), "shift-cyclic", min(g, n))
    reason = symmetric_shift_fallback_reason(geo)
    if reason is None:
        g = group_size or default_group_size(n // 2)
        return ordered_sequence(geo, _visits_shift_symmetric(geo, g), "shift-symmetric", min(g, n // 2))
    return ordered_sequence(geo, _visits_descending(geo), f"descending (fallback: {reason})")


def build_arrival(geo: SeqGeometry, group_size: int | None = None) -> SequenceSchedule:
    """Causal masks: ascending visits, dQ adds in arrival order. A head of up to MAX_GROUP KV
    tiles (or `group_size`) is one co-resident group launched longest tile first; a longer head
    is split into groups of that size, launched top group first (`arrival_launch`), which keeps
    the ranks in arrival order (the tiles of a higher group reach each row first) and every wait
    on a tile that is launched earlier or co-resident. One group size for every length, so the
    sequences of a packed batch share one launch rule. Other masks, where tiles reach their
    first rows together, fall back to `descending` (full: the rank rule would give
    `ascending`'s order)."""
    n = geo.num_kv_tiles
    if not geo.is_causal:
        return ordered_sequence(geo, _visits_descending(geo), "descending (fallback: not a causal mask)")
    g = max(min(n, group_size or MAX_GROUP), 1)
    return ordered_sequence(geo, _visits_arrival(geo, g), "arrival", g)


def build_atomic(geo: SeqGeometry, group_size: int | None = None) -> SequenceSchedule:
    """Ascending visits with unordered (atomic) adds: no ranks."""
    workers = tuple(Worker(tuple(Segment(s.kv, s.q_tiles, None) for s in w.segments), w.group)
                    for w in assign_ranks(geo, _visits_ascending(geo)))
    return SequenceSchedule(geo, workers, "atomic", 1)


def build_split(geo: SeqGeometry, group_size: int | None = None) -> SequenceSchedule:
    """No cross-worker reduction: KV-stationary programs write dK/dV only, then Q-stationary
    programs recompute their row's scores and sum dQ on chip (ascending KV)."""
    kv = [Worker((Segment(j, tuple(_kv_range(geo, j)), None),), j) for j in range(geo.num_kv_tiles)]
    q = [Worker((Segment(-1, (i,) * (hi - lo + 1), None),), geo.num_kv_tiles + i, "q")
         for i, (lo, hi) in enumerate(geo.q_range)]
    return SequenceSchedule(geo, tuple(kv + q), "split", 1)
