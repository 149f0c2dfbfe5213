"""The Hopper-native backward kernel (sm90) and its view of a launch plan; the backend that
offers it to dash_plugin is kernels/hopper_backend.py (docs/hopper-backend.md).

`attention_backward` imports the CuTe DSL code on first use, so this package imports on any
machine and the CPU tests check its tables.
"""
from __future__ import annotations

import importlib.util

from .tile_table import bwd_tiles
from .visit_tables import (RESIDENT_SLOTS, Unsupported, VisitTables, check_waits_follow_launch,
                           cyclic_group_size, heads_per_l2_section, tables_of)

HEAD_DIMS = (64, 96, 128)


def available() -> bool:
    """The packages the kernel compiles with are installed (the `hopper` extra)."""
    return all(importlib.util.find_spec(m) is not None for m in ("cutlass", "flash_attn"))


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool,
                       tables: VisitTables, deterministic: bool):
    """(dq, dk, dv) of dense (B, S, H, D) fp16/bf16 inputs, in the order of `tables`."""
    from . import bwd_sm90
    return bwd_sm90.attention_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                                       causal=causal, tables=tables, deterministic=deterministic)


__all__ = ["HEAD_DIMS", "RESIDENT_SLOTS", "Unsupported", "VisitTables", "attention_backward", "available",
           "bwd_tiles", "check_waits_follow_launch", "cyclic_group_size", "heads_per_l2_section", "tables_of"]
