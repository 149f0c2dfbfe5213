"""The dropout mask stored as keep bits for the Hopper kernels (kernels/dropout_bits.py).

`pack` (plain PyTorch) against the mask of kernels/philox.py read back by `unpack`; the Triton
kernel that draws the bits against `pack`, bit for bit (under TRITON_INTERPRET=1 on the CPU,
compiled on a GPU machine); tiles it leaves undrawn hold no visible score.
"""
import pytest
import torch
import triton
import triton.language as tl

from dash_plugin.kernels.dropout_bits import BitLayout, pack, unpack
from dash_plugin.kernels.dropout_bits_triton import _keep_lanes, philox
from dash_plugin.kernels.philox import dropout_keep_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _keep(seed, p, batch, heads, layout):
    """kernels/philox.py's mask over the layout's padded tile, in the layout's orientation."""
    rows = torch.arange(layout.row_blocks * 16)
    cols = torch.arange(layout.col_tiles * layout.col_tile)
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    if layout.transposed:   # rows are keys, columns queries
        return dropout_keep_mask(seed, p, b, h, cols[None, None, None, :], rows[None, None, :, None])
    return dropout_keep_mask(seed, p, b, h, rows[None, None, :, None], cols[None, None, None, :])


# (rows, cols, row tile, col tile): the Hopper forward's tiles (128 x 128, 192 x 128, 192 x 144)
# and the backward's S^T tiles (128 keys x 64, 80 or 128 queries), with ragged edges.
LAYOUTS = [(200, 300, 128, 128, False), (130, 100, 192, 128, False), (100, 150, 192, 144, False),
           (300, 200, 128, 64, True), (256, 170, 128, 80, True), (129, 129, 128, 128, True)]


@pytest.mark.parametrize("rows, cols, row_tile, col_tile, transposed", LAYOUTS)
def test_unpack_of_pack_is_the_mask(rows, cols, row_tile, col_tile, transposed):
    layout = BitLayout(rows, cols, row_tile, col_tile, transposed)
    keep = _keep(7, 0.3, 2, 3, layout)
    words = pack(keep, layout)
    assert words.dtype == torch.int32 and words.shape == layout.shape(2, 3)
    assert torch.equal(unpack(words, layout), keep)


def test_a_thread_finds_its_eight_scores_in_one_byte():
    """Lane 4 * (i % 8) + (j % 8) // 2 of block (0, 0) holds rows {i, i+8} x columns
    {j, j+1, j+8, j+9}, bit 4*bit3(row) + 2*bit3(col) + bit0(col): checked on a one-hot mask."""
    layout = BitLayout(16, 64, 16, 64, False)
    for row, col in [(0, 0), (3, 5), (11, 9), (15, 14), (8, 1)]:
        keep = torch.zeros(1, 1, 16, 64, dtype=torch.bool)
        keep[0, 0, row, col] = True
        words = pack(keep, layout)[0, 0, 0]
        lane = 4 * (row % 8) + (col % 8) // 2
        bit = 4 * (row // 8 % 2) + 2 * (col // 8 % 2) + col % 2
        expected = torch.zeros(32, 1, dtype=torch.int64)
        expected[lane, 0] = 1 << bit
        assert torch.equal(words.to(torch.int64), expected)


def test_layout_sizes_and_bad_tiles():
    layout = BitLayout(1000, 1000, 192, 144, False)
    assert layout.row_blocks == 6 * 12 and layout.col_tiles == 7 and layout.words_per_tile == 3
    assert layout.shape(2, 4) == (2, 4, 72, 7 * 32, 3)
    assert layout.nbytes(2, 4) == 4 * 2 * 4 * 72 * 7 * 32 * 3
    with pytest.raises(ValueError, match="col_tile=72"):
        BitLayout(10, 10, 128, 72, False)


# Longer layouts, S_q != S_k included, where whole tiles lie outside a causal mask or a window.
SKIPPING = [(1024, 300, 128, 128, False), (700, 1024, 128, 80, True)]


WINDOWS = {"full": (-1, -1), "causal": (-1, 0), "window": (100, 20), "huge-right": (-1, 2 ** 31 - 1)}
DRAW_CASES = ([(*lay, w, 0.2) for lay in LAYOUTS for w in ("full", "causal", "window")]
              + [(*lay, w, 0.2) for lay in SKIPPING for w in ("causal", "window")]
              + [(*LAYOUTS[3], "huge-right", 0.2)]
              # thresholds with the top bit set (p >= 0.5) take the other branch of _keep_lanes
              + [(*LAYOUTS[0], "causal", 0.5), (*LAYOUTS[3], "full", 0.75)])


@pytest.mark.parametrize("rows, cols, row_tile, col_tile, transposed, window, p", DRAW_CASES)
def test_triton_kernel_draws_the_packed_mask(rows, cols, row_tile, col_tile, transposed, window, p):
    window = WINDOWS[window]
    from dash_plugin.kernels import dropout_bits_triton
    from dash_plugin.kernels.philox import dropout_threshold
    layout = BitLayout(rows, cols, row_tile, col_tile, transposed)
    seed, batch, heads = 2 ** 40 + 99, 2, 2
    # Every word starts as -1, so a record the kernel leaves undrawn is seen as such (a drawn
    # record of all-kept bits at p >= 0.2 has probability at most 0.8 ** 256).
    got = torch.full(layout.shape(batch, heads), -1, dtype=torch.int32, device=DEVICE)
    dropout_bits_triton.launch(got, seed, dropout_threshold(p), heads, layout, *window)
    got = got.cpu()
    expected = pack(_keep(seed, p, batch, heads, layout), layout)
    seqlen_q, seqlen_k = (cols, rows) if transposed else (rows, cols)
    q = torch.arange(layout.col_tiles * col_tile if transposed else layout.row_blocks * 16)
    k = torch.arange(layout.row_blocks * 16 if transposed else layout.col_tiles * col_tile)
    rel = k[None, :] - q[:, None] - (seqlen_k - seqlen_q)
    visible = torch.ones_like(rel, dtype=torch.bool)
    if window[1] >= 0:
        visible &= rel <= window[1]
    if window[0] >= 0:
        visible &= rel >= -window[0]
    if transposed:
        visible = visible.T
    blocks = col_tile // 16
    undrawn = 0
    for rb in range(layout.row_blocks):
        for t in range(layout.col_tiles):
            cells = (slice(None), slice(None), rb, slice(t * 32, t * 32 + 32))
            if (got[cells] == -1).all():
                undrawn += 1
                tile_visible = visible[rb * 16:(rb + 1) * 16, t * col_tile:(t + 1) * col_tile]
                assert not tile_visible.any(), f"block {rb}, tile {t}: visible scores, not drawn"
                continue
            got_bytes = got[cells].contiguous().view(torch.uint8).reshape(batch, heads, 32, -1)[..., :blocks]
            want_bytes = expected[cells].contiguous().view(torch.uint8).reshape(batch, heads, 32, -1)[..., :blocks]
            assert torch.equal(got_bytes, want_bytes), f"block {rb}, tile {t}: drawn wrong"
    if window in ((-1, -1), (-1, 2 ** 31 - 1)):
        assert undrawn == 0
    elif (rows, cols, row_tile, col_tile, transposed) in SKIPPING:
        assert undrawn > 0, "nothing skipped where whole tiles are outside the mask"


@triton.jit
def _lanes_kernel(words, out, lanes_threshold, HIGH_THRESHOLD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(words + offs).to(tl.uint32, bitcast=True)
    tl.store(out + offs, _keep_lanes(w, lanes_threshold, HIGH_THRESHOLD).to(tl.int32, bitcast=True))


@pytest.mark.parametrize("threshold", [1, 6554, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF])
def test_both_lanes_of_a_word_compare_like_two_compares(threshold):
    """_keep_lanes against `draw >= threshold` for every 16-bit draw in both lanes of a word."""
    low = torch.arange(1 << 16, dtype=torch.int64)
    high = (low * 40503 + 12345) % (1 << 16)          # every value in the high lane too, shuffled
    words = low | (high << 16)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).to(DEVICE)
    out = torch.empty_like(words)
    block = 1024
    _lanes_kernel[(words.numel() // block,)](words, out, (threshold & 0x7FFF) * 0x10001,
                                     HIGH_THRESHOLD=threshold >= 1 << 15, BLOCK=block)
    out = out.cpu().to(torch.int64) & 0xFFFFFFFF
    assert torch.equal((out >> 15) & 1 == 1, low >= threshold)
    assert torch.equal((out >> 31) & 1 == 1, high >= threshold)
    assert torch.equal(out & ~0x80008000, torch.zeros_like(out))


@triton.jit
def _philox_pair_kernel(ours, theirs, seed, head, batch, M: tl.constexpr, N: tl.constexpr):
    r = tl.arange(0, M)[:, None]
    c = tl.arange(0, N)[None, :]
    zero = r * 0 + c * 0
    off = r * N + c
    a = philox(seed, zero + c, zero + r, zero + head, zero + batch)
    b = tl.philox(seed, zero + c, zero + r, zero + head, zero + batch)
    for i in tl.static_range(4):
        tl.store(ours + i * M * N + off, a[i].to(tl.int32, bitcast=True))
        tl.store(theirs + i * M * N + off, b[i].to(tl.int32, bitcast=True))


@pytest.mark.parametrize("seed", [20240611, 2 ** 40 + 99, 2 ** 64 - 1])
def test_drawing_kernels_philox_gives_the_words_of_tl_philox(seed):
    """The drawing kernel's Philox (one widening multiply per product) against Triton's own, on a
    2-D tile like the attention kernels' anchor grids, and against kernels/philox.py."""
    from dash_plugin.kernels.philox import philox as reference
    m, n = 64, 16
    ours = torch.empty(4 * m * n, dtype=torch.int32, device=DEVICE)
    theirs = torch.empty_like(ours)
    _philox_pair_kernel[(1,)](ours, theirs, seed, 3, 1, M=m, N=n)
    assert torch.equal(ours, theirs)
    rows, cols = torch.arange(m)[:, None], torch.arange(n)[None, :]
    want = torch.stack([w.reshape(-1) for w in reference(seed, cols, rows, 3, 1)])
    want = torch.where(want >= 1 << 31, want - (1 << 32), want).to(torch.int32)
    assert torch.equal(ours.cpu().reshape(4, -1), want)


def test_draw_ahead_is_opt_in_and_bounded(monkeypatch):
    from dash_plugin.kernels.dropout_bits import draw_ahead
    monkeypatch.delenv("DASH_DROPOUT_MASK", raising=False)
    monkeypatch.delenv("DASH_DROPOUT_MASK_MAX_MB", raising=False)
    assert draw_ahead(1) is False                    # default: drawn in the kernels
    monkeypatch.setenv("DASH_DROPOUT_MASK", "ahead")
    assert draw_ahead(1024 * 2 ** 20) is True and draw_ahead(1024 * 2 ** 20 + 1) is False
    monkeypatch.setenv("DASH_DROPOUT_MASK_MAX_MB", "0.5")
    assert draw_ahead(2 ** 19) is True and draw_ahead(2 ** 19 + 1) is False
    monkeypatch.setenv("DASH_DROPOUT_MASK_MAX_MB", "100000")   # capped at 8 GiB (int32 offsets)
    assert draw_ahead(8192 * 2 ** 20) is True and draw_ahead(8192 * 2 ** 20 + 1) is False
    monkeypatch.setenv("DASH_DROPOUT_MASK_MAX_MB", "lots")
    with pytest.raises(ValueError, match="DASH_DROPOUT_MASK_MAX_MB='lots'"):
        draw_ahead(1)
    monkeypatch.setenv("DASH_DROPOUT_MASK", "precomputed")
    with pytest.raises(ValueError, match="DASH_DROPOUT_MASK='precomputed': expected one of inline, ahead"):
        draw_ahead(1)
