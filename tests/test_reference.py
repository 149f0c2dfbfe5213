"""The blockwise reference against float64 math attention, feature by feature."""
import random

import pytest
import torch

from dash_plugin.kernels import reference
from dash_plugin.kernels.philox import (dropout_draws, dropout_keep_mask, dropout_threshold, effective_dropout_p,
                                        four_draws_bias, four_draws_kept, keep_scale, philox, threshold_above_half)
from tests.math_attention import math_attention

CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal_q_shorter": dict(causal=True, sq=37, sk=150),
    "causal_q_longer": dict(causal=True, sq=150, sk=37),
    "window": dict(window_left=17, window_right=5),
    "causal_window": dict(causal=True, window_left=23),
    "softcap": dict(softcap=4.0, causal=True),
    "gqa": dict(hq=6, hkv=2, causal=True),
    "mqa": dict(hq=4, hkv=1),
    "dropout": dict(dropout_p=0.25, seed=1234),
    "head_dim_48": dict(d=48, causal=True),
}


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run(case, varlen_lengths=None):
    case = dict(case)
    sq, sk = case.pop("sq", 130), case.pop("sk", 130)
    hq, hkv, d = case.pop("hq", 2), case.pop("hkv", 2), case.pop("d", 32)
    scale = d ** -0.5
    lengths = varlen_lengths or [(sq, sk)]
    seqs = []
    for b, (lq, lk) in enumerate(lengths):
        q = torch.randn(lq, hq, d, dtype=torch.float64, requires_grad=True)
        k = torch.randn(lk, hkv, d, dtype=torch.float64, requires_grad=True)
        v = torch.randn(lk, hkv, d, dtype=torch.float64, requires_grad=True)
        out, lse = math_attention(q, k, v, softmax_scale=scale, batch_index=b, **case)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        seqs.append(((q, k, v, dout), (out.detach(), lse.detach()), grads))
    f32 = lambda i: torch.cat([s[0][i].detach().float() for s in seqs])  # noqa: E731
    q, k, v, dout = f32(0), f32(1), f32(2), f32(3)
    if varlen_lengths:
        cu_q = torch.tensor([0] + [sum(lq for lq, _ in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
        cu_k = torch.tensor([0] + [sum(lk for _, lk in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        q, k, v, dout = (t[None] for t in (q, k, v, dout))
        kw = {}
    out, lse = reference.attention_forward(q, k, v, softmax_scale=scale, block_q=48, **kw, **case)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse, softmax_scale=scale, block_q=48, **kw, **case)
    flat = lambda t: t.reshape(-1, *t.shape[-2:]) if not varlen_lengths else t  # noqa: E731
    want_out = torch.cat([s[1][0] for s in seqs])
    want_lse = torch.cat([s[1][1] for s in seqs], dim=1)
    got_lse = lse if varlen_lengths else lse[0]
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isinf(got_lse), ~finite), "empty rows must have lse = +inf, and only they"
    assert rel_err(flat(out), want_out) < 1e-5
    assert rel_err(got_lse[finite], want_lse[finite]) < 1e-5
    for got, i in ((dq, 0), (dk, 1), (dv, 2)):
        want = torch.cat([s[2][i] for s in seqs])
        assert rel_err(flat(got), want) < 1e-5, f"gradient {'qkv'[i]}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_matches_float64_math(name):
    torch.manual_seed(0)
    _run(CASES[name])


@pytest.mark.parametrize("name", ["full", "causal", "causal_q_shorter", "window", "gqa", "dropout", "softcap"])
def test_varlen_matches_float64_math(name):
    torch.manual_seed(1)
    case = {k: v for k, v in CASES[name].items() if k not in ("sq", "sk")}
    lengths = [(70, 70), (1, 1), (129, 129), (33, 90)] if name != "causal_q_shorter" else [(20, 64), (64, 100)]
    _run(case, varlen_lengths=lengths)


def test_rows_with_no_visible_key_are_zero_with_infinite_lse():
    # causal with S_q > S_k: the first S_q - S_k rows see nothing (bottom-right alignment).
    q, k, v = torch.randn(1, 10, 2, 32), torch.randn(1, 4, 2, 32), torch.randn(1, 4, 2, 32)
    out, lse = reference.attention_forward(q, k, v, softmax_scale=0.2, causal=True)
    assert torch.equal(out[0, :6], torch.zeros_like(out[0, :6]))
    assert torch.isinf(lse[0, :, :6]).all() and (lse[0, :, :6] > 0).all()
    assert torch.isfinite(lse[0, :, 6:]).all()
    dq, dk, dv = reference.attention_backward(torch.randn_like(out), q, k, v, out, lse, softmax_scale=0.2, causal=True)
    assert torch.equal(dq[0, :6], torch.zeros_like(dq[0, :6])) and torch.isfinite(dk).all()


def test_memory_is_blockwise_not_quadratic():
    # A 4096 x 4096 score matrix per head would be 64 MiB in fp32; blocks of 128 rows keep it at 2 MiB.
    # We check the block structure directly: each _Block holds (heads, rows<=block, S_k) scores.
    seen = []
    original = reference._Block.__init__

    def spy(self, *a, **kw):
        original(self, *a, **kw)
        seen.append(tuple(self.s.shape))
    reference._Block.__init__ = spy
    try:
        q = torch.randn(1, 1000, 1, 32)
        reference.attention_forward(q, q, q, softmax_scale=0.1, block_q=128)
    finally:
        reference._Block.__init__ = original
    assert max(s[2] for s in seen) == 128 and len(seen) == 8


def test_dropout_mask_is_a_pure_function_of_its_counters():
    m1 = dropout_keep_mask(7, 0.5, 0, torch.arange(2).view(2, 1, 1), torch.arange(8).view(1, 8, 1), torch.arange(8).view(1, 1, 8))
    m2 = dropout_keep_mask(7, 0.5, 0, 1, torch.arange(8).view(8, 1), torch.arange(8).view(1, 8))
    assert torch.equal(m1[1], m2)
    assert not torch.equal(m1, dropout_keep_mask(8, 0.5, 0, torch.arange(2).view(2, 1, 1), torch.arange(8).view(1, 8, 1), torch.arange(8).view(1, 1, 8)))
    big = dropout_keep_mask(3, 0.3, 0, 0, torch.arange(256).view(-1, 1), torch.arange(256).view(1, -1))
    assert abs(big.float().mean().item() - 0.7) < 0.01
    # The transposed index layout (the backward's S^T tiles) gives the transposed mask.
    rows, cols = torch.arange(40, 72), torch.arange(16, 64)
    assert torch.equal(dropout_keep_mask(3, 0.3, 2, 5, rows[:, None], cols[None, :]),
                       dropout_keep_mask(3, 0.3, 2, 5, rows[None, :], cols[:, None]).T)


_M32 = 0xFFFFFFFF


def _philox_ints(seed, counter, rounds=7):
    """Philox4x32-R on plain Python ints (Random123's philox4x32; key = the seed's 32-bit halves)."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1, c2, c3 = counter
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _M32, (p0 >> 32) ^ c3 ^ k1, p0 & _M32
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def _draw_ints(seed, b, h, i, j):
    """The 8-bit draw of element (i, j) of (batch b, head h), written from the spec in
    kernels/philox.py: counter (j & ~9, i & ~9, h, b), word 2*bit0(i) + bit0(j), byte
    2*bit3(i) + bit3(j), Philox4x32-7."""
    words = _philox_ints(seed, (j & ~9, i & ~9, h, b))
    word = words[2 * (i & 1) + (j & 1)]
    return (word >> (8 * (2 * ((i >> 3) & 1) + ((j >> 3) & 1)))) & 0xFF


def test_dropout_draws_match_a_scalar_implementation_of_the_spec():
    rng = random.Random(20240611)
    cases = [(rng.randrange(2 ** 63), rng.randrange(4096), rng.randrange(128), rng.randrange(1 << 20),
              rng.randrange(1 << 20)) for _ in range(300)]
    cases += [(0, 0, 0, i, j) for i in range(16) for j in range(16)]   # one whole 16x16 block
    cases += [(2 ** 63 - 1, 65534, 255, 2 ** 31 - 1, 2 ** 31 - 9)]
    seeds, bs, hs, is_, js = zip(*cases)
    for seed in set(seeds):
        idx = [n for n, s in enumerate(seeds) if s == seed]
        got = dropout_draws(seed, torch.tensor([bs[n] for n in idx]), torch.tensor([hs[n] for n in idx]),
                            torch.tensor([is_[n] for n in idx]), torch.tensor([js[n] for n in idx]))
        assert got.tolist() == [_draw_ints(seed, bs[n], hs[n], is_[n], js[n]) for n in idx]


def test_one_philox_call_serves_a_group_of_sixteen():
    """The sixteen draws of a call are rows {i, i+1, i+8, i+9} x columns {j, j+1, j+8, j+9}: all
    sixteen bytes of the four words, each once; and each word is one row parity and one column
    parity (what lets a `wgmma` thread use two whole words)."""
    words = [int(w) for w in philox(99, 32, 16, 3, 1)]
    rows, cols = torch.tensor([16, 17, 24, 25]), torch.tensor([32, 33, 40, 41])
    group = dropout_draws(99, 1, 3, rows.view(4, 1), cols.view(1, 4))
    assert sorted(group.flatten().tolist()) == sorted((w >> s) & 0xFF for w in words for s in (0, 8, 16, 24))
    for rp in range(2):
        for cp in range(2):
            quad = group[rp::2, cp::2].flatten().tolist()   # rows of parity rp x columns of parity cp
            assert quad == [(words[2 * rp + cp] >> (8 * b)) & 0xFF for b in range(4)]


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_dropout_keep_rate_is_one_minus_the_threshold(p):
    n = 1024
    keep = dropout_keep_mask(11, p, 3, torch.arange(2).view(2, 1, 1), torch.arange(n).view(1, n, 1),
                             torch.arange(n).view(1, 1, n))
    rate = 1 - dropout_threshold(p) / 256
    sigma = (rate * (1 - rate) / keep.numel()) ** 0.5
    assert abs(keep.double().mean().item() - rate) < 5 * sigma


def test_keep_scale_is_the_exact_inverse_keep_rate():
    assert dropout_threshold(0.1) == 26 and dropout_threshold(0.3) == 77
    assert effective_dropout_p(0.1) == 26 / 256 and effective_dropout_p(0.5) == 0.5
    assert keep_scale(0.0) == 1.0
    assert keep_scale(0.5) == 2.0
    assert keep_scale(0.25) == 4 / 3
    assert keep_scale(0.1) == 256 / (256 - 26)   # not 1 / 0.9
    assert keep_scale(0.3) == 256 / (256 - 77)
    assert keep_scale(1 - 2 ** -8) == 256.0         # one draw value of 2**8 kept
    for p in (1 - 2 ** -9, 1 - 2 ** -10):
        with pytest.raises(ValueError, match="rounds to dropping every element"):
            keep_scale(p)
    for p in (2 ** -9, 1e-6):
        with pytest.raises(ValueError, match="rounds to no dropout at all"):
            effective_dropout_p(p)
    assert dropout_threshold(2 ** -9 + 1e-12) == 1 and dropout_threshold(1 - 2 ** -9 - 1e-12) == 255
    for p in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
            effective_dropout_p(p)


def test_four_draws_at_once_decide_as_one_compare_each():
    """The Hopper forward's compare of four 8-bit draws at once (four_draws_kept) against
    draw >= threshold, for every threshold a p can give and every draw value in every byte, the
    other bytes holding values that would carry into it if the sums were not kept apart."""
    draws = torch.arange(256, dtype=torch.int64)
    for threshold in range(1, 256):
        above = threshold > 128
        bias = four_draws_bias(threshold, above)
        for byte in range(4):
            for others in (0x00, 0xFF, 0x7F, 0x80):
                filler = sum(others << (8 * b) for b in range(4) if b != byte)
                got = four_draws_kept((draws << (8 * byte)) | filler, bias, above)
                assert torch.equal(got >> (8 * byte + 7) & 1 == 1, draws >= threshold), (threshold, byte, others)
                assert torch.equal(got & ~(0x80 << (8 * byte)) & 0xFFFFFFFF,
                                   torch.full_like(got, sum(((others >= threshold) << (8 * b + 7))
                                                            for b in range(4) if b != byte)))
    assert [threshold_above_half(p) for p in (0.1, 0.5, 0.51, 0.99)] == [False, False, True, True]


def test_philox_known_answers():
    """Random123's test vectors (kat_vectors): Philox4x32-10 and the mask's Philox4x32-7, counter
    and key all zeros and all ones; the scalar spec above agrees."""
    ones = 0xFFFFFFFF
    assert [int(w) for w in philox(0, 0, 0, 0, 0, n_rounds=10)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert [int(w) for w in philox(0, 0, 0, 0, 0)] == [0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48]
    assert [int(w) for w in philox(2 ** 64 - 1, ones, ones, ones, ones)] == [0x5207DDC2, 0x45165E59, 0x4D8EE751,
                                                                               0x8C52F662]
    assert list(_philox_ints(2 ** 64 - 1, (ones,) * 4)) == [0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662]
