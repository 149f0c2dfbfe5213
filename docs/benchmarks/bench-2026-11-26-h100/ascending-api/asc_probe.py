"""Does schedule="ascending" run slower than schedule="auto" (which resolves to ascending) at full
16k, as the dash-bench cells read? Both calls through the public API on dash-bench's inputs, the
gradients compared bit for bit, and the backward timed in four rounds that alternate which call
goes first (a power-cap dip then hits both). Run on the GPU machine from the repository root."""
import torch, triton, dash_plugin
from dash_plugin.bench.protocol import random_inputs
torch.manual_seed(0)
for hd in (64, 128):
    q, k, v, do = random_inputs(hd, 16384, 4)   # B, S, H, D as dash-bench
    res = {}
    calls = {}
    for sched in ("auto", "ascending"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = dash_plugin.flash_attention(qq, kk, vv, causal=False, schedule=sched, deterministic=True)
        print(hd, sched, dash_plugin.last_resolved().describe())
        calls[sched] = (lambda out=out, qq=qq, kk=kk, vv=vv: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
        g = calls[sched]()
        res[sched] = g
    print(hd, "same bits:", all(torch.equal(a, b) for a, b in zip(res["auto"], res["ascending"])))
    for r in range(4):
        for sched in (("auto", "ascending") if r % 2 == 0 else ("ascending", "auto")):
            ms = triton.testing.do_bench(calls[sched], warmup=25, rep=100, return_mode="median")
            print(f"  hd{hd} round {r} {sched:10s} {ms:.3f} ms")
