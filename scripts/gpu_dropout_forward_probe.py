"""What dropout costs the Hopper kernels, by where and how their mask is drawn and applied. For
each point it times one kernel alone (`--kernel fwd`: the forward from the inputs; `bwd`: the
backward, `descending`, from a forward done once), on the same inputs in one process, without
dropout and with p = 0.1 under each variant of the kernel class's switches.

Forward (dropout_sm90.DropoutForwardSm90):
  converted   the product: P dropped after its conversion to 16 bits (four draws compared at
              once, one AND per two scores), except in the first step of a tile;
  scores      every step drops the 32-bit P (one compare and one select per score).
Backward (bwd_sm90.OrderedBackwardSm90):
  ahead       the product: its ahead_units rule's units of a thread's mask drawn while S and
              dP are computed (none above hdim 64);
  ahead-4     four units drawn ahead;
  inline      all drawn after S arrives;
  full-80     full masks at hdim 128 on FA4's 80-row Q tiles, where the product takes 64-row
              ones with dropout (tile_table.DROPOUT_FULL_TILES). Its bits differ from the
              product's (other tiles, other sums), which the bits check reports.

(Removed forward variants, slower than `converted`: `draw-warps` (commit 476deaa, and with
56-64 registers for the drawing warps commit f71500c), the words drawn by the producer
warpgroup's three idle warps into shared memory (docs/benchmarks/dropout-forward-2026-11-24-h100/,
docs/benchmarks/dropout-draw-warps-2026-11-26-h200/); `ahead` (commit c92b81f and the one after it),
the words drawn while the step's products run (docs/benchmarks/dropout-overlap-2026-11-24-h100/).)

All give the same bits (checked here: each variant's outputs against the first's; the mask is
the same, tests/test_gpu_dropout.py reads it out). Rounds are interleaved (every variant once
per round) and the median kept, so a slow moment of the GPU does not land on one variant.

    python scripts/gpu_dropout_forward_probe.py OUT_DIR [HDIM:causal|full:SEQLEN ...] [--kernel fwd|bwd] [--rounds 3]

Writes OUT_DIR/dropout_{fwd,bwd}.json and prints one line per point: ms without dropout, with it
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
from dash_plugin import dispatch  # noqa: E402
from dash_plugin.kernels.hopper import bwd_sm90, dropout_sm90, fwd_sm90, tile_table  # noqa: E402

POINTS = [(128, True, 2048), (128, True, 8192), (128, False, 2048), (64, True, 8192)]
_PRODUCT_FULL_TILES = dict(tile_table.DROPOUT_FULL_TILES)
# kernel -> (class whose switches are set, module whose compile cache is swapped, the product's
# switches, variants' switches)
KERNELS = {
    "fwd": (dropout_sm90.DropoutForwardSm90, fwd_sm90, dict(DROP_CONVERTED=True),
            {"converted": {}, "scores": dict(DROP_CONVERTED=False)}),
    "bwd": (bwd_sm90.OrderedBackwardSm90, bwd_sm90, dict(AHEAD_UNITS=None, DROPOUT_FULL_TILES=_PRODUCT_FULL_TILES),
            {"ahead": {}, "ahead-4": dict(AHEAD_UNITS=4), "inline": dict(AHEAD_UNITS=0),
             "full-80": dict(DROPOUT_FULL_TILES={})}),
}
_MODULE_SWITCHES = {"DROPOUT_FULL_TILES": tile_table}   # switches that are module attributes


def _point(text):
    try:
        hd, mask, seqlen = text.split(":")
        if mask not in ("causal", "full"):
            raise ValueError(mask)
        return int(hd), mask == "causal", int(seqlen)
    except ValueError:
        raise argparse.ArgumentTypeError(f"point {text!r}: expected HDIM:causal|full:SEQLEN, e.g. 128:causal:8192")


_COMPILED = {}   # (kernel, variant) -> its compiled kernels: the switches are read at compile time


def _set_switches(kernel, variant, switches):
    cls, module, product, _ = KERNELS[kernel]
    for name, value in dict(product, **switches).items():
        setattr(_MODULE_SWITCHES.get(name, cls), name, value)
    module._compiled = _COMPILED.setdefault((kernel, variant), {})


def _calls(kernel, point, inputs, p_drop):
    """The timed call at `point` and what it returns."""
    hd, causal, _ = point
    q, k, v, do = inputs

    def forward():
        return fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal, dropout_p=p_drop, seed=7)
    if kernel == "fwd":
        return lambda: forward()[0]
    _set_switches("fwd", "converted", {})
    out, lse = forward()
    return lambda: dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=hd ** -0.5, causal=causal,
                                               schedule="descending", deterministic=True, backend="hopper",
                                               dropout_p=p_drop, seed=7)


def main(out_dir, points, rounds, kernel="fwd", variants=None):
    variants = {v: KERNELS[kernel][3][v] for v in (variants or KERNELS[kernel][3])}
    os.makedirs(out_dir, exist_ok=True)
    times = {p: {v: [] for v in ("without", *variants)} for p in points}
    inputs = {p: random_inputs(p[0], p[2], 4) for p in points}   # q, k, v, dO
    outputs, mismatched = {}, {p: set() for p in points}
    for r in range(rounds):
        for variant, switches in {"without": {}, **variants}.items():
            p_drop = 0.0 if variant == "without" else 0.1
            for point in points:
                call = _calls(kernel, point, inputs[point], p_drop)
                _set_switches(kernel, variant, switches)
                out = call()
                if variant != "without":   # every variant must give the same bits
                    same = outputs.setdefault(point, out)
                    if not all(torch.equal(a, b) for a, b in zip(same if isinstance(same, tuple) else (same,),
                                                                  out if isinstance(out, tuple) else (out,))):
                        mismatched[point].add(variant)
                times[point][variant].append(triton.testing.do_bench(call, warmup=25, rep=100))
                print(f"  {variant} {point}: {times[point][variant][-1]:.3f} ms", flush=True)
        print(f"round {r + 1}/{rounds} done", flush=True)
    _set_switches(kernel, next(iter(KERNELS[kernel][3])), {})   # the product's
    results = {}
    for (hd, causal, s), row in times.items():
        ms = {v: statistics.median(t) for v, t in row.items()}
        name = f"hdim{hd} {'causal' if causal else 'full'} {s}"
        results[name] = dict(ms={v: round(t, 4) for v, t in ms.items()},
                             cost={v: round(ms[v] / ms["without"], 3) for v in variants},
                             bits_differ=sorted(mismatched[(hd, causal, s)]))
        print(kernel, name, f"without {ms['without']:.3f} ms;",
              "; ".join(f"{v} {ms[v]:.3f} ms ({ms[v] / ms['without']:.3f}x)" for v in variants),
              f"; bits differ: {sorted(mismatched[(hd, causal, s)])}" if mismatched[(hd, causal, s)] else
              "; same bits", flush=True)
    with open(os.path.join(out_dir, f"dropout_{kernel}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, kernel=kernel, rounds=rounds,
                       results=results), f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("points", nargs="*", type=_point, help="HDIM:causal|full:SEQLEN (default: POINTS)")
    ap.add_argument("--kernel", choices=tuple(KERNELS), default="fwd")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", help="comma list (default: all of the kernel's)")
    args = ap.parse_args()
    chosen = args.variants.split(",") if args.variants else list(KERNELS[args.kernel][3])
    unknown = set(chosen) - set(KERNELS[args.kernel][3])
    if unknown:
        ap.error(f"--variants={args.variants!r}: {sorted(unknown)} unknown for --kernel {args.kernel}; "
                 f"allowed: {', '.join(KERNELS[args.kernel][3])}")
    main(args.out_dir, args.points or POINTS, args.rounds, args.kernel, chosen)
