"""Philox4x32-10 in plain PyTorch, bit-identical to Triton's ``tl.philox``.

Dropout must draw the same mask in the forward, in the backward and in the CPU reference,
whatever the schedule (docs/DESIGN.md, "Determinism rules", rule 7). The mask is therefore a pure function of
(seed, batch, head, row, col): a counter-based generator, evaluated element by element.

The Triton kernels call ``tl.philox(seed, col, row, head, batch)``; this module computes the
same numbers with int64 tensors holding uint32 values, so the reference reproduces the
kernels' mask bit for bit.
"""
import torch

_MASK32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85

# Dropout compares the top 24 bits of the first Philox word with an integer threshold:
# integer compares give the same decision on every device (no float rounding in the way).
DROPOUT_BITS = 24


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
    """Integer threshold: an element is dropped when its 24-bit draw is below it."""
    return int(round(p * (1 << DROPOUT_BITS)))


def dropout_keep_mask(seed: int, p: float, batch, head, rows, cols) -> torch.Tensor:
    """Boolean keep-mask, broadcast over the index tensors (batch, head, rows, cols).

    ``batch`` is the sequence index (varlen: the index into cu_seqlens), ``head`` the query
    head, ``rows``/``cols`` the query/key positions inside that sequence.
    """
    word, _, _, _ = philox(seed, cols, rows, head, batch)
    return (word >> (32 - DROPOUT_BITS)) >= dropout_threshold(p)
