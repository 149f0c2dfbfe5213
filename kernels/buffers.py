"""Allocation of the buffers our kernels write before anything reads them: outputs (out, lse,
dq, dk, dv) and workspaces (delta, the Hopper backward's fp32 dQ accumulator and row sums).

Under `torch.use_deterministic_algorithms(True)` PyTorch fills every new tensor with NaN
(`torch.utils.deterministic.fill_uninitialized_memory`): a guard that makes an op which reads
memory it never wrote give the same result on every run. Our kernels read none of these buffers
before writing them (docs/DESIGN.md, rule 9; tests/test_buffers.py runs them on NaN-filled
buffers and on unfilled ones and compares the bits). The fill is one more pass over memory per
buffer, about as many bytes as the attention's inputs and outputs; the buffers allocated here
skip it. Accumulators that must start at zero and the order counters are `torch.zeros`.
"""
import math

import torch

# False: these buffers are filled like any other tensor (scripts/gpu_e2e_speed.py's
# `dash_det_ourfill` variant sets it, to time what skipping the fill saves).
SKIP_FILL = True


def _skipping() -> bool:
    return (SKIP_FILL and torch.are_deterministic_algorithms_enabled()
            and torch.utils.deterministic.fill_uninitialized_memory)


def _unfilled(shape, dtype: torch.dtype, device, stride=None) -> torch.Tensor:
    """A tensor on raw storage from the same caching allocator (on the current stream): PyTorch
    fills new tensors, not new storages. `stride` must be that of a dense tensor of `shape`."""
    storage = torch.UntypedStorage(math.prod(shape) * dtype.itemsize, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, stride)


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype, device=device), without the fill."""
    if not _skipping():
        return torch.empty(shape, dtype=dtype, device=device)
    return _unfilled(tuple(shape), dtype, device)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like(t), its strides included (a contiguous tensor may still have any stride
    on a dimension of size 1, and the kernels read a buffer's strides from its input's), without
    the fill. A tensor that is not contiguous keeps torch.empty_like's layout rules and its fill."""
    if not (_skipping() and t.is_contiguous()):
        return torch.empty_like(t)
    return _unfilled(t.shape, t.dtype, t.device, t.stride())
