"""The Hopper-native kernels (sm90): the ordered backward, its view of a launch plan, and the
forward; the backend that offers them to dash_plugin is kernels/hopper_backend.py
(docs/hopper-backend.md).

`attention_backward` imports the CuTe DSL code on first use, so this package imports on any
machine and the CPU tests check its tables.
"""
from __future__ import annotations

import importlib.util

import torch

from .masks import fa4_mask
from .tile_table import HEAD_DIMS, bwd_tiles, head_dim_refusal
from .visit_tables import (CLOSED_FORMS, RESIDENT_SLOTS, Unsupported, VisitTables, batch_tables,
                           check_waits_follow_launch, closed_form_visits, tables_of, visits_every_q_tile)


_available: bool | None = None   # asked on every call's backend choice; installs do not change mid-process


# torch.compile traces the API's backend choice: it cannot trace find_spec, and it would trace
# through an lru_cache (with a warning), so the answer is a constant of its graph, asked when
# traced; the cache is a plain module value for the same reason.
@torch.compiler.assume_constant_result
def available() -> bool:
    """The packages the kernel compiles with are installed (the `hopper` extra). Looks for
    flash_attn.cute itself: FA2's `flash_attn` package alone does not have it."""
    global _available
    if _available is None:
        try:
            _available = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "flash_attn.cute"))
        except ImportError:   # flash_attn absent, or a broken install of it
            _available = False
    return _available


def attention_forward(q, k, v, *, softmax_scale: float, causal: bool, window_left: int = -1,
                      window_right: int = -1, softcap: float = 0.0, dropout_p: float = 0.0, seed: int = 0,
                      cu_seqlens_q=None, cu_seqlens_k=None):
    """(out, lse) of dense (B, S, H, D) or packed (T, H, D) fp16/bf16 inputs: FA4's sm90 forward
    kernel (warp-specialised, TMA loads, `wgmma`, softmax overlapped with the next tile's products),
    compiled and launched by fwd_sm90. No split-KV combine, so the output does not depend on
    timing; lse is the natural-log (B, H, S) fp32 (packed: (H, T)) that the backward reads. Windows
    and softcap as in masks.py. With dropout_p > 0 the kernel is our subclass that drops P in
    registers (dropout_sm90), with the mask of kernels/philox.py."""
    from . import fwd_sm90
    return fwd_sm90.attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                                      window_right=window_right, softcap=softcap, dropout_p=dropout_p, seed=seed,
                                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool,
                       tables: VisitTables, deterministic: bool, window_left: int = -1, window_right: int = -1,
                       softcap: float = 0.0, dropout_p: float = 0.0, seed: int = 0, cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0):
    """(dq, dk, dv) of dense (B, S, H, D) or packed (T, H, D) fp16/bf16 inputs, in the order of
    `tables` (packed: computed per sequence, see visit_tables.batch_tables); dropout draws the
    forward's mask again (same seed)."""
    from . import bwd_sm90
    return bwd_sm90.attention_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                                       causal=causal, tables=tables, deterministic=deterministic,
                                       window_left=window_left, window_right=window_right, softcap=softcap,
                                       dropout_p=dropout_p, seed=seed, cu_seqlens_q=cu_seqlens_q,
                                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


__all__ = ["CLOSED_FORMS", "HEAD_DIMS", "RESIDENT_SLOTS", "Unsupported", "VisitTables", "attention_backward",
           "attention_forward", "available", "batch_tables", "bwd_tiles", "check_waits_follow_launch",
           "closed_form_visits", "head_dim_refusal", "tables_of", "visits_every_q_tile"]
