"""Forward TFLOP/s of the persistent grid with its tiles dealt under other TILE_OVERHEAD values."""
import sys, torch
sys.path.insert(0, "scripts")
from gpu_hopper_bwd import time_rounds, median_ms
from dash_plugin.kernels.hopper import fwd_sm90, fwd_tile_order
VARIANTS = {"TO1": 1, "TO0": 0, "TO2": 2, "TO4": 4}
for point in sys.argv[1:]:
    d, mask, s = point.split(":"); d, s = int(d), int(s); causal = mask == "causal"
    b, h = 16384 // s, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    f = lambda: fwd_sm90.attention_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal)
    plans, outs = {}, {}
    for name, overhead in VARIANTS.items():
        fwd_tile_order.TILE_OVERHEAD = overhead
        fwd_sm90._plans.clear()
        outs[name] = f()
        plans[name] = dict(fwd_sm90._plans)
    fwd_tile_order.TILE_OVERHEAD = 1
    same = all(torch.equal(outs[n][0], outs["TO1"][0]) for n in VARIANTS)
    def with_(table):
        def run():
            fwd_sm90._plans.clear(); fwd_sm90._plans.update(table); return f()
        return run
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    t = time_rounds({n: with_(p) for n, p in plans.items()}, 7)
    print(f"d{d} {mask} {s} same_bits {same}: " + " ".join(
        f"{n} {flops / median_ms(ts) / 1e9:.1f} {[round(flops / x / 1e9, 1) for x in ts]}" for n, ts in t.items()), flush=True)
