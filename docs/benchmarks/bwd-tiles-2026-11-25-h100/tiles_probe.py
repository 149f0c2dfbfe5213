"""hdim 128 full masks: the backward on FA4's 80-query tiles (product) against 64-query tiles
(FA4's masked config), per schedule, interleaved rounds. Each tile choice keeps its own compiled
kernels (the compile key does not hold the tiles)."""
import functools, json, os, sys
import torch
sys.path.insert(0, "scripts")
from dash_plugin.bench.protocol import bwd_flops, random_inputs
from dash_plugin.kernels.hopper import bwd_sm90, fwd_sm90, tile_table
from gpu_hopper_bwd import ours, median_ms, time_rounds

TILES = {"rows80": ((64, 128), (80, 128)), "rows64": ((64, 128), (64, 128))}
compiled = {name: {} for name in TILES}

def with_tiles(name, fn, *args):
    tile_table._BWD_TILES[128] = TILES[name]
    bwd_sm90._compiled = compiled[name]
    return fn(*args)

calls, flops = {}, {}
for s in [int(x) for x in sys.argv[2].split(",")]:
    q, k, v, do = random_inputs(128, s, 4)
    out, lse = fwd_sm90.attention_forward(q, k, v, softmax_scale=128 ** -0.5, causal=False)
    flops[s] = bwd_flops(q.shape[0], q.shape[2], s, 128, False)
    for sched in sys.argv[3].split(","):
        for name in TILES:
            calls[(name, s, sched)] = functools.partial(with_tiles, name, ours, sched, q, k, v, out, lse, do, False)
grads = {key: fn() for key, fn in calls.items()}
for (name, s, sched), g in grads.items():
    if name == "rows64":
        ref = grads[("rows80", s, sched)]
        err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(g, ref))
        print(f"full {s} {sched}: rows64 vs rows80 max rel diff {err:.2e}", flush=True)
        assert err < 2e-2, err
times = time_rounds(calls, int(sys.argv[4]))
res = {}
for (name, s, sched), ts in times.items():
    res[f"{name} full {s} {sched}"] = [round(flops[s] / t / 1e9, 1) for t in ts]
for s in flops:
    line = []
    for sched in sys.argv[3].split(","):
        for name in TILES:
            line.append(f"{sched}/{name}={round(flops[s] / median_ms(times[(name, s, sched)]) / 1e9, 1)}")
    print(f"hdim128 full {s}: " + " ".join(line), flush=True)
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(dict(device=torch.cuda.get_device_name(), rounds=res), open(os.path.join(sys.argv[1], "tiles.json"), "w"), indent=1)
