"""Pieces shared by the Triton forward and backward: host-side shape handling and small
device functions (mask, softcap, dropout).

Layouts (docs/INTERNALS.md): dense ``q (B, S, H, D)``, varlen ``q (T, H, D)`` with
``cu_seqlens``. Both are handed to the kernels the same way: a 4-D view ``(B', S', H, D)``
with its strides plus a per-sequence start row. Dense: start 0, batch stride as is. Varlen:
the packed tensor is one "batch" of T rows (batch stride 0) and sequence ``b`` starts at row
``cu_seqlens[b]``. ``lse``/``delta`` follow the same rule with ``(B, H, S)`` / ``(H, T)``.
"""
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .philox import GROUP_BITS, PHILOX_ROUNDS
from .varlen import seqlens_of

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass
class Problem:
    """Shape facts of one attention call, in the kernels' terms."""
    varlen: bool
    batch: int                 # number of sequences
    heads_q: int
    heads_kv: int
    head_dim: int
    max_seqlen_q: int
    max_seqlen_k: int
    seqlens_q: list            # per sequence (dense: one entry repeated)
    seqlens_k: list
    cu_q: torch.Tensor         # int32 (B+1,) on the device; dense: a placeholder the kernels never read
    cu_k: torch.Tensor

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv


def _check_cu(name, cu, total, device):
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor of B+1 offsets, got dtype={cu.dtype}, "
                         f"shape={tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, the inputs on {device}")


def problem(q, k, v, cu_seqlens_q, cu_seqlens_k, lengths=None) -> Problem:
    """Shape facts of a call. Varlen: ``lengths`` (per-sequence lengths of q and k, as a launch plan
    holds them) saves reading cu_seqlens back, which is a host sync."""
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    want = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name} must be {want}-D ({'varlen (T, H, D)' if varlen else 'dense (B, S, H, D)'}), "
                             f"got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in the head dim (stride(-1)=1), got {t.stride()}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must share the head dim, got {d} and {k.shape[-1]}")
    if hq % hkv != 0:
        raise ValueError(f"heads of q ({hq}) must be a multiple of heads of k/v ({hkv})")
    if varlen:
        _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
        _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries, cu_seqlens_k "
                             f"{cu_seqlens_k.numel()}: both must be B+1")
        if lengths is not None:
            lq, lk = list(lengths[0]), list(lengths[1])
        else:   # one host sync per call: the launch grid needs the lengths
            lq = seqlens_of(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
            lk = seqlens_of(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
        return Problem(True, len(lq), hq, hkv, d, max(lq), max(lk), lq, lk, cu_seqlens_q, cu_seqlens_k)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    unused = placeholder(q.device)
    return Problem(False, b, hq, hkv, d, sq, sk, [sq] * b, [sk] * b, unused, unused)


_PLACEHOLDERS = {}


def placeholder(device) -> torch.Tensor:
    """A one-element int32 tensor per device for pointer arguments a launch never reads (dense
    calls' cu_seqlens, the semaphores of unordered modes): made once, not per call, because at
    short sequences the host side of a call is what bounds it."""
    t = _PLACEHOLDERS.get(device)
    if t is None:
        t = _PLACEHOLDERS[device] = torch.zeros(1, device=device, dtype=torch.int32)
    return t


# CUDA caps grid axes 1 and 2 at 65535 blocks; the sequence is axis 2, so a batch of more
# sequences is launched in chunks (each kernel adds the chunk's first sequence to its axis-2 id).
MAX_GRID_SEQS = 65535


def seq_chunks(batch: int):
    """(first sequence, count) of each launch covering ``batch`` sequences."""
    return [(b, min(MAX_GRID_SEQS, batch - b)) for b in range(0, batch, MAX_GRID_SEQS)]


def as4d(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    """(T, H, D) -> (1, T, H, D); dense tensors unchanged."""
    return t.unsqueeze(0) if varlen else t


def strides4(t: torch.Tensor, varlen: bool):
    """(batch, row, head, dim) strides; the batch stride is 0 for packed varlen tensors."""
    s = as4d(t, varlen).stride()
    return (0 if varlen else s[0]), s[1], s[2]


def stats_strides(t: torch.Tensor, varlen: bool):
    """(batch, head, row) strides of lse/delta: (B, H, S) dense, (H, T) varlen."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


# ---------------------------------------------------------------- device functions

@triton.jit
def seq_bounds(cu_ptr, b, seqlen_dense, VARLEN: tl.constexpr):
    """(first row, length) of sequence b."""
    if VARLEN:
        start = tl.load(cu_ptr + b)
        end = tl.load(cu_ptr + b + 1)
        return start, end - start
    else:
        return b * 0, seqlen_dense + b * 0


@triton.jit
def q_tile_program(CU_Q, CU_K, seq_base, seqlen_q_dense, seqlen_k_dense, VARLEN: tl.constexpr):
    """Where a program of a (Q tiles, heads, sequences) grid works: (Q tile index, head, sequence,
    first Q row, seqlen_q, first K row, seqlen_k). Axis 2 counts from seq_base: a launch covers at
    most MAX_GRID_SEQS sequences."""
    b = tl.program_id(2) + seq_base
    q_start, seqlen_q = seq_bounds(CU_Q, b, seqlen_q_dense, VARLEN)
    k_start, seqlen_k = seq_bounds(CU_K, b, seqlen_k_dense, VARLEN)
    return tl.program_id(0), tl.program_id(1), b, q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def visible(r, c, seqlen_q, seqlen_k, window_left, window_right,
            HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """Mask of docs/INTERNALS.md: bottom-right aligned window, inside both sequences.
    ``r`` and ``c`` are row and column indices already shaped to broadcast ([M, 1] and [1, N] for
    an S tile, [1, M] and [N, 1] for an S^T tile). The window sizes are runtime values (no
    recompile per size); HAS_* say whether they apply."""
    shift = seqlen_k - seqlen_q
    ok = (r < seqlen_q) & (c < seqlen_k)
    if HAS_WL:
        ok = ok & (c >= r + shift - window_left)
    if HAS_WR:
        ok = ok & (c <= r + shift + window_right)
    return ok


@triton.jit
def tanh(x):
    """tanh from exp2 (libdevice is unavailable in the interpreter); accurate near 0 too."""
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


_ROUNDS = tl.constexpr(PHILOX_ROUNDS)
_GROUP_CLEAR = tl.constexpr(~GROUP_BITS)   # the row and column bits a group's counter clears


@triton.jit
def _dropout_keep_each(seed, r, c, head, batch, threshold):
    """`dropout_keep` element by element: one Philox call per element (16x the work of the
    grouped path), for tiles too small to hold whole 16x16 blocks. ``r``/``c`` broadcast like in
    `visible`."""
    zero = r * 0 + c * 0
    i = zero + r
    j = zero + c
    w0, w1, w2, w3 = tl.philox(seed, j & _GROUP_CLEAR, i & _GROUP_CLEAR, zero + head, zero + batch, n_rounds=_ROUNDS)
    odd_j = (j & 1) != 0
    w = tl.where((i & 1) != 0, tl.where(odd_j, w3, w2), tl.where(odd_j, w1, w0))
    byte = 2 * ((i >> 3) & 1) + ((j >> 3) & 1)
    draw = (w >> (8 * byte).to(tl.uint32)) & 0xFF
    return draw.to(tl.int32) >= threshold   # draw < 2**8: the compare is exact in int32


@triton.jit
def _keep_byte_pair(even, odd, byte: tl.constexpr, threshold):
    """Keep bits of draw `byte` of the words of the even and the odd column, joined on a new last
    axis (bit0(col))."""
    return tl.join(((even >> (8 * byte)) & 0xFF).to(tl.int32) >= threshold,
                   ((odd >> (8 * byte)) & 0xFF).to(tl.int32) >= threshold)


@triton.jit
def dropout_keep(seed, m0, n0, head, batch, threshold,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Keep-mask of the scores of query rows [m0, m0 + BLOCK_M) x key columns [n0, n0 + BLOCK_N)
    of one (batch, head): a [BLOCK_M, BLOCK_N] tile, or with TRANSPOSED its transpose (the KV
    kernel's S^T), the same decision per (row, col) either way. The mask is the one
    kernels/philox.py defines (`dropout_keep_mask`), bit for bit. m0 and n0 are multiples of the
    block sizes, so a tile of whole 16x16 blocks holds whole Philox groups."""
    if (BLOCK_M % 16 == 0) and (BLOCK_N % 16 == 0):
        # One Philox call per row parity of a group, on the [BLOCK_M/2, BLOCK_N/4] grid of
        # anchors (row bit 3 and column bits 0, 3 clear): rows r and r + 1 of a group draw the
        # same call and keep the two words of their parity (1/8 of a call per element). A grid of
        # one anchor per group (half the calls) needs one more axis in the permute below, whose
        # layout conversion took more shared memory than the 3-stage hdim 128 tiles leave on an
        # H100; this one does not.
        ar = tl.arange(0, BLOCK_M // 2)
        ac = tl.arange(0, BLOCK_N // 4)
        rows = m0 + (ar // 8) * 16 + ar % 8           # anchor (r16, rlo): row r16*16 + rlo
        cols = n0 + (ac // 4) * 16 + (ac % 4) * 2     # anchor (c16, cmid): column c16*16 + cmid*2
        zero = rows[:, None] * 0 + cols[None, :] * 0
        w0, w1, w2, w3 = tl.philox(seed, zero + cols[None, :], zero + (rows[:, None] & _GROUP_CLEAR), zero + head,
                                   zero + batch, n_rounds=_ROUNDS)
        odd_row = (zero + rows[:, None] & 1) != 0
        even = tl.where(odd_row, w2, w0)              # word 2*bit0(row) + bit0(col)
        odd = tl.where(odd_row, w3, w1)
        # Byte 2*bit3(row) + bit3(col): the joins append (bit0(col), bit3(col), bit3(row)).
        keep = tl.join(tl.join(_keep_byte_pair(even, odd, 0, threshold), _keep_byte_pair(even, odd, 1, threshold)),
                       tl.join(_keep_byte_pair(even, odd, 2, threshold), _keep_byte_pair(even, odd, 3, threshold)))
        # axes 0..6: r16, rlo, c16, cmid, bit0(col), bit3(col), bit3(row)
        keep = tl.reshape(keep, [BLOCK_M // 16, 8, BLOCK_N // 16, 4, 2, 2, 2])
        if TRANSPOSED:   # [column = c16, bit3, cmid, bit0][row = r16, bit3, rlo]
            keep = tl.reshape(tl.permute(keep, [2, 5, 3, 4, 0, 6, 1]), [BLOCK_N, BLOCK_M])
        else:            # [row = r16, bit3, rlo][column = c16, bit3, cmid, bit0]
            keep = tl.reshape(tl.permute(keep, [0, 6, 1, 2, 5, 3, 4]), [BLOCK_M, BLOCK_N])
    else:
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        if TRANSPOSED:
            keep = _dropout_keep_each(seed, rows[None, :], cols[:, None], head, batch, threshold)
        else:
            keep = _dropout_keep_each(seed, rows[:, None], cols[None, :], head, batch, threshold)
    return keep


@triton.jit
def load_tile(base, idx, stride, limit, head_dim, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """Rows ``idx`` x the head dim of a row-major tile (row stride ``stride``), 0 where masked out.
    MASKED: rows >= ``limit`` are masked too (edge tiles); otherwise only the padded head dim is,
    and with EVEN_D nothing is: interior tiles load without any mask."""
    dims = tl.arange(0, BLOCK_D)
    ptrs = base + idx.to(tl.int64)[:, None] * stride + dims[None, :]
    if MASKED:
        t = tl.load(ptrs, mask=(idx < limit)[:, None] & (dims < head_dim)[None, :], other=0.0)
    elif EVEN_D:
        t = tl.load(ptrs)
    else:
        t = tl.load(ptrs, mask=(dims < head_dim)[None, :], other=0.0)
    return t


@triton.jit
def col_range(m_start, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
              HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """Key columns [lo, hi) that rows [m_start, m_start + BLOCK_M) can see."""
    shift = seqlen_k - seqlen_q
    lo = m_start * 0
    hi = seqlen_k + m_start * 0
    if HAS_WL:
        lo = tl.maximum(lo, m_start + shift - window_left)
    if HAS_WR:
        last_row = tl.minimum(m_start + BLOCK_M, seqlen_q) - 1
        hi = tl.minimum(hi, last_row + shift + window_right + 1)
    return lo, hi


@triton.jit
def row_range(n_start, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N: tl.constexpr,
              HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """Query rows [lo, hi) that see at least one of columns [n_start, n_start + BLOCK_N): the mask
    seen from the keys is the same band with q and k swapped and the two windows exchanged."""
    return col_range(n_start, seqlen_k, seqlen_q, window_right, window_left, BLOCK_N, HAS_WR, HAS_WL)


@triton.jit
def interior_cols(m_start, lo, hi, seqlen_q, seqlen_k, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """Split the column walk [lo, hi) of Q tile m_start (lo a multiple of BLOCK_N) into
    [lo, a) masked, [a, b) interior, [b, hi) masked, where every interior KV tile is whole
    (inside seqlen_k) and visible from every row of the Q tile, so it needs no mask at all.
    a and b are multiples of BLOCK_N or equal hi; walking the three parts in turn visits the
    same tiles in the same order as walking [lo, hi)."""
    shift = seqlen_k - seqlen_q
    full_lo = lo
    full_hi = seqlen_k // BLOCK_N * BLOCK_N
    if HAS_WL:
        # the last row of the tile sees columns >= m_start + BLOCK_M - 1 + shift - window_left
        need = tl.maximum(m_start + BLOCK_M - 1 + shift - window_left, 0)
        full_lo = tl.maximum(full_lo, tl.cdiv(need, BLOCK_N) * BLOCK_N)
    if HAS_WR:
        # the first row of the tile sees columns <= m_start + shift + window_right
        top = tl.maximum(m_start + shift + window_right + 1, 0)
        full_hi = tl.minimum(full_hi, top // BLOCK_N * BLOCK_N)
    if m_start + BLOCK_M > seqlen_q:   # ragged last Q tile: its load needs the row mask
        full_hi = full_lo
    a = tl.minimum(full_lo, hi)
    b = tl.minimum(tl.maximum(full_hi, a), hi)
    return a, b


@triton.jit
def interior_rows(n_start, lo, hi, seqlen_q, seqlen_k, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """The KV-side twin of `interior_cols` (q and k swapped, windows exchanged, as in `row_range`):
    split the row walk [lo, hi) of KV tile n_start (lo a multiple of BLOCK_M) into masked, interior
    (whole Q tiles, every row sees every column of the KV tile), masked."""
    return interior_cols(n_start, lo, hi, seqlen_k, seqlen_q, window_right, window_left,
                         BLOCK_N, BLOCK_M, HAS_WR, HAS_WL)
