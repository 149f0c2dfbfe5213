"""Each backward order under sustained load: its throughput, SM clock and power at the power cap.

`gpu_hopper_bwd.py` times an order in a 100 ms window after 25 ms of warm-up, so a round that
falls in one of the power cap's clock dips reads slow, and at some full-mask points one order's
rounds fell in the dips more often than the others'. A training step keeps the GPU at its cap. Here
each order runs back to back for --seconds, and only the second half is timed (CUDA events over
the whole half, so no gaps between calls are hidden), while `nvidia-smi` samples the SM clock and
the board power. Energy per backward = mean power x time per backward: an order that draws more
power for the same work is slower at the cap, whoever wins a short window.

    python scripts/gpu_sustained_orders.py --points 128:full:4096,128:full:16384 --rounds 2 --out DIR
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_hopper_bwd import forward, gpu_environment, make, ours, schedules_for  # noqa: E402

from dash_plugin.bench.clocks import ClockMonitor  # noqa: E402


def parse_power(line: str):
    """(SM MHz, board watts) of one `clocks.sm,power.draw` line, or None for one without them."""
    try:
        mhz, watts = (float(x) for x in line.split(","))
    except ValueError:
        return None
    return mhz, watts


def between(samples, t0, t1):
    """Median SM MHz and mean watts of the samples between two monotonic instants (None, None: none)."""
    inside = [(m, w) for t, m, w in list(samples) if t0 <= t <= t1]
    if not inside:
        return None, None
    return statistics.median(m for m, _ in inside), statistics.mean(w for _, w in inside)


def sustained(fn, seconds):
    """Run fn back to back for `seconds`; time the second half as one stretch of calls.
    Returns (ms per call, monotonic start and end of the timed half)."""
    end = time.monotonic() + seconds / 2
    while time.monotonic() < end:
        fn()
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.monotonic()
    start_event.record()
    calls = 0
    while time.monotonic() - t0 < seconds / 2:
        fn()
        calls += 1
    end_event.record()
    torch.cuda.synchronize()
    return start_event.elapsed_time(end_event) / calls, t0, time.monotonic()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", required=True, help="comma list of hdim:causal|full:seqlen[:gqa] (16k tokens a point, "
                    "model dim 2048)")
    ap.add_argument("--orders", default="", help="only these orders (default: every order of the mask, atomic too)")
    ap.add_argument("--seconds", type=float, default=4.0, help="per order and round; the second half is timed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    unknown = sorted(set(x for x in a.orders.split(",") if x) - set(schedules_for(True)))
    if unknown:
        ap.error(f"--orders: {', '.join(unknown)} not an order of this backend ({', '.join(schedules_for(True))})")
    results = {"env": gpu_environment(), "seconds": a.seconds, "points": []}
    print(results["env"], flush=True)
    device = torch.device("cuda", torch.cuda.current_device())
    with ClockMonitor(device, query="clocks.sm,power.draw", parse=parse_power) as power:
        if power.reason:
            raise SystemExit(f"no clock and power samples: {power.reason}")
        for point in a.points.split(","):
            d, mask, s, *gqa = point.split(":")
            d, s, causal, gqa = int(d), int(s), mask == "causal", int(gqa[0]) if gqa else 1
            b, hq = 16384 // s, 2048 // d
            q, k, v, do = make(b, s, hq, hq // gqa, d, seed=7)
            out, lse = forward(q, k, v, causal)
            flops = 2.5 * 4 * b * hq * s * s * d / (2 if causal else 1)
            orders = [o for o in schedules_for(causal) if not a.orders or o in a.orders.split(",")]
            if not orders:
                raise SystemExit(f"--orders {a.orders!r}: none of them runs at a {mask} mask "
                                 f"(orders: {', '.join(schedules_for(causal))})")
            rows = {o: [] for o in orders}
            for _ in range(a.rounds):
                for o in orders:
                    fn = lambda o=o: ours(o, q, k, v, out, lse, do, causal)  # noqa: E731
                    fn()   # compiled before the clock starts
                    ms, t0, t1 = sustained(fn, a.seconds)
                    mhz, watts = between(power.samples, t0, t1)
                    rows[o].append({"tflops": round(flops / ms / 1e9, 1), "ms": round(ms, 4), "sm_mhz": mhz,
                                    "watts": watts and round(watts, 1),
                                    "joules_per_bwd": watts and round(watts * ms / 1e3, 4)})
            line = " ".join(f"{o}={[r['tflops'] for r in rs]}@{[r['sm_mhz'] for r in rs]}MHz,"
                            f"{[r['watts'] for r in rs]}W" for o, rs in rows.items())
            print(f"sustained d{d} {mask} S{s} gqa{gqa}: {line}", flush=True)
            results["points"].append({"hdim": d, "mask": mask, "seqlen": s, "heads": hq, "gqa": gqa,
                                      "orders": rows})
            save(results, a.out)   # after every point: a run cut by its time limit keeps what it measured


def save(results, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sustained.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
