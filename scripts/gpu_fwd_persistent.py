"""The Hopper forward on a persistent grid (fwd_sm90.PERSISTENT) against FA4's one-tile-per-CTA grid.

Causal masks only (the persistent grid takes causal and windowed tiles). Per point, on the same
inputs in one process: the output and LSE of both grids compared bit for bit (also with dropout at
one point), then forward TFLOP/s of both and of SDPA's cuDNN backend, every column once per round
over interleaved rounds, the median kept. 16k tokens per point, model dim 2048, bf16.

    python3 scripts/gpu_fwd_persistent.py OUT_DIR [--points 128:1024,64:1024,...] [--gqa 1] [--repeat 5]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gpu_hopper_bwd import gpu_environment, median_ms, time_rounds  # noqa: E402
from dash_plugin.kernels.hopper import fwd_sm90  # noqa: E402


def forward(q, k, v, persistent, **kw):
    fwd_sm90.PERSISTENT = persistent
    try:
        return fwd_sm90.attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=True, **kw)
    finally:
        fwd_sm90.PERSISTENT = False


def cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                enable_gqa=kt.shape[1] != qt.shape[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--points", default="128:1024,128:2048,128:4096,128:16384,64:1024,64:2048,64:4096,64:16384",
                    help="hdim:seqlen,...")
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    results = {"env": gpu_environment(), "rows": []}
    print(results["env"], flush=True)
    for n, point in enumerate(args.points.split(",")):
        d, s = (int(x) for x in point.split(":"))
        b, hq = 16384 // s, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(5)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, s, hq // args.gqa, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        one_tile, persistent = forward(q, k, v, False), forward(q, k, v, True)
        same = all(torch.equal(a, b_) for a, b_ in zip(one_tile, persistent))
        row = {"hdim": d, "seqlen": s, "gqa": args.gqa, "same_bits": same}
        if n == 0:   # dropout: the same mask and bits on both grids
            drop = dict(dropout_p=0.1, seed=7)
            row["same_bits_dropout"] = all(torch.equal(a, b_) for a, b_ in
                                           zip(forward(q, k, v, False, **drop), forward(q, k, v, True, **drop)))
        flops = 4 * b * hq * s * s * d / 2
        times = time_rounds({"one-tile": lambda: forward(q, k, v, False), "persistent": lambda: forward(q, k, v, True),
                             "cudnn": lambda: cudnn(q, k, v)}, args.repeat)
        for name, ts in times.items():
            row[name] = None if not ts else round(flops / median_ms(ts) / 1e9, 1)
            row[f"{name} rounds"] = [round(flops / t / 1e9, 1) for t in ts or []]
        print(f"d{d} causal S{s} gqa{args.gqa}: same bits {same}"
              + (f" (dropout {row['same_bits_dropout']})" if n == 0 else "")
              + f"; one-tile {row['one-tile']} persistent {row['persistent']} cudnn {row['cudnn']} TFLOP/s", flush=True)
        results["rows"].append(row)
        del q, k, v
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fwd_persistent.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
