"""Probe: which shift variant stalls on the GPU? Each case runs in its own process with a watchdog
(a stuck kernel cannot be interrupted; the process exits instead)."""
import os
import subprocess
import sys
import time

CASES = ["full-stages2", "causal-stages2", "causal-stages1", "full-stages1", "desc-causal-stages2"]


def one(case):
    import torch
    from dash_plugin.kernels import attn_bwd, attn_fwd, tile_config
    mask, stages = case.rsplit("-", 1)[0], int(case[-1])
    schedule = "descending" if mask.startswith("desc") else "shift"
    causal = "causal" in mask
    orig = tile_config.bwd_config
    tile_config.bwd_config = lambda *a, **k: tile_config.BwdConfig(64, 128, 8, stages) if not k.get("interpret") else orig(*a, **k)
    q = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    kw = dict(softmax_scale=128 ** -0.5, causal=causal)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    ev = torch.cuda.Event()
    attn_bwd.attention_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > 15:
            print(f"{case}: STUCK", flush=True)
            os._exit(3)
        time.sleep(0.01)
    print(f"{case}: finished", flush=True)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
    for c in CASES:
        subprocess.run([sys.executable, __file__, c], timeout=60)
