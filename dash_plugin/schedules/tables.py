"""Compact int32 tables of an ordered schedule, what a backward kernel reads (docs/INTERNALS.md,
"Schedule tables"). Built from `schedule.build_schedule`, so the kernels, the simulator and the
pictures share one set of ranks. Cached per shape: callers must not modify the tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from . import registry
from .schedule import build_cached, normalize_args


@dataclass(frozen=True)
class KernelTables:
    """See docs/INTERNALS.md. B sequences, W = max workers, S = max steps, M = max Q tiles
    (each at least 1, so no tensor is empty). Every KV tile of a sequence is the KV tile of
    exactly one segment (zero-step segments included), so the kernel writes every dK/dV row;
    padding workers have seg_kv = -1 and no steps; padding steps have q_tile = rank = -1."""

    num_workers: torch.Tensor  # (B,)
    seg_kv: torch.Tensor       # (B, W, 2)
    seg_end: torch.Tensor      # (B, W, 2)
    q_tile: torch.Tensor       # (B, W, S)
    rank: torch.Tensor         # (B, W, S)
    num_contrib: torch.Tensor  # (B, M)
    schedule: str = ""
    group_size: int = 1        # largest group whose waits may be cyclic: launch it co-resident
    variants: tuple[str, ...] = ()  # per sequence: what was built (fallbacks named)

    @property
    def max_workers(self) -> int:
        return self.seg_kv.shape[1]

    @property
    def max_steps(self) -> int:
        return self.q_tile.shape[2]


@lru_cache(maxsize=256)
def tables_cached(*normalized) -> KernelTables:
    """`kernel_tables` on `normalize_args`'s output."""
    sched = build_cached(*normalized)
    seqs = sched.sequences
    b = len(seqs)
    w_max = max([1] + [len(s.workers) for s in seqs])
    s_max = max([1] + [w.num_steps for s in seqs for w in s.workers])
    m_max = max([1] + [s.geometry.num_q_tiles for s in seqs])
    num_workers = torch.zeros(b, dtype=torch.int32)
    seg_kv = torch.full((b, w_max, 2), -1, dtype=torch.int32)
    seg_end = torch.zeros((b, w_max, 2), dtype=torch.int32)
    q_tile = torch.full((b, w_max, s_max), -1, dtype=torch.int32)
    rank = torch.full((b, w_max, s_max), -1, dtype=torch.int32)
    num_contrib = torch.zeros((b, m_max), dtype=torch.int32)
    for bi, seq in enumerate(seqs):
        num_workers[bi] = len(seq.workers)
        for i, (lo, hi) in enumerate(seq.geometry.q_range):
            num_contrib[bi, i] = max(0, hi - lo + 1)
        for wi, worker in enumerate(seq.workers):
            end = 0
            for si, seg in enumerate(worker.segments):
                seg_kv[bi, wi, si] = seg.kv
                k = len(seg.q_tiles)
                if k:
                    q_tile[bi, wi, end:end + k] = torch.tensor(seg.q_tiles, dtype=torch.int32)
                    rank[bi, wi, end:end + k] = torch.tensor(seg.ranks, dtype=torch.int32)
                end += k
                seg_end[bi, wi, si] = end
            if len(worker.segments) == 1:
                seg_end[bi, wi, 1] = end
    return KernelTables(num_workers, seg_kv, seg_end, q_tile, rank, num_contrib, sched.name,
                        max(s.group_size for s in seqs), sched.variants)


def kernel_tables(schedule: str, *, seqlens_q, seqlens_k, block_m: int, block_n: int,
                  causal: bool, window_left: int, window_right: int,
                  group_size: int | None = None) -> KernelTables:
    """Tables of an ordered schedule (registry kernel mode "ordered") for a batch (dense: one
    length pair; varlen: one pair per sequence). Cached by shape."""
    normalized = normalize_args(schedule, seqlens_q, seqlens_k, block_m, block_n, causal, window_left,
                                window_right, group_size)
    if not normalized[0].ordered:
        raise ValueError(f"kernel_tables: schedule {schedule!r} needs no tables; tables exist for "
                         f"{', '.join(s.name for s in registry.specs() if s.ordered)}")
    return tables_cached(*normalized)
