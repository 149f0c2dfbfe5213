"""Dropout inside the Hopper kernels: the mask of kernels/philox.py drawn in registers.

The mask is the one the reference and the Triton kernels draw (kernels/philox.py has the
definition): one Philox4x32-7 call per group of sixteen scores, queries {i, i+1, i+8, i+9} x keys
{j, j+1, j+8, j+9} of a 16x16 block, as 8-bit draws. In a `wgmma` accumulator a thread holds rows
{r, r+8} x columns {c, c+1, c+8, c+9} of a block and the thread of lane ^ 4 rows {r+1, r+9}, in
either orientation (the forward's S, rows = queries; the backward's S^T, rows = keys), so the two
lanes hold a group between them, each two of its four words. Each draws one of two groups it
shares with its partner and hands over the two words the partner needs (`shared_group_words`):
one call per 16 scores in every kernel.

No mask is kept in memory, and the keep scale is applied to the outputs of the products, not
per score. The rounds do not hide under the other consumer warpgroup's products (measured on an
H100), so their count per score is what dropout costs; docs/benchmarks/ has the measurements.

Seed and threshold reach the kernel at run time in a 4-int32 device tensor (`params`), so a new
seed per step does not recompile. Imported only with the Hopper backend's packages present.
"""
from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Uint32, Uint64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from quack import layout_utils

from ..philox import (_KEY_A, _KEY_B, _ROUND_A, _ROUND_B, DROPOUT_BITS, GROUP_BITS, PHILOX_ROUNDS, dropout_threshold,
                      four_draws_bias, four_draws_kept)
from .fa4_calls import call_arguments


def refuse_softcap(dropout_p: float, softcap: float) -> None:
    """The Hopper kernels' dropout step applies no score_mod: dropout with softcap is the Triton
    backend's (the backend's `supports` says so; this guards direct callers of the kernels)."""
    if dropout_p > 0 and softcap:
        raise ValueError("dropout_p > 0 with softcap runs on the Triton backend: the Hopper kernels' "
                         "dropout step applies no softcap")


def params_tensor(seed: int, dropout_p: float, device) -> torch.Tensor:
    """(seed low 32 bits, seed high 32 bits, threshold, 0) as int32 on `device`."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    words = [seed & 0xFFFFFFFF, seed >> 32, dropout_threshold(dropout_p), 0]   # refuses a p the mask cannot take
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


def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32 of kernels/philox.py with the mask's rounds, unrolled at trace time."""
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulwide(_ROUND_B, c2)
        hi_a, lo_a = _mulwide(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = k0 + Uint32(_KEY_A), k1 + Uint32(_KEY_B)
    return c0, c1, c2, c3


# Bits of a word above its top draw: shifting byte b up by 8 * (3 - b) puts it on top, where one
# unsigned compare with threshold << 24 decides it without isolating it first.
_TOP_SHIFT = 32 - DROPOUT_BITS
_GROUP_CLEAR = ~GROUP_BITS & 0xFFFFFFFF


class DropoutParams:
    """The run-time dropout constants, loaded once where a kernel function starts.
    `threshold_above_half`: the threshold is above 128 (kernels/philox.py:threshold_above_half),
    which the four-at-once compare (kept_draws) is compiled for."""

    def __init__(self, params: cute.Tensor, threshold_above_half: bool = False):
        self.key0, self.key1 = Uint32(params[0]), Uint32(params[1])
        self.threshold_top = Uint32(params[2]) << Uint32(_TOP_SHIFT)
        self.above_half = threshold_above_half
        self.byte_bias = Uint32(four_draws_bias(Uint32(params[2]), threshold_above_half))
        full = Float32(float(1 << DROPOUT_BITS))
        self.scale = full / (full - Float32(params[2]))   # keep_scale(p), on the device
        # 1 / keep_scale(p) exactly (an integer times 2**-8): steps that divide by the scale
        # multiply by this instead, so no IEEE division (a branch to a slow path) sits in them.
        self.keep_rate = (full - Float32(params[2])) * Float32(1.0 / (1 << DROPOUT_BITS))

    def group_words(self, query, key, head, batch):
        """The four Philox words of the group holding score (query, key)."""
        return _philox(Uint32(key) & Uint32(_GROUP_CLEAR), Uint32(query) & Uint32(_GROUP_CLEAR),
                       Uint32(head), Uint32(batch), self.key0, self.key1)

    def kept(self, word, byte):
        """Whether draw `byte` (0-3, known at trace time or not) of `word` keeps its score."""
        if const_expr(isinstance(byte, int)):
            top = word if byte == 3 else word << Uint32(DROPOUT_BITS * (3 - byte))
        else:
            top = word << (Uint32(DROPOUT_BITS * 3) - Uint32(DROPOUT_BITS) * byte)
        return top >= self.threshold_top

    def kept_draws(self, word):
        """Bit 7 of byte b of the result: whether draw b of `word` keeps its score (the others 0).
        Three instructions for four draws, where `kept` takes one compare (and most often a shift) each."""
        return Uint32(four_draws_kept(Uint32(word), self.byte_bias, self.above_half))


# In a wgmma accumulator, lane ^ 4 holds the next accumulator row (the other row parity) with the
# same columns: the partner that shares this thread's Philox groups.
_PARTNER_LANES = 4


def _select(cond, if_true, if_false):
    return Uint32(cutlass.select_(cond, Uint32(if_true), Uint32(if_false)))


def odd_row(coords_mn: cute.Tensor):
    """Whether this thread holds the odd rows of its row pairs (bit 2 of the lane)."""
    return Boolean((Uint32(coords_mn[0, 0][0]) & Uint32(1)) != Uint32(0))


def _split_words(words, odd, rows_are_queries: bool):
    """(mine, theirs) of a group's four words: the two this thread uses and the two its partner
    uses. Word 2*bit0(query) + bit0(key) (kernels/philox.py): with accumulator rows = queries a
    thread of row parity p uses words {2p, 2p+1} (key parity 0, 1); with rows = keys, words
    {p, p+2} (query parity 0, 1)."""
    if rows_are_queries:
        even, odd_words = (words[0], words[1]), (words[2], words[3])
    else:
        even, odd_words = (words[0], words[2]), (words[1], words[3])
    mine = tuple(_select(odd, o, e) for e, o in zip(even, odd_words))
    theirs = tuple(_select(odd, e, o) for e, o in zip(even, odd_words))
    return mine, theirs


def own_group_words(drop, anchor, odd, head, batch, rows_are_queries: bool):
    """This thread's two words of the group at `anchor` (query, key), drawn alone (a unit left
    without a partner unit: its lane ^ 4 partner draws the same call)."""
    return _split_words(drop.group_words(anchor[0], anchor[1], head, batch), odd, rows_are_queries)[0]


def shared_group_words(drop, anchor_a, anchor_b, odd, head, batch, rows_are_queries: bool):
    """This thread's two words of each of two groups (anchors (query, key)) that it holds with its
    lane ^ 4 partner: the even-row thread draws group a, the odd one group b, and each hands the
    other the two words it needs. One Philox call per thread for 16 of its scores."""
    query = _select(odd, anchor_b[0], anchor_a[0])
    key = _select(odd, anchor_b[1], anchor_a[1])
    mine, theirs = _split_words(drop.group_words(query, key, head, batch), odd, rows_are_queries)
    received = tuple(Uint32(cute.arch.shuffle_sync_bfly(w, offset=_PARTNER_LANES)) for w in theirs)
    words_a = tuple(_select(odd, r, m) for m, r in zip(mine, received))
    words_b = tuple(_select(odd, m, r) for m, r in zip(mine, received))
    return words_a, words_b


def _unit_words(drop, anchors, u, odd, head, batch, rows_are_queries):
    """Words of units u and u + 1 (a pair shares its calls), or of u alone when it is the last."""
    if u + 1 < len(anchors):
        return shared_group_words(drop, anchors[u], anchors[u + 1], odd, head, batch, rows_are_queries)
    return (own_group_words(drop, anchors[u], odd, head, batch, rows_are_queries),)


def quad_words(coords_mn: cute.Tensor, head, batch, drop, rows_are_queries: bool):
    """((r, qd), (word 0, word 1)) at trace time, in drawing order: this thread's two words of the
    group holding row pair (r, r + 1) and column quad qd of the accumulator whose (rows, cols)
    view has the coordinates `coords_mn`. A thread's row pair is rows x, x+8 and its column quad
    columns y, y+1, y+8, y+9: half a group, the partner lane (lane ^ 4) holding rows x+1, x+9.
    Entry (r + dr, 4 qd + q) is word q % 2 of the two, byte 2*bit3(query) + bit3(key):
    2*dr + q // 2 with rows = queries, 2 * (q // 2) + dr with rows = keys. A generator, so that
    a caller may apply each quad's mask as soon as its words are drawn."""
    quads = cute.size(coords_mn, mode=[1]) // 4
    odd = odd_row(coords_mn)
    for r in range(0, cute.size(coords_mn, mode=[0]), 2):
        if rows_are_queries:
            anchors = [coords_mn[r, 4 * qd] for qd in range(quads)]
        else:
            anchors = [(coords_mn[r, 4 * qd][1], coords_mn[r, 4 * qd][0]) for qd in range(quads)]   # (query, key)
        for qa in range(0, quads, 2):
            for k, unit in enumerate(_unit_words(drop, anchors, qa, odd, head, batch, rows_are_queries)):
                yield (r, qa + k), unit


def _drop_quads(acc_mn: cute.Tensor, words, drop, rows_are_queries: bool, negate: bool):
    """Dropped entries of `acc_mn` -> 0, or -P with `negate`, each quad as soon as its words come
    (`words` and their bytes: quad_words)."""
    for (r, qd), unit in words:
        for dr in range(2):
            for q in range(4):
                byte = 2 * dr + q // 2 if rows_are_queries else 2 * (q // 2) + dr
                x = acc_mn[r + dr, 4 * qd + q]
                dropped = -x if negate else Float32(0.0)
                acc_mn[r + dr, 4 * qd + q] = cutlass.select_(drop.kept(unit[q % 2], byte), x, dropped)


def _pair_selector(byte: int) -> int:
    """PRMT selector that makes a converted pair's mask out of two kept_draws results: result
    bytes 0-1 repeat the sign bit of byte `byte` of the first operand (the even column's word),
    bytes 2-3 that of the second (the odd column's): 0xFFFF over a kept half, 0 over a dropped one."""
    first, second = 8 | byte, 8 | (4 + byte)   # bit 3 of a selector nibble: replicate the sign
    return first | first << 4 | second << 8 | second << 12


@dsl_user_op
def _sign_bytes(a, b, selector: int, *, loc=None, ip=None) -> Uint32:
    """`prmt.b32` with a constant selector (cute.arch.prmt's inline assembly is marked as having
    side effects, which keeps the compiler from moving it)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _computed_before_wait(words, never_zero, *, loc=None, ip=None) -> None:
    """Make `words` (up to four) be computed where this is traced, ahead of the `wgmma` wait that
    follows: a shared-memory store of them, predicated on `never_zero` being 0, which it never is
    at run time. ptxas keeps the store before the wait, and without it sinks independent
    arithmetic (the Philox rounds) past the wait, back onto the chain after the scores. No store
    executes."""
    words = list(words) + [words[-1]] * (4 - len(words))
    operands = [Uint32(never_zero).ir_value(loc=loc, ip=ip)] + [Uint32(w).ir_value(loc=loc, ip=ip) for w in words]
    llvm.inline_asm(
        None, operands,
        "{ .reg .pred p; .reg .u32 a; setp.eq.u32 p, $0, 0; mov.u32 a, 0; @p st.shared.v4.u32 [a], {$1, $2, $3, $4}; }",
        "r,r,r,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _mn_places(acc: cute.Tensor) -> list:
    """For each element of the P.V operand view of `acc` (reshape_acc_to_frgA, the order FA4's
    conversion writes the 16-bit P in), its (row, column) in the (rows, cols) view. Both views
    re-index the same registers, so register offsets pair them (trace time)."""
    mn = layout_utils.reshape_acc_to_mn(acc).layout
    frg = layout_utils.convert_layout_acc_frgA(acc.layout)
    place = {cute.crd2idx((r, c), mn): (r, c)
             for r in range(cute.size(mn, mode=[0])) for c in range(cute.size(mn, mode=[1]))}
    return [place[cute.crd2idx(k, frg)] for k in range(cute.size(frg))]


def drop_converted(tOrP: cute.Tensor, acc: cute.Tensor, coords_mn: cute.Tensor, head, batch, drop):
    """Dropout on the forward's P after its conversion to 16 bits (`tOrP`, converted from `acc`,
    rows = queries): dropped entries -> 0. A converted pair (i, j), (i, j+1) is one 32-bit
    register, and its two draws sit at the same byte of the thread's two words of their group
    (column parity 0 and 1), so kept_draws compares four draws at once, one PRMT spreads the two
    verdicts over the pair's halves and one AND applies them: 1.75 instructions a score where
    the 32-bit path (_drop_quads) takes 2.75."""
    kept = {place: (drop.kept_draws(w[0]), drop.kept_draws(w[1]))
            for place, w in quad_words(coords_mn, head, batch, drop, rows_are_queries=True)}
    places = _mn_places(acc)
    pairs = cute.recast_tensor(tOrP, Uint32)
    for i in range(cute.size(pairs)):
        (r, c), second = places[2 * i], places[2 * i + 1]
        assert second == (r, c + 1) and c % 2 == 0, "a 32-bit register holds columns j, j+1 of one row"
        even, odd = kept[(r - r % 2, c // 4)]
        pairs[i] = pairs[i] & _sign_bytes(even, odd, _pair_selector(2 * (r % 2) + (c % 4) // 2))


def tile_coords(thr_mma, shape, offset):
    """The (rows, cols) view of a thread's accumulator coordinates, for a tile of `shape` whose
    first entry sits at `offset`."""
    coords = cute.domain_offset(offset, cute.make_identity_tensor(shape))
    return layout_utils.reshape_acc_to_mn(thr_mma.partition_C(coords))


class MaskWords:
    """A tile's mask words for one thread (quad_words, in drawing order): the first `ahead` units
    (half groups, eight scores each) drawn at once, the rest when `all()` is asked for. The
    backward makes one between issuing its products and waiting for them: nothing here reads a
    score, so the Philox rounds of the units drawn ahead run beside the tensor cores instead of
    after the scores arrive, and where they are drawn changes no bit. `ahead` is a register
    budget: what is drawn ahead stays live across the wait (two registers a unit), and past it
    ptxas spills or serialises the products.
    The forward draws nothing ahead: there, while one consumer warpgroup waits for its scores the
    other runs its softmax on the same schedulers, and rounds drawn in the wait lengthened that
    softmax (1.36x -> 1.50x forward cost at hdim128 causal 8k, H100; docs/benchmarks/)."""

    def __init__(self, coords_mn, head, batch, drop, *, rows_are_queries: bool, ahead: int):
        self._rest = quad_words(coords_mn, head, batch, drop, rows_are_queries)
        units = (cute.size(coords_mn, mode=[0]) // 2) * (cute.size(coords_mn, mode=[1]) // 4)
        ahead = min(units, ahead - ahead % 2)   # whole pairs: a pair of units shares its calls
        self._ahead = [next(self._rest) for _ in range(ahead)]
        flat = [w for _, unit in self._ahead for w in unit]
        for i in range(0, len(flat), 4):
            _computed_before_wait(flat[i:i + 4], drop.threshold_top)

    def all(self):
        """Every unit, ((r, qd), its two words), those left drawn as they are taken (a
        generator, so that a caller may apply each unit's mask as it comes)."""
        yield from self._ahead
        yield from self._rest


def has_quads(acc_mn: cute.Tensor) -> bool:
    """Whether a thread's columns of the accumulator (its (rows, cols) view, or the coordinates
    of one) are whole quads, so that its units are half groups (MaskWords); otherwise
    (hdim 256's backward) drop_scores draws by column pairs."""
    return cute.size(acc_mn, mode=[1]) % 4 == 0


def drop_scores(acc, coords_mn, head, batch, drop, *, rows_are_queries: bool, negate: bool, words=None):
    """Dropout on accumulator `acc` in place: dropped P -> 0 (the forward, whose keep scale the
    epilogue applies), or -P with `negate` (the backward's marking: the sign carries the mask to
    the dS step, so no mask registers are held across the dP product, and the gradients take the
    keep scale after the products). `rows_are_queries`: S (the forward, the hdim 192/256
    backwards) or S^T (the backwards up to hdim 128). A thread whose columns are whole quads holds
    half groups; otherwise (hdim 256's backward, 24 keys per warpgroup) the units are column pairs.
    `words`: the tile's MaskWords, when the step began drawing before its scores arrived
    (has_quads(coords_mn) must hold)."""
    acc_mn = layout_utils.reshape_acc_to_mn(acc)
    if has_quads(acc_mn):
        if words is None:
            words = MaskWords(coords_mn, head, batch, drop, rows_are_queries=rows_are_queries, ahead=0)
        _drop_quads(acc_mn, words.all(), drop, rows_are_queries, negate)
    else:
        assert rows_are_queries, "column pairs are drawn in the forward's orientation only"
        _drop_pairs(acc_mn, coords_mn, head, batch, drop, negate)


@cute.jit
def _drop_pairs(acc_mn: cute.Tensor, coords_mn: cute.Tensor, head, batch, drop, negate: cutlass.Constexpr[bool]):
    """_drop_quads for accumulators (rows = queries) whose column quads need not be one group: a warpgroup
    tile whose width is not a multiple of 16 (hdim 256's backward: 24 keys per warpgroup) puts
    columns j, j+1, j+8, j+9 of a quad in two groups. Rows i, i+8 and a column pair x, x+1 always
    lie in one group, so the units are column pairs (one call per 8 of a thread's scores), each
    picking its bytes by bit 3 of x."""
    pairs = cute.size(acc_mn, mode=[1]) // 2
    odd = odd_row(coords_mn)
    for r in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[0]), 2):
        anchors = [coords_mn[r, 2 * pr] for pr in range(pairs)]
        for pa in cutlass.range_constexpr(0, pairs, 2):
            units = _unit_words(drop, anchors, pa, odd, head, batch, True)
            for k in cutlass.range_constexpr(len(units)):
                c = 2 * (pa + k)
                upper = (Uint32(anchors[pa + k][1]) >> Uint32(3)) & Uint32(1)   # columns x+8, x+9 of the group
                for dr in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        x = acc_mn[r + dr, c + e]
                        dropped = -x if const_expr(negate) else Float32(0.0)
                        acc_mn[r + dr, c + e] = x if drop.kept(units[k][e], Uint32(2 * dr) + upper) else dropped


class _DroppingSoftmax:
    """FA4's Softmax with dropout hooked into a per-KV-tile step: `apply(acc_S)` right after the
    online-softmax step (the row sums have already taken the undropped P: dropout does not
    renormalise), or with `converted` when the step rescales O, which FA4's steps do after
    converting P to 16 bits for P.V (and before that product)."""

    def __init__(self, softmax, apply, converted: bool):
        self._softmax, self._apply, self._converted = softmax, apply, converted
        self._acc_S = None

    def __getattr__(self, name):
        return getattr(self._softmax, name)

    def online_softmax(self, acc_S, **kwargs):
        row_scale = self._softmax.online_softmax(acc_S, **kwargs)
        if self._converted:
            self._acc_S = acc_S   # dropped once the step has converted it, in rescale_O
        else:
            self._apply(acc_S)
        return row_scale

    def rescale_O(self, acc_O, row_scale):
        if self._converted:
            assert self._acc_S is not None, "rescale_O before the step's softmax: P is not converted yet"
            self._apply(self._acc_S)
        return self._softmax.rescale_O(acc_O, row_scale)


def drop_params_of_mma(method, kernel, args, kwargs, threshold_above_half: bool = False):
    """(DropoutParams, the call's arguments by name) of a call of FA4's `mma` (`method`: the
    forward's or the backward's), from its `aux_data`; both kernels' dropout steps and epilogues
    are traced inside that call, so values loaded here serve all of them."""
    arguments = call_arguments(method, kernel, args, kwargs)
    return DropoutParams(arguments["aux_data"].tensors[0], threshold_above_half), arguments


class DropoutForwardSm90(FlashAttentionForwardSm90):
    """FA4's sm90 forward with dropout. FA4 computes P inside its per-KV-tile steps and hands
    them the softmax object; these overrides hand them one that also drops (_DroppingSoftmax):
    on the 16-bit P that P.V reads from registers where the step converts it before rescaling O
    (drop_converted), else on the 32-bit P (the first step of an intra-warpgroup-overlapped tile,
    and tiles whose P goes through shared memory or whose O is rescaled first).
    The kept P enter P.V unscaled and the output takes the keep scale in the epilogue: one
    multiply per output element instead of one per score.
    The tile's (batch, head, query tile) come from the first step of each tile, whose mask
    function FA4 builds with them (later steps may get none); pack_gqa must be off so that
    accumulator rows are query positions. `threshold_above_half`: see DropoutParams."""

    # For scripts/gpu_dropout_forward_probe.py: off, every step drops the 32-bit P (the path
    # before the converted one); on in the product. (Drawing the mask while the step's products
    # run, as the backward does at hdim 64, made this forward slower: see MaskWords.)
    DROP_CONVERTED = True
    SWITCHES = ("DROP_CONVERTED",)   # the class-level switches scripts set (sass_counts.py --set)

    def __init__(self, *args, threshold_above_half: bool = False, **kwargs):
        self.threshold_above_half = threshold_above_half
        super().__init__(*args, **kwargs)

    def mma(self, *args, **kwargs):
        # Trace-time state: values traced here dominate every per-tile step traced inside.
        self._drop, arguments = drop_params_of_mma(FlashAttentionForwardSm90.mma, self, args, kwargs,
                                                   self.threshold_above_half)
        self._thr_mma_qk = arguments["tiled_mma_qk"].get_slice(arguments["tidx"])
        return super().mma(*args, **kwargs)

    def _dropping(self, kwargs, converted: bool):
        """kwargs of a per-tile step with its softmax replaced by one that also drops, on the
        converted P when `converted` and the step reads P from registers. The tile's (batch,
        head, query tile) are noted from FA4's mask function when the step gets one."""
        mask_fn, n_block = kwargs.get("mask_fn"), kwargs["n_block"]
        if mask_fn is not None:
            kw = mask_fn.keywords
            self._tile = (kw["batch_idx"], kw["head_idx"], kw["m_block"])
        batch, head, m_block = self._tile
        q_shift = getattr(kwargs["seqlen"], "q_shift", 0)   # tail-aligned Q tiles (fwd_tail_aligned.py)
        coords_mn = tile_coords(self._thr_mma_qk, (self.tile_m, self.tile_n),
                                (m_block * self.tile_m - q_shift, n_block * self.tile_n))
        converted = converted and self.DROP_CONVERTED and self.mma_pv_is_rs and not self.rescale_O_before_gemm

        def apply(acc_S):
            if converted:
                drop_converted(kwargs["tOrP"], acc_S, coords_mn, head, batch, self._drop)
            else:
                drop_scores(acc_S, coords_mn, head, batch, self._drop, rows_are_queries=True, negate=False)
        return dict(kwargs, softmax=_DroppingSoftmax(kwargs["softmax"], apply, converted))

    def epilogue(self, acc_O, *args, **kwargs):
        acc_O.store(acc_O.load() * self._drop.scale)
        return super().epilogue(acc_O, *args, **kwargs)

    def first_half_block_overlap(self, **kwargs):
        return super().first_half_block_overlap(**self._dropping(kwargs, converted=False))

    def mma_one_n_block(self, smem_pipe_read, **kwargs):
        return super().mma_one_n_block(smem_pipe_read, **self._dropping(kwargs, converted=True))

    def mma_one_n_block_intrawg_overlap(self, smem_pipe_read, **kwargs):
        return super().mma_one_n_block_intrawg_overlap(smem_pipe_read, **self._dropping(kwargs, converted=True))
