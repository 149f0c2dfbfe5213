"""Does the causal symmetric shift stall, and does the persistent grid fix it? Each case runs the
real shift tables (no debug waits) in its own process under a watchdog: one program per worker
(DASH_PERSISTENT_CYCLIC=0) and the persistent grid (=1), at the protocol shapes (16k tokens, 16
heads, hdim 128) and at grids small enough to be resident at once. A finished case is checked
against `split` and for bitwise-equal gradients over 20 repeats.
Usage: python scripts/gpu_persistent_probe.py [seconds per case, default 20]"""
import os
import subprocess
import sys
import time

# persistent-batch-heads-seqlen
CASES = ["1-32-16-512", "1-16-16-1024", "1-8-16-2048", "0-1-1-512", "0-4-16-512", "0-32-16-512"]


def one(case):
    import torch
    from dash_plugin.kernels import attn_bwd, attn_fwd
    persistent, batch, heads, s = case.split("-")
    os.environ["DASH_PERSISTENT_CYCLIC"] = persistent
    attn_bwd._ALLOW_SYMMETRIC_SHIFT = True
    q = torch.randn(int(batch), int(s), int(heads), 128, device="cuda", dtype=torch.bfloat16)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    kw = dict(softmax_scale=128 ** -0.5, causal=True)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    t0 = time.time()
    got = attn_bwd.attention_backward(do, q, k, v, out, lse, schedule="shift", **kw)
    torch.cuda.synchronize()
    first = time.time() - t0
    same = all(all(torch.equal(a, b) for a, b in zip(got, attn_bwd.attention_backward(
        do, q, k, v, out, lse, schedule="shift", **kw))) for _ in range(20))
    ref = attn_bwd.attention_backward(do, q, k, v, out, lse, schedule="split", **kw)
    err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref))
    print(f"{case}: finished ({first:.2f}s first call), 20 repeats bitwise equal: {same}, "
          f"rel. difference to split {err:.1e}", flush=True)


def main(per_case):
    for case in CASES:
        try:
            subprocess.run([sys.executable, __file__, "--one", case], timeout=per_case, check=False)
        except subprocess.TimeoutExpired:
            print(f"{case}: HUNG (no result within {per_case:.0f} s)", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(sys.argv[2])
    else:
        main(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0)
