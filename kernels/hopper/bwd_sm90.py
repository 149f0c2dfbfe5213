"""Hopper-native deterministic backward (sm90): FA4's warp-specialised kernel, run in the
order of a dash_plugin schedule.

What runs on the GPU. One CTA per (KV tile, query head, batch), 3 warpgroups: a producer warp
issues TMA loads of Q, dO, LSE and dPsum; two consumer warpgroups run the five products with
`wgmma` and keep dK/dV in registers; a dQ-writer warp takes each fp32 dQ partial from shared
memory and reduce-adds it into the global accumulator with one bulk copy. That kernel is FA4's
`FlashAttentionBackwardSm90` (package `flash-attn-4`, pinned), used as a library. FA4 walks the
Q tiles of a KV tile from an index list when it is given one (its block-sparse path); we give
it the schedule's visit order, so the producer, the consumers and the writer all follow the
plan without a recompile per schedule.

What is ours. The dQ writer (`OrderedBackwardSm90.dQaccum_store`): before adding the partial
of Q tile m it waits until m's counter equals the rank the plan gives this contribution
(acquire), adds, waits for the add to complete in global memory (not just for its shared-memory
source to be read), then increments the counter (release). The wait sits in its own warp, so
the tensor cores keep working on the next Q tile meanwhile. The launch direction of the KV
tiles comes from the plan too (docs/INTERNALS.md, "Hopper backend").

Imported only when the Hopper backend runs: it needs CUDA, `flash-attn-4` and the CuTe DSL.
"""
from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from flash_attn.cute import barrier
from flash_attn.cute import interface as fa4
from flash_attn.cute import utils as fa4_utils
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch, to_cute_block_sparse_tensors
from flash_attn.cute.cute_dsl_utils import to_cute_tensor, torch2cute_dtype_map
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
from flash_attn.cute.named_barrier import NamedBarrierBwd
from quack import copy_utils

from .tile_table import bwd_tiles
from .visit_tables import VisitTables


class OrderedBackwardSm90(FlashAttentionBackwardSm90):
    """FA4's sm90 backward with a dQ writer that adds in the plan's order."""

    def __init__(self, *args, kv_descending: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_descending = kv_descending

    # FA4's __call__ derives `spt` from the mask and hands it to its tile scheduler as the
    # launch direction of the KV tiles. Here the plan decides the direction, so the
    # assignment is ignored.
    @property
    def spt(self):
        return self.kv_descending

    @spt.setter
    def spt(self, _value):
        pass

    @cute.jit
    def dQaccum_store(self, mdQaccum: cute.Tensor, sdQaccum: cute.Tensor, block_info,
                      TileSchedulerCls: cutlass.Constexpr, SeqlenInfoCls: cutlass.Constexpr,
                      blocksparse_tensors=None, mdQ_semaphore=None):
        """The dQ-writer warp. With index lists (`blocksparse_tensors`: the plan's visit order
        and ranks) it walks them; without, the visit order is ascending and the rank has the
        closed form of the ascending/spt plans (tested equal to the tables on the CPU)."""
        lane = cute.arch.thread_idx()[0] % cute.arch.WARP_SIZE
        chunk_layout = cute.make_layout((self.tile_m * self.tile_hdim // self.num_wg_dQ, self.num_wg_dQ))
        scheduler = TileSchedulerCls()
        work = scheduler.initial_work_tile_info()
        while work.is_valid_tile:
            n_block, head, batch, _ = work.tile_idx
            gdQ = cute.local_tile(mdQaccum[None, head, batch], (chunk_layout,), (None,))
            counters = mdQ_semaphore[None, None, head, batch] if const_expr(self.deterministic) else None
            if const_expr(blocksparse_tensors is not None):
                q_tiles = blocksparse_tensors.mask_block_idx[batch, head, n_block, None]
                ranks = blocksparse_tensors.dq_write_order[batch, head, n_block, None]
                for step in cutlass.range(blocksparse_tensors.mask_block_cnt[batch, head, n_block], unroll=1):
                    self._add_dq_tile(sdQaccum, gdQ, counters, q_tiles[step], ranks[step], lane)
            else:
                seqlen = SeqlenInfoCls(batch)
                m_block_min, m_block_max = block_info.get_m_block_min_max(seqlen, n_block)
                for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                    rank = n_block
                    if const_expr(self.kv_descending):  # spt: the last visible KV tile adds first
                        rank = block_info.get_n_block_min_max(seqlen, m_block)[1] - 1 - n_block
                    self._add_dq_tile(sdQaccum, gdQ, counters, m_block, rank, lane)
            scheduler.advance_to_next_work()
            work = scheduler.get_current_work()
        if const_expr(not self.deterministic):
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _add_dq_tile(self, sdQaccum, gdQ, counters, m_block, rank, lane):
        """Add the consumers' fp32 dQ partial of Q tile `m_block` (in shared memory, one chunk
        per consumer warpgroup) to the global accumulator; ordered mode adds as number `rank`."""
        chunks = self.num_wg_dQ
        handshake = self.num_threads_per_warp_group + cute.arch.WARP_SIZE
        # Shared dQ buffer free again: ordered mode already waited for the last add.
        for c in cutlass.range_constexpr(chunks):
            if const_expr(not self.deterministic):
                cute.arch.cp_async_bulk_wait_group(chunks - 1 - c, read=True)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQEmptyWG0) + c,
                                     number_of_threads=handshake)
        if const_expr(self.deterministic):
            barrier.wait_eq(counters[(m_block, None)].iterator, lane, 0, rank)
        for c in cutlass.range_constexpr(chunks):
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQFullWG0) + c, number_of_threads=handshake)
            with cute.arch.elect_one():
                copy_utils.cpasync_reduce_bulk_add_f32(
                    sdQaccum[None, c].iterator, gdQ[(None, c), m_block].iterator, self.tma_copy_bytes["dQ"])
            cute.arch.cp_async_bulk_commit_group()
        if const_expr(self.deterministic):
            # read=False: the add has landed in global memory, not only left shared memory.
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            barrier.arrive_inc(counters[(m_block, None)].iterator, lane, 0, 1)


def tiles(head_dim: int, causal: bool):
    """FA4's sm90 config for (head dim, mask); its block sizes must be our committed table's,
    or the plan would not be the order the kernel runs."""
    cfg = fa4._tile_size_bwd_sm90(head_dim, head_dim, causal, False)
    if (cfg.m_block_size, cfg.n_block_size) != bwd_tiles(head_dim, causal):
        raise RuntimeError(f"flash-attn-4's sm90 tiles {cfg.m_block_size}x{cfg.n_block_size} for "
                           f"head_dim={head_dim} differ from ours {bwd_tiles(head_dim, causal)}: "
                           "install the pinned flash-attn-4 version")
    return cfg


_compiled: dict = {}
_device_tables: dict = {}


def _tables_on_device(tables: VisitTables, batch: int, heads: int, device):
    """(count, q_tile, rank) as (B, H, N[, S]) int32 CUDA tensors: every (batch, head) walks
    the same per-KV-tile lists."""
    key = (tables, batch, heads, str(device))
    if key not in _device_tables:
        _device_tables[key] = tuple(
            t.to(device).expand(batch, heads, *t.shape).contiguous()
            for t in (tables.count, tables.q_tile, tables.rank))
    return _device_tables[key]


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool,
                       tables: VisitTables, deterministic: bool):
    """dq, dk, dv of dense (B, S, H, D) fp16/bf16 inputs; `lse` (B, H_q, S_q) natural log,
    as the forward returns it. `tables` must be built with `tiles(D, causal)`."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    cfg = tiles(head_dim, causal)
    tm, tn = cfg.m_block_size, cfg.n_block_size
    group = heads // heads_kv
    dtype = torch2cute_dtype_map[q.dtype]
    dev = q.device
    multiple = 64 if cfg.dKV_swapAB else 32
    hdim_r = -(-head_dim // multiple) * multiple
    sq_r, sk_r = -(-seqlen_q // tm) * tm, -(-seqlen_k // tn) * tn
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    lse = lse.contiguous()

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq_accum = torch.empty(batch, heads, sq_r * hdim_r, dtype=torch.float32, device=dev)
    dpsum = torch.empty(batch, heads, sq_r, dtype=torch.float32, device=dev)
    lse_log2 = torch.empty(batch, heads, sq_r, dtype=torch.float32, device=dev)
    if group > 1:  # several query heads add into one dK/dV: fp32 accumulators, then convert
        dk_out = torch.zeros(batch, heads_kv, sk_r * hdim_r, dtype=torch.float32, device=dev)
        dv_out = torch.zeros_like(dk_out)
    else:
        dk_out, dv_out = dk, dv
    # Counters start at 0 on every call, so an interrupted call cannot poison the next one.
    sem_dq = torch.zeros(batch, heads, sq_r // tm, 1, dtype=torch.int32, device=dev) if deterministic else None
    sem_dk = sem_dv = None
    if deterministic and group > 1:
        sem_dk = torch.zeros(batch, heads_kv, sk_r // tn, 2, dtype=torch.int32, device=dev)
        sem_dv = torch.zeros_like(sem_dk)
    count, q_tile, rank = _tables_on_device(tables, batch, heads, dev) if not tables.closed_form else (None,) * 3

    fa4._bwd_preprocess(out, dout, dpsum, lse, lse_log2, dq_accum, None, None, None, dtype,
                        head_dim, head_dim, tm, fake_mode=False, hdim_multiple_of=multiple)

    # Size-1 dimensions get specialised strides at compile time, so they are part of the key.
    ones = tuple(n == 1 for n in (batch, heads, heads_kv, sq_r // tm, sk_r // tn,
                                  tables.q_tile.shape[-1]))
    index_lists = not tables.closed_form
    key = (dtype, head_dim, group, causal, deterministic, tables.kv_descending, index_lists, ones)
    if key not in _compiled:
        kernel = OrderedBackwardSm90(
            dtype, head_dim, head_dim, group, causal, is_local=False, deterministic=deterministic,
            tile_m=tm, tile_n=tn, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO,
            PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB,
            dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP,
            AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
            num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False, q_subtile_factor=1,
            dQ_single_wg=cfg.dQ_single_wg, kv_descending=tables.kv_descending)
        sems = [None if t is None else fa4_utils.convert_from_dlpack_leading_static(
                    t, leading_dim=3, alignment=4, stride_order=t.dim_order())
                for t in (sem_dq, sem_dk, sem_dv)]
        sparse = to_cute_block_sparse_tensors(BlockSparseTensorsTorch(
            mask_block_cnt=count, mask_block_idx=q_tile, dq_write_order=rank,
            block_size=(tm, tn))) if index_lists else None
        _compiled[key] = cute.compile(
            kernel, *(to_cute_tensor(t) for t in (q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out)),
            softmax_scale, None, None, None, None, None, None, *sems,
            fa4_utils.AuxData(None, None), sparse, None,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi")
    _compiled[key](q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, softmax_scale,
                   None, None, None, None, None, None, sem_dq, sem_dk, sem_dv,
                   fa4_utils.AuxData(None, None),
                   (count, q_tile, None, None, None, None, rank, None) if index_lists else None, None)

    threads_dq = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
    fa4._bwd_postprocess_convert(dq_accum, dq, softmax_scale, None, None, 90, dtype, head_dim, tm,
                                 threads_dq, cfg.AtomLayoutMdQ, cfg.dQ_swapAB, cluster_size=1,
                                 fake_mode=False, hdim_multiple_of=multiple)
    if group > 1:
        for acc, grad, scale in ((dk_out, dk, softmax_scale), (dv_out, dv, 1.0)):
            fa4._bwd_postprocess_convert(acc, grad, scale, None, None, 90, dtype, head_dim, tn,
                                         cfg.num_wg * 128, cfg.AtomLayoutNdKV, cfg.dKV_swapAB,
                                         cluster_size=1, fake_mode=False, hdim_multiple_of=multiple)
    return dq, dk, dv
