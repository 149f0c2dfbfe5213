"""The dropout mask drawn ahead of a Hopper kernel, stored as keep bits in the order the
kernel's threads hold the scores.

Why: drawn inside the Hopper kernels, Philox is about 45 instructions per eight scores on the
consumer warpgroups' path, which are the ones that also issue the products and the softmax; the
forward with dropout ran 1.8x the code and 1.8x the time of the forward without. Here a separate
kernel draws the same numbers (kernels/philox.py's mask, bit for bit) and writes one bit per
score; the attention kernel loads one 32-bit word per 64 scores of a row pair and tests bits.
The memory is about B * H * S_q * S_k / 8 bytes, allocated for one kernel and freed after it:
the forward and the backward each draw their own, so nothing is held from one to the other.

Measured on an H100 (docs/benchmarks/dropout-ahead-2026-11-23-h100/, dropout-draw-2026-11-23-h100/):
the attention kernels' own cost of dropout falls (hdim 128, 4k: forward 1.78x -> about 1.2-1.3x the
time without, backward 1.1-1.3x -> 1.03-1.10x), but the drawing kernel takes 0.28-0.54 ms per call
at 4k, bound by the integer multiplier that Philox needs. End to end that wins at full masks and
at hdim 64 from 4k and loses at hdim 128 causal, so it is opt-in (`draw_ahead`).

Layout (`BitLayout`): the kernel's score tile is seen in its own orientation, rows x cols
(forward: queries x keys; backward, which computes S^T: keys x queries). A `wgmma` accumulator
gives each thread, per 16 x 16 block, the rows {i, i+8} and the columns {j, j+1, j+8, j+9} with
i = lane // 4 and j = 2 * (lane % 4) inside the block: eight scores, one byte. Bit
4 * bit3(row) + 2 * bit3(col) + bit0(col) of the byte is the score's keep bit (in the forward's
orientation that is the Philox draw index of kernels/philox.py). A (16-row block, column tile)
of the kernel's tile grid (tile width `col_tile`) is one contiguous record: per lane,
`words_per_tile` int32 words whose byte k is the lane's byte of the tile's k-th 16-column block.
So a warp's loads for one tile read one contiguous stretch, and the drawing kernel writes whole
records.

The rows are padded to the kernel's row tile and the columns to its column tile, and the
padding is drawn too (Philox of positions past the end is well defined), so the kernel reads
the same bits the in-kernel path would draw. Tiles with no visible score, by a margin of one
tile, are not drawn (the kernel never reads them).

`pack` is the plain PyTorch reference of the layout; `draw` launches the Triton kernel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .philox import dropout_threshold

LANES = 32
BLOCK = 16          # rows and columns of one block of a thread's bytes
BLOCKS_PER_WORD = 4  # a 32-bit word holds the bytes of four column blocks


def words_per_tile(col_tile: int) -> int:
    """int32 words of one lane's record in a column tile: a byte per 16-column block."""
    return -(-(col_tile // BLOCK) // BLOCKS_PER_WORD)


@dataclass(frozen=True)
class BitLayout:
    """Where each score's keep bit sits, for one consumer kernel's tiles."""
    rows: int           # in the kernel's orientation
    cols: int
    row_tile: int       # the kernel's tile, rows x cols, multiples of 16
    col_tile: int
    transposed: bool    # rows are keys and columns queries (the backward's S^T)

    def __post_init__(self):
        for name in ("row_tile", "col_tile"):
            value = getattr(self, name)
            if value <= 0 or value % BLOCK:
                raise ValueError(f"{name}={value}: must be a positive multiple of {BLOCK}")

    @property
    def row_blocks(self) -> int:
        """16-row blocks, the rows padded to whole row tiles."""
        return -(-self.rows // self.row_tile) * (self.row_tile // BLOCK)

    @property
    def col_tiles(self) -> int:
        return -(-self.cols // self.col_tile)

    @property
    def words_per_tile(self) -> int:
        return words_per_tile(self.col_tile)

    def shape(self, batch: int, heads: int) -> tuple[int, int, int, int, int]:
        """int32 (batch, heads, 16-row block, column tile * 32 + lane, word)."""
        return batch, heads, self.row_blocks, self.col_tiles * LANES, self.words_per_tile

    def nbytes(self, batch: int, heads: int) -> int:
        b, h, r, c, w = self.shape(batch, heads)
        return 4 * b * h * r * c * w


def pack(keep: torch.Tensor, layout: BitLayout) -> torch.Tensor:
    """Plain PyTorch reference: the int32 words of a (batch, heads, rows, cols) bool keep mask,
    already in the layout's orientation and padded to whole tiles (rows: layout.row_blocks * 16,
    cols: layout.col_tiles * layout.col_tile). Pad bytes of a tile's last word are 0."""
    b, h, rows, cols = keep.shape
    if rows != layout.row_blocks * BLOCK or cols != layout.col_tiles * layout.col_tile:
        raise ValueError(f"keep mask of {rows} x {cols}: the layout wants "
                         f"{layout.row_blocks * BLOCK} x {layout.col_tiles * layout.col_tile}")
    blocks = layout.col_tile // BLOCK
    # rows = (16-row block, bit3, row % 8); cols = (tile, block, bit3, (col % 8) // 2, bit0)
    k = keep.to(torch.int64).reshape(b, h, layout.row_blocks, 2, 8, layout.col_tiles, blocks, 2, 4, 2)
    # -> (b, h, row block, row % 8, col pair, tile, block | bit3 row, bit3 col, bit0 col)
    # -> (b, h, row block, tile, row % 8, col pair, block | bit3 row, bit3 col, bit0 col)
    k = k.permute(0, 1, 2, 5, 4, 8, 6, 3, 7, 9).reshape(b, h, layout.row_blocks, layout.col_tiles, 8, 4, blocks, 8)
    byte = (k << torch.arange(8)).sum(-1)
    byte = torch.nn.functional.pad(byte, (0, layout.words_per_tile * BLOCKS_PER_WORD - blocks))
    byte = byte.reshape(b, h, layout.row_blocks, layout.col_tiles, 8, 4, layout.words_per_tile, BLOCKS_PER_WORD)
    word = (byte << (8 * torch.arange(BLOCKS_PER_WORD))).sum(-1)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)   # as int32
    return word.reshape(layout.shape(b, h)).to(torch.int32)


def unpack(words: torch.Tensor, layout: BitLayout) -> torch.Tensor:
    """The inverse of `pack`: (batch, heads, padded rows, padded cols) bool."""
    b, h = words.shape[:2]
    blocks = layout.col_tile // BLOCK
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = w.reshape(b, h, layout.row_blocks, layout.col_tiles, 8, 4, layout.words_per_tile, 1)
    byte = ((w >> (8 * torch.arange(BLOCKS_PER_WORD))) & 0xFF).reshape(
        b, h, layout.row_blocks, layout.col_tiles, 8, 4, layout.words_per_tile * BLOCKS_PER_WORD)[..., :blocks]
    bits = (byte.unsqueeze(-1) >> torch.arange(8)) & 1     # (..., block, bit d)
    bits = bits.reshape(b, h, layout.row_blocks, layout.col_tiles, 8, 4, blocks, 2, 2, 2)
    # (b, h, row block, tile, row % 8, col pair, block, bit3 row, bit3 col, bit0 col) -> rows x cols
    bits = bits.permute(0, 1, 2, 7, 4, 3, 6, 8, 5, 9)
    return bits.reshape(b, h, layout.row_blocks * BLOCK, layout.col_tiles * layout.col_tile).bool()


MODES = ("inline", "ahead")


def _mode() -> str:
    mode = os.environ.get("DASH_DROPOUT_MASK", "inline").strip().lower() or "inline"
    if mode not in MODES:
        raise ValueError(f"DASH_DROPOUT_MASK={mode!r}: expected one of {', '.join(MODES)}")
    return mode
DEFAULT_MAX_MB = 1024
MAX_MB = 8192


def draw_ahead(nbytes: int) -> bool:
    """Whether a Hopper kernel with dropout reads the mask drawn ahead (True) or draws it
    itself; both give the same bits. DASH_DROPOUT_MASK: `inline` (the default: faster end to end
    on an H100, because the drawing kernel costs more than the kernels save; docs/benchmarks/)
    or `ahead`, which draws ahead when the bits take at most DASH_DROPOUT_MASK_MAX_MB megabytes
    (default 1024, at most 8192) and inline beyond."""
    if _mode() == "inline":
        return False
    limit = os.environ.get("DASH_DROPOUT_MASK_MAX_MB", str(DEFAULT_MAX_MB))
    try:
        limit_mb = float(limit)
    except ValueError:
        raise ValueError(f"DASH_DROPOUT_MASK_MAX_MB={limit!r}: expected a number of megabytes") from None
    # Beyond 8 GiB the kernels' word offsets could pass int32.
    return nbytes <= min(limit_mb, MAX_MB) * 2 ** 20


def draw(seed: int, dropout_p: float, batch: int, heads: int, layout: BitLayout, window_left: int = -1,
         window_right: int = -1, *, device=None) -> torch.Tensor:
    """The keep bits of kernels/philox.py's mask (seed, p) for (batch, heads) in `layout`,
    drawn by a Triton kernel on `device`. Window in our terms (-1: unlimited side; causal is
    window_right = 0), bottom-right aligned; tiles no visible score reaches are left undrawn."""
    from . import dropout_bits_triton
    words = torch.empty(layout.shape(batch, heads), dtype=torch.int32, device=device)
    if words.numel():
        dropout_bits_triton.launch(words, seed, dropout_threshold(dropout_p), heads, layout, window_left,
                                   window_right)
    return words


def bits_for_kernel(seed: int, dropout_p: float, batch: int, heads: int, layout_of, window_left: int,
                    window_right: int, *, device) -> torch.Tensor | None:
    """The keep bits a Hopper kernel reads, or None when it draws the mask itself (`draw_ahead`).
    `layout_of()` gives the kernel's BitLayout; it is only built when DASH_DROPOUT_MASK asks for
    the mask ahead, so the default path does no more work per call."""
    if _mode() == "inline":
        return None
    layout = layout_of()
    if not draw_ahead(layout.nbytes(batch, heads)):
        return None
    return draw(seed, dropout_p, batch, heads, layout, window_left, window_right, device=device)
