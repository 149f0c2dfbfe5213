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

The variants that turn a wait off give unordered bits and exist only to be timed
(OrderedBackwardSm90.WAIT_FOR_RANK / WAIT_FOR_LANDING); the read-ahead ones give the product's
bits (READ_TURN_AHEAD). If `no-rank-wait` is near `atomic`, the
time goes to waiting for one's turn (the schedule's business); if `no-landing` is, to the round
trip of each add to global memory before the next contributor may start (the protocol's).

    python scripts/gpu_dq_chain_probe.py OUT_DIR [HDIM:causal|full:SEQLEN:SCHED[/SCHED] ...] [--variants=a,b]
        [--rounds N]

Every variant's kernels are compiled first (their switches are part of the compile key), then
`--rounds` rounds time every (variant, point) once each, interleaved, and the median is kept,
with each round's lowest SM clock where nvidia-smi can sample it (a slow spell of the GPU then
hits every variant alike; docs/benchmarks/clocks-2026-11-25-h100/).

Points given after OUT_DIR replace the built-in POINTS; `--variants=a,b,...` times only those
(`no-release`: neither wait and no counter increment either, so what is left of the ordered
protocol in the writer's loop is gone too; `shift-afresh`: ordered, with the writer computing each
`shift` visit afresh instead of carrying its index, the same bits; under the causal symmetric
shift `pairs-read`: the dQ writer too reads the plan's lists instead of computing the order,
`pairs-computed`: the producer and consumers too compute it, the same bits; `unordered-dkv`
(with `--gqa N`): dQ ordered, the query heads' dK/dV adds unordered (FA4's non-deterministic
epilogue), to time what ordering them costs; `add-first`: the first add to each dQ tile adds
into a zeroed accumulator instead of storing (OrderedBackwardSm90.STORE_FIRST_DQ off), the same
bits; `fa4-det`:
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin.bench.clocks import ClockMonitor  # noqa: E402
from dash_plugin.bench.protocol import bwd_flops, random_inputs  # noqa: E402
from dash_plugin.kernels.hopper import bwd_sm90, fwd_sm90  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gpu_dq_wait_probe import parse_point  # noqa: E402
from gpu_hopper_bwd import fa4_bwd, median_ms, ours, same_bits, time_rounds  # noqa: E402

# (head dim, causal, seqlen, schedule): the Hopper table's choice at each point
POINTS = [(128, True, 2048, "descending"), (128, True, 16384, "descending"), (128, False, 1024, "shift"),
          (128, False, 4096, "ascending"), (64, False, 2048, "ascending"), (64, True, 8192, "spt"),
          (128, True, 2048, "arrival")]
# The OrderedBackwardSm90 switches as the product sets them (read at import, before any variant
# changes them), and what each variant changes.
_PRODUCT = {name: getattr(bwd_sm90.OrderedBackwardSm90, name) for name in bwd_sm90.OrderedBackwardSm90.SWITCHES}
VARIANTS = {"ordered": {}, "no-read-ahead": dict(READ_TURN_AHEAD=False), "read-ahead": dict(READ_TURN_AHEAD=True),
            "no-rank-wait": dict(WAIT_FOR_RANK=False), "no-landing": dict(WAIT_FOR_LANDING=False),
            "neither": dict(WAIT_FOR_RANK=False, WAIT_FOR_LANDING=False),
            "no-release": dict(WAIT_FOR_RANK=False, WAIT_FOR_LANDING=False, RELEASE_COUNTER=False),
            "shift-afresh": dict(CARRY_SHIFT_VISITS=False),
            "pairs-read": dict(PAIR_RANKS_COMPUTED=False),
            "pairs-computed": dict(PAIR_ROWS_COMPUTED=True),
            "unordered-dkv": dict(ORDERED_DKV=False),
            "add-first": dict(STORE_FIRST_DQ=False),
            "atomic": {}, "fa4-det": {}}
# Only switches in the compile key, so that every variant compiles its own kernels.
assert all(set(v) <= set(_PRODUCT) for v in VARIANTS.values())
# Variants that keep the product's order, and so must give the product's bits (checked).
SAME_BITS = ("no-read-ahead", "read-ahead", "shift-afresh", "pairs-read", "pairs-computed", "add-first")


def _variant_list(text):
    names = text.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"--variants={text!r}: {unknown} unknown; allowed: {', '.join(VARIANTS)}")
    return names


_switches_set = [None]   # the variant's switches now on the class (None: not known)


def _set_switches(kernel, switches):
    if _switches_set[0] is switches:   # a round's calls of one variant follow each other: nothing to change
        return
    for name, value in dict(_PRODUCT, **switches).items():
        setattr(kernel, name, value)
    _switches_set[0] = switches


def main(out_dir, points=None, variants=None, rounds=1, gqa=1):
    points = points or POINTS
    variants = {name: VARIANTS[name] for name in (variants or VARIANTS)}
    kernel = bwd_sm90.OrderedBackwardSm90
    os.makedirs(out_dir, exist_ok=True)
    inputs, flops = {}, {}
    for hd, causal, s, sched in points:
        q, k, v, do = random_inputs(hd, s, 4)
        k, v = (t[:, :, :t.shape[2] // gqa].contiguous() for t in (k, v))
        out, lse = fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal)
        name = f"hdim{hd} {'causal' if causal else 'full'} {s}{f' gqa{gqa}' if gqa > 1 else ''} {sched}"
        inputs[name] = (sched, causal, (q, k, v, out, lse, do))
        flops[name] = bwd_flops(q.shape[0], q.shape[2], s, hd, causal)   # by query heads, as for MHA
    calls = {}
    for variant, switches in variants.items():
        for name, (sched, causal, tensors) in inputs.items():
            if variant == "fa4-det":
                if sched != ("spt" if causal else "ascending"):
                    continue   # FA4's deterministic mode runs one order per mask
                calls[(variant, name)] = functools.partial(fa4_bwd, *tensors, causal, True)
            else:
                schedule = "atomic" if variant == "atomic" else sched
                calls[(variant, name)] = functools.partial(_with_switches, kernel, switches, ours, schedule,
                                                           *tensors, causal)
    # The switches are class attributes read at compile time and part of the compile key, so
    # every variant's kernels live side by side: one untimed call each compiles them, then the
    # rounds interleave the variants (a slow spell of the GPU, such as the power cap's clock dips,
    # then hits them alike; docs/benchmarks/clocks-2026-11-25-h100/).
    _check_bits({key: call() for key, call in calls.items()})   # the gradients go before the timing
    with ClockMonitor(torch.device("cuda")) as monitor:
        lowest = {}
        times = time_rounds(calls, rounds, monitor.recording, lowest)
    _set_switches(kernel, {})
    results = {name: {} for name in flops}
    for (variant, name), ts in times.items():
        if not ts:
            continue
        results[name][variant] = round(flops[name] / median_ms(ts) / 1e9, 1)
        if rounds > 1:
            results[name][variant + " rounds"] = [round(flops[name] / t / 1e9, 1) for t in ts]
        if (variant, name) in lowest:
            results[name][variant + " lowest MHz"] = lowest[(variant, name)]
    for name, row in results.items():   # against atomic where it was timed
        print(name, " ".join(f"{k}={v}" + (f" ({v / row['atomic']:.2f}x atomic)" if "atomic" in row else "")
                             for k, v in row.items() if k in variants))
    with open(os.path.join(out_dir, "dq_chain.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rounds=rounds,
                       clock_monitor=monitor.describe(), results=results), f, indent=1)


def _check_bits(grads):
    """The variants of SAME_BITS must give the product's gradients bit for bit: a probe that
    times a faster kernel with other bits would time the wrong thing. Needs `ordered` timed too."""
    for (variant, name), got in grads.items():
        if variant in SAME_BITS and ("ordered", name) in grads:
            want = grads[("ordered", name)]
            if not same_bits(got, want):
                raise SystemExit(f"{variant} at {name}: gradients differ from the product's (ordered)")
            print(f"{variant} at {name}: same bits as ordered")


def _with_switches(kernel, switches, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the kernel's switches set for a variant (read when its kernels
    compile and when the call picks its compiled kernel by key)."""
    _set_switches(kernel, switches)
    return fn(*args, **kwargs)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("points", nargs="*", help="HDIM:causal|full:SEQLEN:SCHED[/SCHED] (the wait probe's syntax; "
                    "each schedule of a point is a point here)")
    ap.add_argument("--variants", type=_variant_list, help=f"comma list from {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds, the median kept (default 1)")
    ap.add_argument("--gqa", type=int, default=1, help="query heads per K/V head (default 1: MHA)")
    args = ap.parse_args()
    points = [(hd, c, s, x) for hd, c, s, scheds in map(parse_point, args.points) for x in scheds]
    main(args.out_dir, points or None, args.variants, args.rounds, args.gqa)
