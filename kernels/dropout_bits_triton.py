"""The Triton kernel of kernels/dropout_bits.py: kernels/philox.py's dropout mask drawn for a
whole (batch, head, rows, cols) problem and stored as keep bits in a Hopper kernel's thread
order (the layout is described there). One Philox call per eight scores, as in the kernels that
draw it inline; a program covers a few 16-row blocks of one column tile and writes their records
whole (contiguous int32 words, so the stores coalesce)."""
import triton
import triton.language as tl

from . import philox as _philox_ref
from .dropout_bits import BitLayout

# 16-row blocks per program: 128 elements, one per thread of 4 warps (a transposed element
# makes two lanes' records)
ROW_BLOCKS_PER_PROGRAM = {False: 4, True: 8}


_ROUND_A = tl.constexpr(_philox_ref._ROUND_A)
_ROUND_B = tl.constexpr(_philox_ref._ROUND_B)
_KEY_A = tl.constexpr(_philox_ref._KEY_A)
_KEY_B = tl.constexpr(_philox_ref._KEY_B)


@triton.jit
def philox(seed, c0, c1, c2, c3):
    """Philox4x32-10 of kernels/philox.py (the same words as ``tl.philox``), with each round's
    two products taken as one 32x32->64-bit multiply (IMAD.WIDE.U32 on sm90). ``tl.philox``
    asks for the high and low halves apart, which ptxas leaves as two multiplies when the
    factor is an immediate: 40 instead of 20 per call.

    Only this kernel uses it. In the Triton attention kernels (kernels/_triton_common.py) the
    same function gave wrong masks at head dim 128 on an H100 with triton 3.6 (head dim 64 and
    this kernel right; not understood), so they keep ``tl.philox``."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c0 = c0.to(tl.uint32, bitcast=True)
    c1 = c1.to(tl.uint32, bitcast=True)
    c2 = c2.to(tl.uint32, bitcast=True)
    c3 = c3.to(tl.uint32, bitcast=True)
    for _ in tl.static_range(10):
        b = c2.to(tl.uint64) * _ROUND_B
        a = c0.to(tl.uint64) * _ROUND_A
        c0, c1, c2, c3 = (b >> 32).to(tl.uint32) ^ c1 ^ k0, b.to(tl.uint32), (a >> 32).to(tl.uint32) ^ c3 ^ k1, a.to(tl.uint32)
        k0 = k0 + _KEY_A
        k1 = k1 + _KEY_B
    return c0, c1, c2, c3


@triton.jit
def _keep_lanes(w, lanes_threshold, HIGH_THRESHOLD: tl.constexpr):
    """Keep bits of both 16-bit draws of words `w`, at bits 15 (low draw) and 31 (high draw),
    with three integer ops per word instead of a compare and a select per draw. Setting each
    lane's top bit before subtracting the threshold's low 15 bits (`lanes_threshold`, in both
    lanes) keeps the borrow inside the lane, and leaves bit 15 of the lane set iff the draw's
    low 15 bits >= the threshold's. The top bits then decide: with the threshold's top bit
    clear (p < 0.5) the draw is kept iff its top bit or that bit is set, else iff both are."""
    low15 = (w | 0x80008000) - lanes_threshold
    if HIGH_THRESHOLD:
        return w & low15 & 0x80008000
    return (w | low15) & 0x80008000


@triton.jit
def _row_byte(seed, lanes_threshold, query, key, head, batch, HIGH_THRESHOLD: tl.constexpr):
    """Forward orientation: the byte of the Philox group anchored at (query, key), draw d at
    bit d (word i's low draw at bit 2i, its high one at 2i + 1)."""
    w0, w1, w2, w3 = philox(seed, key, query, head, batch)
    bits = ((_keep_lanes(w0, lanes_threshold, HIGH_THRESHOLD) >> 15)
            | (_keep_lanes(w1, lanes_threshold, HIGH_THRESHOLD) >> 13)
            | (_keep_lanes(w2, lanes_threshold, HIGH_THRESHOLD) >> 11)
            | (_keep_lanes(w3, lanes_threshold, HIGH_THRESHOLD) >> 9))
    return ((bits | (bits >> 15)) & 0xFF).to(tl.int32, bitcast=True)


@triton.jit
def _column_bytes(seed, lanes_threshold, key, query, head, batch, HIGH_THRESHOLD: tl.constexpr):
    """Transposed orientation (rows are keys): the bytes of key rows {key, key+8} (parity 0) and
    {key+1, key+9} (parity 1) x query columns {query, query+1, query+8, query+9}. Queries query
    and query+1 are two Philox groups; a draw's index in its call is 4*bit3(query) +
    2*bit3(key) + parity, its bit in the byte 4*bit3(key) + 2*bit3(query) + bit0(query). The low
    draws (parity 0) gather at bits 0-7, the high ones at 16-23."""
    bits = tl.zeros_like(key).to(tl.uint32)
    for b0 in tl.static_range(2):
        w0, w1, w2, w3 = philox(seed, key, query + b0, head, batch)
        bits |= ((_keep_lanes(w0, lanes_threshold, HIGH_THRESHOLD) >> (15 - b0))
                 | (_keep_lanes(w2, lanes_threshold, HIGH_THRESHOLD) >> (13 - b0))
                 | (_keep_lanes(w1, lanes_threshold, HIGH_THRESHOLD) >> (11 - b0))
                 | (_keep_lanes(w3, lanes_threshold, HIGH_THRESHOLD) >> (9 - b0)))
    return (bits & 0xFF).to(tl.int32, bitcast=True), ((bits >> 16) & 0xFF).to(tl.int32, bitcast=True)


@triton.jit
def _draw_bits(words, seed, lanes_threshold, heads, row_programs, row_blocks, col_tiles, shift, left, right,
               ROW_TILE: tl.constexpr, COL_TILE: tl.constexpr, WORDS_PER_TILE: tl.constexpr,
               ROW_BLOCKS: tl.constexpr, TRANSPOSED: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, HIGH_THRESHOLD: tl.constexpr):
    """One program: ROW_BLOCKS 16-row blocks x one column tile of one (batch, head). An element
    is one lane's record (forward) or the records of two lanes that share their Philox calls
    (transposed); it draws the record's bytes and stores whole int32 words."""
    # Axis 0 holds (batch * head, row program): axis 2 of a grid stops at 65,535.
    bh = tl.program_id(0) // row_programs
    pid_r = tl.program_id(0) % row_programs
    tile = tl.program_id(1)
    batch = bh // heads
    head = bh % heads
    # Skip a program whose rows and columns, widened by one kernel tile each way, hold no visible
    # score (query q sees key k iff q + shift - left <= k <= q + shift + right): the kernel never
    # reads those bits. The margin keeps every tile the kernel visits drawn in full.
    r_lo = pid_r * ROW_BLOCKS * 16 - ROW_TILE
    r_hi = (pid_r + 1) * ROW_BLOCKS * 16 - 1 + ROW_TILE
    c_lo = tile * COL_TILE - COL_TILE
    c_hi = (tile + 2) * COL_TILE - 1
    if TRANSPOSED:
        q_lo, q_hi, k_lo, k_hi = c_lo, c_hi, r_lo, r_hi
    else:
        q_lo, q_hi, k_lo, k_hi = r_lo, r_hi, c_lo, c_hi
    skip = False
    if HAS_RIGHT:
        skip = k_lo > q_hi + shift + right
    if HAS_LEFT:
        skip = skip | (k_hi < q_lo + shift - left)
    if not skip:
        col0 = tile * COL_TILE
        if TRANSPOSED:
            e = tl.arange(0, ROW_BLOCKS * 16)
            rb = pid_r * ROW_BLOCKS + e // 16
            pair = (e % 16) // 4                      # key rows 2*pair, 2*pair + 1 of the block
            cpair = e % 4                             # query columns 2*cpair (+1, +8, +9)
            key = rb * 16 + 2 * pair                  # Philox column counter (bits 0 and 3 clear)
            lane = 8 * pair + cpair                   # parity 0; parity 1 is lane + 4
            base = (((bh.to(tl.int64) * row_blocks + rb) * col_tiles + tile) * 32 + lane) * WORDS_PER_TILE
            ok = rb < row_blocks
            for w in tl.static_range(WORDS_PER_TILE):
                even = tl.zeros_like(key)
                odd = tl.zeros_like(key)
                for q in tl.static_range(4):
                    if 4 * w + q < COL_TILE // 16:
                        query = col0 + (4 * w + q) * 16 + 2 * cpair
                        e_byte, o_byte = _column_bytes(seed, lanes_threshold, key, query, head + key * 0, batch + key * 0,
                                                       HIGH_THRESHOLD)
                        even |= e_byte << (8 * q)
                        odd |= o_byte << (8 * q)
                tl.store(words + base + w, even, mask=ok)
                tl.store(words + base + 4 * WORDS_PER_TILE + w, odd, mask=ok)
        else:
            e = tl.arange(0, ROW_BLOCKS * 32)
            rb = pid_r * ROW_BLOCKS + e // 32
            lane = e % 32
            query = rb * 16 + lane // 4                # Philox row counter (bit 3 clear)
            base = (((bh.to(tl.int64) * row_blocks + rb) * col_tiles + tile) * 32 + lane) * WORDS_PER_TILE
            ok = rb < row_blocks
            for w in tl.static_range(WORDS_PER_TILE):
                word = tl.zeros_like(query)
                for q in tl.static_range(4):
                    if 4 * w + q < COL_TILE // 16:
                        key = col0 + (4 * w + q) * 16 + 2 * (lane % 4)
                        word |= _row_byte(seed, lanes_threshold, query, key, head + query * 0, batch + query * 0,
                                          HIGH_THRESHOLD) << (8 * q)
                tl.store(words + base + w, word, mask=ok)


def launch(words, seed: int, threshold: int, heads: int, layout: BitLayout, window_left: int,
           window_right: int) -> None:
    """Fill `words` (int32, layout.shape(batch, heads)) with the keep bits."""
    batch = words.shape[0]
    seqlen_q, seqlen_k = (layout.cols, layout.rows) if layout.transposed else (layout.rows, layout.cols)
    row_blocks_per_program = ROW_BLOCKS_PER_PROGRAM[layout.transposed]
    while layout.row_blocks % row_blocks_per_program:
        row_blocks_per_program //= 2
    row_programs = layout.row_blocks // row_blocks_per_program
    grid = (batch * heads * row_programs, layout.col_tiles)
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    # A window wider than both sequences limits nothing; clamped so the int32 bounds cannot wrap.
    reach = seqlen_q + seqlen_k
    # Both 16-bit lanes of a word are compared at once (_keep_lanes): the threshold's low 15 bits
    # in each lane, and its top bit as a compile-time choice.
    lanes_threshold = (threshold & 0x7FFF) * 0x10001
    _draw_bits[grid](
        words, seed, lanes_threshold, heads, row_programs, layout.row_blocks, layout.col_tiles, seqlen_k - seqlen_q,
        min(max(window_left, 0), reach), min(max(window_right, 0), reach), ROW_TILE=layout.row_tile,
        COL_TILE=layout.col_tile,
        WORDS_PER_TILE=layout.words_per_tile, ROW_BLOCKS=row_blocks_per_program, TRANSPOSED=layout.transposed,
        HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HIGH_THRESHOLD=threshold >= 1 << 15, num_warps=4)
