"""Packed (varlen) batches: the per-sequence lengths behind ``cu_seqlens``."""
import torch


def seqlens_of(cu_seqlens: torch.Tensor, rows: int, name: str = "cu_seqlens") -> list:
    """Per-sequence lengths from int32 offsets (read back to the host: a sync), checked to start
    at 0, never decrease and end at the ``rows`` of the packed tensor: every path reads
    cu_seqlens through here, so none reads or writes outside the packed tensors."""
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] != 0 or min(lens) < 0:
        raise ValueError(f"{name}={cu[:8]}{'...' if len(cu) > 8 else ''} must start at 0 and never decrease")
    if cu[-1] != rows:
        raise ValueError(f"{name}[-1]={cu[-1]} must equal the number of tokens ({rows})")
    return lens
