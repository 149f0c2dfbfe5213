"""The Triton kernels' dropout mask against kernels/philox.py, bit for bit.

`dropout_keep` builds the mask of a whole tile, [BLOCK_M, BLOCK_N] (forward, dQ kernel) or its
transpose (the KV kernel's S^T), from one Philox call per group of sixteen elements when the tile
holds whole 16x16 blocks, element by element otherwise. A tiny kernel stores that mask: under
TRITON_INTERPRET=1 on the CPU, compiled on a GPU machine (there these tests check what the
compiler made of the joins, reshapes and permutes). The forward/backward check against the
float64 reference runs in the interpreter; on a GPU tests/test_gpu_kernels.py has dropout cases.
"""
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dash_plugin import dispatch  # noqa: E402
from dash_plugin.kernels import attn_fwd, reference  # noqa: E402
from dash_plugin.kernels._triton_common import dropout_keep  # noqa: E402
from dash_plugin.kernels.philox import dropout_keep_mask, dropout_threshold  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")
DEVICE = "cpu" if INTERPRET else "cuda"


@triton.jit
def _store_mask(OUT, seed, m0, n0, head, batch, threshold,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    keep = dropout_keep(seed, m0, n0, head, batch, threshold, BLOCK_M, BLOCK_N, TRANSPOSED)
    if TRANSPOSED:
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    else:
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(OUT + offs, keep.to(tl.int8))


def _kernel_mask(seed, p, m0, n0, head, batch, bm, bn, transposed):
    """The kernel's mask as a [bm, bn] bool tensor (rows x columns), whatever the orientation."""
    out = torch.full((bm * bn,), 7, dtype=torch.int8, device=DEVICE)
    _store_mask[(1,)](out, seed, m0, n0, head, batch, dropout_threshold(p),
                      BLOCK_M=bm, BLOCK_N=bn, TRANSPOSED=transposed)
    out = out.cpu()
    assert set(out.unique().tolist()) <= {0, 1}
    return (out.view(bn, bm).T if transposed else out.view(bm, bn)).bool()


# Grouped path: the sm90 tiles of kernels/tile_config.py and the interpreter's; per-element
# path: tiles narrower than a 16x16 block.
TILES = [(16, 16), (32, 16), (16, 32), (64, 64), (64, 128), (128, 64), (8, 16), (16, 8), (4, 32)]


@pytest.mark.parametrize("transposed", [False, True], ids=["S", "S^T"])
@pytest.mark.parametrize("tile", TILES, ids=[f"{m}x{n}" for m, n in TILES])
def test_kernel_mask_is_the_reference_mask(tile, transposed):
    bm, bn = tile
    for seed, p, mt, nt, head, batch in [(2024, 0.25, 0, 0, 0, 0), (2 ** 40 + 12345, 0.37, 3, 5, 3, 2),
                                         (2 ** 63 - 1, 0.9, 7, 1, 31, 1000)]:
        m0, n0 = mt * bm, nt * bn
        got = _kernel_mask(seed, p, m0, n0, head, batch, bm, bn, transposed)
        ref = dropout_keep_mask(seed, p, batch, head, torch.arange(m0, m0 + bm)[:, None],
                                torch.arange(n0, n0 + bn)[None, :])
        assert torch.equal(got, ref), f"seed={seed} tile at ({m0}, {n0}): {(got != ref).sum().item()} bits differ"


def test_both_orientations_and_both_paths_agree_on_a_shared_region():
    """A 64x128 tile and its transpose, and the per-element path on 8x16 pieces of it."""
    seed, p = 99, 0.5
    whole = _kernel_mask(seed, p, 64, 128, 1, 0, 64, 128, False)
    assert torch.equal(whole, _kernel_mask(seed, p, 64, 128, 1, 0, 64, 128, True))
    for r in range(0, 64, 8):
        for c in range(0, 128, 16):
            piece = _kernel_mask(seed, p, 64 + r, 128 + c, 1, 0, 8, 16, (r + c) % 3 == 0)
            assert torch.equal(piece, whole[r:r + 8, c:c + 16])


@pytest.mark.skipif(not INTERPRET, reason="fp32 tl.dot runs as TF32 on the GPU; test_gpu_kernels.py covers it")
@pytest.mark.parametrize("schedule", ["ascending", "split"])
def test_forward_backward_with_dropout_match_the_float64_reference(schedule):
    """Forward (S tiles), KV kernel (S^T tiles) and, with split, the dQ kernel (S tiles), ragged
    lengths and a window (masked and interior tiles), against the reference's mask and scale."""
    g = torch.Generator().manual_seed(3)
    b, sq, sk, hq, hkv, d = 2, 72, 88, 2, 1, 32
    q = torch.randn(b, sq, hq, d, generator=g)
    k, v = (torch.randn(b, sk, hkv, d, generator=g) for _ in range(2))
    do = torch.randn(b, sq, hq, d, generator=g)
    kw = dict(softmax_scale=0.3, window_left=40, window_right=24, dropout_p=0.5, seed=2 ** 35 + 7)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    d64 = [t.double() for t in (q, k, v, do)]
    o64, lse64 = reference.attention_forward(*d64[:3], **kw)

    def rel(a, ref):
        return ((a.double() - ref).norm() / ref.norm()).item()

    assert rel(out, o64) < 1e-5
    grads = dispatch.attention_backward(do, q, k, v, out, lse, schedule=schedule, backend="triton", **kw)
    refs = reference.attention_backward(d64[3], *d64[:3], o64, lse64, **kw)
    for name, a, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert rel(a, ref) < 1e-5, f"{name}: {rel(a, ref):.2e}"
    other, _ = attn_fwd.attention_forward(q, k, v, **dict(kw, seed=kw["seed"] + 1))
    assert rel(other, o64) > 1e-2


def test_a_p_that_rounds_to_dropping_everything_is_refused():
    q = torch.randn(1, 16, 1, 16, device=DEVICE)
    for p in (1 - 2 ** -9, 1 - 2 ** -17):
        with pytest.raises(ValueError, match=f"dropout_p={p}.*rounds to dropping every element"):
            attn_fwd.attention_forward(q, q, q, softmax_scale=0.25, dropout_p=p, seed=1)
        with pytest.raises(ValueError, match="rounds to dropping every element"):
            reference.attention_forward(q.cpu().double(), q.cpu().double(), q.cpu().double(), softmax_scale=0.25,
                                        dropout_p=p, seed=1)


def test_a_p_that_rounds_to_no_dropout_is_refused():
    """p below 2**-9 would silently drop nothing at the mask's 2**-8 resolution."""
    q = torch.randn(1, 16, 1, 16, device=DEVICE)
    for p in (1e-6, 2 ** -9):
        with pytest.raises(ValueError, match=r"rounds to no dropout at all.*must be 0 or above 0.001953125"):
            attn_fwd.attention_forward(q, q, q, softmax_scale=0.25, dropout_p=p, seed=1)
    q = torch.randn(1, 64, 1, 16, device=DEVICE)
    out, _ = attn_fwd.attention_forward(q, q, q, softmax_scale=0.25, dropout_p=2 ** -8, seed=1)   # one step: runs
    ref, _ = reference.attention_forward(*(q.cpu().double(),) * 3, softmax_scale=0.25, dropout_p=2 ** -8, seed=1)
    # float32 arithmetic in the interpreter; on a GPU the kernel's float32 products run as TF32
    # (10-bit mantissas, about 1e-3 here)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < (1e-5 if INTERPRET else 5e-3)
