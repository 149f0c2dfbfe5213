"""The Hopper backward's view of a schedule.

The Hopper kernel runs one CTA per (KV tile, query head, batch), walks the Q tiles of its KV
tile from a per-KV-tile list, and its dQ-writer warp adds each partial in the rank the plan
gives it. So the plan's per-worker tables become per-KV-tile tables here: how many Q tiles a
KV tile visits, which ones in what order, and the rank of each dQ add.

The CTAs are launched KV tile by KV tile, either from the first tile up or from the last one
down. A schedule runs here only if that launch order agrees with its ranks: every wait must
point at a KV tile launched earlier, or at one of the same co-resident group (cyclic shift).
Pure Python and torch: everything in this module is tested on the CPU. It reads the plan's
schedule of one sequence (`dash_plugin.schedules.SequenceSchedule`) by its fields and imports
nothing above the kernel layer.
"""
from __future__ import annotations

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
    closed_form: the kernel may compute the order instead of reading it (see `_is_closed_form`).
    """

    count: torch.Tensor
    q_tile: torch.Tensor
    rank: torch.Tensor
    kv_descending: bool
    group_size: int
    variant: str
    closed_form: bool = False


# How many consecutive CTAs may wait on each other. The kernel's tile scheduler (FA4's) launches
# the CTAs of a few heads together for L2 reuse: `swizzle` heads per section, KV tile by KV
# tile, so G consecutive KV tiles of one head span about (G - 1) * swizzle + 1 launch slots. A
# cyclic group must fit in the CTAs surely resident at once; 64 leaves a margin on every Hopper
# part (H20: 78 SMs, one CTA each). Shape-only, so the ranks never depend on the GPU.
RESIDENT_SLOTS = 64
_L2_BYTES = 50 * 1024 * 1024  # the constant FA4's scheduler divides by (not the device's L2)


def heads_per_l2_section(seqlen_q: int, head_dim: int, element_size: int) -> int:
    """FA4's sm90 backward scheduler: heads launched together (a power of two)."""
    one_head = seqlen_q * 2 * head_dim * element_size + seqlen_q * head_dim * 4
    if one_head > _L2_BYTES:
        return 1
    return 1 << ((_L2_BYTES // one_head).bit_length() - 1)


def cyclic_group_size(seqlen_q: int, head_dim: int, element_size: int) -> int:
    return max(1, (RESIDENT_SLOTS - 1) // heads_per_l2_section(seqlen_q, head_dim, element_size) + 1)


def _launch_direction(kv_of_worker: list[int], n: int) -> bool:
    if kv_of_worker == list(range(n)):
        return False
    if kv_of_worker == list(range(n - 1, -1, -1)):
        return True
    raise Unsupported(f"workers launch KV tiles in the order {kv_of_worker[:8]}..., which is "
                      "neither ascending nor descending")


def tables_of(seq) -> VisitTables:
    """Per-KV-tile tables of one sequence's schedule (`seq`: the launch plan's SequenceSchedule)."""
    n = seq.geometry.num_kv_tiles
    if any(len(w.segments) != 1 for w in seq.workers):
        raise Unsupported(f"schedule variant {seq.variant!r} pairs two KV tiles in one worker; the "
                          "Hopper kernel runs one KV tile per CTA")
    kv_descending = _launch_direction([w.segments[0].kv for w in seq.workers], n)
    steps = max([1] + [w.num_steps for w in seq.workers])
    count = torch.zeros(n, dtype=torch.int32)
    q_tile = torch.full((n, steps), -1, dtype=torch.int32)
    rank = torch.full((n, steps), -1, dtype=torch.int32)
    for w in seq.workers:
        seg = w.segments[0]
        k = len(seg.q_tiles)
        count[seg.kv] = k
        if k:
            q_tile[seg.kv, :k] = torch.tensor(seg.q_tiles, dtype=torch.int32)
            if seg.ranks is not None:
                rank[seg.kv, :k] = torch.tensor(seg.ranks, dtype=torch.int32)
    return VisitTables(count, q_tile, rank, kv_descending, seq.group_size, seq.variant,
                       _is_closed_form(seq, kv_descending))


def _is_closed_form(seq, kv_descending: bool) -> bool:
    """True when every KV tile visits its Q tiles in ascending order and each rank is what the
    kernel's closed form gives: the KV tile's index (launched ascending), or the last KV tile
    visible from the row minus it (launched descending, i.e. spt). Then the kernel walks
    m_min..m_max-1 and computes the rank, with no table reads on its critical path."""
    geo = seq.geometry
    for w in seq.workers:
        seg = w.segments[0]
        lo, hi = geo.kv_range[seg.kv]
        if list(seg.q_tiles) != list(range(lo, hi + 1)):
            return False
        if seg.ranks is None:  # atomic: adds in arrival order, no ranks to compute
            continue
        want = [geo.q_range[m][1] - seg.kv if kv_descending else seg.kv for m in seg.q_tiles]
        if list(seg.ranks) != want:
            return False
    return True


def check_waits_follow_launch(tables: VisitTables) -> None:
    if tables.rank.numel() and int(tables.rank.max()) < 0:  # atomic: nobody waits
        return
    """Every dQ add waits only for KV tiles launched before it or inside its own group, so a
    grid dispatched in launch order can always make progress (see docs/INTERNALS.md)."""
    counts, q_tiles, ranks = (t.tolist() for t in (tables.count, tables.q_tile, tables.rank))
    n = len(counts)
    position = {kv: (n - 1 - kv if tables.kv_descending else kv) for kv in range(n)}
    by_tile: dict[int, list[tuple[int, int]]] = {}
    for kv in range(n):
        for i in range(counts[kv]):
            by_tile.setdefault(q_tiles[kv][i], []).append((ranks[kv][i], kv))
    g = tables.group_size
    for q, adds in by_tile.items():
        adds.sort()
        if [r for r, _ in adds] != list(range(len(adds))):
            raise Unsupported(f"dQ tile {q}: ranks {[r for r, _ in adds]} are not 0..{len(adds) - 1}")
        for (_, a), (_, b) in zip(adds, adds[1:]):
            if position[b] < position[a] and position[a] // g != position[b] // g:
                raise Unsupported(f"dQ tile {q}: KV tile {b} adds after KV tile {a} but is "
                                  "launched before it, outside its group")
