"""Allocation of the buffers our kernels write before anything reads them: outputs (out, lse,
dq, dk, dv) and workspaces (delta, the Hopper backward's fp32 dQ accumulator and row sums).

Under `torch.use_deterministic_algorithms(True)` PyTorch fills every new tensor with NaN
(`torch.utils.deterministic.fill_uninitialized_memory`): a guard that makes an op which reads
memory it never wrote give the same result on every run. Our kernels read none of these buffers
before writing them, which is how they run without the flag (memory as the allocator hands it
over, as in every benchmark and most tests; the GPU tests hand the forward NaN-filled buffers and
check every element was written). The fill is one more pass over memory per buffer, about as
many bytes as the attention's inputs and outputs; the buffers allocated here skip it.
Accumulators that must start at zero and the order counters are `torch.zeros`, as before.
"""
import math

import torch

# False: these buffers are filled like any other tensor (scripts/gpu_e2e_speed.py's
# `dash_det_ourfill` variant sets it, to time what skipping the fill saves).
SKIP_FILL = True


def _filling() -> bool:
    return torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(shape), without PyTorch's NaN fill under the deterministic flag."""
    if not (SKIP_FILL and _filling()):
        return torch.empty(shape, dtype=dtype, device=device)
    shape = tuple(shape)
    # Raw storage from the same caching allocator (on the current stream); storages are not filled.
    storage = torch.UntypedStorage(math.prod(shape) * dtype.itemsize, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like(t) without the fill; a strided `t` keeps torch.empty_like (its layout
    rules, and the fill)."""
    if not t.is_contiguous():
        return torch.empty_like(t)
    return empty(t.shape, t.dtype, t.device)
