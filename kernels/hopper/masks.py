"""Our mask and softcap arguments in FA4's terms (pure Python, tested on the CPU).

Ours: `causal`, and a window of `window_left` / `window_right` keys around the diagonal (-1: that
side unlimited; causal means window_right 0), bottom-right aligned. FA4's: `causal`, or a `local`
mask with `window_size_left` / `window_size_right` (None: unlimited). Both align the band the
same way (row i sees column j iff i + S_k - S_q - left <= j <= i + S_k - S_q + right).
"""
from __future__ import annotations


def fa4_mask(causal: bool, window_left: int, window_right: int):
    """(causal, local, window_size_left, window_size_right) for FA4's kernels. A window of no
    left limit and 0 keys to the right is the causal mask, whichever way it was spelled."""
    right = 0 if causal else window_right
    if window_left < 0 and right < 0:
        return False, False, None, None
    if window_left < 0 and right == 0:
        return True, False, None, None
    return False, True, (None if window_left < 0 else window_left), (None if right < 0 else right)


def may_have_empty_rows(masked: bool, seqlens_q, seqlens_k) -> bool:
    """Whether a query row can see no key: under a causal or windowed mask (`masked`) where a
    sequence (lengths per sequence) has more queries than keys (bottom-right alignment)."""
    return masked and any(a > b for a, b in zip(seqlens_q, seqlens_k))
