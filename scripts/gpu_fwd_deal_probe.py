"""The persistent Hopper forward with its tiles dealt under other values of one of
kernels/hopper/fwd_tile_order.py's constants (L2_BYTES, TILE_OVERHEAD), side by side.

The forward runs on the persistent grid at every point (fwd_sm90.GRID), as the product does
wherever the deal matters. Per point, on the same inputs in one process: each value's work table
is built once (the first
value is the one compared against), the outputs of all values are compared bit for bit (a deal
moves tiles between CTAs, never bits), then forward TFLOP/s of every value, once per round over
interleaved rounds, the median kept. The timed calls only swap the plans that were built; nothing
is dealt inside a timing. 16k tokens per point, model dim 2048, bf16.

    python3 scripts/gpu_fwd_deal_probe.py L2_BYTES=26214400,52428800,12582912 64:causal:1024 128:causal:4096
        [--rounds 7]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gpu_hopper_bwd import median_ms, same_bits, time_rounds  # noqa: E402
from dash_plugin.bench.protocol import fwd_flops  # noqa: E402
from dash_plugin.kernels.hopper import fwd_sm90, fwd_tile_order  # noqa: E402

KNOBS = ("L2_BYTES", "TILE_OVERHEAD")


def _values(text: str):
    name, sep, values = text.partition("=")
    if not sep or name not in KNOBS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=V1,V2,... with NAME one of {', '.join(KNOBS)}")
    try:
        return name, [int(v) for v in values.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the values must be integers") from None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("values", type=_values, help="NAME=V1,V2,...: the first value is the reference")
    ap.add_argument("points", nargs="+", help="HDIM:causal|full:SEQLEN")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    name, values = args.values
    original = getattr(fwd_tile_order, name)
    fwd_sm90.GRID = "persistent"   # a deal exists only there (auto would run FA4's grid at some points)
    for point in args.points:
        d, mask, s = point.split(":")
        d, s, causal = int(d), int(s), mask == "causal"
        b, h = 16384 // s, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))

        def forward():
            return fwd_sm90.attention_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal)
        plans, outputs = {}, {}
        try:
            for value in values:
                setattr(fwd_tile_order, name, value)
                fwd_sm90._plans.clear()
                outputs[value] = forward()
                plans[value] = dict(fwd_sm90._plans)
        finally:
            setattr(fwd_tile_order, name, original)
            fwd_sm90._plans.clear()
        same = all(same_bits(outputs[value], outputs[values[0]]) for value in values)

        def with_plans(table):
            def run():
                fwd_sm90._plans.clear()
                fwd_sm90._plans.update(table)
                return forward()
            return run
        flops = fwd_flops(b, h, s, d, causal)
        times = time_rounds({value: with_plans(plans[value]) for value in values}, args.rounds)
        plan = fwd_sm90.plan_of(q, k, v, causal=causal)
        print(f"d{d} {mask} {s} (persistent, q_shift {plan.q_shift}) same_bits {same}: " + " ".join(
            f"{name}={value} " + (f"{flops / median_ms(ts) / 1e9:.1f} {[round(flops / t / 1e9, 1) for t in ts]}"
                                  if ts else "failed")
            for value, ts in times.items()), flush=True)
        fwd_sm90._plans.clear()


if __name__ == "__main__":
    main()
