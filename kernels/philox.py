"""Philox4x32-10 in plain PyTorch, bit-identical to Triton's ``tl.philox``, and the dropout
mask built on it: the one place that defines the mask (the comment above ``DROPOUT_BITS``).

Dropout must draw the same mask in the forward, in the backward and in the CPU reference,
whatever the schedule (docs/DESIGN.md, "Determinism rules", rule 7). The mask is therefore a pure
function of (seed, batch, head, row, col): a counter-based generator whose counter is derived
from the element's position, never from a tile or a launch.

Every kernel implements this definition: the Triton kernels in
``kernels/_triton_common.py:dropout_keep`` (one ``tl.philox(seed, col & ~9, row & ~8, head,
batch)`` call per group of eight elements, spread over the tile) and the Hopper kernels
(kernels/hopper/, where a group is what one thread holds). This module computes the same
numbers with int64 tensors holding uint32 values, so the reference reproduces the kernels' mask
bit for bit.
"""
import torch

_MASK32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85

# The dropout mask spends one Philox call on eight elements, as 16-bit draws. The eight share a
# Philox counter: the row with bit 3 cleared and the column with bits 0 and 3 cleared, i.e. rows
# {i, i+8} x columns {j, j+1, j+8, j+9} of a 16x16 block. That is the set of scores one thread
# holds in a Hopper `wgmma` accumulator, so the Hopper forward draws each number once; the
# Hopper backward holds the transposed tile and uses four of a call's eight draws (a thread's
# rows {j, j+8} x columns {i, i+8}). Element (i, j) takes draw d = 4*bit3(i) + 2*bit3(j) + bit0(j):
# the low (d even) or high (d odd) 16 bits of word d // 2 of philox(seed, j & ~9, i & ~8, head,
# batch). The element is kept iff its draw >= dropout_threshold(p), and kept elements are scaled
# by keep_scale(p), the exact inverse of that keep rate. Integer compares give the same
# decision on every device (no float rounding in the way).
DROPOUT_BITS = 16
GROUP_ROW_BITS = 0x8      # row bits that vary inside one Philox call's group
GROUP_COL_BITS = 0x9      # column bits that vary inside one group


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit halves of the 64-bit product of a constant and a uint32 tensor."""
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    low = a * b_lo            # < 2**48, exact in int64
    high = a * b_hi           # < 2**48
    hi = (high + (low >> 16)) >> 16
    lo = (low + ((high & 0xFFFF) << 16)) & _MASK32
    return hi & _MASK32, lo


def philox(seed: int, c0, c1, c2, c3, n_rounds: int = 10):
    """Four uint32 words (as int64 tensors) for the counters (c0, c1, c2, c3) under ``seed``.

    Matches ``tl.philox(seed, c0, c1, c2, c3)`` with 32-bit counters: the key is the seed's
    low and high 32-bit halves.
    """
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64) for c in (c0, c1, c2, c3)))
    c0, c1, c2, c3 = (c & _MASK32 for c in (c0, c1, c2, c3))
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(n_rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def dropout_threshold(p: float) -> int:
    """Integer threshold: an element is dropped when its 16-bit draw is below it."""
    return int(round(p * (1 << DROPOUT_BITS)))


def keep_scale(p: float) -> float:
    """1 / (probability of keeping), from the threshold actually used, so that the scaled mask
    has expectation exactly 1 (p is rounded to a multiple of 2**-16)."""
    full = 1 << DROPOUT_BITS
    kept = full - dropout_threshold(p)
    if kept <= 0:
        raise ValueError(f"dropout_p={p}: rounds to dropping every element (the mask resolution is 2**-16)")
    return full / kept


def dropout_draws(seed: int, batch, head, rows, cols) -> torch.Tensor:
    """The 16-bit draw of each element (int64), broadcast over the index tensors."""
    rows, cols = torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)
    words = philox(seed, cols & ~GROUP_COL_BITS, rows & ~GROUP_ROW_BITS, head, batch)
    d = 4 * ((rows >> 3) & 1) + 2 * ((cols >> 3) & 1) + (cols & 1)
    words = torch.stack(torch.broadcast_tensors(*words))
    d = torch.broadcast_to(d, words.shape[1:])
    word = torch.gather(words, 0, (d >> 1).unsqueeze(0)).squeeze(0)
    return (word >> (DROPOUT_BITS * (d & 1))) & ((1 << DROPOUT_BITS) - 1)


def dropout_keep_mask(seed: int, p: float, batch, head, rows, cols) -> torch.Tensor:
    """Boolean keep-mask, broadcast over the index tensors (batch, head, rows, cols).

    ``batch`` is the sequence index (varlen: the index into cu_seqlens), ``head`` the query
    head, ``rows``/``cols`` the query/key positions inside that sequence.
    """
    return dropout_draws(seed, batch, head, rows, cols) >= dropout_threshold(p)
