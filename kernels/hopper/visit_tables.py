"""The Hopper backward's view of a schedule.

The Hopper kernel runs one CTA per (KV tile, query head, batch), walks the Q tiles of its KV
tile from a per-KV-tile list, and its dQ-writer warp adds each partial in the rank the plan
gives it. So the plan's per-worker tables become per-KV-tile tables here: how many Q tiles a
KV tile visits, which ones in what order, and the rank of each dQ add.

The CTAs are launched KV tile by KV tile, from the first tile up, from the last one down, or
(`arrival` over more KV tiles than one group) in groups launched top group first, each from its
first tile up. The causal symmetric shift launches pairs instead: CTA p of a head runs KV tile p,
then KV tile N-1-p, each from its own row of the tables. A schedule runs here only if that
launch order agrees with its ranks: every wait must point at a KV tile launched earlier, or at
one of the same co-resident group.
Pure Python and torch: everything in this module is tested on the CPU. It reads the plan's
schedule of one sequence (`dash_plugin.schedules.SequenceSchedule`) by its fields and imports
nothing above the kernel layer.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch


class Unsupported(ValueError):
    """The Hopper backward cannot run this request; the caller falls back to Triton."""


@dataclass(frozen=True, eq=False)  # hashed by identity: instances are cached
class VisitTables:
    """Per-KV-tile tables of one sequence length pair (N KV tiles, S = most visits).

    count[n]: Q tiles KV tile n visits; q_tile[n, :count[n]]: them in visit order;
    rank[n, i]: position of that contribution in the dQ tile's addition order. Padding is -1.
    kv_descending: launch the KV tiles from the last one down (else from the first up).
    top_group_first: launch them in groups of group_size from the top group down, each from its
    first tile up (`top_group_first_launch`; kv_descending is then False).
    paired: CTA p runs KV tile p, then KV tile N-1-p (the causal symmetric shift; N is even,
    group_size counts pairs; visit is then `pairs`, or None where the plan's ranks are not it).
    visit: the closed form the kernel computes instead of reading the tables (one of
    CLOSED_FORMS, see `closed_form_visits`), or None: the kernel reads them.
    """

    count: torch.Tensor
    q_tile: torch.Tensor
    rank: torch.Tensor
    kv_descending: bool
    group_size: int
    variant: str
    visit: str | None = None
    top_group_first: bool = False
    paired: bool = False


# The longest run of consecutive CTAs that may wait on each other (a cyclic shift group). The
# shift kernel launches the KV tiles of one head after another (no head interleaving), so a
# group of G KV tiles spans G launch slots; 64 leaves a margin on every Hopper part (H20: 78
# SMs, one CTA each). It is also the plan's MAX_GROUP, so the plan's default groups fit.
RESIDENT_SLOTS = 64

CLOSED_FORMS = ("ascending", "descending", "shift", "arrival", "pairs")


def top_group_first_launch(n: int, group_size: int) -> list[int]:
    """KV tile of each launch slot when groups of `group_size` consecutive KV tiles, counted from
    the last tile down, are launched top group first, each from its first tile up (the bottom
    group takes what is left): `arrival`'s launch beyond one group. The kernel's schedulers
    compute the same per CTA (`bwd_sm90._top_group_first`)."""
    return [max(n - (s // group_size + 1) * group_size, 0) + s % group_size for s in range(n)]


def _launch_of(kv_of_worker: list[int], n: int, group_size: int) -> tuple[bool, bool]:
    """(kv_descending, top_group_first) of the workers' launch order."""
    if kv_of_worker == list(range(n)):
        return False, False
    if kv_of_worker == list(range(n - 1, -1, -1)):
        return True, False
    if kv_of_worker == top_group_first_launch(n, group_size):
        return False, True
    raise Unsupported(f"workers launch KV tiles in the order {kv_of_worker[:8]}..., which is neither "
                      f"ascending, descending nor top group first in groups of {group_size}")


def pair_launch(n: int) -> list[tuple[int, ...]]:
    """KV tiles of each CTA of a head of `n` KV tiles (n even) under the paired launch: CTA p runs
    p, then n-1-p. The kernel's scheduler computes the same per CTA (`bwd_sm90._PairScheduler`)."""
    return [(p, n - 1 - p) for p in range(n // 2)]


def _is_pair_launch(seq) -> bool:
    kvs = [tuple(s.kv for s in w.segments) for w in seq.workers]
    return any(len(k) > 1 for k in kvs) and kvs == pair_launch(seq.geometry.num_kv_tiles)


def launch_slots(tables: VisitTables, n: int) -> list[int]:
    """The KV tile of each launch slot of a head of `n` KV tiles under the launch rule of
    `tables` (a packed batch launches every sequence by one rule, each from its own length)."""
    if tables.paired:
        return [p for p, _ in pair_launch(n)]
    if tables.top_group_first:
        return top_group_first_launch(n, tables.group_size)
    return list(range(n - 1, -1, -1)) if tables.kv_descending else list(range(n))


def tables_of(seq) -> VisitTables:
    """Per-KV-tile tables of one sequence's schedule (`seq`: the launch plan's SequenceSchedule)."""
    n = seq.geometry.num_kv_tiles
    paired = _is_pair_launch(seq)
    several = next((w for w in seq.workers if len(w.segments) != 1), None)
    if not paired and several is not None:
        raise Unsupported(f"schedule variant {seq.variant!r} runs the KV tiles "
                          f"{[s.kv for s in several.segments]} in one worker; the Hopper kernel runs "
                          "one KV tile per CTA or the pairs (p, N-1-p)")
    kv_descending, top_group_first = (False, False) if paired else _launch_of(
        [w.segments[0].kv for w in seq.workers], n, seq.group_size)
    if seq.group_size > RESIDENT_SLOTS:
        raise Unsupported(f"cyclic groups of {seq.group_size} KV tiles; this grid keeps at most "
                          f"{RESIDENT_SLOTS} co-resident")
    steps = max([1] + [len(s.q_tiles) for w in seq.workers for s in w.segments])
    count = torch.zeros(n, dtype=torch.int32)
    q_tile = torch.full((n, steps), -1, dtype=torch.int32)
    rank = torch.full((n, steps), -1, dtype=torch.int32)
    for seg in (s for w in seq.workers for s in w.segments):
        k = len(seg.q_tiles)
        count[seg.kv] = k
        if k:
            q_tile[seg.kv, :k] = torch.tensor(seg.q_tiles, dtype=torch.int32)
            if seg.ranks is not None:
                rank[seg.kv, :k] = torch.tensor(seg.ranks, dtype=torch.int32)
    visit = _closed_form_of(seq, kv_descending, top_group_first, paired)
    return VisitTables(count, q_tile, rank, kv_descending, seq.group_size, seq.variant, visit, top_group_first,
                       paired)


def closed_form_visits(visit: str, geo, kv: int, *, kv_descending: bool = False,
                       group_size: int = 1) -> list[tuple[int, int]]:
    """(Q tile, rank) of KV tile `kv` in visit order, as the kernel computes them (bwd_sm90's
    `_visit` is the same arithmetic), with lo..hi the Q tiles the KV tile sees:

    - ascending: lo..hi; rank = kv minus the row's first visible KV tile (0 without a window),
      or under an spt launch (KV tiles from the last down) the last visible one minus kv;
    - descending: hi..lo; rank as ascending's;
    - arrival (a whole head in one co-resident group, or groups launched top group first):
      lo..hi, ranked in order of arrival, which under a causal mask is the row's last visible
      KV tile first: rank = that tile minus kv
      (the spt ranks); the Z KV tiles that Q tile 0 sees (more than one only where keys
      outnumber queries) reach every row at one step, after the others, and add last by
      (group launched first, KV tile): rank = (last + 1 - Z) + their place in that order
      (kv itself with one group);
    - shift (full masks, groups of G consecutive KV tiles from j0): member l = kv - j0 visits
      lo + (l + t) mod L at step t. The rank rule orders a dQ tile's adds by (group, step,
      member): the j0 adds of earlier groups come first, and inside the group member l arrives
      at row offset i at step (i - l) mod L, which puts it at (min(i, G' - 1) - l) mod G'
      (G' = the group's size, i = row offset);
    - pairs (the causal symmetric shift, equal lengths, s = block_n / block_m Q tiles per KV
      tile, CTA p running KV tiles p and N-1-p, groups of g pairs from p0, member l = p - p0):
      the big side KV p walks the group's rectangle, rows r0.. (r0 = first row of the group's
      last big side) from r0 + l cyclically, then its own rows p*s..r0-1 upwards; the small
      side KV N-1-p walks its rows downwards. Ranks (the rank rule: group, step in the CTA,
      CTA): the adds of earlier groups first (`_pair_adds_before`), then in the rectangle the
      big sides as `shift`'s members, then the small sides from the last member down; in a
      big side's own rows the members from the highest down.
    `tables_of` compares every value with the plan's, so an order these do not give is read
    from the tables."""
    lo, hi = geo.kv_range[kv]
    if hi < lo:
        return []
    rows = range(lo, hi + 1)
    if visit == "ascending":
        return [(m, geo.q_range[m][1] - kv if kv_descending else kv - geo.q_range[m][0]) for m in rows]
    if visit == "descending":
        return [(m, kv - geo.q_range[m][0]) for m in reversed(rows)]
    if visit == "arrival":
        tied = geo.q_range[0][1] + 1 if geo.q_range else 0   # (0, -1) when Q tile 0 sees nothing
        n, g = geo.num_kv_tiles, group_size
        top = (n - 1 - kv) // g   # kv's group, counted from the top one (launched first)
        # place among the tied tiles: those of the groups above, then the lower ones of its own
        tie_place = max(tied - n + top * g, 0) + kv - max(n - (top + 1) * g, 0)
        return [(m, geo.q_range[m][1] + 1 - tied + tie_place if kv < tied else geo.q_range[m][1] - kv)
                for m in rows]
    if visit == "shift":
        length = hi - lo + 1
        lane = kv % group_size
        j0 = kv - lane
        members = min(group_size, geo.num_kv_tiles - j0)
        out = []
        for t in range(length):
            i = (lane + t) % length
            out.append((lo + i, j0 + _member_place(i, lane, members)))
        return out
    if visit == "pairs":
        return _pair_visits(geo, kv, group_size)
    raise ValueError(f"visit={visit!r}; closed forms: {CLOSED_FORMS}")


def _member_place(i: int, lane: int, members: int) -> int:
    """Place among its group's adds of cyclic group member `lane` at the group's i-th row: it
    reaches row offset i at step (i - lane) mod L, so the rank rule puts it at
    (min(i, members - 1) - lane) mod members (bwd_sm90's `_shift_visit` and `_pair_visit`
    compute it without division)."""
    return (min(i, members - 1) - lane) % members


def _pair_adds_before(q: int, s: int, n: int, p0: int) -> int:
    """Adds to dQ tile q from the pairs before p0 (earlier groups): big sides j < p0 with
    j*s <= q, small sides N-1-j with (N-1-j)*s <= q."""
    f = q // s
    return min(p0, f + 1) + max(0, p0 - max(0, n - 1 - f))


def _pair_visits(geo, kv: int, g: int) -> list[tuple[int, int]]:
    """`closed_form_visits` for `pairs` (bwd_sm90's `_pair_visit` is the same arithmetic)."""
    n, m, s = geo.num_kv_tiles, geo.num_q_tiles, geo.block_n // geo.block_m
    p = min(kv, n - 1 - kv)
    l = p % g
    p0 = p - l
    members = min(g, n // 2 - p0)
    if kv != p:   # the small side: its rows downwards, after the group's big sides
        return [(q, _pair_adds_before(q, s, n, p0) + 2 * members - 1 - l) for q in range(m - 1, kv * s - 1, -1)]
    r0 = (p0 + members - 1) * s
    rlen = m - r0
    out = []
    for t in range(m - p * s):
        if t < rlen:
            i = (l + t) % rlen
            out.append((r0 + i, _pair_adds_before(r0 + i, s, n, p0) + _member_place(i, l, members)))
        else:
            q = p * s + t - rlen
            out.append((q, _pair_adds_before(q, s, n, p0) + q // s - p0 - l))
    return out


def _closed_form_of(seq, kv_descending: bool, top_group_first: bool, paired: bool = False) -> str | None:
    """The closed form that gives every visit and rank of `seq`, or None. Shift and arrival need
    the head-by-head launch, so only an ascending launch qualifies for them, and arrival only
    with the whole head in one group or the groups launched top group first (its ranks ignore
    groups: the tiles of a higher group reach every row first); `pairs` is the paired launch's
    only form."""
    for visit in CLOSED_FORMS:
        if (_may_run(seq, visit, kv_descending, top_group_first, paired)
                and _follows(seq, visit, kv_descending, seq.group_size)):
            return visit
    return None


def _may_run(seq, visit: str, kv_descending: bool, top_group_first: bool, paired: bool = False) -> bool:
    """Whether the kernel can run `seq` in closed form `visit` at all (see _closed_form_of)."""
    if paired != (visit == "pairs"):
        return False
    if (kv_descending and visit != "ascending") or (top_group_first and visit != "arrival"):
        return False
    return not (visit == "arrival" and not top_group_first and seq.group_size < len(seq.workers))


def _follows(seq, visit: str, kv_descending: bool, group_size: int) -> bool:
    """Every visit and rank of `seq` is the closed form's with these parameters (a closed form
    gives one KV tile's walk; a paired worker's two KV tiles are checked one by one)."""
    segments = [seg for w in seq.workers for seg in w.segments]
    atomic = all(seg.ranks is None for seg in segments)
    for seg in segments:
        got = closed_form_visits(visit, seq.geometry, seg.kv, kv_descending=kv_descending, group_size=group_size)
        if [m for m, _ in got] != list(seg.q_tiles) or (not atomic and [r for _, r in got] != list(seg.ranks)):
            return False
    return True


def batch_tables(sequences) -> VisitTables:
    """A packed (varlen) batch: one compiled kernel computes every sequence's order from that
    sequence's own lengths, so all of them must follow one closed form with one launch direction
    and group size. Returns the tables of the sequence with the most KV tiles, which carry those
    parameters (the kernel reads none of their lists); raises Unsupported where a sequence's
    schedule is another order (a fallback variant, say)."""
    distinct = list({id(s): s for s in sequences}.values())
    longest = max(distinct, key=lambda s: s.geometry.num_kv_tiles)
    tables = tables_of(longest)
    if tables.paired:
        raise Unsupported("a packed batch does not take the paired launch (the causal symmetric shift)")
    if tables.visit is None:
        raise Unsupported(f"schedule variant {longest.variant!r} has no order the kernel computes, and a packed "
                          "batch cannot read per-sequence lists")
    def runs_in(seq, visit):
        return ([w.segments[0].kv for w in seq.workers] == launch_slots(tables, seq.geometry.num_kv_tiles)
                and _may_run(seq, visit, tables.kv_descending, tables.top_group_first)
                and _follows(seq, visit, tables.kv_descending, tables.group_size))

    # A sequence whose KV tiles visit one Q tile each (few queries, many keys) walks several closed
    # forms alike, so the longest one alone may not name the form the others need: the first
    # form every sequence follows is the batch's.
    for visit in CLOSED_FORMS:
        if all(runs_in(seq, visit) for seq in distinct):
            return dataclasses.replace(tables, visit=visit)
    seq = next(s for s in distinct if not runs_in(s, tables.visit))   # the longest's own form failed
    geo = seq.geometry
    raise Unsupported(f"a sequence of {geo.seqlen_q} queries and {geo.seqlen_k} keys ({seq.variant!r}) does not "
                      f"follow the {tables.visit} order of the longest ({longest.variant!r})")


@functools.lru_cache(maxsize=256)
def visits_every_q_tile(tables: VisitTables, q_tiles: int) -> bool:
    """Whether every one of the `q_tiles` dQ tiles of a dense sequence gets an add. A row that
    sees no key (a causal mask or window with more queries than keys) gets none, and the
    backward then zeroes its dQ accumulator instead of storing each tile's first add."""
    seen = torch.zeros(q_tiles, dtype=torch.bool)
    visited = tables.q_tile[tables.q_tile >= 0].long()
    seen[visited[visited < q_tiles]] = True
    return bool(seen.all())


def check_waits_follow_launch(tables: VisitTables) -> None:
    """Every dQ add waits only for KV tiles launched before it or inside its own group, so a
    grid dispatched in launch order can always make progress (see docs/INTERNALS.md). Under the
    paired launch a CTA also runs its two KV tiles one after the other, so inside a group the
    adds of each dQ tile must come in the order (step in its CTA, CTA): then no add waits, even
    through a chain of others, for one that its own CTA runs later."""
    if tables.rank.numel() and int(tables.rank.max()) < 0:  # atomic: nobody waits
        return
    counts, q_tiles, ranks = (t.tolist() for t in (tables.count, tables.q_tile, tables.rank))
    n = len(counts)
    position = {kv: slot for slot, kv in enumerate(launch_slots(tables, n))}
    first_step = dict.fromkeys(range(n), 0)   # step of the CTA at which each KV tile starts
    if tables.paired:
        position.update({small: p for p, small in pair_launch(n)})
        first_step.update({small: counts[p] for p, small in pair_launch(n)})
    by_tile: dict[int, list[tuple[int, int, int]]] = {}
    for kv in range(n):
        for i in range(counts[kv]):
            by_tile.setdefault(q_tiles[kv][i], []).append((ranks[kv][i], kv, first_step[kv] + i))
    g = tables.group_size
    for q, adds in by_tile.items():
        adds.sort()
        if [r for r, _, _ in adds] != list(range(len(adds))):
            raise Unsupported(f"dQ tile {q}: ranks {[r for r, _, _ in adds]} are not 0..{len(adds) - 1}")
        for (_, a, step_a), (_, b, step_b) in zip(adds, adds[1:]):
            if position[b] < position[a] and position[a] // g != position[b] // g:
                raise Unsupported(f"dQ tile {q}: KV tile {b} adds after KV tile {a} but is "
                                  "launched before it, outside its group")
            if tables.paired and (position[b] // g, step_b, position[b]) <= (position[a] // g, step_a, position[a]):
                raise Unsupported(f"dQ tile {q}: KV tile {b} (step {step_b} of CTA {position[b]}) adds after "
                                  f"KV tile {a} (step {step_a} of CTA {position[a]}), which its group may not "
                                  "have reached")
