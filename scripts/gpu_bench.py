"""First speed figures of the Triton kernels vs SDPA and FlexAttention, measured in one run.

hdim 128, seqlen 8192, batch 2, 16 heads, bf16, causal and full. TFLOP/s: forward FLOPs =
4*B*H*S*S*D (halved for causal), backward = 2.5 x forward (the DASH/FA3 convention). Times
are medians of triton.testing.do_bench. Writes JSON to the path given as argv[1].
"""
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

from dash_plugin import dispatch
from dash_plugin.schedules import registry
from dash_plugin.kernels import attn_fwd

B, S, H, D = 2, 8192, 16, 128
SCHEDULES = registry.names()


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def bench(fn):
    return do_bench(fn, warmup=25, rep=150, return_mode="median")


def finishes(fn, seconds=30.0):
    """Run fn once and wait for the GPU at most `seconds`; a cyclic-wait schedule that cannot
    make progress would otherwise hang the whole script."""
    ev = torch.cuda.Event()
    fn()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > seconds:
            return False
        time.sleep(0.01)
    return True


def main(path):
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    results = {"device": dev, "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "shape": dict(batch=B, seqlen=S, heads=H, hdim=D),
               "dtype": "bf16", "rows": []}
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    scale = D ** -0.5
    only_shift = len(sys.argv) > 2 and sys.argv[2] == "shift"
    for causal in (() if only_shift else (True, False)):
        fwd_flops = 4 * B * H * S * S * D / (2 if causal else 1)
        bwd_flops = 2.5 * fwd_flops
        mask = "causal" if causal else "full"
        kw = dict(softmax_scale=scale, causal=causal)

        def row(impl, fwd_ms=None, bwd_ms=None):
            r = {"mask": mask, "impl": impl,
                 "fwd_ms": fwd_ms, "fwd_tflops": tflops(fwd_flops, fwd_ms) if fwd_ms else None,
                 "bwd_ms": bwd_ms, "bwd_tflops": tflops(bwd_flops, bwd_ms) if bwd_ms else None}
            results["rows"].append(r)
            print(f"{mask:6s} {impl:22s} fwd {r['fwd_tflops'] or 0:7.1f} TFLOP/s  bwd {r['bwd_tflops'] or 0:7.1f} "
                  f"TFLOP/s", flush=True)

        out, lse = attn_fwd.attention_forward(q, k, v, **kw)
        row("dash fwd", fwd_ms=bench(lambda: attn_fwd.attention_forward(q, k, v, **kw)))
        for s in SCHEDULES:
            if s == "shift":
                continue  # last, behind a watchdog
            try:
                ms = bench(lambda: dispatch.attention_backward(do, q, k, v, out, lse, backend="triton", schedule=s,
                                                               deterministic=s != "atomic", **kw))
                row(f"dash bwd {s}", bwd_ms=ms)
            except Exception as e:  # report and go on: one failing schedule must not hide the others
                print(f"{mask} {s}: FAILED {type(e).__name__}: {e}", flush=True)
                results["rows"].append({"mask": mask, "impl": f"dash bwd {s}", "error": repr(e)[:500]})

        # SDPA (flash backend) on (B, H, S, D)
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
        f_ms = bench(sdpa)
        o = sdpa()
        g = do.transpose(1, 2)
        b_ms = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True))
        row("sdpa", f_ms, b_ms)

        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            flex = torch.compile(flex_attention, dynamic=False)
            bm = None
            if causal:
                bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
            fl = lambda: flex(qt, kt, vt, block_mask=bm)  # noqa: E731
            f_ms = bench(fl)
            o = fl()
            b_ms = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True))
            row("flex (torch.compile)", f_ms, b_ms)
        except Exception as e:
            print(f"{mask} flex: FAILED {type(e).__name__}: {e}", flush=True)
            results["rows"].append({"mask": mask, "impl": "flex", "error": repr(e)[:500]})
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    for causal in (False, True):
        mask = "causal" if causal else "full"
        kw = dict(softmax_scale=scale, causal=causal)
        out, lse = attn_fwd.attention_forward(q, k, v, **kw)
        fn = lambda: dispatch.attention_backward(do, q, k, v, out, lse, backend="triton", schedule="shift", **kw)  # noqa: E731
        t0 = time.time()
        if not finishes(fn):
            print(f"{mask} shift: did not finish within 30 s (hang or stall); stopping", flush=True)
            results["rows"].append({"mask": mask, "impl": "dash bwd shift", "error": "no finish in 30 s"})
            break
        print(f"{mask} shift: first call {time.time() - t0:.1f} s (with compile)", flush=True)
        ms = bench(fn)
        fwd_flops = 4 * B * H * S * S * D / (2 if causal else 1)
        results["rows"].append({"mask": mask, "impl": "dash bwd shift", "bwd_ms": ms,
                                "bwd_tflops": tflops(2.5 * fwd_flops, ms)})
        print(f"{mask:6s} dash bwd shift         bwd {tflops(2.5 * fwd_flops, ms):7.1f} TFLOP/s", flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    sys.stdout.flush()
    os._exit(0)   # a stuck kernel must not keep the process alive


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kernels-first-figures.json")
