"""atomic and ordered backward, FA4's grid and persistent, one call each inside a profiler range."""
import sys
import torch
sys.path.insert(0, "scripts")
from dash_plugin.bench.protocol import random_inputs
from dash_plugin.kernels.hopper import bwd_sm90, fwd_sm90
from gpu_hopper_bwd import ours
K = bwd_sm90.OrderedBackwardSm90
calls = []
for hd, causal, s, sched in [(128, False, 1024, "ascending"), (128, True, 1024, "descending")]:
    q, k, v, do = random_inputs(hd, s, 4)
    out, lse = fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal)
    for schedule in ("atomic", sched):
        for pers in (False, True):
            calls.append((pers, schedule, (q, k, v, out, lse, do, causal)))
def run(pers, schedule, args):
    K.PERSISTENT = pers
    return ours(schedule, *args)
for _ in range(3):
    for c in calls: run(*c)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for c in calls:
    run(*c)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
