"""What a compiled Hopper forward is specialised on (pure Python, tested on the CPU; fwd_sm90
compiles one kernel per key).

Run-time arguments (sizes, strides, the softmax scale, window sizes, the dropout seed) are not in
it; what the compiler bakes in is: dtype, head dim, the GQA group, the mask kind, which window
sides are limited, the softcap value, dropout (and which side of one half its threshold lies: the per-byte compare
differs, kernels/philox.py:threshold_above_half), whether the
batch is packed (varlen: the tensors lose their batch dimension and the kernel reads cu_seqlens),
and which input dimensions have stride 0 (CuTe keeps those static when it marks a layout dynamic:
K/V expanded over the batch, say).
"""
from __future__ import annotations

from ..philox import threshold_above_half


def forward_key(q, k, v, *, causal: bool, local: bool, window_size_left, window_size_right, softcap: float,
                dropout_p: float, varlen: bool = False) -> tuple:
    """The key of fwd_sm90's compile cache for inputs (B, S, H, D), or (T, H, D) when `varlen`;
    the mask arguments in FA4's terms (masks.fa4_mask)."""
    return (q.dtype, q.shape[-1], q.shape[-2] // k.shape[-2], bool(causal), bool(local), window_size_left is None,
            window_size_right is None, float(softcap), dropout_p > 0, dropout_p > 0 and threshold_above_half(dropout_p),
            tuple(tuple(stride == 0 for stride in t.stride()) for t in (q, k, v)), bool(varlen))
