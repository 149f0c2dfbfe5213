"""The Hopper forward on a persistent grid: one CTA per SM walks the tiles, so the next tile's
Q and K/V loads overlap this tile's last products and epilogue.

Why. FA4's sm90 forward takes all registers of an SM (3 warpgroups at 24/240/240), so one CTA
runs per SM, and on its one-tile-per-CTA grid each tile pays its set-up, its first loads and an
epilogue that nothing overlaps. At 1k tokens a causal tile has 1-8 KV steps, and that fixed cost
is a large share of the time (the forward at hdim 64 causal 1k ran at 0.76x cuDNN).

What changes against FA4's kernel, and why each piece:
- The scheduler (`_PersistentTiles`): FA4's tile order (LPT for causal/windowed masks, its L2
  sections otherwise) walked by `ctas` CTAs. `snake` hands out round r of `ctas` consecutive tiles
  left to right when r is even and right to left when it is odd, so the CTA that took the
  longest tile of one round takes the shortest of the next (tiles of a causal head get shorter
  along the LPT order).
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

import functools
import inspect
import threading
from contextlib import contextmanager

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from flash_attn.cute import flash_fwd_sm90
from flash_attn.cute.tile_scheduler import SingleTileLPTScheduler

ORDERS = ("stride", "snake")


def fits(head_dim: int, mma_pv_is_rs: bool, varlen: bool) -> bool:
    """Whether the persistent grid serves this configuration: P in registers (the O buffer takes
    the P field), head dims up to 128 (shared memory for a second tile-sized buffer), dense."""
    return mma_pv_is_rs and head_dim <= 128 and not varlen


class _PersistentTiles(SingleTileLPTScheduler):
    """FA4's tile order, walked by a grid of at most CTAS programs (ORDER: stride or snake)."""

    CTAS = 0
    SNAKE = False

    @classmethod
    def get_grid_shape(cls, params, *, loc=None, ip=None):
        tiles, splits, one = SingleTileLPTScheduler.get_grid_shape(params, loc=loc, ip=ip)
        return cutlass.min(tiles, Int32(cls.CTAS)), splits, one

    @classmethod
    def create(cls, params, *, loc=None, ip=None):   # FA4's builds its own class, not a subclass
        base = SingleTileLPTScheduler.create(params, loc=loc, ip=ip)
        return cls(params, base._tile_idx, base._split_idx, loc=loc, ip=ip)

    def advance_to_next_work(self, *, loc=None, ip=None):
        ctas = cute.arch.grid_dim()[0]
        if cutlass.const_expr(self.SNAKE):
            # position c of an even round goes to position ctas-1-c of the next one, and back
            c = cute.arch.block_idx()[0]
            odd = (self._tile_idx // ctas) % 2
            self._tile_idx = self._tile_idx + odd * (2 * c + 1) + (1 - odd) * (2 * (ctas - c) - 1)
        else:
            self._tile_idx = self._tile_idx + ctas
        return self.get_current_work()


@functools.lru_cache(maxsize=None)
def _scheduler(ctas: int, order: str):
    return type("_PersistentTiles", (_PersistentTiles,), {"CTAS": ctas, "SNAKE": order == "snake"})


class _OwnOutputBuffer:
    """A forward kernel whose epilogue stages O in the struct's P field instead of Q's buffer."""

    def _get_shared_storage_cls(self):
        assert self.mma_pv_is_rs, "the O buffer takes the P field, which holds P without mma_pv_is_rs"
        self.sP_layout = self.sO_layout
        return super()._get_shared_storage_cls()

    def mma(self, *args, **kwargs):
        arguments = _signature(flash_fwd_sm90.FlashAttentionForwardSm90.mma).bind(self, *args, **kwargs).arguments
        del arguments["self"]
        arguments["sO"], arguments["sP"] = arguments["sP"], None
        return super().mma(**arguments)


@functools.lru_cache(maxsize=None)
def _signature(method):
    return inspect.signature(method)


@functools.lru_cache(maxsize=None)
def kernel_class(base):
    """`base` (FA4's forward or a subclass) with O in its own buffer."""
    return type("Persistent" + base.__name__, (_OwnOutputBuffer, base), {})


@contextmanager
def persistent_grid(ctas: int, order: str):
    """While FA4's __call__ builds its grid, both of its dense schedulers are `_PersistentTiles`
    (module globals of FA4's, swapped under a lock as bwd_sm90 swaps its backward schedulers)."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r}: expected one of {ORDERS}")
    cls = _scheduler(ctas, order)
    with _swap_lock:
        saved = flash_fwd_sm90.SingleTileLPTScheduler, flash_fwd_sm90.SingleTileScheduler
        flash_fwd_sm90.SingleTileLPTScheduler = flash_fwd_sm90.SingleTileScheduler = cls
        try:
            yield
        finally:
            flash_fwd_sm90.SingleTileLPTScheduler, flash_fwd_sm90.SingleTileScheduler = saved


_swap_lock = threading.Lock()
