"""Backward tile sweep: which fixed (block_m, block_n, warps, stages) row should the table hold?

Times our backward (dQ/dK/dV) for a few candidate rows at the points that decide the targets,
all in one process on one GPU, and writes JSON to argv[1]. The table itself stays fixed
(DESIGN.md rule 2): this script only informs what is committed to kernels/tile_config.py.
"""
import json
import sys
import time

import torch
from triton.testing import do_bench

import dash_plugin
from dash_plugin.kernels import tile_config

CANDIDATES = [(64, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3),
              (64, 128, 8, 3), (128, 128, 8, 2)]
POINTS = [(128, 8192, 2, True, "descending"), (128, 8192, 2, False, "atomic"), (128, 8192, 2, False, "shift"),
          (64, 2048, 8, False, "shift")]


def main(path):
    rows = []
    for d, s, b, causal, sched in POINTS:
        h = 2048 // d
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(4))
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        for bm, bn, w, st in CANDIDATES:
            tile_config._BWD_SM90[d] = tile_config.BwdConfig(bm, bn, w, st)
            det = sched != "atomic"
            out = dash_plugin.flash_attention(q, k, v, causal=causal, schedule=sched, deterministic=det)
            row = dict(hdim=d, seqlen=s, causal=causal, schedule=sched, cfg=[bm, bn, w, st])
            try:
                fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
                t0 = time.time()
                fn()
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t0, 2)
                ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
                row.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as exc:  # out of shared memory / registers for this row
                row["error"] = repr(exc)[:200]
            rows.append(row)
            print(row, flush=True)
        del q, k, v, do, out
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
              open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
