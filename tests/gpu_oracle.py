"""Helpers shared by the GPU tests of the backends (tests/test_gpu_*.py).

- the float64 oracle (tests/math_attention.py, per sequence, autograd for the gradients) and the
  error bar of the FlashAttention papers: twice the error of plain PyTorch math in the inputs'
  dtype (bf16; fp16 in the Triton tests) against it. One path, sequence by sequence
  (`packed_oracle_and_bf16_math`); `oracle_of_call` gives it any call's keywords, dense or
  packed, and `oracle_and_bf16_math` shapes its results as a dense batch's;
- `assert_within_bar`: a kernel's result against the oracle, under that bar
  (`assert_call_matches_oracle`: a whole call's out and gradients);
- `assert_same_sums`: two results of one kernel's fp32 sums added in different orders (two
  schedules) agree element by element to one rounding step of their dtype;
- the dropout keep-mask of a dense batch, as kernels/philox.py defines it;
- whether the Hopper backend can run here (an sm90 GPU and the `hopper` extra).

Importable without CUDA (nothing runs at import).
"""
from typing import NamedTuple

import pytest
import torch

from dash_plugin.kernels import hopper
from tests.math_attention import keep_mask, math_attention  # noqa: F401 (keep_mask: the tests import it from here)


def hopper_ready() -> bool:
    """The Hopper backend runs here: an sm90 GPU and the `hopper` extra."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and hopper.available()


HOPPER_SKIP = pytest.mark.skipif(not hopper_ready(), reason="needs an sm90 GPU and the hopper extra")


def rel(a, b):
    """Relative L2 error of a (any device, any dtype) against the float64 CPU tensor b."""
    return ((a.double().cpu() - b).norm() / b.norm()).item()


def assert_error_within_bar(name, err, bar):
    """An error `err` within twice plain math's error `bar` against the same reference."""
    assert 0 < bar < float("inf"), f"{name}: plain math's error {bar} is no bar"
    assert err <= 2 * bar, f"{name}: error {err:.2e} > 2 x plain math's {bar:.2e}"


def assert_within_bar(name, got, want, bar):
    """`got` (any device and dtype, reshaped as `want`) within twice plain math's error `bar`
    of the float64 oracle `want`."""
    assert torch.isfinite(got).all(), f"{name}: NaN/inf"
    assert_error_within_bar(name, rel(got.reshape(want.shape), want), bar)


def assert_call_matches_oracle(q, k, v, out, **kw):
    """A call's out (from q, k, v with requires_grad, keywords `kw` as oracle_of_call takes them)
    and its gradients for a random upstream gradient, each within the oracle's bar."""
    do = torch.randn(out.shape, device=out.device, dtype=out.dtype,
                     generator=torch.Generator(device=out.device).manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), do)
    oracle = oracle_of_call(q.detach(), k.detach(), v.detach(), do, **kw)
    for name, got, want, bar in zip(("out", "dq", "dk", "dv"), (out.detach(), *grads), (oracle.out, *oracle.grads),
                                    (oracle.out_bar, *oracle.grad_bars)):
        assert_within_bar(name, got, want, bar)


def same_sums_excess(a, b) -> float:
    """How far two bf16/fp16 results of the same fp32 sums, added in different orders, part:
    the largest |a - b| over one rounding step (ulp) of the larger of the two, plus a floor of
    1e-3 x rms(b). The two fp32 sums differ by fp32 rounding, far below a step of the output
    dtype, so each element rounds to the same value or a neighbour (<= 1). A contribution lost
    or added twice moves its elements by about rms / sqrt(contributions), tens of steps; the
    floor covers elements near zero, whose step is smaller than the fp32 sums' own error."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    eps = torch.finfo(a.dtype).eps                # one step at magnitudes in [1, 2)
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "NaN/inf"
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))   # |x| in [2**(e-1), 2**e)
    step = eps * torch.ldexp(torch.ones_like(a), exponent - 1)
    floor = 1e-3 * b.pow(2).mean().sqrt()
    return ((a - b).abs() / (step + floor)).max().item()


def assert_same_sums(name, a, b):
    excess = same_sums_excess(a, b)
    print(f"[same sums] {name}: {excess:.3f} of the allowance")   # the margin, for the records (-rP)
    assert excess <= 1, f"{name}: differs by {excess:.2f} x (one rounding step + floor) somewhere"


class Oracle(NamedTuple):
    out: torch.Tensor        # float64 on the CPU: (B, S, H_q, D) dense, (T, H_q, D) packed
    grads: list              # dq, dk, dv, float64 on the CPU, shaped as q, k, v (packed: as out)
    out_bar: float           # rel error of plain PyTorch math's out against `out`
    grad_bars: list          # ... of its dq, dk, dv against `grads`
    lse: torch.Tensor        # float64 (B, H_q, S) dense, (H_q, T) packed; +inf where no key is seen


def oracle_and_bf16_math(q, k, v, do, *, causal, window_left=-1, window_right=-1, softcap=0.0,
                         dropout_p=0.0, seed=0):
    """The float64 oracle of dense (B, S, H, D) CUDA inputs (equal lengths) and the error of plain
    PyTorch math in their dtype (the same mask, softcap and dropout mask) against it: the bar,
    times 2, that a kernel's out / dq / dk / dv must stay under. Shaped as the inputs; lse
    (B, H_q, S)."""
    b, s, hq, _ = q.shape
    o = oracle_of_call(q, k, v, do, causal=causal, window_left=window_left, window_right=window_right,
                       softcap=softcap, dropout_p=dropout_p, seed=seed)
    return Oracle(o.out.view(q.shape), [g.view(t.shape) for g, t in zip(o.grads, (q, k, v))], o.out_bar,
                  o.grad_bars, o.lse.view(hq, b, s).transpose(0, 1))


def packed_oracle_and_bf16_math(q, k, v, do, cu_seqlens_q, cu_seqlens_k, **mask) -> Oracle:
    """`oracle_and_bf16_math` for packed (T, H, D) CUDA inputs (bf16 or fp16; the plain math runs
    in that dtype on the GPU): sequence by sequence, masks bottom-right aligned where a sequence's
    lengths differ (a dense batch of unequal lengths is the packed batch of its rows); a row that
    sees no key gives 0. `mask`: math_attention's keywords (causal, softmax_scale, window_left/right,
    softcap, dropout_p, seed); the dropout mask of sequence b is that of batch index b."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    runs, lses = {}, []   # dtype -> (outs, dq, dk, dv) per sequence; float64 lse per sequence
    for dtype, device in ((torch.float64, "cpu"), (q.dtype, q.device)):
        parts = [[], [], [], []]
        for b in range(len(cq) - 1):
            rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            qi, ki, vi = (t[r].detach().to(device, dtype).requires_grad_() for t, r in ((q, rq), (k, rk), (v, rk)))
            o, lse = math_attention(qi, ki, vi, batch_index=b, **mask)   # dropout keys its mask by sequence
            if dtype == torch.float64:
                lses.append(lse.detach())
            if o.numel() and ki.shape[0]:
                grads = torch.autograd.grad(o, (qi, ki, vi), do[rq].to(device, dtype))
            else:   # an empty sequence: nothing flows
                grads = [torch.zeros_like(t) for t in (qi, ki, vi)]
            for part, x in zip(parts, (o.detach(), *grads)):
                part.append(x)
        runs[dtype] = [torch.cat(p) for p in parts]
    ref, math = runs[torch.float64], runs[q.dtype]
    return Oracle(ref[0], ref[1:], rel(math[0], ref[0]), [rel(x, r) for x, r in zip(math[1:], ref[1:])],
                  torch.cat(lses, dim=1))


def flat(t):
    """A dense (B, S, ...) tensor as the packed (B * S, ...) one of its rows."""
    return t.reshape(-1, *t.shape[2:])


def oracle_of_call(q, k, v, do, **kw) -> Oracle:
    """The oracle of a dense (B, S, H, D) or packed (T, H, D) call with the kernel's keywords
    (cu_seqlens_q/k and max_seqlen_q/k for packed calls, softmax_scale and the mask's), through
    `packed_oracle_and_bf16_math`: out and grads packed (T, H, D), lse (H_q, T)."""
    if kw.get("cu_seqlens_q") is not None:
        cu = kw["cu_seqlens_q"], kw["cu_seqlens_k"]
    else:
        cu = [torch.arange(q.shape[0] + 1, device=q.device, dtype=torch.int32) * n for n in (q.shape[1], k.shape[1])]
        q, k, v, do = (flat(t) for t in (q, k, v, do))
    mask = {n: x for n, x in kw.items() if not n.startswith(("cu_seqlens", "max_seqlen"))}
    return packed_oracle_and_bf16_math(q, k, v, do, *cu, **mask)
