"""The Hopper forward on a persistent grid: one CTA per SM walks the tiles dealt to it, so the
next tile's Q and K/V loads overlap this tile's last products and epilogue.

Why. FA4's sm90 forward takes all registers of an SM (3 warpgroups at 24/240/240), so one CTA
runs per SM, and on its one-tile-per-CTA grid each tile pays its set-up, its first loads and an
epilogue that nothing overlaps. Where tiles are short (1k-2k tokens, causal up to 4k) that fixed
cost is a large share of the time: the forward at hdim 64 causal 1k ran at 0.76x cuDNN.

What changes against FA4's kernel, and why each piece:
- The scheduler (`_DealtTiles`): each CTA walks its list of the work table that
  fwd_tile_order.py deals on the host (longest tiles first, each to the CTA free first). FA4's
  sm90 forward hands its `mCuTotalMBlocks` argument to the scheduler alone, so the table travels
  there. A grid stride over FA4's order instead leaves CTAs up to 16 % apart in work on causal
  masks (measured 9-13 % slower than FA4's grid at 4k-16k).
- O gets its own shared memory (`_OwnOutputBuffer`). FA4 stages O in Q's buffer, which is free on
  its grid; here the producer loads the next tile's Q once the consumers release it (before the
  last P.V product), so that Q would land on an O not yet stored. The buffer is the struct's `sP`
  field, sized for O: with P in registers (`mma_pv_is_rs`) FA4 leaves that field empty. The
  epilogue's first barrier already orders a tile's writes to O after the previous tile's store
  has read it (the storing warp waits for the read before it reaches that barrier).

Same bits as FA4's grid: every tile is computed by one CTA in the same steps; only which CTA and
when change (tests/test_gpu_hopper.py compares both grids bit for bit).
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from flash_attn.cute import flash_fwd_sm90
from flash_attn.cute.tile_scheduler import SingleTileLPTScheduler, WorkTileInfo

from .fa4_calls import call_arguments


def fits(head_dim: int, mma_pv_is_rs: bool, varlen: bool) -> bool:
    """Whether the persistent grid serves this configuration: P in registers (the O buffer takes
    the P field), head dims up to 128 (shared memory for a second tile-sized buffer), dense."""
    return mma_pv_is_rs and head_dim <= 128 and not varlen


class _DealtTiles(SingleTileLPTScheduler):
    """A grid of at most CTAS programs, each walking its list of the work table
    (fwd_tile_order.work_table: CTAS + 1 starts, then the tile ids CTA by CTA). Its state is
    FA4's, with `_tile_idx` holding the position in the table instead of a tile id."""

    CTAS = 0

    @dataclass
    class Params(SingleTileLPTScheduler.Params):
        work: Optional[cute.Tensor] = None

    @staticmethod
    def to_underlying_arguments(args, *, loc=None, ip=None):
        base = SingleTileLPTScheduler.Params.create(args, loc=loc, ip=ip)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return _DealtTiles.Params(**fields, work=args.cu_total_m_blocks_ptr)

    @classmethod
    def get_grid_shape(cls, params, *, loc=None, ip=None):
        tiles, splits, one = SingleTileLPTScheduler.get_grid_shape(params, loc=loc, ip=ip)
        return cutlass.min(tiles, Int32(cls.CTAS)), splits, one

    @classmethod
    def create(cls, params, *, loc=None, ip=None):   # FA4's builds its own class, not a subclass
        return cls(params, Int32(params.work[cute.arch.block_idx()[0]]), Int32(0), loc=loc, ip=ip)

    @cute.jit
    def get_current_work(self, *, loc=None, ip=None):
        p, cta = self.params, cute.arch.block_idx()[0]
        valid = self._tile_idx < p.work[cta + 1]
        tile = p.work[cute.arch.grid_dim()[0] + 1 + self._tile_idx]   # one entry past the end is padding
        bidhb, block = tile // p.num_block, tile % p.num_block
        batch, head = divmod(bidhb, p.num_head_divmod)
        return WorkTileInfo((Int32(block), Int32(head), Int32(batch), Int32(0)), valid)

    def advance_to_next_work(self, *, loc=None, ip=None):
        self._tile_idx = self._tile_idx + 1
        return self.get_current_work()


@functools.lru_cache(maxsize=None)
def _scheduler(ctas: int):
    return type("_DealtTiles", (_DealtTiles,), {"CTAS": ctas})


class _OwnOutputBuffer:
    """A forward kernel whose epilogue stages O in the struct's P field instead of Q's buffer."""

    def _get_shared_storage_cls(self):
        assert self.mma_pv_is_rs, "the O buffer takes the P field, which holds P without mma_pv_is_rs"
        self.sP_layout = self.sO_layout
        return super()._get_shared_storage_cls()

    def mma(self, *args, **kwargs):
        arguments = call_arguments(flash_fwd_sm90.FlashAttentionForwardSm90.mma, self, args, kwargs)
        del arguments["self"]
        arguments["sO"], arguments["sP"] = arguments["sP"], None
        return super().mma(**arguments)


@functools.lru_cache(maxsize=None)
def kernel_class(base):
    """`base` (FA4's forward or a subclass) with O in its own buffer."""
    return type("Persistent" + base.__name__, (_OwnOutputBuffer, base), {})


@contextmanager
def persistent_grid(ctas: int):
    """While FA4's __call__ builds its grid, both of its dense schedulers are `_DealtTiles` for a
    grid of at most `ctas` CTAs (module globals of FA4's, swapped under a lock as bwd_sm90 swaps
    its backward schedulers)."""
    cls = _scheduler(ctas)
    with _swap_lock:
        saved = flash_fwd_sm90.SingleTileLPTScheduler, flash_fwd_sm90.SingleTileScheduler
        flash_fwd_sm90.SingleTileLPTScheduler = flash_fwd_sm90.SingleTileScheduler = cls
        try:
            yield
        finally:
            flash_fwd_sm90.SingleTileLPTScheduler, flash_fwd_sm90.SingleTileScheduler = saved


_swap_lock = threading.Lock()
