"""Tile geometry of one sequence: which Q tiles each KV tile sees under the mask.

Semantics are those of docs/INTERNALS.md: bottom-right aligned causal and sliding windows,
`shift = s_k - s_q`; row i sees column j iff
`(wl < 0 or j >= i + shift - wl) and (wr < 0 or j <= i + shift + wr)`.
Q tile i covers rows [i*block_m, min((i+1)*block_m, s_q)), KV tile j covers columns
[j*block_n, min((j+1)*block_n, s_k)).

Because both bounds of the visible band grow with the row, the Q tiles a KV tile sees form one
contiguous range, and so do the KV tiles a Q tile receives from. That is what makes every
schedule below a simple walk over a range.
"""
from __future__ import annotations

from dataclasses import dataclass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SeqGeometry:
    """Visible tile ranges of one sequence (all ranges inclusive; empty ranges are (0, -1))."""

    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    window_left: int   # < 0: unlimited
    window_right: int  # < 0: unlimited; 0 for causal
    kv_range: tuple[tuple[int, int], ...]   # per KV tile j: (lo_j, hi_j) Q tiles it sees
    q_range: tuple[tuple[int, int], ...]    # per Q tile i: (jlo_i, jhi_i) KV tiles that add to dQ_i

    @property
    def num_q_tiles(self) -> int:
        return len(self.q_range)

    @property
    def num_kv_tiles(self) -> int:
        return len(self.kv_range)

    @property
    def is_full(self) -> bool:
        return self.window_left < 0 and self.window_right < 0

    @property
    def is_causal(self) -> bool:
        return self.window_left < 0 and self.window_right == 0

    def visible_pairs(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.kv_range if hi >= lo)


def kv_tile_range(j: int, *, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                  window_left: int, window_right: int) -> tuple[int, int]:
    """Inclusive range of Q tiles that KV tile j sees; (0, -1) if it sees none.

    Tile pair (i, j) is visible iff some row r of tile i and column c of tile j satisfy the band.
    The union over the rows r0..r1 of tile i of the visible columns is the contiguous interval
    [r0 + shift - wl, r1 + shift + wr], so the pair is visible iff that interval meets [c0, c1].
    """
    m = _ceil_div(seqlen_q, block_m)
    shift = seqlen_k - seqlen_q
    c0 = j * block_n
    c1 = min((j + 1) * block_n, seqlen_k) - 1
    lo, hi = 0, m - 1
    if window_right >= 0:
        # need r1(i) >= c0 - shift - wr, r1(i) = min((i+1)*bm, s_q) - 1 grows with i.
        x = c0 - shift - window_right
        if x > seqlen_q - 1:
            return (0, -1)
        lo = max(0, x // block_m)
    if window_left >= 0:
        # need r0(i) = i*bm <= c1 - shift + wl.
        y = c1 - shift + window_left
        if y < 0:
            return (0, -1)
        hi = min(m - 1, y // block_m)
    if lo > hi:
        return (0, -1)
    return (lo, hi)


def make_geometry(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                  window_left: int, window_right: int) -> SeqGeometry:
    n = _ceil_div(seqlen_k, block_n)
    m = _ceil_div(seqlen_q, block_m)
    kv_range = tuple(
        kv_tile_range(j, seqlen_q=seqlen_q, seqlen_k=seqlen_k, block_m=block_m, block_n=block_n,
                      window_left=window_left, window_right=window_right)
        for j in range(n))
    jlo = [n] * m
    jhi = [-1] * m
    for j, (lo, hi) in enumerate(kv_range):
        for i in range(lo, hi + 1):
            jlo[i] = min(jlo[i], j)
            jhi[i] = max(jhi[i], j)
    q_range = tuple((a, b) if b >= a else (0, -1) for a, b in zip(jlo, jhi))
    return SeqGeometry(seqlen_q, seqlen_k, block_m, block_n, window_left, window_right,
                       kv_range, q_range)
