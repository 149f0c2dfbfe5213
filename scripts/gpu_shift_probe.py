"""Probe for the causal symmetric shift on the GPU (docs/benchmarks/NOTES.md has its history).
Each case runs the real two-segment shift tables (hdim 128, bf16, the tile table's row) in its own
process under a watchdog, and says whether it finished, matched `split` and gave the same bits
over 20 repeats. A case is debug-persistent-batch-heads-seqlen:
  debug       1: DASH_DEBUG_WAITS=1, a stuck wait becomes a StuckWaitError naming the dQ tile, the
              rank and the counter, and the stuck worker's tables are printed; 0: the plain build
  persistent  DASH_PERSISTENT_CYCLIC: 1 the persistent grid, 0 one program per worker
Usage: python scripts/gpu_shift_probe.py [seconds per case, default 30] [case ...]"""
import os
import subprocess
import sys
import time

# the plain build at the protocol shapes, then grids small enough to be resident at once, then the
# debug build at the shape that stalled in the benchmark
CASES = ["0-1-32-16-512", "0-1-16-16-1024", "0-1-8-16-2048", "0-0-1-1-512", "0-0-4-16-512",
         "0-0-32-16-512", "1-0-32-16-512"]


def one(case):
    debug, persistent, batch, heads, s = case.split("-")
    os.environ["DASH_DEBUG_WAITS"] = debug
    os.environ.setdefault("DASH_DEBUG_WAIT_POLLS", str(1 << 20))
    os.environ["DASH_PERSISTENT_CYCLIC"] = persistent
    import torch
    from dash_plugin import dispatch
    from dash_plugin.kernels import attn_fwd, tile_config
    from dash_plugin.kernels.backends import StuckWaitError
    from dash_plugin.schedules import kernel_tables
    q = torch.randn(int(batch), int(s), int(heads), 128, device="cuda", dtype=torch.bfloat16)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    kw = dict(softmax_scale=128 ** -0.5, causal=True)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)

    def shift():
        return dispatch.attention_backward(do, q, k, v, out, lse, backend="triton", schedule="shift", **kw)

    t0 = time.time()
    try:
        got = shift()
        torch.cuda.synchronize()
    except StuckWaitError as exc:
        print(f"{case}: STUCK: {exc}", flush=True)
        cfg = tile_config.bwd_config(q.dtype, 128, interpret=False)
        t = kernel_tables("shift", seqlens_q=[int(s)], seqlens_k=[int(s)], block_m=cfg.block_m,
                          block_n=cfg.block_n, causal=True, window_left=-1, window_right=0)
        print("variants", t.variants, "group", t.group_size, "workers", t.num_workers.tolist())
        for w in range(int(t.num_workers[0])):
            print(" worker", w, "seg_kv", t.seg_kv[0, w].tolist(), "seg_end", t.seg_end[0, w].tolist(),
                  "q", t.q_tile[0, w].tolist(), "rank", t.rank[0, w].tolist())
        return
    first = time.time() - t0
    same = all(all(torch.equal(a, b) for a, b in zip(got, shift())) for _ in range(20))
    ref = dispatch.attention_backward(do, q, k, v, out, lse, backend="triton", schedule="split", **kw)
    err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref))
    print(f"{case}: finished ({first:.2f}s first call), 20 repeats bitwise equal: {same}, "
          f"rel. difference to split {err:.1e}", flush=True)


def main(per_case, cases):
    for case in cases:
        try:
            subprocess.run([sys.executable, __file__, "--one", case], timeout=per_case, check=False)
        except subprocess.TimeoutExpired:
            print(f"{case}: HUNG (no result within {per_case:.0f} s)", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(sys.argv[2])
    else:
        main(float(sys.argv[1]) if len(sys.argv) > 1 else 30.0, sys.argv[2:] or CASES)
