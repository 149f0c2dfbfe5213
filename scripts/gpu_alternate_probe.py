"""Probe: heads alternating between `arrival` and `descending` (OrderedBackwardSm90.ALTERNATE_HEADS).

Why it might pay: with one head's KV tiles in flight at a time, a head whose tiles all start
together gets arrival order's two-step lead at every row, and its tiles then finish two steps
apart; the next head's tiles then start two steps apart, which cancels arrival's lead but gives
`descending` (its tiles reach each row in KV order) the same two steps, and a `descending` head's
tiles all finish together, so the head after it starts together again. Either order alone
alternates between heads that wait in lock-step and heads that do not
(docs/benchmarks/arrival-groups-2026-11-24-h100/). This times, on the same inputs in one
process, `descending`, `arrival`, the alternation (even heads `arrival` with its groups launched top
group first, odd heads `descending`, heads one after another), `spt`, `atomic` and FA4's
deterministic backward, interleaved rounds, median kept; and checks the alternation repeats its
bits and agrees with `ascending` to rounding. Backward TFLOP/s, causal, 16k tokens per point.

    python3 scripts/gpu_alternate_probe.py OUT_DIR [--points 128:16384,128:8192] [--repeat 3]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gpu_hopper_bwd import fa4_bwd, forward, gpu_environment, have_fa4, make, median_ms, ours, time_rounds  # noqa: E402
from dash_plugin.kernels.hopper import bwd_sm90  # noqa: E402


def alternate(q, k, v, out, lse, do):
    bwd_sm90.OrderedBackwardSm90.ALTERNATE_HEADS = True
    try:
        return ours("descending", q, k, v, out, lse, do, True)
    finally:
        bwd_sm90.OrderedBackwardSm90.ALTERNATE_HEADS = False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--points", default="128:16384,128:8192", help="hdim:seqlen,...")
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    fa4 = have_fa4()
    results = {"env": gpu_environment(), "rows": []}
    print(results["env"], flush=True)
    for point in args.points.split(","):
        d, s = (int(x) for x in point.split(":"))
        b, hq = 16384 // s, 2048 // d
        q, k, v, do = make(b, s, hq, hq // args.gqa, d, seed=7)
        out, lse = forward(q, k, v, True)
        first = alternate(q, k, v, out, lse, do)
        repeats = all(all(torch.equal(a, b_) for a, b_ in zip(first, alternate(q, k, v, out, lse, do)))
                      for _ in range(20))
        base = ours("ascending", q, k, v, out, lse, do, True)
        err = max(((a.double() - b_.double()).norm() / b_.double().norm()).item() for a, b_ in zip(first, base))
        impls = {"alternate": lambda: alternate(q, k, v, out, lse, do)}
        for x in ("descending", "arrival", "spt", "atomic"):
            impls[x] = (lambda x=x: ours(x, q, k, v, out, lse, do, True))
        if fa4:
            impls["fa4-det"] = lambda: fa4_bwd(q, k, v, out, lse, do, True, True)
        flops = 2.5 * 4 * b * hq * s * s * d / 2
        times = time_rounds(impls, args.repeat)
        row = {"hdim": d, "seqlen": s, "gqa": args.gqa, "repeats_over_20": repeats, "rel_err_vs_ascending": err}
        for name, ts in times.items():
            row[name] = None if not ts else round(flops / median_ms(ts) / 1e9, 1)
            row[f"{name} rounds"] = [round(flops / t / 1e9, 1) for t in ts or []]
        print(f"d{d} causal S{s} gqa{args.gqa}: repeats {repeats}, rel err vs ascending {err:.1e}; "
              + " ".join(f"{n}={row[n]}" for n in impls), flush=True)
        results["rows"].append(row)
        del q, k, v, do, out, lse
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "alternate.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
