"""Dropout in the Hopper backend, on the GPU: the mask read out of the kernels, the gradients
against float64, repeatability, and the cost of dropout next to SDPA's flash backend.

    python scripts/gpu_hopper_dropout.py OUT_DIR [--stages mask,grad,det,time]
        [--schedules descending,arrival] [--seqlens 2048,8192]   (the time stage's orders and lengths)

Writes OUT_DIR/hopper_dropout.json and prints one line per check. The pytest versions of the
checks are in tests/test_gpu_dropout.py; this script is the quick look and the timing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin import dispatch  # noqa: E402
from dash_plugin.kernels import hopper  # noqa: E402
from dash_plugin.kernels.philox import effective_dropout_p, keep_scale  # noqa: E402
from tests.gpu_oracle import keep_mask, oracle_and_bf16_math, rel  # noqa: E402


def forward(q, k, v, causal, p, seed):
    return hopper.attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=causal, dropout_p=p, seed=seed)


def backward(do, q, k, v, out, lse, causal, p, seed, schedule="descending"):
    return dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=q.shape[-1] ** -0.5, causal=causal,
                                       schedule=schedule, deterministic=schedule != "atomic", backend="hopper",
                                       dropout_p=p, seed=seed)


def mask_readout(hd, hq, hkv, seqlen_q, p, seed):
    """q = k = 0 makes P uniform (1/S_k); V = identity (S_k = hd) makes out[i, j] = keep * scale / S_k."""
    b = 2
    q = torch.zeros(b, seqlen_q, hq, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(b, hd, hkv, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.eye(hd, device="cuda", dtype=torch.bfloat16).view(1, hd, 1, hd).expand(b, hd, hkv, hd).contiguous()
    out, _ = forward(q, k, v, False, p, seed)
    got = (out != 0).permute(0, 2, 1, 3).cpu()                       # (b, h, i, j)
    want = keep_mask(seed, p, b, hq, seqlen_q, hd)
    kept_value = out.float()[out != 0]
    value_ok = bool(torch.allclose(kept_value, torch.full_like(kept_value, keep_scale(p) / hd), rtol=1e-2))
    # dV readout: dO = identity rows (S_q = hd) gives dV[j, i] = sum over query heads of P_ij keep scale
    return dict(mismatch=int((got != want).sum()), elements=got.numel(), kept=float(got.float().mean()),
                expected_kept=1 - effective_dropout_p(p), values_ok=value_ok)


def grads(hd, causal, hq, hkv, p, seed, schedule):
    """Relative errors of out/dq/dk/dv against the float64 oracle with the same mask, and the bar
    (twice plain bf16 math's error) the GPU tests hold them to."""
    torch.manual_seed(0)
    s = 512
    q, k, v, do = (torch.randn(2, s, h, hd, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
    out, lse = forward(q, k, v, causal, p, seed)
    dq, dk, dv = backward(do, q, k, v, out, lse, causal, p, seed, schedule)
    ref = oracle_and_bf16_math(q, k, v, do, causal=causal, dropout_p=p, seed=seed)
    errs = {"out": rel(out, ref.out), **{n: rel(x, r) for n, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref.grads)}}
    bars = dict(zip(("out", "dq", "dk", "dv"), (2 * b for b in (ref.out_bar, *ref.grad_bars))))
    return dict(errors=errs, bars=bars, within=all(errs[n] <= bars[n] for n in errs))


def repeat(hd, causal, p, seed, schedule, passes):
    torch.manual_seed(1)
    q, k, v, do = (torch.randn(2, 1024, 8, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    first = None
    bad = 0
    for _ in range(passes):
        out, lse = forward(q, k, v, causal, p, seed)
        res = (out, *backward(do, q, k, v, out, lse, causal, p, seed, schedule))
        if first is None:
            first = res
        else:
            bad += not all(torch.equal(a, b) for a, b in zip(first, res))
    other = forward(q, k, v, causal, p, seed + 1)[0]
    return dict(passes=passes, mismatching=bad, other_seed_differs=not torch.equal(other, first[0]))


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def cost(hd, causal, seqlen, p, schedules=("descending",)):
    """ms with and without dropout, ours (Hopper, each of `schedules`) and SDPA flash, in one
    process on the same inputs: forward + backward (the cost the issue's goal names) and each of
    the two alone (the forward from the inputs; the backward from a forward done once), so the
    extra time of dropout can be split between the kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(2)
    b, h = max(1, 16384 // seqlen), 16
    q, k, v, do = (torch.randn(b, seqlen, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    dot = do.transpose(1, 2)

    def ours(pp, schedule):
        fwd = lambda: forward(q, k, v, causal, pp, 7)   # noqa: E731
        out, lse = fwd()
        bwd = lambda: backward(do, q, k, v, out, lse, causal, pp, 7, schedule)   # noqa: E731
        return dict(both=lambda: backward(do, q, k, v, *fwd(), causal, pp, 7, schedule), forward=fwd, backward=bwd)

    def sdpa(pp):
        def fwd():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, dropout_p=pp, is_causal=causal)
        o = fwd()
        return dict(both=lambda: torch.autograd.grad(fwd(), (qt, kt, vt), dot), forward=fwd,
                    backward=lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True))

    row = {}
    impls = [(f"dash-hopper-{s}", lambda pp, s=s: ours(pp, s)) for s in schedules] + [("sdpa-flash", sdpa)]
    for name, make in impls:
        without, with_p = make(0.0), make(p)
        row[name] = {}
        for stage in ("both", "forward", "backward"):
            t0, t1 = timed(without[stage]), timed(with_p[stage])
            key = "" if stage == "both" else f"{stage}_"
            row[name].update({f"{key}ms_without": t0, f"{key}ms_with": t1, f"{key}cost": t1 / t0})
    return row


def _cost_line(r):
    """'1.217 (3.35->4.07 ms; fwd 1.30, bwd 1.18)': forward + backward, then each alone."""
    return (f"{r['cost']:.3f} ({r['ms_without']:.2f}->{r['ms_with']:.2f} ms; "
            f"fwd {r['forward_cost']:.2f}, bwd {r['backward_cost']:.2f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--stages", default="mask,grad,det,time")
    ap.add_argument("--passes", type=int, default=100)
    ap.add_argument("--schedules", default="descending", help="time stage: our orders, comma list")
    ap.add_argument("--seqlens", default="2048,4096,8192", help="time stage: sequence lengths, comma list")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stages = args.stages.split(",")
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    if "mask" in stages:
        res["mask"] = {}
        for hd in (64, 128):
            for hq, hkv in ((4, 4), (8, 2)):
                for p in (0.1, 0.5):
                    r = mask_readout(hd, hq, hkv, 384, p, 11)
                    res["mask"][f"hd{hd} h{hq}/{hkv} p{p}"] = r
                    print("mask", hd, hq, hkv, p, r, flush=True)
    if "grad" in stages:
        res["grad"] = {}
        for hd in (64, 96, 128):
            for causal in (True, False):
                for schedule in ("ascending", "descending", "atomic"):
                    r = grads(hd, causal, 8, 2, 0.2, 5, schedule)
                    res["grad"][f"hd{hd} {'causal' if causal else 'full'} {schedule}"] = r
                    print("grad", hd, causal, schedule, {k: f"{v:.2e}" for k, v in r["errors"].items()},
                          "within 2x bf16 math" if r["within"] else "OUTSIDE 2x bf16 math", flush=True)
    if "det" in stages:
        res["det"] = {}
        for schedule in ("descending", "ascending", "shift"):
            r = repeat(128, schedule != "shift", 0.1, 3, schedule, args.passes)
            res["det"][schedule] = r
            print("det", schedule, r, flush=True)
    if "time" in stages:
        res["time"] = {}
        for hd in (128, 64):
            for causal in (True, False):
                for seqlen in (int(x) for x in args.seqlens.split(",")):
                    t = time.time()
                    r = cost(hd, causal, seqlen, 0.1, tuple(args.schedules.split(",")))
                    res["time"][f"hd{hd} {'causal' if causal else 'full'} {seqlen}"] = r
                    print("time", hd, causal, seqlen, {k: _cost_line(v) for k, v in r.items()},
                          f"{time.time() - t:.0f}s", flush=True)
    with open(os.path.join(args.out, "hopper_dropout.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
