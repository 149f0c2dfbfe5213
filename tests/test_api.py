"""The public API: results through the op equal the reference; bad input gets clear errors."""
import pytest
import torch

import dash_plugin
from dash_plugin.kernels import reference


def qkv(b=2, sq=40, sk=40, hq=4, hkv=2, d=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    mk = lambda s, h: torch.randn(b, s, h, d, generator=g, dtype=dtype)  # noqa: E731
    return mk(sq, hq), mk(sk, hkv), mk(sk, hkv)


def test_dense_forward_backward_equals_reference_bitwise():
    q, k, v = (t.requires_grad_() for t in qkv())
    out, lse = dash_plugin.flash_attention(q, k, v, causal=True, window=(9, -1), softcap=3.0, return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out, ref_lse = reference.attention_forward(q.detach(), k.detach(), v.detach(), softmax_scale=32 ** -0.5,
                                                   causal=True, window_left=9, softcap=3.0)
    grads = reference.attention_backward(dout, q.detach(), k.detach(), v.detach(), ref_out, ref_lse,
                                         softmax_scale=32 ** -0.5, causal=True, window_left=9, softcap=3.0)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        assert torch.equal(got, want)


def test_varlen_equals_per_sequence_dense_calls():
    lengths = [5, 17, 1, 30]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n, 2, 32, generator=g) for n in lengths]
    cu = torch.tensor([0, 5, 22, 23, 53], dtype=torch.int32)
    packed = torch.cat(seqs)
    out = dash_plugin.flash_attention(packed, packed, packed, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for s, a, b in zip(seqs, cu[:-1].tolist(), cu[1:].tolist()):
        dense = dash_plugin.flash_attention(s[None], s[None], s[None], causal=True)[0]
        torch.testing.assert_close(out[a:b], dense, rtol=0, atol=1e-6)


def test_dropout_same_seed_same_bits_and_seed_from_torch_generator():
    q, k, v = qkv()
    a = dash_plugin.flash_attention(q, k, v, dropout_p=0.3, dropout_seed=5)
    b = dash_plugin.flash_attention(q, k, v, dropout_p=0.3, dropout_seed=5)
    c = dash_plugin.flash_attention(q, k, v, dropout_p=0.3, dropout_seed=6)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(3)
    d = dash_plugin.flash_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    e = dash_plugin.flash_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(d, e)


def test_non_contiguous_inputs():
    q, k, v = qkv()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, H, S, D) memory
    assert not qt.is_contiguous()
    torch.testing.assert_close(dash_plugin.flash_attention(qt, k, v), dash_plugin.flash_attention(q, k, v), rtol=0, atol=0)


BAD = [
    (dict(q=torch.randn(2, 8, 4, 32, dtype=torch.float16)), TypeError, "share one dtype"),
    (dict(q=torch.randn(2, 8, 4, 32).int()), TypeError, r"q.dtype=torch.int32 is not supported"),
    (dict(q=torch.randn(2, 8, 4, 0), k=torch.randn(2, 8, 2, 0), v=torch.randn(2, 8, 2, 0)), ValueError, r"head_dim=0 .* allowed: 1..256"),
    (dict(q=torch.randn(2, 8, 4, 300), k=torch.randn(2, 8, 2, 300), v=torch.randn(2, 8, 2, 300)), ValueError, r"head_dim=300"),
    (dict(q=torch.randn(2, 8, 3, 32)), ValueError, r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    (dict(q=torch.randn(3, 8, 4, 32)), ValueError, "same batch size"),
    (dict(q=torch.randn(8, 4, 32)), ValueError, r"expected 4 dims \(batch, seqlen, heads, head_dim\)"),
    (dict(v=torch.randn(2, 9, 2, 32)), ValueError, "k and v must have the same shape"),
    (dict(window=(3,)), ValueError, r"window=\(3,\) must be a pair"),
    (dict(window=(-2, 0)), ValueError, ">= 0, or -1"),
    (dict(causal=True, window=(4, 2)), ValueError, "causal allows no keys to the right"),
    (dict(softcap=-1.0), ValueError, "softcap=-1.0"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p=1.0 must be in \[0, 1\)"),
    (dict(dropout_p=1 - 2 ** -17), ValueError, r"dropout_p=0.99999237\d* rounds to dropping every element"),
    (dict(dropout_p=1e-4), ValueError, r"dropout_p=0.0001 rounds to no dropout at all: the mask's resolution is "
                                       r"2\*\*-8, so dropout_p must be 0 or above 0.001953125 and below 0.998046875"),
    (dict(softmax_scale=0), ValueError, "softmax_scale=0"),
    (dict(softcap=float("nan")), ValueError, r"softcap=nan must be a finite number >= 0"),
    (dict(softcap=float("inf")), ValueError, r"softcap=inf must be a finite number >= 0"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale=nan must be a finite number > 0"),
    (dict(softmax_scale=float("inf")), ValueError, r"softmax_scale=inf must be a finite number > 0"),
    (dict(softcap="1"), ValueError, r"softcap='1' must be a finite number >= 0"),
    (dict(softcap=1e39), ValueError, r"softcap=1e\+39 must be 0 \(off\) or in 2\*\*-126..2\*\*126 \(the scores are float32\)"),
    (dict(softcap=1e-50), ValueError, r"softcap=1e-50 must be 0 \(off\) or in 2\*\*-126"),
    (dict(softmax_scale=1e39), ValueError, r"softmax_scale=1e\+39 must be in 2\*\*-126..2\*\*126 \(the scores are "
                                           r"float32\), or None for 1/sqrt\(head_dim\)"),
    (dict(softmax_scale=1e-39), ValueError, r"softmax_scale=1e-39 must be in 2\*\*-126"),
    (dict(softmax_scale=2.0 ** 100, softcap=2.0 ** -100), ValueError,
     r"softmax_scale / softcap = 1.2676506002282294e\+30 / 7.888609052210118e-31 must be at most 2\*\*126"),
    (dict(window=(2 ** 63, -1)), ValueError, r"window=\(9223372036854775808, -1\): each side must be an int in -1..2\*\*63-1"),
    (dict(window=(4, True)), ValueError, r"window=\(4, True\) must be a pair of ints"),
    (dict(dropout_p=0.1, dropout_seed=2 ** 63), ValueError, r"dropout_seed=9223372036854775808 must be an int in 0..2\*\*63-1"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, r"dropout_seed=-1 must be an int in 0..2\*\*63-1"),
    (dict(dropout_p=0.1, dropout_seed="3"), ValueError, r"dropout_seed='3' must be an int in 0..2\*\*63-1"),
    (dict(q=torch.randn(2, 8, 4, 32, device="meta")), ValueError, r"q is on the meta device"),
    (dict(schedule="fastest"), ValueError, "schedule='fastest'.*allowed: auto, atomic"),
    (dict(schedule="atomic", deterministic=True), ValueError, "not deterministic"),
    (dict(causal="False"), ValueError, r"causal='False' must be True or False"),
    (dict(causal=1), ValueError, r"causal=1 must be True or False"),
    (dict(return_lse="no"), ValueError, r"return_lse='no' must be True or False"),
    (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q=3 is for packed \(varlen\) calls; this dense call's length is 8"),
    (dict(model_config="bogus"), ValueError, r"model_config='bogus' must be a model config"),
    (dict(model_config=["x"]), ValueError, r"model_config=\['x'\] must be a model config"),
    (dict(max_seqlen_q="8"), ValueError, r"max_seqlen_q='8' must be an int in 0..2\*\*63-1"),
    (dict(max_seqlen_k=8.0), ValueError, r"max_seqlen_k=8.0 must be an int in 0..2\*\*63-1"),
]


@pytest.mark.parametrize("window, same_as", [((-1, 2 ** 63 - 1), (-1, -1)), ((2 ** 63 - 1, 2 ** 63 - 1), (-1, -1)),
                                             ((2, 2 ** 63 - 4), (2, -1)), ((2 ** 63 - 1, 3), (-1, 3))])
def test_a_window_side_longer_than_both_sequences_is_unbounded(window, same_as):
    """Sides near 2**63 overflowed the position arithmetic and gave wrong rows: a side that reaches
    past both sequences sees every key on its side, exactly as -1."""
    q, k, v = qkv(sq=12, sk=8)
    want = dash_plugin.flash_attention(q, k, v, window=same_as)
    assert torch.equal(dash_plugin.flash_attention(q, k, v, window=window), want)


@pytest.mark.parametrize("kwargs,exc,match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input_errors_name_argument_value_and_allowed(kwargs, exc, match):
    q, k, v = qkv(sq=8, sk=8)
    args = dict(q=q, k=k, v=v)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        dash_plugin.flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("kwargs", [dict(softcap=2.0 ** -126), dict(softcap=2.0 ** 126), dict(softmax_scale=2.0 ** -126),
                                    dict(softmax_scale=2.0 ** 100, softcap=2.0 ** -26)], ids=str)
def test_scalars_at_the_edges_of_their_range_compute_float32_right(kwargs):
    """Out of range they became 0 or inf in float32 and every score NaN (refused above); at the
    edges the float32 call is finite and gives the float64 call's result."""
    q, k, v = (t.requires_grad_() for t in qkv(sq=8, sk=8))
    out = dash_plugin.flash_attention(q, k, v, causal=True, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = dash_plugin.flash_attention(*wide, causal=True, **kwargs)
    want_grads = torch.autograd.grad(want, wide, torch.ones_like(want))
    for got, ref in zip((out, *grads), (want, *want_grads)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_meta_and_nested_tensors_are_refused_clearly():
    meta = torch.randn(2, 8, 4, 32, device="meta")
    with pytest.raises(ValueError, match=r"q is on the meta device.*allowed: devices with data"):
        dash_plugin.flash_attention(meta, meta[:, :, :2], meta[:, :, :2])
    nested = torch.nested.nested_tensor([torch.randn(3, 2, 32), torch.randn(5, 2, 32)], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"q is a nested tensor.*cu_seqlens"):
        dash_plugin.flash_attention(nested, nested, nested)


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("bad", ["6", 6.0, 2 ** 63, True])
def test_max_seqlen_must_be_an_int(name, bad):
    with pytest.raises(ValueError, match=rf"{name}={bad!r} must be an int"):
        _varlen(torch.tensor([0, 4, 10], dtype=torch.int32), **{name: bad})


def test_cu_seqlens_on_the_meta_device_are_refused_by_name():
    with pytest.raises(ValueError, match=r"cu_seqlens_q is on the meta device"):
        _varlen(torch.tensor([0, 4, 10], dtype=torch.int32, device="meta"))


def _varlen(cu_q, cu_k=None, **kw):
    x = torch.randn(10, 2, 32)
    return dash_plugin.flash_attention(x, x, x, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q if cu_k is None else cu_k, **kw)


@pytest.mark.parametrize("cu,match", [
    (torch.tensor([0, 4, 10], dtype=torch.int64), r"cu_seqlens_q.dtype=torch.int64; allowed: torch.int32"),
    (torch.tensor([0, 6, 4, 10], dtype=torch.int32), "never decrease"),
    (torch.tensor([1, 4, 10], dtype=torch.int32), "must start at 0"),
    (torch.tensor([0, 4, 9], dtype=torch.int32), r"cu_seqlens_q\[-1\]=9 must equal the number of tokens \(10\)"),
    (torch.tensor([[0, 10]], dtype=torch.int32), r"expected \(batch \+ 1,\)"),
])
def test_bad_cu_seqlens(cu, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _varlen(cu)


def test_varlen_argument_pairing_and_max_seqlen():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    x = torch.randn(10, 2, 32)
    with pytest.raises(ValueError, match="given together"):
        dash_plugin.flash_attention(x, x, x, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match=r"max_seqlen_q=3 is smaller than the longest sequence \(6\)"):
        _varlen(cu, max_seqlen_q=3)
    with pytest.raises(ValueError, match="has 2 entries but cu_seqlens_q has 3"):
        _varlen(cu, torch.tensor([0, 10], dtype=torch.int32))


@pytest.mark.parametrize("varlen", [False, True])
def test_float64_is_float64_accurate_lse_included(varlen):
    """float64 inputs keep the LSE in float64 (it was rounded to fp32, so the gradients were only
    fp32-accurate): out, lse and every gradient agree with the float64 math oracle to ~1e-13."""
    from tests.math_attention import math_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, h, 24, generator=g, dtype=torch.float64).requires_grad_() for h in (4, 2, 2))
    dout = torch.randn(40, 4, 24, generator=g, dtype=torch.float64)
    want_out, want_lse = math_attention(q, k, v, causal=True, softcap=5.0)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    if varlen:
        cu = torch.tensor([0, 40], dtype=torch.int32)
        out, lse = dash_plugin.flash_attention(q, k, v, causal=True, softcap=5.0, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                               return_lse=True)
    else:
        out, lse = dash_plugin.flash_attention(q[None], k[None], v[None], causal=True, softcap=5.0, return_lse=True)
        out, lse = out[0], lse[0]
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-13)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-13)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_effective_dropout_p_is_the_p_a_call_gets():
    """The mask takes p in steps of 2**-8: effective_dropout_p says which. A forward's read-out
    (q = k = 0, V = identity: out = keep * scale / S_k) is the definition's mask exactly, and its
    kept values carry the scale of the rounded p, 256 / 230, not 1 / 0.9."""
    from tests.math_attention import keep_mask
    assert dash_plugin.effective_dropout_p(0.1) == 26 / 256
    assert dash_plugin.effective_dropout_p(0.0) == 0.0 and dash_plugin.effective_dropout_p(0.25) == 0.25
    for bad in ("a", None, True):   # named, not a TypeError from a comparison
        with pytest.raises(ValueError, match=rf"dropout_p={bad!r} must be in \[0, 1\)"):
            dash_plugin.effective_dropout_p(bad)
    b, h, sq, d = 2, 4, 512, 16
    q = torch.zeros(b, sq, h, d, dtype=torch.float64)
    v = torch.eye(d, dtype=torch.float64).view(1, d, 1, d).expand(b, d, h, d)
    out = dash_plugin.flash_attention(q, torch.zeros(b, d, h, d, dtype=torch.float64), v, dropout_p=0.1,
                                      dropout_seed=3)
    kept = out != 0
    assert torch.equal(kept, keep_mask(3, 0.1, b, h, sq, d).transpose(1, 2))
    assert torch.allclose(out[kept], torch.full_like(out[kept], 256 / 230 / d), rtol=1e-12)
