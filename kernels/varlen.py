"""Packed (varlen) batches: the per-sequence lengths behind ``cu_seqlens``."""
import torch


def seqlens_of(cu_seqlens: torch.Tensor, rows: int, name: str = "cu_seqlens") -> list:
    """Per-sequence lengths from int32 offsets, checked to start at 0, never decrease and end at
    the ``rows`` of the packed tensor: every path reads cu_seqlens through here, so none reads or
    writes outside the packed tensors.

    Reading them is a copy to the host, which waits for the GPU to finish all queued work. The
    forward, its checks and the backward of one call read the same offsets tensor, so the
    lengths are kept on it, valid while its version counter (bumped by every in-place change)
    stays the same: only the first read of a tensor waits."""
    kept = getattr(cu_seqlens, "_dash_seqlens", None)
    if kept is not None and kept[0] == cu_seqlens._version and kept[1] == rows:
        return list(kept[2])
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] != 0 or min(lens) < 0:
        raise ValueError(f"{name}={cu[:8]}{'...' if len(cu) > 8 else ''} must start at 0 and never decrease")
    if cu[-1] != rows:
        raise ValueError(f"{name}[-1]={cu[-1]} must equal the number of tokens ({rows})")
    try:
        cu_seqlens._dash_seqlens = (cu_seqlens._version, rows, tuple(lens))
    except (AttributeError, RuntimeError):   # a tensor subclass that takes no attributes: read again next time
        pass
    return lens
