"""Philox4x32 in plain PyTorch, bit-identical to Triton's ``tl.philox``, and the dropout mask
built on it: the one place that defines the mask (the comment above ``DROPOUT_BITS``).

Dropout must draw the same mask in the forward, in the backward and in the CPU reference,
whatever the schedule (docs/DESIGN.md, "Determinism rules", rule 7). The mask is therefore a pure
function of (seed, batch, head, row, col): a counter-based generator whose counter is derived
from the element's position, never from a tile or a launch.

Every kernel implements this definition: the Triton kernels in
``kernels/_triton_common.py:dropout_keep`` (one ``tl.philox(seed, col & ~9, row & ~9, head,
batch, n_rounds=7)`` call per group of sixteen elements, spread over the tile) and the Hopper
kernels (kernels/hopper/dropout_sm90.py, where two lanes share a group). This module computes
the same numbers with int64 tensors holding uint32 values, so the reference reproduces the
kernels' mask bit for bit.
"""
import numbers

import torch

_MASK32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85

# The dropout mask spends one Philox4x32-7 call on sixteen elements, as 8-bit draws. The sixteen
# share a Philox counter: the row and the column with bits 0 and 3 cleared, i.e. rows
# {i, i+1, i+8, i+9} x columns {j, j+1, j+8, j+9} of a 16x16 block. A `wgmma` accumulator puts
# rows {r, r+8} x columns {c, c+1, c+8, c+9} in one thread and rows {r+1, r+9} in the thread of
# lane ^ 4, in either orientation (S or S^T), so two lanes hold one group whole and split its
# call between them (kernels/hopper/dropout_sm90.py). Element (i, j) takes byte
# 2*bit3(i) + bit3(j) of word 2*bit0(i) + bit0(j) of philox(seed, j & ~9, i & ~9, head, batch):
# each word holds the four elements (i, j), (i, j+8), (i+8, j), (i+8, j+8) of one row parity and
# one column parity, so a thread of either orientation uses two whole words. The element is kept
# iff its draw >= dropout_threshold(p), and kept elements are scaled by keep_scale(p), the exact
# inverse of that keep rate. Integer compares give the same decision on every device.
#
# Why 8-bit draws and 7 rounds: the integer multiplier bounds Philox on a Hopper SM (each round
# is two 32x32->64-bit products), and the extra time of dropout followed the number of products
# per score. 16 scores per call of 7 rounds is 0.875 products per score where 8 scores per call of
# 10 rounds was 2.5. It is the budget of FlashAttention-2's dropout (SDPA's flash backend: 8-bit
# draws, Philox4x32 with 7 rounds); Philox4x32-7 passes TestU01's BigCrush (Salmon et al., SC'11),
# 10 rounds being the generator's default safety margin. The price: p is taken in steps of
# 2**-8 (effective_dropout_p says which p a call gets).
DROPOUT_BITS = 8
PHILOX_ROUNDS = 7
GROUP_BITS = 0x9          # row and column bits that vary inside one Philox call's group


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit halves of the 64-bit product of a constant and a uint32 tensor."""
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    low = a * b_lo            # < 2**48, exact in int64
    high = a * b_hi           # < 2**48
    hi = (high + (low >> 16)) >> 16
    lo = (low + ((high & 0xFFFF) << 16)) & _MASK32
    return hi & _MASK32, lo


def philox(seed: int, c0, c1, c2, c3, n_rounds: int = PHILOX_ROUNDS):
    """Four uint32 words (as int64 tensors) for the counters (c0, c1, c2, c3) under ``seed``.

    Matches ``tl.philox(seed, c0, c1, c2, c3, n_rounds)`` with 32-bit counters: the key is the
    seed's low and high 32-bit halves. The default is the mask's round count (7);
    n_rounds=10 is the standard Philox4x32-10.
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
    """Integer threshold: an element is dropped when its 8-bit draw is below it. Refuses a p
    that the mask's 2**-8 steps would turn into no dropout or into dropping everything, naming
    the value and the range (every path takes its threshold from here)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p < 1.0:   # NaN too
        raise ValueError(f"dropout_p={p!r} must be in [0, 1)")
    full = 1 << DROPOUT_BITS
    threshold = int(round(p * full))   # ties to even: 3 * 2**-9 and 5 * 2**-9 both give 2
    if threshold >= full or (p > 0 and threshold == 0):
        edge = 2.0 ** -(DROPOUT_BITS + 1)
        what = "dropping every element" if threshold else "no dropout at all"
        raise ValueError(f"dropout_p={p!r} rounds to {what}: the mask's resolution is 2**-{DROPOUT_BITS}, "
                         f"so dropout_p must be 0 or above {edge!r} and below {1 - edge!r}")
    return threshold


def threshold_above_half(p: float) -> bool:
    """Whether p's threshold is above 2**7 (p above about one half). The Hopper forward compares
    four draws at once (dropout_sm90.DropoutParams.kept_draws), by a formula that differs on
    either side of it, so its kernel is compiled for one side."""
    return dropout_threshold(p) > 1 << (DROPOUT_BITS - 1)


# Four 8-bit draws of a word compared with the threshold at once (the Hopper forward does this):
# each byte's low seven bits plus a bias reach the byte's bit 7 exactly when the draw keeps its
# score, and no sum carries into the next byte.
_LOW_SEVEN, _BYTE_TOPS, _EVERY_BYTE = 0x7F7F7F7F, 0x80808080, 0x01010101


def four_draws_bias(threshold, above_half: bool):
    """The per-byte bias of four_draws_kept for `threshold` (an int, or a kernel's run-time value).
    A draw x is kept iff x >= t. Up to one half (t <= 128): iff bit 7 of x is set or its low seven
    bits reach t, i.e. (x & 0x7f) + (128 - t) >= 128. Above (t > 128): iff bit 7 is set and the low
    seven bits reach t - 128, i.e. (x & 0x7f) + (256 - t) >= 128."""
    full = 1 << DROPOUT_BITS
    return ((full if above_half else full // 2) - threshold) * _EVERY_BYTE


def four_draws_kept(word, bias, above_half: bool):
    """Bit 7 of byte b of the result is set iff draw b of `word` (bits 8b..8b+7) keeps its score;
    every other bit is 0. Works on ints and on a kernel's 32-bit values alike."""
    low = (word & _LOW_SEVEN) + bias
    return ((word & low) if above_half else (word | low)) & _BYTE_TOPS


def effective_dropout_p(p: float) -> float:
    """The drop probability a call with ``dropout_p=p`` gets: p rounded to a multiple of 2**-8
    (0.1 -> 26/256 = 0.1015625). Kept elements are scaled by its exact inverse keep rate."""
    return dropout_threshold(p) / (1 << DROPOUT_BITS)


def keep_scale(p: float) -> float:
    """1 / (probability of keeping), from the threshold actually used, so that the scaled mask
    has expectation exactly 1 (p is rounded to a multiple of 2**-8)."""
    full = 1 << DROPOUT_BITS
    return full / (full - dropout_threshold(p))


def dropout_draws(seed: int, batch, head, rows, cols) -> torch.Tensor:
    """The 8-bit draw of each element (int64), broadcast over the index tensors."""
    rows, cols = torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)
    words = philox(seed, cols & ~GROUP_BITS, rows & ~GROUP_BITS, head, batch)
    word_index = 2 * (rows & 1) + (cols & 1)
    byte = 2 * ((rows >> 3) & 1) + ((cols >> 3) & 1)
    words = torch.stack(torch.broadcast_tensors(*words))
    word_index = torch.broadcast_to(word_index, words.shape[1:])
    word = torch.gather(words, 0, word_index.unsqueeze(0)).squeeze(0)
    return (word >> (DROPOUT_BITS * byte)) & ((1 << DROPOUT_BITS) - 1)


def dropout_keep_mask(seed: int, p: float, batch, head, rows, cols) -> torch.Tensor:
    """Boolean keep-mask, broadcast over the index tensors (batch, head, rows, cols).

    ``batch`` is the sequence index (varlen: the index into cu_seqlens), ``head`` the query
    head, ``rows``/``cols`` the query/key positions inside that sequence.
    """
    return dropout_draws(seed, batch, head, rows, cols) >= dropout_threshold(p)
