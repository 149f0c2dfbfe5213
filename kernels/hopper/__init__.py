"""The Hopper-native backend (sm90): warp-specialised backward kernels that run the plan's
schedule order. `unsupported_reason` says, without importing the CuTe DSL, whether a request
can run here; `attention_backward` has the kernel-level signature of the Triton backward
(docs/INTERNALS.md) and imports the GPU code on first use.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

from .tile_table import bwd_tiles
from .visit_tables import (Unsupported, VisitTables, check_waits_follow_launch, cyclic_group_size,
                           visit_tables)

# Ordered schedules this backend runs, plus atomic (its non-deterministic reference point).
SCHEDULES = ("ascending", "spt", "descending", "shift", "atomic")
HEAD_DIMS = (64, 96, 128)


def available() -> bool:
    """The packages this backend compiles with are installed (the `hopper` extra)."""
    return all(importlib.util.find_spec(m) is not None for m in ("cutlass", "flash_attn.cute"))


def unsupported_reason(q, k, *, varlen: bool, causal: bool, window_left: int, window_right: int,
                       softcap: float, dropout_p: float, schedule: str) -> str | None:
    """None if this backend runs the request; else why not, in a few words."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "needs an sm90 (Hopper) GPU"
    if not available():
        return "flash-attn-4 / nvidia-cutlass-dsl not installed (pip install 'dash_plugin[hopper]')"
    if schedule not in SCHEDULES:
        return f"schedule {schedule!r} runs on the Triton backend"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} (this backend: {', '.join(map(str, HEAD_DIMS))})"
    if varlen:
        return "varlen"
    if q.shape[1] != k.shape[1]:
        return "seqlen_q != seqlen_k"
    if window_left >= 0 or (window_right >= 0 and not (causal and window_right == 0)):
        return "sliding window"
    if softcap:
        return "softcap"
    if dropout_p:
        return "dropout"
    return None


@lru_cache(maxsize=128)
def plan_tables(schedule: str, *, seqlen: int, head_dim: int, causal: bool,
                element_size: int = 2) -> VisitTables:
    """The per-KV-tile tables of `schedule` at this backend's tile sizes (atomic walks the
    ascending order and ignores the ranks). Built and checked once per shape."""
    bm, bn = bwd_tiles(head_dim, causal)
    group = cyclic_group_size(seqlen, head_dim, element_size) if schedule == "shift" else None
    tables = visit_tables("ascending" if schedule == "atomic" else schedule, seqlen_q=seqlen,
                          seqlen_k=seqlen, block_m=bm, block_n=bn, causal=causal, group_size=group)
    check_waits_follow_launch(tables)
    return tables


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool = False,
                       schedule: str = "ascending", deterministic: bool = True, **_unused):
    """(dq, dk, dv) of dense (B, S, H, D) inputs; call `unsupported_reason` first."""
    if deterministic and schedule == "atomic":
        raise ValueError("schedule='atomic' is not deterministic, but deterministic=True")
    from . import bwd_sm90
    tables = plan_tables(schedule, seqlen=q.shape[1], head_dim=q.shape[-1], causal=causal,
                         element_size=q.element_size())
    return bwd_sm90.attention_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                                       causal=causal, tables=tables,
                                       deterministic=deterministic and schedule != "atomic")


__all__ = ["SCHEDULES", "HEAD_DIMS", "Unsupported", "VisitTables", "available", "attention_backward",
           "plan_tables", "unsupported_reason", "visit_tables"]
