"""Tail-aligned Q tiles for the Hopper forward: the last Q tile ends on the last query, and the
first one starts `q_shift` rows above the sequence.

Why. FA4's sm90 forward cuts the queries into tiles from the top, so when the length is no
multiple of the tile (1k tokens in 192-row tiles at hdim 64) the short tile is the last one,
and under a causal mask a tile's KV steps follow its last row: each full tile reaches past a
KV-tile boundary the aligned one would stop at. Aligned to the end the short tile is the first
one, which sees one KV tile: 27 KV steps per head at 1k instead of 32, 96 instead of 101 at 2k
(fwd_tile_order.tail_shift decides where it cuts steps).

How, without touching FA4's kernel body: the parts of it that place a row for the causal mask,
its KV bounds and the Q/O copies read the sequence info its load and mma steps build per tile,
so those steps get one (`TailAlignedSeqlen`) that says the sequence is `q_shift` rows longer and
whose Q and O views start `q_shift` rows before the tensors. The masks and KV bounds are
bottom-right aligned, so with seqlen_q + q_shift rows a shifted row sees exactly what its query
sees. Parts that place rows from m_block alone (a score_mod's or mask_mod's q_idx, GQA rows
packed, learnable sinks) would be off by `q_shift`: the class refuses packed rows and mask_mod,
and the only score_mod fwd_sm90 passes, softcap, reads no index. Rows above the sequence have
negative coordinates in the TMA view of Q, which loads them as zeros. A TMA store whose box
starts at a negative coordinate is an illegal instruction on the H100 (measured), so the top
tile's O goes out per thread from registers (`_store_top_tile`, rows above skipped; one tile a
head) while FA4's TMA store of it is aimed past the end of the sequence, where it writes
nothing. O's address reaches the kernel as the last aux tensor, O seen as int32 words (FA4's
kernel sees O only as a TMA view). LSE is stored per thread, and FA4's store bounds only the end, so this class stores
it (`_store_lse`, both bounds) and hands FA4's epilogue no LSE.

Same bits as FA4's tiling: a row's KV tiles keep their order. A tile it no longer visits, or one
it now visits first (a left window can add one), is masked whole for that row: its P is 0, it
adds exact zeros, and the running max it leaves is -inf, which FA4's online softmax rescales
by exactly 0 when the first visible tile comes. tests/test_gpu_hopper.py compares both tilings
bit for bit. Dense batches with one row per query only (not GQA packed into rows, not varlen).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.seqlen_info import SeqlenInfoQK

from .dropout_sm90 import tile_coords
from .fa4_calls import call_arguments
from .fwd_tile_order import rows_above


@dataclass(frozen=True)
class TailAlignedSeqlen(SeqlenInfoQK):
    """FA4's sequence info of one batch entry with its Q tiles moved up by `q_shift` rows:
    seqlen_q counts the rows above the sequence, and Q/O views start there."""
    q_shift: Int32 = 0
    view_shift: Int32 = 0   # rows the Q/O views start before the tensors: q_shift, or less to aim past the end

    def offset_batch_Q(self, mQ, batch_idx, dim, padded=False, ragged=False):
        mQ = super().offset_batch_Q(mQ, batch_idx, dim, padded=padded, ragged=ragged)
        return cute.domain_offset((-self.view_shift,) + (None,) * (cute.rank(mQ) - 1), mQ)


def _tail_aligned(seqlen_info_cls, tile_m: int):
    """A drop-in for FA4's per-tile SeqlenInfoCls(batch_idx) giving TailAlignedSeqlen."""
    def create(batch_idx):
        info = seqlen_info_cls(batch_idx)
        shift = rows_above(info.seqlen_q, tile_m)
        values = {f.name: getattr(info, f.name) for f in fields(info)}
        values["seqlen_q"] = info.seqlen_q + shift
        return TailAlignedSeqlen(**values, q_shift=shift, view_shift=shift)
    return create


class _TailAlignedQ:
    """A forward kernel (FA4's sm90 forward or a subclass) with tail-aligned Q tiles."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.pack_gqa or self.mask_mod is not None:   # they place rows from m_block alone
            raise ValueError("tail-aligned Q tiles need one row per query and no mask_mod "
                             f"(pack_gqa={self.pack_gqa}, mask_mod={self.mask_mod})")

    def load(self, *args, **kwargs):
        return super().load(**self._shifted(FlashAttentionForwardSm90.load, args, kwargs))

    def mma(self, *args, **kwargs):
        arguments = self._shifted(FlashAttentionForwardSm90.mma, args, kwargs)
        self._out = arguments["aux_data"].tensors[-1]   # trace-time: O as (batch, seqlen, head, dim / 2) int32
        return super().mma(**arguments)

    def _shifted(self, method, args, kwargs) -> dict:
        arguments = call_arguments(method, self, args, kwargs)
        del arguments["self"]
        arguments["SeqlenInfoCls"] = _tail_aligned(arguments["SeqlenInfoCls"], self.tile_m)
        return arguments

    def epilogue(self, *args, **kwargs):
        arguments = call_arguments(FlashAttentionForwardSm90.epilogue, self, args, kwargs)
        del arguments["self"]
        seqlen = arguments["seqlen"]
        tile_place = [arguments[name] for name in ("seqlen", "tiled_mma", "tidx", "m_block", "head_idx", "batch_idx")]
        if cutlass.const_expr(arguments["mLSE"] is not None):
            self._store_lse(arguments["lse"], arguments["mLSE"], *tile_place)
        # only block 0 can hold rows above the sequence (q_shift < tile_m)
        top = arguments["m_block"] * self.tile_m < seqlen.q_shift
        past_end = seqlen.seqlen_q + self.tile_m   # taken off the view's shift: the whole box lies past the end
        o_view = replace(seqlen, view_shift=seqlen.q_shift - cutlass.select_(top, past_end, Int32(0)))
        super().epilogue(**dict(arguments, mLSE=None, seqlen=o_view))
        # after FA4's epilogue: acc_O holds what it stored (dropout's scale applied)
        self._store_top_tile(arguments["acc_O"], *tile_place)

    def _first_row(self, seqlen, m_block):
        """The query of Q tile `m_block`'s first row (negative above the sequence)."""
        return m_block * self.tile_m - seqlen.q_shift

    @cute.jit
    def _store_lse(self, lse, mLSE, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx):
        """Each row's LSE from the thread holding its column 0, rows above the sequence skipped
        (mLSE is (seqlen, head, batch); its row r is the query r)."""
        rows = tile_coords(tiled_mma.get_slice(tidx), (self.tile_m, self.tile_hdimv),
                           (self._first_row(seqlen, m_block), 0))
        mLSE_cur = mLSE[None, head_idx, batch_idx]
        if rows[0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = rows[r, 0][0]
                if row >= 0:
                    if row < seqlen.seqlen_q - seqlen.q_shift:
                        mLSE_cur[row] = lse[r]

    @cute.jit
    def _store_top_tile(self, acc_O, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx):
        """O of the top tile (the one holding rows above the sequence; other tiles store nothing
        here), per thread from its accumulator, rows above the sequence skipped."""
        # A thread's accumulator holds columns in adjacent pairs (c, c + 1): one 32-bit store a
        # pair, into O seen as int32 words (fwd_sm90 hands it in so).
        mO_words, first_row = self._out, self._first_row(seqlen, m_block)
        coords = tiled_mma.get_slice(tidx).partition_C(cute.domain_offset(
            (first_row, 0), cute.make_identity_tensor((self.tile_m, self.tile_hdimv))))
        rO = cute.make_fragment_like(acc_O, self.dtype)
        if first_row < 0:
            rO.store(acc_O.load().to(rO.element_type))
            rO_words = cute.recast_tensor(rO, Int32)
            for i in cutlass.range_constexpr(cute.size(rO_words)):
                row, col = coords[2 * i]
                if row >= 0:
                    # columns past the head dim are the tile's padding (head dims not a multiple of 16)
                    if cutlass.const_expr(not self.check_hdim_v_oob) or col < mO_words.shape[3] * 2:
                        mO_words[batch_idx, row, head_idx, col // 2] = rO_words[i]


@functools.lru_cache(maxsize=None)
def kernel_class(base):
    """`base` (FA4's forward or a subclass) with tail-aligned Q tiles."""
    return type("TailAligned" + base.__name__, (_TailAlignedQ, base), {})
