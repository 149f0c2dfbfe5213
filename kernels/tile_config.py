"""Fixed tile configurations for the Triton attention kernels (docs/DESIGN.md, "Determinism
rules", rule 2).

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
class Tiles:
    """One kernel's tiles and launch shape (forward and backward kernels alike)."""
    block_m: int        # Q tile rows
    block_n: int        # KV tile rows
    num_warps: int
    num_stages: int

    def launch_args(self) -> dict:
        """The Triton meta-parameters of a launch with these tiles. FP fusion (a*b+c as one FMA,
        one rounding instead of two) is named rather than left to Triton's default, which
        Triton 3.9 announces will change in 3.10: a changed default would change our bits
        between two Triton versions. True is what every figure and test so far ran with."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.num_warps,
                    num_stages=self.num_stages, enable_fp_fusion=True)


# Hopper (sm90) and anything newer/older that has no row of its own. Keys: padded head dim.
# Rows from scripts/gpu_tune.py on an H200 (docs/benchmarks/tune-h200-1.json and -2.json, SDPA cuDNN
# timed beside them; hdim 256 from tune-256-h200.json); the history is in docs/benchmarks/NOTES.md.
_FWD_SM90 = {
    32: Tiles(128, 64, 4, 3),
    64: Tiles(128, 64, 8, 3),     # 393 TFLOP/s full 2k; 128x128 drops to 329
    128: Tiles(128, 128, 8, 3),   # 494 full 8k, 454 causal 8k (128x64: 451 / 410)
    256: Tiles(128, 64, 8, 2),    # 439 causal 8k, 432 full 2k (64x64/8w/2st: 212 / 214)
}
# KV-stationary kernel with dQ adds (ordered schedules and `atomic`; the ordered schedules'
# ranks are a function of these tiles). The dQ product needs dS transposed; at 8 warps the
# 64x128 tile hides it best: hdim 128 full 8k atomic 373 vs 202 TFLOP/s at 64x64/4 warps.
_BWD_SM90 = {
    32: Tiles(64, 128, 8, 3),
    64: Tiles(64, 128, 8, 3),
    128: Tiles(64, 128, 8, 3),
    256: Tiles(32, 32, 4, 2),     # atomic 156 causal 8k, 159 full 2k (32x64/8w/1st: 89 / 105)
}
# `split`: the KV kernel without dQ, and the Q-stationary dQ kernel. No cross-program
# reduction, so these tiles may differ from the ones above without changing any rank.
# tune-h200-2.json sweeps each with the other at its old row (64x64, 4 warps, 2 stages).
_SPLIT_KV_SM90 = {
    32: Tiles(64, 64, 4, 3),
    64: Tiles(64, 64, 4, 3),      # 330 TFLOP/s full 2k
    128: Tiles(64, 128, 8, 2),    # 351 causal 8k, 374 full 8k, 273 causal 2k (64x64/4: 337/376/264)
    256: Tiles(64, 64, 8, 2),     # 127 causal 8k, 134 full 2k with dQ at 32x64 (32x64/8w/1st: 90 / 94)
}
# Q-stationary like the forward: 128-row tiles at 8 warps win at every point swept.
_SPLIT_DQ_SM90 = {
    32: Tiles(128, 64, 8, 3),
    64: Tiles(128, 64, 8, 3),     # 342 full 2k (64x64/4: 320)
    128: Tiles(128, 64, 8, 3),    # 335 causal 8k, 400 full 8k, 273 causal 2k (64x64/4: 323/368/269)
    256: Tiles(128, 64, 8, 1),    # 126 causal 8k, 134 full 2k with KV at 32x64 (32x64/8w/1st: 90 / 94)
}

# Under TRITON_INTERPRET=1 (CPU CI): small tiles so that tiny test shapes still span several
# tiles (multi-tile online softmax, several dQ contributors, ragged last tiles).
_FWD_INTERPRET = Tiles(32, 16, 4, 1)
_BWD_INTERPRET = Tiles(16, 32, 4, 1)


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


def fwd_config(dtype: torch.dtype, head_dim: int, *, interpret: bool, arch=None) -> Tiles:
    """Forward tiles. ``arch`` is (major, minor); every arch uses the sm90 row for now."""
    if interpret:
        return _FWD_INTERPRET
    return _row(_FWD_SM90, head_dim)


_BWD_TABLES = {"ordered": _BWD_SM90, "split_kv": _SPLIT_KV_SM90, "split_dq": _SPLIT_DQ_SM90}


def bwd_config(dtype: torch.dtype, head_dim: int, *, interpret: bool, kernel: str = "ordered",
               arch=None) -> Tiles:
    """Backward tiles of one kernel: ``ordered`` (KV-stationary with dQ adds: ordered schedules
    and atomic; block_n is a multiple of block_m, which the causal shift pairs need),
    ``split_kv`` or ``split_dq``."""
    if kernel not in _BWD_TABLES:
        raise ValueError(f"kernel={kernel!r}: one of {sorted(_BWD_TABLES)}")
    if interpret:
        return _BWD_INTERPRET
    return _row(_BWD_TABLES[kernel], head_dim)
