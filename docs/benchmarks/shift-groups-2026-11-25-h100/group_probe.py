"""`shift` at full masks with cyclic groups smaller than a head (G = 4, 2) against the plan's
default (the whole head) and `atomic`, interleaved rounds. Why: on FA4's grid CTAs start in waves
of 132 (H100) and a head of 8 or 16 KV tiles straddles a wave boundary; groups of 4 tile the
wave exactly."""
import functools, json, os, sys
import torch
sys.path.insert(0, "scripts")
from dash_plugin.bench.protocol import bwd_flops, random_inputs
from dash_plugin.kernels import hopper_backend
from dash_plugin.kernels.hopper import fwd_sm90
from gpu_hopper_bwd import ours, median_ms, time_rounds

orig_tiles = hopper_backend.HopperBackend.tiles
GROUP = [None]
def tiles(self, r):
    t = orig_tiles(self, r)
    return t._replace(group_size=GROUP[0])
hopper_backend.HopperBackend.tiles = tiles

def with_group(g, fn, *args):
    GROUP[0] = g
    return fn(*args)

VARIANTS = {"shift": ("shift", None), "shift-G4": ("shift", 4), "shift-G2": ("shift", 2), "atomic": ("atomic", None)}
calls, flops = {}, {}
for spec in sys.argv[2].split(","):
    hd, s = map(int, spec.split(":"))
    q, k, v, do = random_inputs(hd, s, 4)
    out, lse = fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=False)
    flops[(hd, s)] = bwd_flops(q.shape[0], q.shape[2], s, hd, False)
    for name, (sched, g) in VARIANTS.items():
        calls[(name, hd, s)] = functools.partial(with_group, g, ours, sched, q, k, v, out, lse, do, False)
grads = {key: fn() for key, fn in calls.items()}
for (name, hd, s), g in grads.items():
    ref = grads[("shift", hd, s)]
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(g, ref))
    print(f"hdim{hd} full {s} {name}: max rel diff to shift {err:.2e}", flush=True)
    assert err < 2e-2, err
times = time_rounds(calls, int(sys.argv[3]))
res = {}
for (name, hd, s), ts in times.items():
    res[f"hdim{hd} full {s} {name}"] = [round(flops[(hd, s)] / t / 1e9, 1) for t in ts]
for (hd, s) in flops:
    a = flops[(hd, s)] / median_ms(times[("atomic", hd, s)]) / 1e9
    print(f"hdim{hd} full {s}: " + " ".join(
        f"{n}={flops[(hd, s)] / median_ms(times[(n, hd, s)]) / 1e9:.1f} ({flops[(hd, s)] / median_ms(times[(n, hd, s)]) / 1e9 / a:.2f}x atomic)"
        for n in VARIANTS), flush=True)
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(dict(device=torch.cuda.get_device_name(), rounds=res), open(os.path.join(sys.argv[1], "groups.json"), "w"), indent=1)
