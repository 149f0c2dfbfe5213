"""Does the GPU's clock explain the scatter of single timings? Times one backward twelve times in
a row (triton's do_bench, 100 ms windows, as the timing scripts do) while nvidia-smi samples the
SM clock, board power and throttle reasons every 100 ms; each round's start and end go to
rounds.json beside the samples (smi.csv), to be lined up afterwards.

    python scripts/gpu_clock_scatter.py OUT_DIR

On an H100 (docs/benchmarks/clocks-2026-11-25-h100/) the low rounds were the ones timed while
the power cap pulled the clock down as the board's power ramped up.
"""
import functools
import json
import os
import subprocess
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin.bench.protocol import bwd_flops, random_inputs  # noqa: E402
from dash_plugin.kernels.hopper import fwd_sm90  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gpu_hopper_bwd import ours  # noqa: E402

POINTS = [(64, False, 16384, "atomic"), (64, True, 8192, "spt")]   # (head dim, causal, seqlen, schedule)


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    query = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    with open(os.path.join(out_dir, "smi.csv"), "w") as samples:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-lms", "100"],
                               stdout=samples)
        rows = []
        try:
            for hd, causal, s, sched in POINTS:
                q, k, v, do = random_inputs(hd, s, 4)
                out, lse = fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal)

                call = functools.partial(ours, sched, q, k, v, out, lse, do, causal)
                call()
                torch.cuda.synchronize()
                for _ in range(12):
                    start = time.time()
                    ms = triton.testing.do_bench(call, warmup=25, rep=100)
                    rows.append(dict(point=f"hdim{hd} {'causal' if causal else 'full'} {s} {sched}", start=start,
                                     end=time.time(), tflops=round(bwd_flops(q.shape[0], q.shape[2], s, hd, causal)
                                                                   / ms / 1e9, 1)))
                    print(rows[-1], flush=True)
        finally:
            smi.terminate()
    with open(os.path.join(out_dir, "rounds.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
