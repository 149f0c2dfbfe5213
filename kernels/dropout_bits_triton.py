"""The Triton kernel of kernels/dropout_bits.py: kernels/philox.py's dropout mask drawn for a
whole (batch, head, rows, cols) problem and stored as keep bits in a Hopper kernel's thread
order (the layout is described there). One Philox call per eight scores, as in the kernels that
draw it inline; a program covers a few 16-row blocks of one column tile."""
import torch
import triton
import triton.language as tl

from .dropout_bits import BLOCK, BitLayout

ROW_BLOCKS_PER_PROGRAM = 4


@triton.jit
def _keep_pair(w, threshold, low_bit: tl.constexpr, high_bit: tl.constexpr):
    """The low and high 16-bit draws of words `w` as keep bits at positions low_bit, high_bit."""
    low = ((w & 0xFFFF).to(tl.int32) >= threshold).to(tl.int32)
    high = ((w >> 16).to(tl.int32) >= threshold).to(tl.int32)
    return (low << low_bit) | (high << high_bit)


@triton.jit
def _keep_half(w, threshold, high):
    """Keep bit (0/1) of the low (high = 0) or high (high = 1) 16-bit draw of words `w`."""
    return (((w >> (16 * high)) & 0xFFFF).to(tl.int32) >= threshold).to(tl.int32)


@triton.jit
def _draw_bits(words, seed, threshold, heads, row_blocks, words_per_row, shift, left, right,
               ROW_TILE: tl.constexpr, COL_TILE: tl.constexpr, WORDS_PER_TILE: tl.constexpr,
               BLOCKS: tl.constexpr, ROW_BLOCKS: tl.constexpr, TRANSPOSED: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    pid_r = tl.program_id(0)
    tile = tl.program_id(1)
    bh = tl.program_id(2)
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
        blk = tl.arange(0, BLOCKS)
        col0 = tile * COL_TILE + blk * 16                      # first column of each 16-column block
        byte_offset = tile * WORDS_PER_TILE * 4 + blk          # byte k of a tile: its k-th block
        blk_ok = blk < COL_TILE // 16
        if TRANSPOSED:
            # Rows are keys, columns queries. A byte holds key rows {j, j+8} of one parity and query
            # columns {i, i+1, i+8, i+9}: two Philox groups (queries i and i+1), four draws of
            # each. The two parities' bytes share the two calls, so one element makes both.
            e = tl.arange(0, ROW_BLOCKS * 16)
            rb = pid_r * ROW_BLOCKS + e // 16
            pair = (e % 16) // 4                                 # key rows 2*pair, 2*pair + 1 of the block
            cpair = e % 4                                        # query columns 2*cpair (+1, +8, +9)
            zero = rb[:, None] * 0 + blk[None, :] * 0
            key = zero + (rb * 16 + 2 * pair)[:, None]            # Philox column counter (bits 0, 3 clear)
            query = zero + col0[None, :] + (2 * cpair)[:, None]  # bit 0 clear; + b0 below
            ok = (rb < row_blocks)[:, None] & blk_ok[None, :]
            for parity in tl.static_range(2):
                lane = 4 * (2 * pair + parity) + cpair
                byte = zero
                for b0 in tl.static_range(2):
                    w0, w1, w2, w3 = tl.philox(seed, key, query + b0, zero + head, zero + batch)
                    # draw index in the call: 4*bit3(query) + 2*bit3(key) + parity; bit in the
                    # byte: 4*bit3(key) + 2*bit3(query) + b0
                    byte |= _keep_half(w0, threshold, parity) << b0
                    byte |= _keep_half(w1, threshold, parity) << (4 + b0)
                    byte |= _keep_half(w2, threshold, parity) << (2 + b0)
                    byte |= _keep_half(w3, threshold, parity) << (6 + b0)
                row = (bh.to(tl.int64) * row_blocks + rb) * 32 + lane
                ptrs = words + (row * words_per_row * 4)[:, None] + byte_offset[None, :]
                tl.store(ptrs, byte.to(tl.int8), mask=ok)
        else:
            # Rows are queries, columns keys: a byte is one Philox group, draw d at bit d.
            e = tl.arange(0, ROW_BLOCKS * 32)
            rb = pid_r * ROW_BLOCKS + e // 32
            lane = e % 32
            zero = rb[:, None] * 0 + blk[None, :] * 0
            query = zero + (rb * 16 + lane // 4)[:, None]         # Philox row counter (bit 3 clear)
            key = zero + col0[None, :] + (2 * (lane % 4))[:, None]
            w0, w1, w2, w3 = tl.philox(seed, key, query, zero + head, zero + batch)
            byte = (_keep_pair(w0, threshold, 0, 1) | _keep_pair(w1, threshold, 2, 3)
                    | _keep_pair(w2, threshold, 4, 5) | _keep_pair(w3, threshold, 6, 7))
            row = (bh.to(tl.int64) * row_blocks + rb) * 32 + lane
            ptrs = words + (row * words_per_row * 4)[:, None] + byte_offset[None, :]
            tl.store(ptrs, byte.to(tl.int8), mask=(rb < row_blocks)[:, None] & blk_ok[None, :])


def launch(words, seed: int, threshold: int, heads: int, layout: BitLayout, window_left: int,
           window_right: int) -> None:
    """Fill `words` (int32, layout.shape(batch, heads)) with the keep bits."""
    batch = words.shape[0]
    seqlen_q, seqlen_k = (layout.cols, layout.rows) if layout.transposed else (layout.rows, layout.cols)
    row_blocks_per_program = ROW_BLOCKS_PER_PROGRAM
    while layout.row_blocks % row_blocks_per_program:
        row_blocks_per_program //= 2
    grid = (layout.row_blocks // row_blocks_per_program, layout.col_tiles, batch * heads)
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    _draw_bits[grid](
        words.view(-1).view(torch.int8), seed, threshold, heads, layout.row_blocks,
        layout.words_per_row, seqlen_k - seqlen_q, max(window_left, 0), max(window_right, 0),
        ROW_TILE=layout.row_tile, COL_TILE=layout.col_tile, WORDS_PER_TILE=layout.words_per_tile,
        BLOCKS=triton.next_power_of_2(layout.col_tile // BLOCK), ROW_BLOCKS=row_blocks_per_program,
        TRANSPOSED=layout.transposed, HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0,
        num_warps=4)

