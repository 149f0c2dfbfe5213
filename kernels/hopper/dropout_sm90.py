"""Dropout inside the Hopper kernels: the mask of kernels/philox.py drawn in registers.

The mask is the one the reference and the Triton kernels draw (kernels/philox.py has the
definition): one Philox4x32-10 call per group of eight scores, rows {i, i+8} x columns
{j, j+1, j+8, j+9} of a 16x16 block, as 16-bit draws. The group is what one thread holds in a
`wgmma` accumulator, so:

- the forward (accumulator rows = queries) draws every number once: one call per 8 scores;
- the backward (FA4 computes S^T there: rows = keys) holds, per group, the key rows {j, j+8} of
  one key parity and the query columns {i, i+8}: four of a call's eight draws. The two threads
  of a group (lanes l and l ^ 4) each draw one of their two groups and swap halves, so the
  backward too makes one call per 8 scores (`mark_dropped`).

No mask is kept in memory, and the keep scale is applied to the outputs of the products, not
per score. The hope was that the rounds would hide under the other consumer warpgroup's
products; measured on an H100 they do not (1.3-1.9x the call without dropout at hdim 128;
docs/benchmarks/ has the split between Philox and applying the mask, and the issue-slot count).

Seed and threshold reach the kernel at run time in a 4-int32 device tensor (`params`), so a new
seed per step does not recompile. Imported only with the Hopper backend's packages present.
"""
from __future__ import annotations

import functools
import inspect

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, Uint64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from quack import layout_utils

from ..dropout_bits import words_per_tile
from ..philox import _KEY_A, _KEY_B, _ROUND_A, _ROUND_B, DROPOUT_BITS, dropout_threshold, keep_scale


def refuse_softcap(dropout_p: float, softcap: float) -> None:
    """The Hopper kernels' dropout step applies no score_mod: dropout with softcap is the Triton
    backend's (the backend's `supports` says so; this guards direct callers of the kernels)."""
    if dropout_p > 0 and softcap:
        raise ValueError("dropout_p > 0 with softcap runs on the Triton backend: the Hopper kernels' "
                         "dropout step applies no softcap")


def params_tensor(seed: int, dropout_p: float, device) -> torch.Tensor:
    """(seed low 32 bits, seed high 32 bits, threshold, 0) as int32 on `device`."""
    keep_scale(dropout_p)   # refuses a p that rounds to dropping everything
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    words = [seed & 0xFFFFFFFF, seed >> 32, dropout_threshold(dropout_p), 0]
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    return torch.tensor(signed, dtype=torch.int32, device=device)


@dsl_user_op
def _mulwide(a, b, *, loc=None, ip=None) -> tuple[Uint32, Uint32]:
    """(high, low) words of the 64-bit product a * b. One `mul.wide.u32` (IMAD.WIDE.U32) where
    mul.hi and mul.lo apart are two multiplies on the same inputs."""
    wide = Uint64(llvm.inline_asm(
        T.i64(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
        "mul.wide.u32 $0, $1, $2;", "=l,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
    return Uint32(wide >> Uint64(32)), Uint32(wide)


PHILOX_ROUNDS = 10   # the mask's; scripts/gpu_dropout_probe.py times 7 (a different mask)


def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of kernels/philox.py, unrolled at trace time."""
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulwide(_ROUND_B, c2)
        hi_a, lo_a = _mulwide(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = k0 + Uint32(_KEY_A), k1 + Uint32(_KEY_B)
    return c0, c1, c2, c3


class DropoutParams:
    """The run-time dropout constants, loaded once where a kernel function starts."""

    def __init__(self, params: cute.Tensor):
        self.key0, self.key1 = Uint32(params[0]), Uint32(params[1])
        # A draw sits in the top half of a word once the low half is shifted up (or already is):
        # comparing the word with threshold << 16 then decides it, without isolating it first.
        self.threshold_high = Uint32(params[2]) << Uint32(DROPOUT_BITS)
        full = Float32(float(1 << DROPOUT_BITS))
        self.scale = full / (full - Float32(params[2]))   # keep_scale(p), on the device
        # 1 / keep_scale(p) exactly (an integer times 2**-16): steps that divide by the scale
        # multiply by this instead, so no IEEE division (a branch to a slow path) sits in them.
        self.keep_rate = (full - Float32(params[2])) * Float32(1.0 / (1 << DROPOUT_BITS))

    def group_words(self, row, col, head, batch):
        """The four Philox words of the group holding score (row, col)."""
        return _philox(Uint32(col) & Uint32(~0x9 & 0xFFFFFFFF), Uint32(row) & Uint32(~0x8 & 0xFFFFFFFF),
                       Uint32(head), Uint32(batch), self.key0, self.key1)


@cute.jit
def drop_probabilities(acc_mn: cute.Tensor, coords_mn: cute.Tensor, head, batch, drop,
                       negate: cutlass.Constexpr[bool] = False):
    """Forward: P -> P * keep, in place (the keep scale is applied once per output element, by
    DropoutForwardSm90.epilogue); `negate`: dropped P -> -P instead (the backward's marking,
    see mark_dropped, where its accumulator has rows = queries). `acc_mn` is the accumulator's
    (rows, cols) view with rows = queries; thread-local row pairs (r, r+1) are rows i, i+8 and
    column quads c..c+3 are columns j, j+1, j+8, j+9: one group, one Philox call."""
    for r in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[0]), 2):
        for c in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[1]), 4):
            words = drop.group_words(coords_mn[r, c][0], coords_mn[r, c][1], head, batch)
            for d in cutlass.range_constexpr(8):
                word = words[d // 2]
                draw_high = word if d % 2 else word << Uint32(DROPOUT_BITS)
                x = acc_mn[r + d // 4, c + d % 4]
                dropped = -x if const_expr(negate) else Float32(0.0)
                acc_mn[r + d // 4, c + d % 4] = x if draw_high >= drop.threshold_high else dropped


@cute.jit
def drop_by_pairs(acc_mn: cute.Tensor, coords_mn: cute.Tensor, head, batch, drop, negate: cutlass.Constexpr[bool]):
    """drop_probabilities for accumulators whose column quads need not be one group: a warpgroup
    tile whose width is not a multiple of 16 (hdim 256's backward: 24 keys per warpgroup) puts
    columns j, j+1, j+8, j+9 of a quad in two groups. Rows i, i+8 and a column pair x, x+1 always
    share a group, so each pair takes its own Philox call (two per 8 scores instead of one) and
    picks its draws by bit 3 of x."""
    for r in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[0]), 2):
        for c in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[1]), 2):
            col = Uint32(coords_mn[r, c][1])
            words = drop.group_words(coords_mn[r, c][0], col, head, batch)
            upper = ((col >> Uint32(3)) & Uint32(1)) != Uint32(0)   # columns x+8, x+9 of the group
            for dr in cutlass.range_constexpr(2):
                word = words[2 * dr + 1] if upper else words[2 * dr]
                for e in cutlass.range_constexpr(2):
                    draw_high = word if e else word << Uint32(DROPOUT_BITS)
                    x = acc_mn[r + dr, c + e]
                    dropped = -x if const_expr(negate) else Float32(0.0)
                    acc_mn[r + dr, c + e] = x if draw_high >= drop.threshold_high else dropped


# In a wgmma accumulator, lane ^ 4 holds the next accumulator row (here: the key of the other
# parity) with the same columns (queries).
_PARTNER_LANES = 4


@dsl_user_op
def _prmt(a, b, selector, *, loc=None, ip=None) -> Uint32:
    """PTX prmt.b32: four bytes picked from (a, b) by the selector's nibbles (one instruction)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(v).ir_value(loc=loc, ip=ip) for v in (a, b, selector)],
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


# prmt selectors that pack the low (high) 16-bit halves of (a, b) into one word, a's in the low half.
_LOW_HALVES, _HIGH_HALVES = 0x5410, 0x7632


def _halves(words, high):
    """The low (high = 0) or high (high = 1) 16-bit halves of a call's four words, packed two
    per word; `high` is a run-time 0 or 1."""
    selector = Uint32(_LOW_HALVES) + high * Uint32(_HIGH_HALVES - _LOW_HALVES)
    return [_prmt(words[2 * kk], words[2 * kk + 1], selector) for kk in range(2)]


@cute.jit
def mark_dropped(acc_mn: cute.Tensor, coords_mn: cute.Tensor, head, batch, drop):
    """Backward, on P^T (rows = keys, cols = queries): kept P stays, dropped P -> -P (the keep
    scale is applied to the gradients once, after the products).

    The sign carries the mask to the dS step (P >= 0), so no mask registers are held across the
    dP product. A thread's key rows are j, j+8 of one parity p (bit 0 of j) and its query columns
    c, c+2 of a quad are i, i+8, so it holds four scores of the group of (i, j); the thread with
    the other parity (lane ^ 4) holds the other four, with the same queries. Each of a quad's two
    query columns is one group; instead of both threads drawing both groups, the thread of
    parity p draws the group of column c + p, keeps its own halves (bits 16p..16p+15 of each
    word) and hands the partner the other halves through one exchange of two words: one Philox
    call per 8 scores, as in the forward."""
    for r in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[0]), 2):
        for c in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[1]), 4):
            key = Uint32(coords_mn[r, c][0])
            parity = key & Uint32(1)
            words = drop.group_words(Uint32(coords_mn[r, c][1]) + parity, key, head, batch)
            mine = _halves(words, parity)
            theirs = [cute.arch.shuffle_sync_bfly(w, offset=_PARTNER_LANES)
                      for w in _halves(words, Uint32(1) - parity)]
            for e in cutlass.range_constexpr(2):
                use_mine = parity == Uint32(e)
                packed = (mine[0] if use_mine else theirs[0], mine[1] if use_mine else theirs[1])
                for dr in cutlass.range_constexpr(2):
                    for kk in cutlass.range_constexpr(2):
                        draw_high = packed[kk] if dr else packed[kk] << Uint32(DROPOUT_BITS)
                        x = acc_mn[r + dr, c + e + 2 * kk]
                        acc_mn[r + dr, c + e + 2 * kk] = x if draw_high >= drop.threshold_high else -x


class _DroppingSoftmax:
    """FA4's Softmax with dropout applied right after each online-softmax step: the row sums
    have already taken the undropped P (dropout does not renormalise), and the P.V product that
    follows sees P * keep."""

    def __init__(self, softmax, apply):
        self._softmax, self._apply = softmax, apply

    def __getattr__(self, name):
        return getattr(self._softmax, name)

    def online_softmax(self, acc_S, **kwargs):
        row_scale = self._softmax.online_softmax(acc_S, **kwargs)
        self._apply(acc_S)
        return row_scale


def drop_params_of_mma(method, kernel, args, kwargs):
    """(DropoutParams, KeepBits or None, the call's arguments by name) of a call of FA4's `mma`
    (`method`: the forward's or the backward's), from its `aux_data` (params, then the keep bits
    when the mask was drawn ahead); both kernels' dropout steps and epilogues are traced inside
    that call, so values loaded here serve all of them."""
    arguments = _signature(method).bind(kernel, *args, **kwargs).arguments
    tensors = arguments["aux_data"].tensors
    bits = KeepBits(tensors[1], kernel.bits_col_tile) if len(tensors) > 1 else None
    return DropoutParams(tensors[0]), bits, arguments


class KeepBits:
    """The mask drawn ahead by kernels/dropout_bits.py: int32 words (batch, head, 16-row block,
    column tile * 32 + lane, word), one byte per thread and 16 x 16 block, bit 4*dr + q for
    accumulator entry (r + dr, c + q) of the row pair r and column quad c that hold the block
    (the order of `drop_probabilities` and `mark_dropped`)."""

    def __init__(self, words: cute.Tensor, col_tile: int):
        self.words = words
        self.blocks = col_tile // 16
        self.words_per_tile = words_per_tile(col_tile)

    def load(self, coords_mn: cute.Tensor, batch, head, col_tile_index):
        """The words of this thread's bytes in one tile: a list per row pair of the accumulator.
        Called before the tile's products are waited for, so the loads are in flight meanwhile."""
        # apply_keep_bits takes a thread's column quad c as the tile's 16-column block c // 4:
        # true while every thread holds the tile's whole width, as FA4's sm90 tiles do.
        assert cute.size(coords_mn, mode=[1]) == 4 * self.blocks, "a thread must hold the tile's full width"
        words = []
        for r in range(0, cute.size(coords_mn, mode=[0]), 2):   # unrolled at trace time
            row, col = Int32(coords_mn[r, 0][0]), Int32(coords_mn[r, 0][1])
            lane = (row & 7) * 4 + ((col & 7) >> 1)
            record = col_tile_index * 32 + lane
            words.append([Uint32(self.words[batch, head, row >> 4, record, w]) for w in range(self.words_per_tile)])
        return words


@cute.jit
def apply_keep_bits(acc_mn: cute.Tensor, words, negate: cutlass.Constexpr[bool]):
    """Forward (negate False): dropped P -> 0. Backward (negate True): dropped P -> -P. The
    masks of drop_probabilities and mark_dropped, read from `KeepBits.load`'s words."""
    for r in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[0]), 2):
        for c in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[1]), 4):
            block = c // 4
            word = words[r // 2][block // 4]
            for d in cutlass.range_constexpr(8):
                bit = Uint32(1 << (8 * (block % 4) + d))
                x = acc_mn[r + d // 4, c + d % 4]
                dropped = -x if const_expr(negate) else Float32(0.0)
                acc_mn[r + d // 4, c + d % 4] = x if (word & bit) != Uint32(0) else dropped


@functools.lru_cache(maxsize=None)
def _signature(method):
    return inspect.signature(method)


class DropoutForwardSm90(FlashAttentionForwardSm90):
    """FA4's sm90 forward with dropout. FA4 computes P inside its per-KV-tile steps and hands
    them the softmax object; these overrides hand them one that also drops (_DroppingSoftmax).
    The kept P enter P.V unscaled and the output takes the keep scale in the epilogue: one
    multiply per output element instead of one per score.
    `keep_bits`: the mask comes drawn ahead (kernels/dropout_bits.py, the second aux tensor) and
    each step loads its tile's words before its products; otherwise Philox runs in the step.
    The tile's (batch, head, query tile) come from the first step of each tile, whose mask
    function FA4 builds with them (later steps may get none); pack_gqa must be off so that
    accumulator rows are query positions."""

    def __init__(self, *args, keep_bits: bool = False, **kwargs):
        self.keep_bits = keep_bits
        super().__init__(*args, **kwargs)

    @property
    def bits_col_tile(self):
        return self.tile_n

    def mma(self, *args, **kwargs):
        # Trace-time state: values traced here dominate every per-tile step traced inside.
        self._drop, self._bits, arguments = drop_params_of_mma(FlashAttentionForwardSm90.mma, self, args, kwargs)
        self._thr_mma_qk = arguments["tiled_mma_qk"].get_slice(arguments["tidx"])
        return super().mma(*args, **kwargs)

    def _dropping(self, kwargs):
        """kwargs of a per-tile step with its softmax replaced by one that also drops. The
        tile's (batch, head, query tile) are noted from FA4's mask function when the step gets one."""
        mask_fn, n_block = kwargs.get("mask_fn"), kwargs["n_block"]
        if mask_fn is not None:
            kw = mask_fn.keywords
            self._tile = (kw["batch_idx"], kw["head_idx"], kw["m_block"])
        batch, head, m_block = self._tile
        coords = cute.make_identity_tensor((self.tile_m, self.tile_n))
        coords = cute.domain_offset((m_block * self.tile_m, n_block * self.tile_n), coords)
        coords_mn = layout_utils.reshape_acc_to_mn(self._thr_mma_qk.partition_C(coords))
        if self.keep_bits:
            words = self._bits.load(coords_mn, batch, head, n_block)

            def apply(acc_S):
                apply_keep_bits(layout_utils.reshape_acc_to_mn(acc_S), words, False)
        else:
            def apply(acc_S):
                drop_probabilities(layout_utils.reshape_acc_to_mn(acc_S), coords_mn, head, batch, self._drop)

        return dict(kwargs, softmax=_DroppingSoftmax(kwargs["softmax"], apply))

    def epilogue(self, acc_O, *args, **kwargs):
        acc_O.store(acc_O.load() * self._drop.scale)
        return super().epilogue(acc_O, *args, **kwargs)

    def first_half_block_overlap(self, **kwargs):
        return super().first_half_block_overlap(**self._dropping(kwargs))

    def mma_one_n_block(self, smem_pipe_read, **kwargs):
        return super().mma_one_n_block(smem_pipe_read, **self._dropping(kwargs))

    def mma_one_n_block_intrawg_overlap(self, smem_pipe_read, **kwargs):
        return super().mma_one_n_block_intrawg_overlap(smem_pipe_read, **self._dropping(kwargs))
