"""Regression probe for the causal symmetric shift, which stalled on the GPU in the first kernel
build: runs the two-segment shift tables under DASH_DEBUG_WAITS=1, so a stuck wait becomes a
StuckWaitError naming the dQ tile, the rank and the counter value, and then prints the tables of
the worker that gave up. Each case runs in its own process with a watchdog."""
import os
import subprocess
import sys
import time

# seqlen-block_m-block_n-batch-heads: the small grids that finished, and the bench shape that stalled
CASES = ["1024-64-128-1-2", "512-64-128-1-16", "512-64-128-32-1", "512-64-128-4-16", "512-64-128-32-16"]


def one(case):
    os.environ["DASH_DEBUG_WAITS"] = "1"
    os.environ.setdefault("DASH_DEBUG_WAIT_POLLS", str(1 << 20))
    import torch
    from dash_plugin.kernels import attn_bwd, attn_fwd, tile_config
    from dash_plugin.schedules import kernel_tables
    s, bm, bn, batch, heads = (int(x) for x in case.split("-"))
    tile_config._BWD_SM90[128] = tile_config.Tiles(bm, bn, 8, 3)
    attn_bwd._ALLOW_SYMMETRIC_SHIFT = True
    q = torch.randn(batch, s, heads, 128, device="cuda", dtype=torch.bfloat16)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    kw = dict(softmax_scale=128 ** -0.5, causal=True)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    t0 = time.time()
    try:
        got = attn_bwd.attention_backward(do, q, k, v, out, lse, schedule="shift", **kw)
        torch.cuda.synchronize()
        ref = attn_bwd.attention_backward(do, q, k, v, out, lse, schedule="split", **kw)
        err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref))
        print(f"{case}: finished in {time.time() - t0:.2f}s, rel. difference to split {err:.2e}", flush=True)
    except attn_bwd.StuckWaitError as exc:
        print(f"{case}: STUCK: {exc}", flush=True)
        t = kernel_tables("shift", seqlens_q=[s], seqlens_k=[s], block_m=bm, block_n=bn, causal=True,
                          window_left=-1, window_right=0)
        print("variants", t.variants, "group", t.group_size, "workers", t.num_workers.tolist())
        for w in range(int(t.num_workers[0])):
            print(" worker", w, "seg_kv", t.seg_kv[0, w].tolist(), "seg_end", t.seg_end[0, w].tolist(),
                  "q", t.q_tile[0, w].tolist(), "rank", t.rank[0, w].tolist())
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
    for c in CASES:
        try:
            subprocess.run([sys.executable, __file__, c], timeout=45)
        except subprocess.TimeoutExpired:
            print(f"{c}: watchdog: no answer in 45 s (a hang that DASH_DEBUG_WAITS did not catch)", flush=True)
