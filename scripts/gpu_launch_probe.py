"""Probe: the Hopper backward's acyclic orders launched head by head instead of with FA4's L2
swizzle (several heads' KV tiles interleaved), beside `arrival` (always head by head) and `atomic`
(FA4's plain grid, KV tile fastest: head by head too). Backward TFLOP/s, interleaved rounds, median.

    python3 scripts/gpu_launch_probe.py OUT_DIR [--points 128:causal:16384,...] [--orders descending,spt]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gpu_hopper_bwd import forward, gpu_environment, make, median_ms, ours, time_rounds  # noqa: E402
from dash_plugin.kernels.hopper import bwd_sm90  # noqa: E402


def head_by_head(schedule, *args):
    bwd_sm90.FORCE_HEAD_BY_HEAD = True
    try:
        return ours(schedule, *args)
    finally:
        bwd_sm90.FORCE_HEAD_BY_HEAD = False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--points", default="128:causal:16384,128:causal:8192,128:causal:2048,128:full:8192")
    ap.add_argument("--orders", default="descending,spt,ascending")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    results = {"env": gpu_environment(), "rows": []}
    print(results["env"], flush=True)
    for point in args.points.split(","):
        d, mask, s = point.split(":")
        d, s, causal = int(d), int(s), mask == "causal"
        b, hq = 16384 // s, 2048 // d
        q, k, v, do = make(b, s, hq, hq, d, seed=7)
        out, lse = forward(q, k, v, causal)
        x = (q, k, v, out, lse, do, causal)
        impls = {}
        for o in args.orders.split(","):
            if o == "spt" and not causal:
                continue
            impls[o] = (lambda o=o: ours(o, *x))
            impls[f"{o}-hbh"] = (lambda o=o: head_by_head(o, *x))
            same = all(torch.equal(a, b_) for a, b_ in zip(ours(o, *x), head_by_head(o, *x)))
            assert same, f"{o}: the launch changed the bits"
        if causal:
            impls["arrival"] = lambda: ours("arrival", *x)
        impls["atomic"] = lambda: ours("atomic", *x)
        flops = 2.5 * 4 * b * hq * s * s * d / (2 if causal else 1)
        times = time_rounds(impls, args.repeat)
        row = {"hdim": d, "mask": mask, "seqlen": s}
        for name, ts in times.items():
            row[name] = None if not ts else round(flops / median_ms(ts) / 1e9, 1)
            row[f"{name} rounds"] = [round(flops / t / 1e9, 1) for t in ts or []]
        print(f"d{d} {mask} S{s}: " + " ".join(f"{n}={row[n]}" for n in impls), flush=True)
        results["rows"].append(row)
        del q, k, v, do, out, lse
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
