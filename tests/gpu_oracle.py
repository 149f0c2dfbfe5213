"""Helpers shared by the GPU tests of the backends (tests/test_gpu_hopper.py, tests/test_gpu_dropout.py).

- the float64 oracle (tests/math_attention.py, per sequence, autograd for the gradients) and the
  error bar of the FlashAttention papers: twice the error of plain bf16 PyTorch math against it;
  for dense batches of equal lengths, and for packed (varlen) batches or unequal lengths;
- the dropout keep-mask of a dense batch, as kernels/philox.py defines it;
- whether the Hopper backend can run here (an sm90 GPU and the `hopper` extra).

Importable without CUDA (nothing runs at import).
"""
from typing import NamedTuple

import pytest
import torch

from dash_plugin.kernels import hopper
from dash_plugin.kernels.philox import keep_scale
from tests.math_attention import keep_mask, math_attention  # noqa: F401 (keep_mask: the tests import it from here)


def hopper_ready() -> bool:
    """The Hopper backend runs here: an sm90 GPU and the `hopper` extra."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and hopper.available()


HOPPER_SKIP = pytest.mark.skipif(not hopper_ready(), reason="needs an sm90 GPU and the hopper extra")


def rel(a, b):
    """Relative L2 error of a (any device, any dtype) against the float64 CPU tensor b."""
    return ((a.double().cpu() - b).norm() / b.norm()).item()


class Oracle(NamedTuple):
    out: torch.Tensor        # float64 (B, S, H_q, D) on the CPU
    grads: list              # dq, dk, dv, float64 on the CPU
    out_bar: float           # rel error of bf16 PyTorch math's out against `out`
    grad_bars: list          # ... of its dq, dk, dv against `grads`


def oracle_and_bf16_math(q, k, v, do, *, causal, window_left=-1, window_right=-1, softcap=0.0,
                         dropout_p=0.0, seed=0):
    """The float64 oracle of dense (B, S, H, D) bf16 CUDA inputs (equal lengths), and the error of
    plain bf16 PyTorch math (the same mask, softcap and dropout mask) against it: the bar, times 2,
    that a kernel's out / dq / dk / dv must stay under."""
    b, s, hq, d = q.shape
    right = 0 if causal else window_right
    outs, ref = [], []
    for i in range(b):
        qi, ki, vi = (t[i].detach().double().cpu().requires_grad_() for t in (q, k, v))
        o, _ = math_attention(qi, ki, vi, causal=causal, window_left=window_left, window_right=right,
                              softcap=softcap, dropout_p=dropout_p, seed=seed, batch_index=i)
        outs.append(o.detach())
        ref.append(torch.autograd.grad(o, (qi, ki, vi), do[i].double().cpu()))
    ref = [torch.stack([r[j] for r in ref]) for j in range(3)]
    out = torch.stack(outs)
    qx, kx, vx = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ke, ve = (t.repeat_interleave(hq // k.shape[2], dim=2) for t in (kx, vx))
    sc = torch.einsum("bqhd,bkhd->bhqk", qx, ke) * d ** -0.5
    if softcap > 0:
        sc = softcap * torch.tanh(sc / softcap)
    rows = torch.arange(s, device=q.device)[:, None]
    cols = torch.arange(s, device=q.device)[None, :]
    hidden = torch.zeros(s, s, device=q.device, dtype=torch.bool)
    if right >= 0:
        hidden |= cols > rows + right
    if window_left >= 0:
        hidden |= cols < rows - window_left
    sc = sc.masked_fill(hidden, float("-inf"))
    probs = sc.softmax(-1)
    if dropout_p > 0:   # as F.dropout on bf16: the product in fp32, rounded to bf16
        drop = keep_mask(seed, dropout_p, b, hq, s, s, device=q.device).float() * keep_scale(dropout_p)
        probs = (probs.float() * drop).to(probs.dtype)
    o = torch.einsum("bhqk,bkhd->bqhd", probs, ve)
    base = torch.autograd.grad(o, (qx, kx, vx), do)
    return Oracle(out, ref, rel(o, out), [rel(x, r) for x, r in zip(base, ref)])


def packed_oracle_and_bf16_math(q, k, v, do, cu_seqlens_q, cu_seqlens_k, **mask) -> Oracle:
    """`oracle_and_bf16_math` for packed (T, H, D) bf16 CUDA inputs: sequence by sequence, masks
    bottom-right aligned where a sequence's lengths differ (a dense batch of unequal lengths is
    the packed batch of its rows). The bf16 math runs on the GPU; a row that sees no key gives 0.
    `mask` may name dropout_p and seed: the mask of sequence b is that of batch index b."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    runs = {}   # dtype -> (outs, dq, dk, dv) per sequence
    for dtype, device in ((torch.float64, "cpu"), (q.dtype, q.device)):
        parts = [[], [], [], []]
        for b in range(len(cq) - 1):
            rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            qi, ki, vi = (t[r].detach().to(device, dtype).requires_grad_() for t, r in ((q, rq), (k, rk), (v, rk)))
            o, _ = math_attention(qi, ki, vi, batch_index=b, **mask)   # dropout keys its mask by sequence
            if o.numel() and ki.shape[0]:
                grads = torch.autograd.grad(o, (qi, ki, vi), do[rq].to(device, dtype))
            else:   # an empty sequence: nothing flows
                grads = [torch.zeros_like(t) for t in (qi, ki, vi)]
            for part, x in zip(parts, (o.detach(), *grads)):
                part.append(x)
        runs[dtype] = [torch.cat(p) for p in parts]
    ref, math = runs[torch.float64], runs[q.dtype]
    return Oracle(ref[0], ref[1:], rel(math[0], ref[0]), [rel(x, r) for x, r in zip(math[1:], ref[1:])])
