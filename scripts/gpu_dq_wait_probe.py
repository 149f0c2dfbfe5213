"""Where the Hopper backward's dQ writer waits, schedule by schedule. The writer of each CTA
handles one Q tile per step: wait for its rank (the ordered add's turn), wait for the consumers'
partial and issue the add, wait for the add to land. With OrderedBackwardSm90.RECORD_WAITS the
kernel sums the SM clock cycles of each of those waits into spare columns of the dQ counters
(a probe build, off in the product). For each point and schedule this prints, per step of a
writer (cycles, averaged over every CTA and step):

  rank     waiting for one's turn at the dQ tile;
  partial  waiting for the consumers' dQ partial (the writer is ahead: the products are the
           bottleneck) and issuing the add;
  landing  waiting for the add to land in global memory;

then the rank wait by launch position (the first heads launched against the rest: the first
wave starts all at once), by KV tile and by Q tile, and the backward TFLOP/s of the same
schedule without recording, beside `atomic`.

    python scripts/gpu_dq_wait_probe.py OUT_DIR [HDIM:causal|full:SEQLEN:SCHED/SCHED ...]

Points given after OUT_DIR replace the built-in POINTS.

Writes OUT_DIR/dq_waits.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin import dispatch  # noqa: E402
from dash_plugin.bench.protocol import bwd_flops, random_inputs  # noqa: E402
from dash_plugin.kernels.hopper import bwd_sm90, bwd_tiles, fwd_sm90  # noqa: E402
from dash_plugin.schedules import make_geometry  # noqa: E402

# (head dim, causal, seqlen, schedules)
POINTS = [(128, True, 2048, ("descending", "arrival", "spt", "ascending")),
          (128, True, 8192, ("descending", "arrival", "spt")),
          (64, True, 8192, ("spt", "arrival", "descending")),
          (128, False, 1024, ("shift", "ascending")),
          (128, False, 4096, ("ascending",))]


def profile(counters, steps_per_kv):
    """Summaries of one call's recorded counters (B, H, M, 5), steps_per_kv[n] = visits of KV tile n."""
    c = counters.to(torch.float64).cpu()
    n = len(steps_per_kv)
    steps = torch.tensor(steps_per_kv, dtype=torch.float64)
    total_steps = float(steps.sum()) * c.shape[0] * c.shape[1]
    per_step = {name: float(c[:, :, :n, col].sum()) / total_steps
                for name, col in (("rank", 2), ("landing", 3), ("partial", 4))}
    heads = c[:, :, :n, 2].sum(-1).flatten()          # launch order: batch-major, then head
    head_steps = float(steps.sum())
    first = max(1, len(heads) // 8)
    by_kv = (c[:, :, :n, 2].sum((0, 1)) / (steps * c.shape[0] * c.shape[1])).tolist()
    rows = c[:, :, :, 1].sum((0, 1))
    return dict(per_step={k: round(v) for k, v in per_step.items()},
                rank_first_eighth_of_heads=round(float(heads[:first].sum()) / (first * head_steps)),
                rank_other_heads=round(float(heads[first:].sum()) / (max(1, len(heads) - first) * head_steps)),
                rank_by_head=[round(float(x) / head_steps) for x in heads],
                rank_by_kv_tile=[round(x) for x in by_kv],
                rank_by_q_tile_total=[round(float(x) / c.shape[0] / c.shape[1]) for x in rows])


def main(out_dir, points=None):
    points = points or POINTS
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    cls = bwd_sm90.OrderedBackwardSm90
    for hd, causal, s, schedules in points:
        q, k, v, do = random_inputs(hd, s, 4)
        out, lse = fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal)
        flops = bwd_flops(q.shape[0], q.shape[2], s, hd, causal)
        point = f"hdim{hd} {'causal' if causal else 'full'} {s}"
        geo = make_geometry(s, s, *bwd_tiles(hd, causal), -1, 0 if causal else -1)
        steps = [hi - lo + 1 for lo, hi in geo.kv_range]   # visits of each KV tile

        def call(schedule):
            return dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=hd ** -0.5, causal=causal,
                                               schedule=schedule, backend="hopper",
                                               deterministic=schedule != "atomic")

        row = {"atomic": round(flops / triton.testing.do_bench(lambda: call("atomic"), warmup=25, rep=100) / 1e9, 1)}
        for sched in schedules:
            tflops = round(flops / triton.testing.do_bench(lambda: call(sched), warmup=25, rep=100) / 1e9, 1)
            cls.RECORD_WAITS = True
            try:
                bwd_sm90.recorded_waits.clear()
                call(sched)           # compiles the recording build
                bwd_sm90.recorded_waits.clear()
                call(sched)
                torch.cuda.synchronize()
                counters = bwd_sm90.recorded_waits[-1]
            finally:
                cls.RECORD_WAITS = False
                bwd_sm90.recorded_waits.clear()
            prof = profile(counters, steps)
            row[sched] = dict(tflops=tflops, vs_atomic=round(tflops / row["atomic"], 3), **prof)
            ps = prof["per_step"]
            print(f"{point} {sched:10s} {tflops:6.1f} TFLOP/s ({tflops / row['atomic']:.2f}x atomic) per step: "
                  f"rank {ps['rank']} partial {ps['partial']} landing {ps['landing']} cycles; rank, first eighth "
                  f"of heads {prof['rank_first_eighth_of_heads']} / others {prof['rank_other_heads']}", flush=True)
            print(f"    rank by KV tile: {prof['rank_by_kv_tile'][:8]} ... {prof['rank_by_kv_tile'][-4:]}", flush=True)
            print(f"    rank by head (launch order): {prof['rank_by_head'][:16]}", flush=True)
        results[point] = row
    with open(os.path.join(out_dir, "dq_waits.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f, indent=1)


def parse_point(text):
    """HDIM:causal|full:SEQLEN:SCHED/SCHED -> a POINTS entry."""
    hd, mask, s, sched = text.split(":")
    if mask not in ("causal", "full"):
        raise SystemExit(f"point {text!r}: mask {mask!r}; allowed: causal, full")
    return int(hd), mask == "causal", int(s), tuple(sched.split("/"))


if __name__ == "__main__":
    main(sys.argv[1], [parse_point(p) for p in sys.argv[2:]] or None)
