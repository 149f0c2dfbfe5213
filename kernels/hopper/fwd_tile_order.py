"""Which tiles each CTA of the persistent Hopper forward computes, in what order (pure Python,
tested on the CPU).

The persistent forward runs one CTA per SM, each walking its own list of output tiles (a Q tile
of one head and batch). How the tiles are dealt decides when the grid finishes: causal tiles
differ in length (a Q tile near the top of a causal head sees one KV tile, the last one sees
them all), and dealing them round-robin leaves some CTAs with up to 16 % more work than the
average (hdim 128 causal 16k, 132 CTAs). The lists here are what a dynamic scheduler would
produce, worked out on the host: the tiles go out longest first, each to the CTA that would be
free first, counting a tile's KV steps plus one for its set-up (`TILE_OVERHEAD`). The result is
within 0.5-3 % of the average at the protocol's shapes, and it is fixed per
shape, so no counter is shared at run time. A tile's output does not depend on which CTA
computes it (each tile is one CTA's work from start to end), so the order moves no bits.

L2: tiles are dealt section by section, a section being as many (batch, head) pairs as keep
their K and V in about 25 MB of L2 (the CTAs at work at one time then read few heads' K/V); inside a
section longest first, ties head by head, a head's Q tiles next to each other.

The table (`work_table`): ctas + 1 start offsets, then every tile's linear id
((batch * heads + head) * num_block + block) CTA by CTA, then one padding entry (a CTA reads the
entry after its last one before it learns it is done).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

TILE_OVERHEAD = 1     # a tile's set-up and epilogue, in KV steps, for dealing the tiles
# Half the H100's 50 MB L2: sections of 25 MB ran 1.6-4.0 % faster than 50 MB at 1k-4k causal,
# hdim 64 and 128, and were the best or within 1.1 % of the best of 6, 12, 25 and 50 MB there; at
# 8k-16k the sizes tie (docs/benchmarks/fwd-l2-2026-11-25-h100/). An L2 half is one of the chip's
# two L2 partitions.
L2_BYTES = 25 * 1024 * 1024
# Where the persistent grid is the faster one (H100; docs/benchmarks/fwd-dealt-2026-11-24-h100/,
# fwd-grid-2026-11-25-h100/):
# - causal masks at every length: +3-16 % at 1k-4k, and at 8k-16k +4-5 % at hdim 128 (where
#   FA4's grid leaves its last wave of long tiles half empty) and +0-1 % at hdim 64;
# - full masks at hdim 64 at every length (+1.5-4 % at 4k-16k);
# - full masks at hdim 128 up to this mean of KV steps per tile: +2-4 % at 1k, a tie at 2k (16
#   steps), -2 to -6 % from 4k (32 steps) on, where FA4's kernel runs one tile straight through
#   and its code for a run of tiles is slower per step. The bar sits between the two.
PERSISTENT_MAX_MEAN_STEPS = 24


@dataclass(frozen=True)
class ForwardTiles:
    """The forward's tile grid as the kernel sees it. With GQA heads packed into the rows
    (`rows_per_query` = query heads per KV head), `heads` counts KV heads and a Q tile holds
    tile_m / rows_per_query query positions."""
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    tile_m: int
    tile_n: int
    causal: bool
    window_left: int | None = None     # None: unlimited on that side
    window_right: int | None = None
    rows_per_query: int = 1
    element_bytes: int = 2
    q_shift: int = 0   # rows the Q tiles start above the sequence (tail-aligned tiles: fwd_tail_aligned.py)

    @property
    def num_block(self) -> int:
        return -(-(self.seqlen_q * self.rows_per_query + self.q_shift) // self.tile_m)

    def kv_steps(self, block: int) -> int:
        """KV steps the kernel runs for Q tile `block` (bottom-right aligned masks, as the
        kernel's): the KV tiles its rows see, and one where they see none (FA4's forward always
        runs a tile's first step). A tile's first row may lie above the sequence (q_shift): the
        kernel bounds its KV tiles from there."""
        first_row = block * self.tile_m // self.rows_per_query - self.q_shift
        last_row = min(((block + 1) * self.tile_m - 1) // self.rows_per_query - self.q_shift, self.seqlen_q - 1)
        shift = self.seqlen_k - self.seqlen_q
        hi, lo = self.seqlen_k, 0
        right = 0 if self.causal else self.window_right
        if right is not None:
            hi = min(hi, last_row + shift + right + 1)
        if self.window_left is not None:
            lo = max(lo, first_row + shift - self.window_left)
        if hi <= lo:
            return 1
        return -(-hi // self.tile_n) - lo // self.tile_n

    @property
    def l2_section(self) -> int:
        """(batch, head) pairs per L2 section: a power of two whose K/V fit in L2_BYTES."""
        per_head = self.seqlen_k * 2 * self.head_dim * self.element_bytes
        fit = max(L2_BYTES // per_head, 1)
        return 1 << (fit.bit_length() - 1)


def total_steps(tiles: ForwardTiles) -> int:
    """KV steps of one (batch, head) pair's Q tiles."""
    return sum(tiles.kv_steps(b) for b in range(tiles.num_block))


def persistent_pays(tiles: ForwardTiles) -> bool:
    """Whether the persistent grid is the faster one for this shape (see PERSISTENT_MAX_MEAN_STEPS)."""
    if tiles.causal or tiles.head_dim <= 64:
        return True
    return total_steps(tiles) <= PERSISTENT_MAX_MEAN_STEPS * tiles.num_block


def rows_above(seqlen_q, tile_m):
    """Rows the first Q tile starts above the sequence when the last tile ends on the last query.
    The host's rule (tail_shift) and the kernel (fwd_tail_aligned.py, on its run-time length)
    both compute it here, so the two cannot drift apart."""
    return (tile_m - seqlen_q % tile_m) % tile_m


def tail_shift(tiles: ForwardTiles, multiple: int = 1) -> int:
    """Rows to move the Q tiles up so that the last one ends on the last query, where that cuts
    the KV steps (a causal mask whose length is no multiple of tile_m: at 1k tokens and 192-row
    tiles, 27 steps instead of 32) and is a multiple of `multiple` (dropout's mask is drawn in
    16-row groups), else 0. Only with one row per query (GQA heads packed into the rows would
    move by a fraction of a query)."""
    shift = rows_above(tiles.seqlen_q, tiles.tile_m)
    if tiles.rows_per_query != 1 or not shift or shift % multiple:
        return 0
    return shift if total_steps(replace(tiles, q_shift=shift)) < total_steps(tiles) else 0


def deal(tiles: ForwardTiles, ctas: int) -> list[list[int]]:
    """Each CTA's tile ids in the order it computes them (at most `ctas` lists, none empty)."""
    nb, pairs = tiles.num_block, tiles.batch * tiles.heads
    cost = [tiles.kv_steps(b) + TILE_OVERHEAD for b in range(nb)]
    blocks_of: dict[int, list[int]] = {}
    for b in range(nb):
        blocks_of.setdefault(cost[b], []).append(b)
    section = tiles.l2_section
    lists: list[list[int]] = [[] for _ in range(min(ctas, nb * pairs))]
    free = [(0, c) for c in range(len(lists))]   # (time it is free, CTA): ties go to the lower CTA
    for first in range(0, pairs, section):
        members = range(first, min(first + section, pairs))
        for length in sorted(blocks_of, reverse=True):   # longest first; then head by head, block by block
            for pair in members:
                for b in blocks_of[length]:
                    t, c = heapq.heappop(free)
                    lists[c].append(pair * nb + b)
                    heapq.heappush(free, (t + length, c))
    return lists


def work_table(tiles: ForwardTiles, ctas: int) -> tuple[int, ...]:
    """The table the kernel reads (see the module's docstring); fwd_sm90 keeps it per shape."""
    lists = deal(tiles, ctas)
    starts = [0]
    for tile_ids in lists:
        starts.append(starts[-1] + len(tile_ids))
    return tuple(starts) + tuple(t for tile_ids in lists for t in tile_ids) + (0,)


def makespan(tiles: ForwardTiles, lists: list[list[int]]) -> int:
    """The longest CTA's cost, in the units `deal` counts (for tests and for reading a deal)."""
    nb = tiles.num_block
    return max(sum(tiles.kv_steps(t % nb) + TILE_OVERHEAD for t in tile_ids) for tile_ids in lists)
