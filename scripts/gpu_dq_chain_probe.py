"""What the ordered dQ add costs in the Hopper backward, split into its two waits. For each point
it times, on the same inputs in one process:

  atomic        the non-deterministic backward (unordered bulk adds);
  ordered       the product: wait for the rank, add, wait until the add has landed, release,
                with the next tile's counter read while the add lands above head dim 64;
  no-read-ahead the same with each counter read only when its turn is waited for;
  read-ahead    the same with the next counter read while the add lands at every head dim;
  no-rank-wait  the same without the acquire wait (the adds land in any order);
  no-landing    with the acquire wait, but the release as soon as shared memory is read;
  neither       both off.

Variants other than `ordered` and `atomic` give unordered bits and exist only to be timed
(OrderedBackwardSm90.WAIT_FOR_RANK / WAIT_FOR_LANDING / READ_TURN_AHEAD). If `no-rank-wait` is near `atomic`, the
time goes to waiting for one's turn (the schedule's business); if `no-landing` is, to the round
trip of each add to global memory before the next contributor may start (the protocol's).

    python scripts/gpu_dq_chain_probe.py OUT_DIR [HDIM:causal|full:SEQLEN:SCHED[/SCHED] ...] [--variants=a,b]

Points given after OUT_DIR replace the built-in POINTS; `--variants=a,b,...` times only those
(`no-release`: neither wait and no counter increment either, so what is left of the ordered
protocol in the writer's loop is gone too; `shift-afresh`: ordered, with the writer computing each
`shift` visit afresh instead of carrying its index, the same bits; under the causal symmetric
shift `pairs-read`: the dQ writer too reads the plan's lists instead of computing the order,
`pairs-computed`: the producer and consumers too compute it, the same bits; `fa4-det`:
FA4's own deterministic backward, timed at the points whose order it runs: `spt` on causal
masks, `ascending` on full ones).

Writes OUT_DIR/dq_chain.json and prints one line per point (backward TFLOP/s).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin import dispatch  # noqa: E402
from dash_plugin.bench.protocol import bwd_flops, random_inputs  # noqa: E402
from dash_plugin.kernels.hopper import bwd_sm90, fwd_sm90  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gpu_dq_wait_probe import parse_point  # noqa: E402

# (head dim, causal, seqlen, schedule): the Hopper table's choice at each point
POINTS = [(128, True, 2048, "descending"), (128, True, 16384, "descending"), (128, False, 1024, "shift"),
          (128, False, 4096, "ascending"), (64, False, 2048, "ascending"), (64, True, 8192, "spt"),
          (128, True, 2048, "arrival")]
# The OrderedBackwardSm90 switches as the product sets them, and what each variant changes.
_PRODUCT = dict(WAIT_FOR_RANK=True, WAIT_FOR_LANDING=True, READ_TURN_AHEAD=None, RELEASE_COUNTER=True,
                CARRY_SHIFT_VISITS=True, PAIR_ROWS_COMPUTED=False, PAIR_RANKS_COMPUTED=True)
VARIANTS = {"ordered": {}, "no-read-ahead": dict(READ_TURN_AHEAD=False), "read-ahead": dict(READ_TURN_AHEAD=True),
            "no-rank-wait": dict(WAIT_FOR_RANK=False), "no-landing": dict(WAIT_FOR_LANDING=False),
            "neither": dict(WAIT_FOR_RANK=False, WAIT_FOR_LANDING=False),
            "no-release": dict(WAIT_FOR_RANK=False, WAIT_FOR_LANDING=False, RELEASE_COUNTER=False),
            "shift-afresh": dict(CARRY_SHIFT_VISITS=False),
            "pairs-read": dict(PAIR_RANKS_COMPUTED=False),
            "pairs-computed": dict(PAIR_ROWS_COMPUTED=True),
            "atomic": {}, "fa4-det": {}}


def _fa4_deterministic(q, k, v, out, do, lse, causal):
    """FA4's own deterministic backward (the same kernel with FA4's dQ writer) from our out/lse."""
    from flash_attn.cute.interface import _flash_attn_bwd
    return _flash_attn_bwd(q, k, v, out, do, lse, softmax_scale=q.shape[-1] ** -0.5, causal=causal,
                           deterministic=True)


def _variant_list(text):
    names = text.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"--variants={text!r}: {unknown} unknown; allowed: {', '.join(VARIANTS)}")
    return names


def _set_switches(kernel, switches):
    for name, value in dict(_PRODUCT, **switches).items():
        setattr(kernel, name, value)


def main(out_dir, points=None, variants=None):
    points = points or POINTS
    variants = {name: VARIANTS[name] for name in (variants or VARIANTS)}
    os.makedirs(out_dir, exist_ok=True)
    inputs = {}
    for hd, causal, s, _ in points:
        q, k, v, do = random_inputs(hd, s, 4)
        out, lse = fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal)
        inputs[(hd, causal, s)] = (q, k, v, do, out, lse)
    results = {f"hdim{hd} {'causal' if c else 'full'} {s} {sched}": {} for hd, c, s, sched in points}
    # Variant outermost: the switches are class attributes read at compile time, so each variant
    # compiles its configurations once.
    kernel = bwd_sm90.OrderedBackwardSm90
    for variant, switches in variants.items():
        _set_switches(kernel, switches)
        bwd_sm90._compiled.clear()
        for hd, causal, s, sched in points:
            q, k, v, do, out, lse = inputs[(hd, causal, s)]
            schedule = "atomic" if variant == "atomic" else sched
            if variant == "fa4-det":
                if sched != ("spt" if causal else "ascending"):
                    continue   # FA4's deterministic mode runs one order per mask
                call = functools.partial(_fa4_deterministic, q, k, v, out, do, lse, causal)
            else:
                call = lambda: dispatch.attention_backward(  # noqa: E731
                    do, q, k, v, out, lse, softmax_scale=hd ** -0.5, causal=causal, schedule=schedule,
                    backend="hopper", deterministic=schedule != "atomic")
            call()
            ms = triton.testing.do_bench(call, warmup=25, rep=100)
            flops = bwd_flops(q.shape[0], q.shape[2], s, hd, causal)
            name = f"hdim{hd} {'causal' if causal else 'full'} {s} {sched}"
            results[name][variant] = round(flops / ms / 1e9, 1)
            print(f"{variant:12s} {name}: {results[name][variant]}", flush=True)
    _set_switches(kernel, {})
    for name, row in results.items():   # against atomic where it was timed
        print(name, " ".join(f"{k}={v}" + (f" ({v / row['atomic']:.2f}x atomic)" if "atomic" in row else "")
                             for k, v in row.items()))
    with open(os.path.join(out_dir, "dq_chain.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("points", nargs="*", help="HDIM:causal|full:SEQLEN:SCHED[/SCHED] (the wait probe's syntax; "
                    "each schedule of a point is a point here)")
    ap.add_argument("--variants", type=_variant_list, help=f"comma list from {', '.join(VARIANTS)}")
    args = ap.parse_args()
    points = [(hd, c, s, x) for hd, c, s, scheds in map(parse_point, args.points) for x in scheds]
    main(args.out_dir, points or None, args.variants)
