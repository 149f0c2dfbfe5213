"""The forward's TMA loads against its pointer loads, side by side in one process on one GPU:
same outputs bit for bit (out and lse, torch.equal), and the forward time of each at the
protocol's points (bf16, 16k tokens, model dim 2048). Writes OUT/fwd_tma.json and prints a table.
Usage: python scripts/gpu_fwd_tma.py OUT_DIR"""
import json
import os
import sys

import torch
import triton

from dash_plugin.bench.protocol import fwd_flops, random_inputs
from dash_plugin.kernels import attn_fwd

POINTS = [(hd, causal, s) for hd in (64, 128) for causal in (True, False) for s in (512, 2048, 8192, 16384)]
POINTS += [(256, True, 2048), (256, False, 8192)]


def use_tma(on):
    os.environ["DASH_FWD_TMA"] = "1" if on else "0"   # read per call by attn_fwd


def forward(q, k, v, causal):
    return attn_fwd.attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=causal)


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for hd, causal, s in POINTS:
        q, k, v = random_inputs(hd, s, 3)
        batch, heads = q.shape[0], q.shape[2]
        use_tma(True)
        a = forward(q, k, v, causal)
        use_tma(False)
        b = forward(q, k, v, causal)
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        # alternate the two so drift in clocks hits both alike
        ms = {True: [], False: []}
        for _ in range(3):
            for tma in (True, False):
                use_tma(tma)   # outside the timed call
                ms[tma].append(triton.testing.do_bench(lambda: forward(q, k, v, causal), warmup=10, rep=50))
        flops = fwd_flops(batch, heads, s, hd, causal)
        t_on, t_off = min(ms[True]), min(ms[False])
        row = dict(hdim=hd, causal=causal, seqlen=s, batch=batch, heads=heads, bitwise_equal=same,
                   tma_ms=t_on, pointer_ms=t_off, tma_tflops=flops / t_on / 1e9, pointer_tflops=flops / t_off / 1e9,
                   speedup=t_off / t_on)
        rows.append(row)
        print(f"hdim{hd} {'causal' if causal else 'full'} {s:5d}: TMA {row['tma_tflops']:6.1f} TFLOP/s, "
              f"pointers {row['pointer_tflops']:6.1f}, {row['speedup']:.3f}x, bitwise equal {same}", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(os.path.join(out_dir, "fwd_tma.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
