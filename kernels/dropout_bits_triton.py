"""The Triton kernel of kernels/dropout_bits.py: kernels/philox.py's dropout mask drawn for a
whole (batch, head, rows, cols) problem and stored as keep bits in a Hopper kernel's thread
order (the layout is described there). One Philox call per eight scores, as in the kernels that
draw it inline; a program covers a few 16-row blocks of one column tile and writes their records
whole (contiguous int32 words, so the stores coalesce)."""
import triton
import triton.language as tl

from .dropout_bits import BitLayout

# 16-row blocks per program: 128 elements, one per thread of 4 warps (a transposed element
# makes two lanes' records)
ROW_BLOCKS_PER_PROGRAM = {False: 4, True: 8}


@triton.jit
def _keep_pair(w, threshold, low_bit: tl.constexpr, high_bit: tl.constexpr):
    """The low and high 16-bit draws of words `w` as keep bits at positions low_bit, high_bit."""
    low = ((w & 0xFFFF).to(tl.int32) >= threshold).to(tl.int32)
    high = ((w >> 16).to(tl.int32) >= threshold).to(tl.int32)
    return (low << low_bit) | (high << high_bit)


@triton.jit
def _keep_half(w, threshold, bit: tl.constexpr, HIGH: tl.constexpr):
    """Keep bit of the low or high (HIGH) 16-bit draw of words `w`, at position `bit`."""
    draw = (w >> 16) if HIGH else (w & 0xFFFF)
    return (draw.to(tl.int32) >= threshold).to(tl.int32) << bit


@triton.jit
def _row_byte(seed, threshold, query, key, head, batch):
    """Forward orientation: the byte of the Philox group anchored at (query, key), draw d at bit d."""
    w0, w1, w2, w3 = tl.philox(seed, key, query, head, batch)
    return (_keep_pair(w0, threshold, 0, 1) | _keep_pair(w1, threshold, 2, 3)
            | _keep_pair(w2, threshold, 4, 5) | _keep_pair(w3, threshold, 6, 7))


@triton.jit
def _column_bytes(seed, threshold, key, query, head, batch):
    """Transposed orientation (rows are keys): the bytes of key rows {key, key+8} (parity 0) and
    {key+1, key+9} (parity 1) x query columns {query, query+1, query+8, query+9}. Queries query
    and query+1 are two Philox groups; a draw's index in its call is 4*bit3(query) +
    2*bit3(key) + parity, its bit in the byte 4*bit3(key) + 2*bit3(query) + bit0(query)."""
    even = tl.zeros_like(key)
    odd = tl.zeros_like(key)
    for b0 in tl.static_range(2):
        w0, w1, w2, w3 = tl.philox(seed, key, query + b0, head, batch)
        even |= (_keep_half(w0, threshold, b0, False) | _keep_half(w1, threshold, 4 + b0, False)
                 | _keep_half(w2, threshold, 2 + b0, False) | _keep_half(w3, threshold, 6 + b0, False))
        odd |= (_keep_half(w0, threshold, b0, True) | _keep_half(w1, threshold, 4 + b0, True)
                | _keep_half(w2, threshold, 2 + b0, True) | _keep_half(w3, threshold, 6 + b0, True))
    return even, odd


@triton.jit
def _draw_bits(words, seed, threshold, heads, row_programs, row_blocks, col_tiles, shift, left, right,
               ROW_TILE: tl.constexpr, COL_TILE: tl.constexpr, WORDS_PER_TILE: tl.constexpr,
               ROW_BLOCKS: tl.constexpr, TRANSPOSED: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr):
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
                        e_byte, o_byte = _column_bytes(seed, threshold, key, query, head + key * 0, batch + key * 0)
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
                        word |= _row_byte(seed, threshold, query, key, head + query * 0, batch + query * 0) << (8 * q)
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
    _draw_bits[grid](
        words, seed, threshold, heads, row_programs, layout.row_blocks, layout.col_tiles, seqlen_k - seqlen_q,
        min(max(window_left, 0), reach), min(max(window_right, 0), reach), ROW_TILE=layout.row_tile,
        COL_TILE=layout.col_tile,
        WORDS_PER_TILE=layout.words_per_tile, ROW_BLOCKS=row_blocks_per_program, TRANSPOSED=layout.transposed,
        HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, num_warps=4)
