"""Per-kernel GPU time of one GQA 4:1 deterministic backward (and MHA for comparison), torch.profiler."""
import sys
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, "scripts")
from dash_plugin.bench.protocol import random_inputs
from dash_plugin.kernels.hopper import fwd_sm90
from gpu_hopper_bwd import ours
for hd, s, causal, gqa, sched in [(128, 2048, False, 4, "ascending"), (128, 2048, False, 1, "ascending"), (128, 2048, True, 4, "arrival"), (128, 4096, False, 4, "ascending")]:
    q, k, v, do = random_inputs(hd, s, 4)
    k, v = (t[:, :, :t.shape[2] // gqa].contiguous() for t in (k, v))
    out, lse = fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal)
    for _ in range(3):
        ours(sched, q, k, v, out, lse, do, causal)
    torch.cuda.synchronize()
    n = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            ours(sched, q, k, v, out, lse, do, causal)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            rows.setdefault(e.name[:90], []).append(e.device_time)
    total = sum(sum(v) for v in rows.values()) / n
    print(f"== hdim{hd} {'causal' if causal else 'full'} {s} gqa{gqa} {sched}: {total:.1f} us of kernels per call")
    for name, ts in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(ts) / n:8.1f} us  x{len(ts) // n}  {name}")
