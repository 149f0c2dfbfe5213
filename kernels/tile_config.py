"""Fixed tile configurations for the Triton attention kernels (DESIGN.md rule 2).

No runtime autotuning: two processes on the same GPU model must pick the same tiles, because
the backward's dQ accumulation order (the schedule's ranks) depends on the tile sizes. The
config is a pure function of (arch, dtype, head dim, mask kind); nothing here reads timings
or the SM count.

Block sizes are powers of two. The padded head dim (next power of two, at least 16) picks
the row; bigger head dims need smaller tiles to keep the fp32 accumulators in registers.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class BwdConfig:
    block_m: int        # Q tile (rows of dQ visited by a KV program)
    block_n: int        # KV tile (owned by one program)
    num_warps: int
    num_stages: int


# Hopper (sm90) and anything newer/older that has no row of its own. Keys: padded head dim.
_FWD_SM90 = {
    32: FwdConfig(128, 64, 4, 3),
    64: FwdConfig(128, 64, 4, 3),
    128: FwdConfig(128, 64, 8, 3),
    256: FwdConfig(64, 64, 8, 2),
}
# Rows chosen by scripts/gpu_tune_bwd.py on an H200 (docs/benchmarks/tune-bwd-h200.json): 64x64
# tiles at 4 warps beat 64x128 at 8 warps by 1.4x (hdim 128: causal descending 117 -> 168,
# full atomic 147 -> 209, full shift 138 -> 155 TFLOP/s; hdim 64 full shift 158 -> 204), because
# the 128-row fp32 dK/dV accumulators no longer spill.
_BWD_SM90 = {
    32: BwdConfig(64, 64, 4, 3),
    64: BwdConfig(64, 64, 4, 3),
    128: BwdConfig(64, 64, 4, 3),
    256: BwdConfig(32, 64, 8, 1),
}

# Under TRITON_INTERPRET=1 (CPU CI): small tiles so that tiny test shapes still span several
# tiles (multi-tile online softmax, several dQ contributors, ragged last tiles).
_FWD_INTERPRET = FwdConfig(32, 16, 4, 1)
_BWD_INTERPRET = BwdConfig(16, 32, 4, 1)


def padded_head_dim(head_dim: int) -> int:
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim={head_dim} is not supported: the Triton kernels take 1..256")
    p = 16
    while p < head_dim:
        p *= 2
    return p


def _row(table, head_dim):
    p = padded_head_dim(head_dim)
    return table[max(32, p)]


def fwd_config(dtype: torch.dtype, head_dim: int, *, interpret: bool, arch=None) -> FwdConfig:
    """Forward tiles. ``arch`` is (major, minor); every arch uses the sm90 row for now."""
    if interpret:
        return _FWD_INTERPRET
    return _row(_FWD_SM90, head_dim)


def bwd_config(dtype: torch.dtype, head_dim: int, *, interpret: bool, arch=None) -> BwdConfig:
    """Backward tiles; block_n is a multiple of block_m (the causal shift pairs need it)."""
    if interpret:
        return _BWD_INTERPRET
    return _row(_BWD_SM90, head_dim)
