"""Packed (varlen) batches: the per-sequence lengths behind ``cu_seqlens``."""
import torch


def seqlens_of(cu_seqlens: torch.Tensor, rows: int) -> list:
    """Per-sequence lengths from int32 offsets (read back to the host: a sync), checked to start
    at 0, never decrease and stay within the ``rows`` of the packed tensor."""
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] != 0 or min(lens) < 0:
        raise ValueError(f"cu_seqlens={cu[:8]}{'...' if len(cu) > 8 else ''} must start at 0 and never decrease")
    if cu[-1] > rows:
        raise ValueError(f"cu_seqlens end at {cu[-1]} but the tensor holds {rows} rows")
    return lens
