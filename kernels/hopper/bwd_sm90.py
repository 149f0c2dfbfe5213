"""Hopper-native deterministic backward (sm90): FA4's warp-specialised kernel, run in the
order of a dash_plugin schedule.

What runs on the GPU. One CTA per (KV tile, query head, batch) (the causal symmetric shift:
per pair of KV tiles, run one after the other), 3 warpgroups: a producer warp
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

import dataclasses
import functools
import inspect
import threading
from contextlib import contextmanager

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute import FastDivmodDivisorV2
from cutlass.cute.nvgpu import warpgroup
from flash_attn.cute import barrier
from flash_attn.cute import interface as fa4
from flash_attn.cute import utils as fa4_utils
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch, to_cute_block_sparse_tensors
from flash_attn.cute.cute_dsl_utils import to_cute_aux_tensor, to_cute_tensor, torch2cute_dtype_map
from flash_attn.cute import flash_bwd_sm90
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
from flash_attn.cute.tile_scheduler import SingleTileLPTBwdScheduler, SingleTileVarlenScheduler, WorkTileInfo
from flash_attn.cute.named_barrier import NamedBarrierBwd
from quack import copy_utils, layout_utils

from .. import buffers
from ..philox import keep_scale
from . import dropout_sm90
from .masks import fa4_mask
from .tile_table import bwd_tiles
from .visit_tables import VisitTables, visits_every_q_tile


class OrderedBackwardSm90(FlashAttentionBackwardSm90):
    """FA4's sm90 backward with a dQ writer that adds in the plan's order.

    `visit` names the closed form of the order (visit_tables.CLOSED_FORMS) or is None: read the
    plan's lists. `ascending` and `arrival` are FA4's own loop; `descending` and `shift` run FA4's
    index-list loops with each Q tile computed instead of read (`_ComputedVisits`), so no table
    read sits on the producer's, the consumers' or the writer's path. A cyclic shift
    or arrival (group_size > 1) is compiled with the KV tiles of one head launched after another
    (`_launch_head_by_head`), which its groups need to be co-resident.
    """

    # Switches for scripts/gpu_dq_chain_probe.py, which times what each half of the ordered add
    # costs by turning it off (the bits are then no longer ordered); always on in the product.
    WAIT_FOR_RANK = True      # acquire: wait until the tile's counter equals this add's rank
    WAIT_FOR_LANDING = True   # release only once the add has landed in global memory
    RELEASE_COUNTER = True    # off: no counter increment either (only with WAIT_FOR_RANK off: nobody reads it)
    # Read the next tile's counter while this add lands (True/False), or None: read_turn_ahead()'s
    # rule, the product's. Same bits either way.
    READ_TURN_AHEAD = None
    # For scripts/gpu_dq_wait_probe.py: the dQ writer also sums the SM clock cycles it spends in
    # each wait into extra columns of the dQ counters (WAIT_COLUMNS); off in the product.
    RECORD_WAITS = False
    # For scripts/gpu_dq_chain_probe.py: off, the dQ writer computes each `shift` visit afresh
    # (two divisions a step) instead of carrying the index; same order and bits. On in the product.
    CARRY_SHIFT_VISITS = True
    # Under the paired launch (visit "pairs"): whether the producer and consumers compute each
    # Q tile (else they read the plan's lists) and whether the dQ writer computes each Q tile and
    # rank (else it reads them). Same order and bits. The consumers read: computing spilled
    # their registers at hdim 64 (52 bytes) and 128 (28 bytes), and at hdim 64 16k causal the
    # backward ran at 479 TFLOP/s computing against 510 reading (hdim 128: within 1 %; H100,
    # scripts/gpu_dq_chain_probe.py variants pairs-computed, pairs-read).
    PAIR_ROWS_COMPUTED = False
    PAIR_RANKS_COMPUTED = True
    # Units (half groups, eight scores) of a step's dropout mask drawn while its products run
    # (dropout_sm90.MaskWords); None: ahead_units' rule.
    AHEAD_UNITS = None
    # For scripts/gpu_dq_chain_probe.py: off, GQA's dK/dV adds run unordered (FA4's
    # non-deterministic epilogue) while dQ stays ordered, to time what the ordered adds cost.
    ORDERED_DKV = True
    # Deterministic mode: the first add to each dQ tile (rank 0) stores its partial instead of
    # adding it, so the accumulator needs no zeroing where every Q tile has an add
    # (`attention_backward`). Off: every add reduces into a zeroed accumulator. Same bits.
    STORE_FIRST_DQ = True
    # The class-level switches above, read at compile time: their values are part of the compile
    # key, so kernels compiled under different settings live side by side (probes interleave them).
    SWITCHES = ("WAIT_FOR_RANK", "WAIT_FOR_LANDING", "RELEASE_COUNTER", "READ_TURN_AHEAD", "RECORD_WAITS",
                "CARRY_SHIFT_VISITS", "PAIR_ROWS_COMPUTED", "PAIR_RANKS_COMPUTED", "AHEAD_UNITS",
                "ORDERED_DKV", "STORE_FIRST_DQ")

    def __init__(self, *args, kv_descending: bool, visit: str | None, group_size: int = 1,
                 dropout: bool = False, **kwargs):
        self.kv_descending = kv_descending
        self.visit = visit
        self.group_size = group_size
        self.dropout = dropout
        self._index_lists = False
        super().__init__(*args, has_aux_tensors=dropout, **kwargs)

    # FA4's __call__ derives `spt` from the mask and hands it to its tile scheduler as the
    # launch direction of the KV tiles. Here the plan decides the direction, so the
    # assignment is ignored.
    @property
    def spt(self):
        return self.kv_descending

    @spt.setter
    def spt(self, _value):
        pass

    # FA4's __call__ sets this from "index lists given"; a computed order walks the same loops.
    @property
    def use_block_sparsity(self):
        return self._index_lists or self.visit in _COMPUTED

    @use_block_sparsity.setter
    def use_block_sparsity(self, value):
        self._index_lists = value

    def load(self, *args):
        return super().load(*_with_computed_visits(self, args, _LOAD_ARGS))

    def mma(self, *args, **kwargs):
        if self.dropout:
            # Trace-time state: the run-time dropout constants, loaded where the consumers start,
            # for every per-Q-tile step and the dK/dV epilogue traced inside.
            self._drop, _ = dropout_sm90.drop_params_of_mma(
                FlashAttentionBackwardSm90.mma, self, args, kwargs)
        return super().mma(*_with_computed_visits(self, args, _MMA_ARGS), **kwargs)

    def epilogue_dKV(self, acc_dV, mdV, sV, acc_dK, *args, **kwargs):
        """FA4's epilogue; with dropout, dV and dK first take the keep scale that the per-score
        steps leave out (see _mma_one_m_block_dropout)."""
        if self.dropout:
            acc_dV.store(acc_dV.load() * self._drop.scale)
            acc_dK.store(acc_dK.load() * self._drop.scale)
        if const_expr(self.ORDERED_DKV):
            return super().epilogue_dKV(acc_dV, mdV, sV, acc_dK, *args, **kwargs)
        deterministic, self.deterministic = self.deterministic, False   # read while tracing
        try:
            return super().epilogue_dKV(acc_dV, mdV, sV, acc_dK, *args, **kwargs)
        finally:
            self.deterministic = deterministic

    def _visit(self, seqlen, block_info, n_block, step):
        """(Q tile, rank) of this KV tile's `step`-th visit under the closed form; the same
        arithmetic as visit_tables.closed_form_visits (a CPU test checks that one against the
        plan, a GPU test this one against the tables)."""
        m_min, m_max = block_info.get_m_block_min_max(seqlen, n_block)
        if const_expr(self.visit == "arrival"):   # FA4's ascending loop, ranks in arrival order
            m_block = m_min + step
            n_max = block_info.get_n_block_min_max(seqlen, m_block)[1]
            # The KV tiles the first Q tile sees reach every row at one step, after the others (more
            # than one only where keys outnumber queries): they add last, by (group launched
            # first, KV tile); with one group (g >= n) their place is n_block itself.
            tied = cutlass.max(block_info.get_n_block_min_max(seqlen, 0)[1], 0)
            n, g = cute.ceil_div(seqlen.seqlen_k, self.tile_n), self.group_size
            top = (n - 1 - n_block) // g
            tie_place = cutlass.max(tied - n + top * g, 0) + n_block - cutlass.max(n - (top + 1) * g, 0)
            rank = Int32(cutlass.select_(n_block < tied, n_max - tied + tie_place, n_max - 1 - n_block))
        elif const_expr(self.visit in ("ascending", "descending")):
            m_block = m_min + step if const_expr(self.visit == "ascending") else m_max - 1 - step
            n_min, n_max = block_info.get_n_block_min_max(seqlen, m_block)
            # KV tiles add in index order from the row's first visible one (n_min is a constant 0
            # without a window); under spt's launch the last visible one adds first
            rank = n_max - 1 - n_block if const_expr(self.kv_descending) else n_block - n_min
        elif const_expr(self.visit == "pairs"):
            m_block, rank = self._pair_visit(seqlen, n_block, step)
        else:  # shift: member `lane` of the group starting at KV tile j0
            group = self._shift_group(seqlen, n_block)
            m_block, rank = self._shift_visit(group, m_min, (group[0] + step) % (m_max - m_min))
        return m_block, rank

    def _pair_visit(self, seqlen, n_block, step):
        """(Q tile, rank) of KV tile `n_block`'s `step`-th visit under the paired launch: the
        arithmetic of visit_tables._pair_visits, without division (s = tile_n / tile_m is a
        compile-time power of two; a rectangle row offset l + step < 2 rlen wraps by a compare)."""
        s = self.tile_n // self.tile_m
        n = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
        m = cute.ceil_div(seqlen.seqlen_q, self.tile_m)
        small = 2 * n_block >= n
        p = cutlass.select_(small, n - 1 - n_block, n_block)
        lane = p % self.group_size
        p0 = p - lane
        members = cutlass.min(self.group_size, n // 2 - p0)
        r0 = (p0 + members - 1) * s
        rlen = m - r0
        i = lane + step
        i = i - cutlass.select_(i >= rlen, rlen, 0)
        place = cutlass.min(i, members - 1) - lane + members
        in_rect = step < rlen
        m_big = cutlass.select_(in_rect, r0 + i, p * s + step - rlen)
        m_block = cutlass.select_(small, m - 1 - step, m_big)
        f = m_block // s
        own = cutlass.select_(in_rect, place - cutlass.select_(place >= members, members, 0), f - p0 - lane)
        own = cutlass.select_(small, 2 * members - 1 - lane, own)
        before = cutlass.min(p0, f + 1) + cutlass.max(0, p0 - cutlass.max(0, n - 1 - f))
        return m_block, before + own

    def _shift_group(self, seqlen, n_block):
        """(lane, j0, members) of KV tile `n_block` under `shift`: its place in its group, the
        group's first KV tile and its size."""
        lane = n_block % self.group_size
        j0 = n_block - lane
        return lane, j0, cutlass.min(self.group_size, cute.ceil_div(seqlen.seqlen_k, self.tile_n) - j0)

    @staticmethod
    def _shift_visit(group, m_min, i):
        """(Q tile, rank) of a `shift` member's visit to its i-th Q tile from m_min. The rank's
        wrap needs no division: min(i, members - 1) - lane + members lies in [1, 2 members - 1]
        (lane < members)."""
        lane, j0, members = group
        place = cutlass.min(i, members - 1) - lane + members
        return m_min + i, j0 + place - cutlass.select_(place >= members, members, 0)

    @cute.jit
    def dQaccum_store(self, mdQaccum: cute.Tensor, sdQaccum: cute.Tensor, block_info,
                      TileSchedulerCls: cutlass.Constexpr, SeqlenInfoCls: cutlass.Constexpr,
                      blocksparse_tensors=None, mdQ_semaphore=None):
        """The dQ-writer warp: walks the plan's visit order and ranks, read from the index lists
        or computed (`_visit`)."""
        lane = cute.arch.thread_idx()[0] % cute.arch.WARP_SIZE
        chunk_layout = cute.make_layout((self.tile_m * self.tile_hdim // self.num_wg_dQ, self.num_wg_dQ))
        scheduler = TileSchedulerCls()
        work = scheduler.initial_work_tile_info()
        while work.is_valid_tile:
            n_block, head, batch, _ = work.tile_idx
            seqlen = SeqlenInfoCls(batch)
            if const_expr(not seqlen.has_cu_seqlens_q):
                dq_rows = mdQaccum[None, head, batch]
            else:   # packed: this sequence's rows start at its tile-aligned offset
                dq_rows = cute.domain_offset((seqlen.padded_offset_q * self.tile_hdim,), mdQaccum[None, head])
            gdQ = cute.local_tile(dq_rows, (chunk_layout,), (None,))
            counters = mdQ_semaphore[None, None, head, batch] if const_expr(self.deterministic) else None
            seen = Int32(-1)   # the counter of this step's dQ tile as read ahead (-1: not read)
            if const_expr(not _writer_computes(self.visit)):
                q_tiles = blocksparse_tensors.mask_block_idx[batch, head, n_block, None]
                ranks = blocksparse_tensors.dq_write_order[batch, head, n_block, None]
                count = blocksparse_tensors.mask_block_cnt[batch, head, n_block]
                for step in cutlass.range(count, unroll=1):
                    ahead = cutlass.min(step + 1, count - 1)
                    seen = self._add_dq_tile(sdQaccum, gdQ, counters, q_tiles[step], ranks[step], lane, n_block,
                                             seen, step + 1 < count, q_tiles[ahead], ranks[ahead])
            elif const_expr(self.visit == "shift" and self.CARRY_SHIFT_VISITS):
                # The visit index i walks the Q tiles cyclically from lane % count: carried from
                # step to step, so the writer's loop (the ordered adds' chain) does no division.
                m_block_min, m_block_max = block_info.get_m_block_min_max(seqlen, n_block)
                count = m_block_max - m_block_min
                group = self._shift_group(seqlen, n_block)
                i = group[0] % cutlass.max(count, 1)
                m_block, rank = self._shift_visit(group, m_block_min, i)
                for step in cutlass.range(count, unroll=1):
                    i = i + 1
                    i = cutlass.select_(i == count, 0, i)
                    next_m_block, next_rank = self._shift_visit(group, m_block_min, i)
                    seen = self._add_dq_tile(sdQaccum, gdQ, counters, m_block, rank, lane, n_block,
                                             seen, step + 1 < count, next_m_block, next_rank)
                    m_block, rank = next_m_block, next_rank
            else:
                m_block_min, m_block_max = block_info.get_m_block_min_max(seqlen, n_block)
                count = m_block_max - m_block_min
                for step in cutlass.range(count, unroll=1):
                    m_block, rank = self._visit(seqlen, block_info, n_block, step)
                    next_m_block, next_rank = self._visit(seqlen, block_info, n_block, step + 1)
                    seen = self._add_dq_tile(sdQaccum, gdQ, counters, m_block, rank, lane, n_block,
                                             seen, step + 1 < count, next_m_block, next_rank)
            scheduler.advance_to_next_work()
            work = scheduler.get_current_work()
        if const_expr(not self.deterministic):
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _add_dq_tile(self, sdQaccum, gdQ, counters, m_block, rank, lane, n_block,
                     seen, has_next, next_m_block, next_rank):
        """Add the consumers' fp32 dQ partial of Q tile `m_block` (in shared memory, one chunk
        per consumer warpgroup) to the global accumulator; ordered mode adds as number `rank`.

        `seen` is m_block's counter as read during the previous step (-1: not read). Returns
        the counter of the next step's tile, read while this add lands: one read of a counter
        costs about a global-memory round trip, which would otherwise sit in the writer's loop
        between two adds (scripts/gpu_dq_wait_probe.py measured it)."""
        chunks = self.num_wg_dQ
        handshake = self.num_threads_per_warp_group + cute.arch.WARP_SIZE
        # Shared dQ buffer free again: ordered mode already waited for the last add.
        for c in cutlass.range_constexpr(chunks):
            if const_expr(not self.deterministic):
                cute.arch.cp_async_bulk_wait_group(chunks - 1 - c, read=True)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQEmptyWG0) + c,
                                     number_of_threads=handshake)
        if const_expr(self.deterministic and self.WAIT_FOR_RANK):
            if const_expr(self.RECORD_WAITS):
                started = cute.arch.clock()
            self._wait_turn(counters[(m_block, None)].iterator, lane, rank, seen)
            if const_expr(self.RECORD_WAITS):
                self._record(counters, cute.arch.clock() - started, (m_block, 1), (n_block, 2))
        record = self.RECORD_WAITS and self.deterministic
        if const_expr(record):
            started = cute.arch.clock()
        for c in cutlass.range_constexpr(chunks):
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQFullWG0) + c, number_of_threads=handshake)
            with cute.arch.elect_one():
                partial = (sdQaccum[None, c].iterator, gdQ[(None, c), m_block].iterator, self.tma_copy_bytes["dQ"])
                if const_expr(self.stores_first(self.deterministic)):
                    if rank == 0:   # the tile's first add: nothing to add to
                        copy_utils.cpasync_bulk_s2g(*partial)
                    else:
                        copy_utils.cpasync_reduce_bulk_add_f32(*partial)
                else:
                    copy_utils.cpasync_reduce_bulk_add_f32(*partial)
            cute.arch.cp_async_bulk_commit_group()
        if const_expr(record):   # waiting for the consumers' partial (and issuing it)
            self._record(counters, cute.arch.clock() - started, (n_block, 4))
        seen_next = Int32(-1)
        if const_expr(self.deterministic and self.WAIT_FOR_RANK and self.read_turn_ahead()):
            if has_next:
                seen_next = self._read_turn(counters[(next_m_block, None)].iterator, lane, next_rank)
        if const_expr(self.deterministic):
            # read=False: the add has landed in global memory, not only left shared memory.
            if const_expr(self.RECORD_WAITS):
                started = cute.arch.clock()
            cute.arch.cp_async_bulk_wait_group(0, read=not self.WAIT_FOR_LANDING)
            if const_expr(self.RECORD_WAITS):
                self._record(counters, cute.arch.clock() - started, (n_block, 3))
            if const_expr(self.RELEASE_COUNTER):
                barrier.arrive_inc(counters[(m_block, None)].iterator, lane, 0, 1)
        return seen_next

    @classmethod
    def stores_first(cls, deterministic: bool) -> bool:
        """Whether rank 0 stores (STORE_FIRST_DQ): only where the adds are ordered, so that the
        store lands before any other add to the tile starts. Read by the kernel as it is traced
        and by `attention_backward` to leave the accumulator unzeroed."""
        return cls.STORE_FIRST_DQ and deterministic and cls.WAIT_FOR_RANK

    def read_turn_ahead(self) -> bool:
        """Whether the dQ writer reads the next tile's counter while an add lands: above head dim
        64. It took the counter's round trip out of the writer's loop where contributors wait
        for their turn (hdim 128 causal 2k `arrival`: +5-8 %, full 8k: +2-6 %). At hdim 64 it
        gained nothing at 2k-8k and cost 0-5 % at full 16k in four runs, with a wider scatter (the
        acquire load is still in flight at the release fence that follows the landing wait, so
        the release waits for it too); H100, docs/benchmarks/read-turn-2026-11-25-h100/."""
        if self.READ_TURN_AHEAD is not None:
            return self.READ_TURN_AHEAD
        return self.tile_hdim > 64

    @cute.jit
    def _read_turn(self, counter, lane, rank) -> Int32:
        """The counter's value (lane 0; rank 0 needs no read: counters start at 0)."""
        value = Int32(0)
        if lane == 0:
            if rank > 0:
                value = barrier.ld_acquire(counter)
        return value

    @cute.jit
    def _wait_turn(self, counter, lane, rank, seen):
        """Lane 0 spins until the counter equals `rank`, starting from `seen` if it was read
        ahead (the counter only grows, so a value read earlier that equals the rank is final)."""
        if lane == 0:
            value = seen
            if rank == 0:
                value = rank
            while value != rank:
                value = barrier.ld_acquire(counter)

    @staticmethod
    def _record(counters, cycles, *cells):
        """One lane adds `cycles` to the counter cells (row, column) named (rows: Q or KV tiles)."""
        with cute.arch.elect_one():
            for row, col in cells:
                fa4_utils.atomic_add_i32(cycles, counters[(row, None)].iterator + col)


    def ahead_units(self) -> int:
        """A dropout step's units drawn while S and dP are computed: four (half a thread's) at
        hdim 64, where that took 6-7 % off the backward with dropout (H100); none above, where a
        thread holds four units and drawing them ahead gained nothing at causal masks and cost
        9 % at full ones (spills). Eight at hdim 64 serialised the products (ptxas)."""
        if self.AHEAD_UNITS is not None:
            return self.AHEAD_UNITS
        return 4 if self.tile_hdim <= 64 else 0

    def mma_one_m_block(self, *args, **kwargs):
        """One Q tile of a KV tile's loop: FA4's step, or ours when dropout is on."""
        if not self.dropout:
            return super().mma_one_m_block(*args, **kwargs)
        return self._mma_one_m_block_dropout(*args, **kwargs)

    @cute.jit
    def _mma_one_m_block_dropout(
        self, m_block, consumer_state_Q, consumer_state_dO, warp_group_idx, mma_qk_fn, mma_dov_fn,
        mma_pdo_fn, mma_dsq_fn, mma_dsk_fn, copy_P_r2s, copy_dS_r2s, pipeline_Q, pipeline_dO,
        tLSEsLSE, tLSEsdPsum, tdQsdQaccum, softmax_scale_log2, PdS_barrier,
        is_dQ_wg: cutlass.Constexpr[bool] = True, mask_fn=None, score_mod_fn=None, score_mod_bwd_fn=None,
        dKV_accumulate=True,
    ):
        """FA4's step (products, pipelines and barriers in its order) with dropout between
        P and its two uses: dV takes P * keep * scale, and dS = P * (dP * keep * scale - dPsum).
        Both are computed divided by the keep scale (dV from P * keep, dS as
        P * keep * dP - P * dPsum / scale), which dK and dV take once in the epilogue and dQ in its
        conversion: one multiply per output element instead of one per score. The mask rides on
        the sign of P (dropout_sm90.drop_scores) from the first use to the second."""
        # score_mod_fn is FA4's partial with this KV tile's coordinates bound (no score_mod runs here).
        tile = score_mod_fn.keywords
        drop = self._drop
        state_dO = consumer_state_Q if const_expr(self.Q_stage == self.dO_stage) else consumer_state_dO
        # The accumulator's coordinates: rows = keys under SdP_swapAB (the head dims up to 128),
        # rows = queries above.
        shape, offset = (self.tile_m, self.tile_n), (m_block * self.tile_m, tile["n_block"] * self.tile_n)
        coords_mn = dropout_sm90.tile_coords(tile["thr_mma_SdP"], shape[::-1] if const_expr(self.SdP_swapAB) else shape,
                                             offset[::-1] if const_expr(self.SdP_swapAB) else offset)
        idx_Q = consumer_state_Q.index
        idx_dO = state_dO.index if const_expr(self.dO_stage > 1) else 0
        idx_PdS = idx_Q if const_expr(self.PdS_stage > 1) else 0
        # S = Q K^T and dP = dO V^T, both in flight
        pipeline_Q.consumer_wait(consumer_state_Q, pipeline_Q.consumer_try_wait(consumer_state_Q))
        acc_S = mma_qk_fn(A_idx=idx_Q, wg_wait=-1)
        lse = copy_utils.load_s2r(tLSEsLSE[None, idx_Q])
        pipeline_dO.consumer_wait(state_dO, pipeline_dO.consumer_try_wait(state_dO))
        acc_dP = mma_dov_fn(A_idx=idx_Q, wg_wait=-1)
        # The mask's words, begun while both products run (dropout_sm90.MaskWords), then S.
        words = None
        if const_expr(dropout_sm90.has_quads(coords_mn)):
            words = dropout_sm90.MaskWords(coords_mn, tile["head_idx"], tile["batch_idx"], drop,
                                           rows_are_queries=not self.SdP_swapAB, ahead=self.ahead_units())
        warpgroup.wait_group(1)
        if const_expr(mask_fn is not None):
            mask_fn(acc_S, m_block=m_block)
        # P = exp(S - LSE)
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=self.SdP_swapAB)
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            lse_r = self._get_stat(lse, r, lane, shuffle=self.shuffle_LSE)
            for c in cutlass.range(cute.size(acc_S_mn, mode=[1]), unroll_full=True):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * softmax_scale_log2 - lse_r, fastmath=True)
        # Dropout, in the accumulator's own orientation: dropped P -> -P.
        dropout_sm90.drop_scores(acc_S, coords_mn, tile["head_idx"], tile["batch_idx"], drop,
                                 rows_are_queries=not self.SdP_swapAB, negate=True, words=words)
        dpsum = copy_utils.load_s2r(tLSEsdPsum[None, idx_dO])
        # P * keep for dV: the marked (negative) entries become 0
        kept = cute.make_fragment_like(acc_S)
        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
            kept[i] = acc_S[i] if acc_S[i] > Float32(0.0) else Float32(0.0)
        tdVrP = fa4_utils.cvt_f16(layout_utils.reshape_acc_to_frgA(kept), self.dtype)
        if const_expr(not self.mma_dkv_is_rs):
            if const_expr(self.PdS_stage == 1):
                PdS_barrier.arrive_and_wait()
            copy_P_r2s(tdVrP, dst_idx=idx_PdS)
        # dS / scale = P * keep * dP - P * dPsum / scale, with P * keep the dV operand above and
        # P = |e|: a multiply and a fused multiply-add per score, no select.
        warpgroup.wait_group(0)
        acc_dP_mn = layout_utils.reshape_acc_to_mn(acc_dP, transpose=self.SdP_swapAB)
        kept_mn = layout_utils.reshape_acc_to_mn(kept, transpose=self.SdP_swapAB)
        for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
            dpsum_r = self._get_stat(dpsum, r, lane, shuffle=self.shuffle_dPsum) * drop.keep_rate   # / scale
            for c in cutlass.range(cute.size(acc_dP_mn, mode=[1]), unroll_full=True):
                acc_dP_mn[r, c] = kept_mn[r, c] * acc_dP_mn[r, c] - abs(acc_S_mn[r, c]) * dpsum_r
        tdKrdS = fa4_utils.cvt_f16(layout_utils.reshape_acc_to_frgA(acc_dP), self.dtype)
        # From here on FA4's step unchanged: dS to shared memory, dV += P^T dO, dQ = dS K, dK += dS^T Q.
        if const_expr(not self.mma_dkv_is_rs or (self.PdS_stage == 1 and self.mma_dkv_is_rs)):
            cute.arch.fence_view_async_shared()
            PdS_barrier.arrive_and_wait()
        copy_dS_r2s(tdKrdS, dst_idx=idx_PdS)
        if const_expr(not self.mma_dkv_is_rs):
            mma_pdo_fn(A_idx=idx_PdS, B_idx=idx_dO, zero_init=not dKV_accumulate, wg_wait=-1)
        else:
            mma_pdo_fn(tCrA=tdVrP, B_idx=idx_dO, zero_init=not dKV_accumulate, wg_wait=-1)
        cute.arch.fence_view_async_shared()
        PdS_barrier.arrive_and_wait()
        if const_expr(is_dQ_wg):
            acc_dQ = mma_dsk_fn(A_idx=idx_PdS, wg_wait=1)
            pipeline_dO.consumer_release(state_dO)
            self._dk_step(mma_dsq_fn, idx_PdS, idx_Q, tdKrdS, dKV_accumulate)
            handshake = self.num_threads_per_warp_group + cute.arch.WARP_SIZE
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmptyWG0) + warp_group_idx, number_of_threads=handshake)
            cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQaccum.shape)), tdQsdQaccum)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQFullWG0) + warp_group_idx,
                                     number_of_threads=handshake)
            warpgroup.wait_group(0)
            pipeline_Q.consumer_release(consumer_state_Q)
        else:
            self._dk_step(mma_dsq_fn, idx_PdS, idx_Q, tdKrdS, dKV_accumulate)
            pipeline_dO.consumer_release(state_dO)
            warpgroup.wait_group(0)
            pipeline_Q.consumer_release(consumer_state_Q)
        consumer_state_Q.advance()
        consumer_state_dO.advance()
        return consumer_state_Q, consumer_state_dO

    @cute.jit
    def _dk_step(self, mma_dsq_fn, idx_PdS, idx_Q, tdKrdS, dKV_accumulate):
        """dK += dS^T Q, from shared memory or (register-sourced config) from registers."""
        if const_expr(not self.mma_dkv_is_rs):
            mma_dsq_fn(A_idx=idx_PdS, B_idx=idx_Q, zero_init=not dKV_accumulate, wg_wait=1)
        else:
            mma_dsq_fn(tCrA=tdKrdS, B_idx=idx_Q, zero_init=not dKV_accumulate, wg_wait=1)


_COMPUTED = ("descending", "shift", "pairs")   # closed forms that run FA4's index-list loops


def _rows_computed(visit) -> bool:
    """Whether the producer and consumers compute the Q tiles of closed form `visit` in FA4's
    index-list loops (else those loops read the plan's lists; orders outside _COMPUTED run FA4's
    own loop)."""
    return visit in _COMPUTED and (visit != "pairs" or OrderedBackwardSm90.PAIR_ROWS_COMPUTED)


def _writer_computes(visit) -> bool:
    """Whether the dQ writer computes each visit and rank (else it reads the plan's lists)."""
    return visit is not None and (visit != "pairs" or OrderedBackwardSm90.PAIR_RANKS_COMPUTED)


def _arg_positions(method):
    """Positions (after self) of the arguments `_with_computed_visits` reads and replaces."""
    names = list(inspect.signature(method).parameters)[1:]
    return tuple(names.index(n) for n in ("blocksparse_tensors", "block_info", "SeqlenInfoCls"))


_LOAD_ARGS = _arg_positions(FlashAttentionBackwardSm90.load)
_MMA_ARGS = _arg_positions(FlashAttentionBackwardSm90.mma)


def _with_computed_visits(kernel, args, positions):
    """`args` with the index lists replaced by the computed order when the kernel has one."""
    if not _rows_computed(kernel.visit):
        return args
    sparse, block_info, seqlen_cls = positions
    args = list(args)
    args[sparse] = _ComputedVisits(kernel, args[block_info], args[seqlen_cls])
    return tuple(args)


class _ComputedVisits:
    """Stands in for FA4's block-sparse index lists (BlockSparseTensors: per KV tile a count and
    the Q tiles in visit order) and answers each lookup with the closed form, at trace time."""

    def __init__(self, kernel, block_info, seqlen_cls):
        self.kernel, self.block_info, self.seqlen_cls = kernel, block_info, seqlen_cls

    def __iter__(self):   # (count, Q tiles, no "full" lists, no varlen offsets, no ranks)
        return iter((_VisitCount(self), _VisitRows(self), None, None, None, None, None, None))


class _VisitCount:
    def __init__(self, visits):
        self.visits = visits

    def __getitem__(self, index):
        batch, _head, n_block = index
        m_min, m_max = self.visits.block_info.get_m_block_min_max(self.visits.seqlen_cls(batch), n_block)
        return m_max - m_min


class _VisitRows:
    def __init__(self, visits, at=None):
        self.visits, self.at = visits, at

    def __getitem__(self, index):
        if self.at is None:   # [batch, head, n_block, None]: this KV tile's list
            return _VisitRows(self.visits, index)
        batch, _head, n_block, _ = self.at
        v = self.visits
        return v.kernel._visit(v.seqlen_cls(batch), v.block_info, n_block, index)[0]


@contextmanager
def _launch_head_by_head(enabled: bool, top_group: int = 0, pair_threads: int = 0):
    """While FA4's __call__ builds its grid, its tile schedulers (dense deterministic, and packed)
    launch the KV tiles of one head after another (no interleaving of heads for L2 reuse), so a
    cyclic group of G KV tiles occupies G consecutive launch slots (visit_tables.RESIDENT_SLOTS);
    with `top_group` > 0, in groups of that many launched top group first (`_top_group_first`);
    with `pair_threads` > 0 (dense batches), in pairs (`_PairScheduler`: that many threads meet
    at its hand-over of the K/V buffers). It swaps module globals of FA4's for the compile
    (FA4's __call__ names the classes directly), under a lock so that two of our compiles never
    interleave the swap; a compile of FA4's own backward in another thread at that moment would
    still see it."""
    if not enabled:
        yield
        return
    swaps = dict(zip(("SingleTileLPTBwdScheduler", "SingleTileVarlenScheduler"),
                     _head_by_head_schedulers(top_group, pair_threads)))
    with _swap_lock:
        saved = {name: getattr(flash_bwd_sm90, name) for name in swaps}
        for name, cls in swaps.items():
            setattr(flash_bwd_sm90, name, cls)
        try:
            yield
        finally:
            for name, cls in saved.items():
                setattr(flash_bwd_sm90, name, cls)


_swap_lock = threading.Lock()


def _top_group_first(slot, n, group: int):
    """KV tile of launch `slot` of a head of `n` KV tiles, groups of `group` launched top group
    first (visit_tables.top_group_first_launch is the same arithmetic, and the plan's order)."""
    return cutlass.max(n - (slot // group + 1) * group, 0) + slot % group


class _HeadByHeadScheduler(SingleTileLPTBwdScheduler):
    """FA4's deterministic backward scheduler with one head per L2 section."""

    TOP_GROUP = 0   # > 0: launch a head's KV tiles in groups of this many, top group first

    @staticmethod
    def to_underlying_arguments(args, *, loc=None, ip=None, **kwargs):
        params = SingleTileLPTBwdScheduler.to_underlying_arguments(args, loc=loc, ip=ip, **kwargs)
        one = FastDivmodDivisorV2(1)
        return dataclasses.replace(
            params, l2_minor=Int32(1), l2_minor_divmod=one, l2_minor_residual_divmod=one,
            l2_major_divmod=FastDivmodDivisorV2(params.num_block),
            num_hb_quotient=Int32(args.num_head * args.num_batch))

    @classmethod
    def create(cls, params, *, loc=None, ip=None):   # FA4's builds its own class, not a subclass
        base = SingleTileLPTBwdScheduler.create(params, loc=loc, ip=ip)
        return cls(params, base._tile_idx, loc=loc, ip=ip)

    def get_current_work(self, *, loc=None, ip=None):
        work = SingleTileLPTBwdScheduler.get_current_work(self, loc=loc, ip=ip)
        if const_expr(self.TOP_GROUP == 0):
            return work
        slot, head, batch, split = work.tile_idx
        kv = _top_group_first(slot, self.params.num_block, self.TOP_GROUP)
        return WorkTileInfo((Int32(kv), head, batch, split), work.is_valid_tile)


class _HeadByHeadVarlenScheduler(SingleTileVarlenScheduler):
    """FA4's packed-batch scheduler without its head swizzle: inside a sequence, one head's KV
    tiles after another, from the first up (or, with TOP_GROUP, in groups top group first,
    counted from the sequence's own KV tiles)."""

    TOP_GROUP = 0

    @staticmethod
    def to_underlying_arguments(args, **kwargs):
        return SingleTileVarlenScheduler.to_underlying_arguments(
            dataclasses.replace(args, head_swizzle=False, lpt=False), **kwargs)

    @classmethod
    def create(cls, params, ctx=None, *, loc=None, ip=None):
        base = SingleTileVarlenScheduler.create(params, ctx, loc=loc, ip=ip)
        return cls(params, base._tile_idx, base._split_idx, ctx, loc=loc, ip=ip)

    def _decode_work_tile(self):
        work = SingleTileVarlenScheduler._decode_work_tile(self)
        if const_expr(self.TOP_GROUP == 0):
            return work
        slot, head, batch, split = work.tile_idx
        d = self.params.decoder
        b = cutlass.min(batch, d.num_batch - 1)   # an invalid tile's batch may be one past the last
        n = cute.ceil_div(d.mCuSeqlensQ[b + 1] - d.mCuSeqlensQ[b], d.tile_shape_mn[0])   # KV tiles (roles swapped)
        kv = _top_group_first(slot, n, self.TOP_GROUP)
        return WorkTileInfo((Int32(kv), head, batch, split), work.is_valid_tile)


# Named barrier at which the producer warp waits, before a pair's second KV tile, for the
# consumer warpgroups to be done with the K/V buffers (the first one's products and its dK/dV
# stores, which stage through the same buffers). FA4's backward uses the ids below it.
KV_FREE_BARRIER = max(NamedBarrierBwd) + 1


class _PairScheduler(_HeadByHeadScheduler):
    """The causal symmetric shift's launch: CTA p of a head runs KV tile p (its big side), then
    KV tile N-1-p (its small side), every CTA the same N+1 columns of work; heads one after
    another as `_HeadByHeadScheduler`. The slot is counted past the grid for the second tile.

    FA4's kernel walks whatever tiles its scheduler hands out, but loads a tile's K and V into
    the buffers that the previous tile's dK/dV stores stage through, with no wait between the two
    (its own schedulers hand out one tile per CTA). The hand-over between a pair's tiles adds it:
    the producer warp (warp 0 in FA4's kernel) waits at KV_FREE_BARRIER, where the consumer warps
    (warps 4 and up) arrive once their stores have read the buffers (warp 4 issues them)."""

    KV_FREE_THREADS = 0   # the consumer threads and the producer warp: set per kernel

    @staticmethod
    def to_underlying_arguments(args, *, loc=None, ip=None, **kwargs):
        return _HeadByHeadScheduler.to_underlying_arguments(
            dataclasses.replace(args, num_block=args.num_block // 2), loc=loc, ip=ip, **kwargs)

    @cute.jit
    def get_current_work(self, *, loc=None, ip=None):
        total = self.params.total_blocks
        second = self._tile_idx >= total
        slot = self._tile_idx - cutlass.select_(second, total, 0)
        pair, head, batch, split = SingleTileLPTBwdScheduler(self.params, slot).get_current_work().tile_idx
        kv = cutlass.select_(second, 2 * self.params.num_block - 1 - pair, pair)
        return WorkTileInfo((Int32(kv), head, batch, split), self._tile_idx < 2 * total)

    def advance_to_next_work(self, *, loc=None, ip=None):
        self._hand_over_kv(self._tile_idx < self.params.total_blocks)
        self._tile_idx = self._tile_idx + self.params.total_blocks
        return self.get_current_work()

    @cute.jit
    def _hand_over_kv(self, first_of_pair):
        if first_of_pair:
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp == 0:
                cute.arch.barrier(barrier_id=KV_FREE_BARRIER, number_of_threads=self.KV_FREE_THREADS)
            elif warp >= 4:
                if warp == 4:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier_arrive(barrier_id=KV_FREE_BARRIER, number_of_threads=self.KV_FREE_THREADS)


@functools.lru_cache(maxsize=None)
def _head_by_head_schedulers(top_group: int, pair_threads: int = 0):
    if pair_threads:
        return type("_PairScheduler", (_PairScheduler,), {"KV_FREE_THREADS": pair_threads}), _HeadByHeadVarlenScheduler
    if top_group == 0:
        return _HeadByHeadScheduler, _HeadByHeadVarlenScheduler
    return tuple(type(cls.__name__, (cls,), {"TOP_GROUP": top_group})
                 for cls in (_HeadByHeadScheduler, _HeadByHeadVarlenScheduler))


def tiles(head_dim: int, causal: bool, local: bool = False, dropout: bool = False):
    """FA4's sm90 config for (head dim, mask); its block sizes must be our committed table's,
    or the plan would not be the order the kernel runs. Where our table gives a full mask with
    dropout the masked tiles, FA4's config for masked tiles is taken (it differs from the full
    one in its tiles alone; the mask itself is passed apart). Likewise a masked call whose tiles
    are the full masks' (a probe's table) takes FA4's config for those."""
    ours = bwd_tiles(head_dim, causal or local, dropout)
    cfg = _fa4_config(head_dim, True, local)
    if (cfg.m_block_size, cfg.n_block_size) != ours:
        cfg = _fa4_config(head_dim, False, local)
    if (cfg.m_block_size, cfg.n_block_size) != ours:
        raise RuntimeError(f"flash-attn-4's sm90 tiles {cfg.m_block_size}x{cfg.n_block_size} for "
                           f"head_dim={head_dim} differ from ours {ours}: "
                           "install the pinned flash-attn-4 version")
    return cfg


@functools.lru_cache(maxsize=None)   # asked on every backward: a pure function of its arguments, 5 us a call
def _fa4_config(head_dim: int, masked: bool, local: bool):
    """FA4's sm90 backward config for masked (causal or windowed) or full masks."""
    return fa4._tile_size_bwd_sm90(head_dim, head_dim, masked, local)


def softcap_mods(softcap: float):
    """FA4's score_mod pair for tanh softcapping (its forward and backward), or (None, None)."""
    if not softcap:
        return None, None
    return fa4_utils.create_softcap_scoremod(softcap), fa4_utils.create_softcap_scoremod_bwd(softcap)


# With RECORD_WAITS: each call's dQ counters (B, H, M, WAIT_COLUMNS): column 0 the counter, 1 the
# rank-wait cycles per Q tile, 2 the same per KV tile (row n), 3 the landing-wait cycles per KV
# tile, 4 the cycles per KV tile spent waiting for the consumers' partial (and issuing its add).
WAIT_COLUMNS = 5
recorded_waits: list = []

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
                       tables: VisitTables, deterministic: bool, window_left: int = -1, window_right: int = -1,
                       softcap: float = 0.0, dropout_p: float = 0.0, seed: int = 0, cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0):
    """dq, dk, dv of dense (B, S, H, D) fp16/bf16 inputs, `lse` (B, H_q, S_q), or of packed ones
    (T, H, D) with int32 `cu_seqlens_q/k` and the true longest lengths `max_seqlen_q/k` (they size
    the counters), `lse` (H_q, T_q); natural log, as the forward returns it. `tables` must be built
    with `tiles(D, causal, local, dropout)`; a packed batch needs a computed order
    (visit_tables.batch_tables).
    Windows and softcap are ours in meaning (-1: unlimited side; s -> softcap * tanh(s / softcap)),
    run as FA4's local mask and softcap score_mod. With dropout_p > 0 the forward's mask (same seed)
    is drawn again in the kernel (not with softcap: the dropout step applies no score_mod)."""
    dropout_sm90.refuse_softcap(dropout_p, softcap)
    varlen = cu_seqlens_q is not None
    if varlen:
        if tables.visit is None:
            raise ValueError("a packed batch needs an order the kernel computes (visit_tables.batch_tables)")
        if tables.paired:
            raise ValueError("the paired launch (causal symmetric shift) runs dense batches only")
        total_q, heads, head_dim = q.shape
        total_k, heads_kv = k.shape[0], k.shape[1]
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        cu_seqlens_q, cu_seqlens_k = (t.contiguous() for t in (cu_seqlens_q, cu_seqlens_k))   # int32: checked
    else:
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, heads_kv = k.shape[1], k.shape[2]
    causal, local, window_size_left, window_size_right = fa4_mask(causal, window_left, window_right)
    cfg = tiles(head_dim, causal, local, dropout=dropout_p > 0)
    tm, tn = cfg.m_block_size, cfg.n_block_size
    group = heads // heads_kv
    dtype = torch2cute_dtype_map[q.dtype]
    dev = q.device
    # The accumulators' rows are as wide as the kernel's tile_hdim (FlashAttentionBackwardSm90
    # rounds the head dim up to 16, or 64 with dK/dV swapped), and the postprocess must read them
    # so: FA4's launcher rounds to 32, and at head dims such as 40 or 80 its conversion then reads
    # tiles where the kernel wrote none. The preprocess keeps FA4's 32 (at 16 its row sums of
    # dO * O lost their bits from call to call at head dim 80); where the two roundings differ it
    # must not zero the accumulator, which is then zeroed here.
    multiple = 64 if cfg.dKV_swapAB else 16
    pre_multiple = 64 if cfg.dKV_swapAB else 32
    hdim_r = -(-head_dim // multiple) * multiple
    sq_r, sk_r = -(-seqlen_q // tm) * tm, -(-seqlen_k // tn) * tn
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    lse = lse.contiguous()

    dq, dk, dv = buffers.empty_like(q), buffers.empty_like(k), buffers.empty_like(v)
    if varlen:
        # FA4's packed accumulators: each sequence starts on a whole tile (SeqlenInfo.padded_offset_q)
        rows_q = (total_q + (batch + 1) * tm - 1) // tm * tm
        dq_accum = buffers.empty((heads, rows_q * hdim_r), torch.float32, dev)
        dpsum = buffers.empty((heads, rows_q), torch.float32, dev)
        lse_log2 = buffers.empty((heads, rows_q), torch.float32, dev)
        kv_accum_shape = (heads_kv, (total_k + (batch + 1) * tn - 1) // tn * tn * hdim_r)
    else:
        dq_accum = buffers.empty((batch, heads, sq_r * hdim_r), torch.float32, dev)
        dpsum = buffers.empty((batch, heads, sq_r), torch.float32, dev)
        lse_log2 = buffers.empty((batch, heads, sq_r), torch.float32, dev)
        kv_accum_shape = (batch, heads_kv, sk_r * hdim_r)
    if group > 1:  # several query heads add into one dK/dV: fp32 accumulators, then convert
        dk_out = torch.zeros(kv_accum_shape, dtype=torch.float32, device=dev)
        dv_out = torch.zeros_like(dk_out)
    else:
        dk_out, dv_out = dk, dv
    # Counters start at 0 on every call, so an interrupted call cannot poison the next one.
    sem_cols = WAIT_COLUMNS if OrderedBackwardSm90.RECORD_WAITS else 1
    sem_dq = torch.zeros(batch, heads, sq_r // tm, sem_cols, dtype=torch.int32, device=dev) if deterministic else None
    if OrderedBackwardSm90.RECORD_WAITS:
        recorded_waits.append(sem_dq)
    sem_dk = sem_dv = None
    if deterministic and group > 1:
        sem_dk = torch.zeros(batch, heads_kv, sk_r // tn, 2, dtype=torch.int32, device=dev)
        sem_dv = torch.zeros_like(sem_dk)
    # The plan's lists go to the device where a warp reads them instead of computing the order.
    visit = tables.visit
    index_lists = not _writer_computes(visit) or (visit in _COMPUTED and not _rows_computed(visit))
    count, q_tile, rank = _tables_on_device(tables, batch, heads, dev) if index_lists else (None,) * 3

    # The preprocess zeroes the dQ accumulator (it writes as many bytes as it reads of O and
    # dO) unless the first add to every tile stores instead.
    unzeroed = (OrderedBackwardSm90.stores_first(deterministic) and not varlen
                and visits_every_q_tile(tables, sq_r // tm))
    same_rows = -(-head_dim // pre_multiple) * pre_multiple == hdim_r   # the preprocess may zero the accumulator
    if not unzeroed and not same_rows:
        dq_accum.zero_()
    fa4._bwd_preprocess(out, dout, dpsum, lse, lse_log2, dq_accum if not unzeroed and same_rows else None,
                        cu_seqlens_q, None, None, dtype, head_dim, head_dim, tm, fake_mode=False,
                        hdim_multiple_of=pre_multiple)

    # Size-1 dimensions get specialised strides at compile time, so they are part of the key.
    ones = tuple(n == 1 for n in (batch, heads, heads_kv, sq_r // tm, sk_r // tn, tables.q_tile.shape[-1],
                                  *q.shape[:-2], *k.shape[:-2]))
    dropout = dropout_p > 0
    aux = [dropout_sm90.params_tensor(seed, dropout_p, dev)] if dropout else None
    head_by_head = tables.group_size > 1 or tables.paired   # cyclic groups must be co-resident
    # Window sizes are run-time arguments; only which sides are limited is compiled in.
    key = (dtype, head_dim, group, causal, local, window_size_left is None, window_size_right is None,
           float(softcap), deterministic, tables.kv_descending, tables.visit, tables.group_size, ones, dropout,
           varlen, tables.top_group_first, tables.paired,
           tuple(getattr(OrderedBackwardSm90, name) for name in OrderedBackwardSm90.SWITCHES))
    if key not in _compiled:
        score_mod, score_mod_bwd = softcap_mods(softcap)
        kernel = OrderedBackwardSm90(
            dtype, head_dim, head_dim, group, causal, is_local=local, deterministic=deterministic,
            score_mod=score_mod, score_mod_bwd=score_mod_bwd,
            tile_m=tm, tile_n=tn, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO,
            PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB,
            dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP,
            AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
            num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False, q_subtile_factor=1,
            dQ_single_wg=cfg.dQ_single_wg, kv_descending=tables.kv_descending, visit=tables.visit,
            group_size=tables.group_size, dropout=dropout)
        sems = [None if t is None else fa4_utils.convert_from_dlpack_leading_static(
                    t, leading_dim=3, alignment=4, stride_order=t.dim_order())
                for t in (sem_dq, sem_dk, sem_dv)]
        sparse = to_cute_block_sparse_tensors(BlockSparseTensorsTorch(
            mask_block_cnt=count, mask_block_idx=q_tile, dq_write_order=rank,
            block_size=(tm, tn))) if index_lists else None
        cu = [None if t is None else to_cute_tensor(t, assumed_align=4) for t in (cu_seqlens_q, cu_seqlens_k)]
        pair_threads = cfg.num_wg * 128 + 32 if tables.paired else 0   # consumers + the producer warp
        with _launch_head_by_head(head_by_head, tables.group_size if tables.top_group_first else 0, pair_threads):
            _compiled[key] = cute.compile(
                kernel, *(to_cute_tensor(t) for t in (q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out)),
                softmax_scale, *cu, None, None, window_size_left, window_size_right, *sems,
                fa4_utils.AuxData([to_cute_aux_tensor(t) for t in aux] if dropout else None, None), sparse, None,
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                options="--enable-tvm-ffi")
    _compiled[key](q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, softmax_scale,
                   cu_seqlens_q, cu_seqlens_k, None, None, window_size_left, window_size_right, sem_dq, sem_dk, sem_dv,
                   fa4_utils.AuxData(aux, None),
                   (count, q_tile, None, None, None, None, rank, None) if index_lists else None, None)

    threads_dq = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
    # With dropout the kernel's dQ partials leave out the keep scale (see _mma_one_m_block_dropout).
    dq_scale = softmax_scale * keep_scale(dropout_p) if dropout else softmax_scale
    fa4._bwd_postprocess_convert(dq_accum, dq, dq_scale, cu_seqlens_q, None, 90, dtype, head_dim, tm,
                                 threads_dq, cfg.AtomLayoutMdQ, cfg.dQ_swapAB, cluster_size=1,
                                 fake_mode=False, hdim_multiple_of=multiple)
    if group > 1:
        for acc, grad, scale in ((dk_out, dk, softmax_scale), (dv_out, dv, 1.0)):
            fa4._bwd_postprocess_convert(acc, grad, scale, cu_seqlens_k, None, 90, dtype, head_dim, tn,
                                         cfg.num_wg * 128, cfg.AtomLayoutNdKV, cfg.dKV_swapAB,
                                         cluster_size=1, fake_mode=False, hdim_multiple_of=multiple)
    return dq, dk, dv
