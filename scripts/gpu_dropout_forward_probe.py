"""What dropout costs the Hopper forward, by the way its mask is applied. For each point it times
the forward alone, on the same inputs in one process, without dropout and with p = 0.1 under
each variant of dropout_sm90.DropoutForwardSm90's switches:

  converted   the product: P dropped after its conversion to 16 bits (four draws compared at
              once, one AND per two scores), except in the first step of a tile;
  scores      every step drops the 32-bit P (one compare and one select per score).

(Commit 476deaa had a third, `draw-warps`: the words drawn by the producer warpgroup's three
idle warps into shared memory; slower, removed: docs/benchmarks/dropout-forward-2026-11-24-h100/.)

All give the same bits (checked here: each variant's output against the first's) (the mask is the same; tests/test_gpu_dropout.py reads it out). Rounds
are interleaved (every variant once per round) and the median kept, so a slow moment of the GPU
does not land on one variant.

    python scripts/gpu_dropout_forward_probe.py OUT_DIR [HDIM:causal|full:SEQLEN ...] [--rounds 3]

Writes OUT_DIR/dropout_forward.json and prints one line per point: ms without dropout, with it
under each variant, and the cost ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin.bench.protocol import random_inputs  # noqa: E402
from dash_plugin.kernels.hopper import dropout_sm90, fwd_sm90  # noqa: E402

POINTS = [(128, True, 2048), (128, True, 8192), (128, False, 2048), (64, True, 8192)]
_PRODUCT = dict(DROP_CONVERTED=True)
VARIANTS = {"converted": {}, "scores": dict(DROP_CONVERTED=False)}


def _point(text):
    try:
        hd, mask, seqlen = text.split(":")
        if mask not in ("causal", "full"):
            raise ValueError(mask)
        return int(hd), mask == "causal", int(seqlen)
    except ValueError:
        raise argparse.ArgumentTypeError(f"point {text!r}: expected HDIM:causal|full:SEQLEN, e.g. 128:causal:8192")


_COMPILED = {}   # variant -> its compiled kernels: the switches are read at compile time


def _set_switches(variant, switches):
    for name, value in dict(_PRODUCT, **switches).items():
        setattr(dropout_sm90.DropoutForwardSm90, name, value)
    fwd_sm90._compiled = _COMPILED.setdefault(variant, {})


def main(out_dir, points, rounds, variants=None):
    variants = {v: VARIANTS[v] for v in (variants or VARIANTS)}
    os.makedirs(out_dir, exist_ok=True)
    times = {p: {v: [] for v in ("without", *variants)} for p in points}
    inputs = {p: random_inputs(p[0], p[2], 3) for p in points}
    outputs, mismatched = {}, {p: set() for p in points}
    for r in range(rounds):
        for variant, switches in {"without": {}, **variants}.items():
            _set_switches(variant, switches)
            p_drop = 0.0 if variant == "without" else 0.1
            for point in points:
                hd, causal, _ = point
                q, k, v = inputs[point]
                call = lambda: fwd_sm90.attention_forward(  # noqa: E731
                    q, k, v, softmax_scale=hd ** -0.5, causal=causal, dropout_p=p_drop, seed=7)
                out = call()[0]
                if variant != "without":   # every variant must give the same bits
                    same = outputs.setdefault(point, out)
                    mismatched[point] |= {variant} if not torch.equal(same, out) else set()
                times[point][variant].append(triton.testing.do_bench(call, warmup=25, rep=100))
                print(f"  {variant} {point}: {times[point][variant][-1]:.3f} ms", flush=True)
        print(f"round {r + 1}/{rounds} done", flush=True)
    _set_switches("converted", {})
    results = {}
    for (hd, causal, s), row in times.items():
        ms = {v: statistics.median(t) for v, t in row.items()}
        name = f"hdim{hd} {'causal' if causal else 'full'} {s}"
        results[name] = dict(ms={v: round(t, 4) for v, t in ms.items()},
                             cost={v: round(ms[v] / ms["without"], 3) for v in variants},
                             bits_differ=sorted(mismatched[(hd, causal, s)]))
        print(name, f"without {ms['without']:.3f} ms;",
              "; ".join(f"{v} {ms[v]:.3f} ms ({ms[v] / ms['without']:.3f}x)" for v in variants),
              f"; bits differ: {sorted(mismatched[(hd, causal, s)])}" if mismatched[(hd, causal, s)] else
              "; same bits", flush=True)
    with open(os.path.join(out_dir, "dropout_forward.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rounds=rounds,
                       results=results), f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("points", nargs="*", type=_point, help="HDIM:causal|full:SEQLEN (default: POINTS)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list (default: all)")
    args = ap.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants={args.variants!r}: {sorted(unknown)} unknown; allowed: {', '.join(VARIANTS)}")
    main(args.out_dir, args.points or POINTS, args.rounds, args.variants.split(","))
