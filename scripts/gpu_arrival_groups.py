"""Time `arrival` (or the causal `shift`'s pairs) by group size, next to the other orders.

A head of more than 64 KV tiles (hdim 128 causal beyond 8k tokens, hdim 192 beyond 6k) runs
`arrival` as groups launched top group first (builders.arrival_launch). This times, on the same
inputs in one process, every column once per round over interleaved rounds (median kept):
`arrival` with the plan's groups (64 KV tiles) and with smaller ones (the kernel-level call with
tables built for that group size; group 1 is `spt`'s launch), next to `descending`, `spt`,
`atomic` and FA4's deterministic and non-deterministic backwards. Backward TFLOP/s (2.5 x the
forward's FLOPs, causal halved), 16k tokens per point. With `--schedule shift` the groups are
the causal symmetric shift's groups of pairs (the plan's: a head's pairs up to 64).

Usage: python3 scripts/gpu_arrival_groups.py [--points 128:8192,128:16384,192:8192] [--groups 64,32,16]
       [--schedule arrival|shift] [--gqa 1] [--repeat 3] [--out DIR]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gpu_hopper_bwd import fa4_bwd, forward, gpu_environment, have_fa4, make, median_ms, ours, time_rounds  # noqa: E402
from dash_plugin.kernels import hopper  # noqa: E402
from dash_plugin.kernels.backends import Request  # noqa: E402
from dash_plugin.kernels.hopper_backend import BACKEND, HopperTiles  # noqa: E402
from dash_plugin.schedules.plan import AttentionShape, launch_plan  # noqa: E402


def group_tables(b, s, hq, hkv, d, group, schedule="arrival"):
    """Per-KV-tile tables of `schedule` (arrival, or shift: pairs) with groups of `group` KV tiles
    (pairs) (the plan's rule otherwise)."""
    req = Request(torch.device("cuda"), torch.bfloat16, d, schedule, "ordered", False, s, s, True, -1, 0)
    tiles = BACKEND.tiles(req)
    plan = launch_plan(AttentionShape(b, hq, hkv, (s,) * b, (s,) * b, False, True, -1, 0), schedule,
                       tiles=HopperTiles(tiles.block_m, tiles.block_n, group), device=BACKEND.device_props("cuda"))
    tables = hopper.tables_of(plan.schedule.sequences[0])
    hopper.check_waits_follow_launch(tables)
    return tables


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="128:8192,128:16384,192:8192,192:16384", help="hdim:seqlen,...")
    ap.add_argument("--groups", default="64,32,16", help="group sizes to time")
    ap.add_argument("--schedule", choices=("arrival", "shift"), default="arrival")
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    fa4 = have_fa4()
    results = {"env": gpu_environment(), "rows": []}
    print(results["env"], flush=True)
    for point in args.points.split(","):
        d, s = (int(x) for x in point.split(":"))
        b, hq = 16384 // s, 2048 // d
        hkv = hq // args.gqa
        q, k, v, do = make(b, s, hq, hkv, d, seed=7)
        out, lse = forward(q, k, v, True)
        flops = 2.5 * 4 * b * hq * s * s * d / 2
        impls = {}
        for g in (int(x) for x in args.groups.split(",")):
            tables = group_tables(b, s, hq, hkv, d, g, args.schedule)
            impls[f"{args.schedule}-g{g}"] = (lambda t=tables: hopper.attention_backward(
                do, q, k, v, out, lse, softmax_scale=d ** -0.5, causal=True, tables=t, deterministic=True))
        for x in (args.schedule, "descending", "spt", "atomic"):   # through the API: the plan's groups
            impls[x] = (lambda x=x: ours(x, q, k, v, out, lse, do, True))
        if fa4:
            impls["fa4-det"] = lambda: fa4_bwd(q, k, v, out, lse, do, True, True)
            impls["fa4"] = lambda: fa4_bwd(q, k, v, out, lse, do, True, False)
        times = time_rounds(impls, args.repeat)
        row = {"hdim": d, "seqlen": s, "gqa": args.gqa, "kv_tiles": tables.count.shape[0]}
        for name, ts in times.items():
            row[name] = None if not ts else round(flops / median_ms(ts) / 1e9, 1)
            row[f"{name} rounds"] = [round(flops / t / 1e9, 1) for t in ts or []]
        print(f"d{d} causal S{s} gqa{args.gqa} ({row['kv_tiles']} KV tiles): "
              + " ".join(f"{n}={row[n]}" for n in impls), flush=True)
        results["rows"].append(row)
        del q, k, v, do, out, lse
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.schedule}_groups.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
