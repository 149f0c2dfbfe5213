"""Side-by-side timing of the Hopper backend where a batch is not one dense square: packed
(varlen) documents, unequal query/key lengths, sliding windows. Every column runs on the same
inputs in this process: our Hopper orders, our Triton `split`, and FA4 (`flash-attn-4`)
deterministic and not, when it imports; the forward next to FA4's.

FLOPs count the visible (query, key) pairs exactly: forward 4 * D * pairs per head, backward
2.5x that. Each column is timed once per round (CUDA events, median of do_bench), rounds
interleaved, and the median round kept.

With --dropout P it times instead forward + backward with dropout P and without, per packed
point, on the Hopper backend (the schedule `auto` takes there) and on our Triton `split` (where
packed dropout ran before the Hopper kernels took it): the cost ratio and the speed-up.

Usage: python3 scripts/gpu_varlen_bench.py [--points docs,unequal,window] [--repeat 3] [--out DIR]
       python3 scripts/gpu_varlen_bench.py --points docs --dropout 0.1
"""
import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from dash_plugin import dispatch  # noqa: E402
from dash_plugin.kernels.hopper.masks import fa4_mask as fa4_mask_of  # noqa: E402
from gpu_hopper_bwd import gpu_environment, have_fa4, median_ms, time_rounds  # noqa: E402

DTYPE = torch.bfloat16
TOKENS = 16384


def doc_lengths(lo: int, hi: int, seed: int) -> list[int]:
    """Document lengths drawn uniformly from [lo, hi] until TOKENS are filled (the last one cut)."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < TOKENS:
        lens.append(min(int(torch.randint(lo, hi + 1, (1,), generator=g)), TOKENS - sum(lens)))
    return lens


def visible_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """(query, key) pairs a bottom-right aligned band lets through in one sequence."""
    i = torch.arange(sq, dtype=torch.int64) + (sk - sq)
    lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = (i + right).clamp(max=sk - 1) if right >= 0 else torch.full_like(i, sk - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def points(kinds):
    """(name, per-sequence (S_q, S_k) or None for a dense batch, dense (B, S_q, S_k), head dim, GQA,
    causal, window_left, window_right)."""
    out = []
    if "docs" in kinds:
        lens = [(n, n) for n in doc_lengths(256, 4096, seed=0)]
        for d, gqa, causal in ((128, 1, True), (128, 1, False), (64, 1, True), (128, 4, True)):
            out.append(("docs256-4k", lens, None, d, gqa, causal, -1, -1))
        out.append(("docs64-1k", [(n, n) for n in doc_lengths(64, 1024, seed=0)], None, 128, 1, True, -1, -1))
    if "unequal" in kinds:
        out.append(("q1k-k4k", None, (4, 1024, 4096), 128, 1, True, -1, -1))
    if "window" in kinds:
        out.append(("causal-window2k", None, (2, 8192, 8192), 128, 1, True, 2047, -1))
        out.append(("band512", None, (2, 8192, 8192), 128, 1, False, 512, 512))
    return out


def make(seqs, dense, d, gqa, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hq = 2048 // d
    hkv = hq // gqa
    rnd = lambda *sh: torch.randn(*sh, device="cuda", dtype=DTYPE, generator=g)  # noqa: E731
    if seqs is None:
        b, sq, sk = dense
        return dict(q=rnd(b, sq, hq, d), k=rnd(b, sk, hkv, d), v=rnd(b, sk, hkv, d), do=rnd(b, sq, hq, d), kw={})
    cq, ck = (torch.tensor([0] + list(itertools.accumulate(s[i] for s in seqs)), dtype=torch.int32, device="cuda")
              for i in (0, 1))
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(s[0] for s in seqs),
              max_seqlen_k=max(s[1] for s in seqs))
    tq, tk = int(cq[-1]), int(ck[-1])
    return dict(q=rnd(tq, hq, d), k=rnd(tk, hkv, d), v=rnd(tk, hkv, d), do=rnd(tq, hq, d), kw=kw)


def dropout_cost(env, kinds, p: float, repeat: int, out_dir: str):
    """Forward + backward ms with dropout p and without, Hopper (auto's order) and Triton split."""
    from dash_plugin.schedules import auto
    rows = []
    for name, seqs, dense, d, gqa, causal, left, right in points(kinds):
        t = make(seqs, dense, d, gqa)
        q, k, v, do, kw = t["q"], t["k"], t["v"], t["do"], t["kw"]
        mask = dict(causal=causal, window_left=left, window_right=-1 if causal else right)
        longest = kw["max_seqlen_q"] if seqs is not None else dense[1]
        order = auto.choose_schedule(causal=causal, head_dim=d, seqlen_q=longest, seqlen_k=longest,
                                     varlen=seqs is not None, window_left=left, window_right=mask["window_right"],
                                     backend="hopper")

        def step(backend, schedule, dropout_p):
            out, lse = dispatch.attention_forward(q, k, v, softmax_scale=d ** -0.5, backend=backend, dropout_p=dropout_p,
                                                  seed=5, **mask, **kw)
            return dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=d ** -0.5, schedule=schedule,
                                               backend=backend, dropout_p=dropout_p, seed=5, **mask, **kw)
        impls = {f"{b}-{s_}-p{x}": (lambda b=b, s_=s_, x=x: step(b, s_, x))
                 for b, s_ in (("hopper", order), ("triton", "split")) for x in (0.0, p)}
        times = time_rounds(impls, repeat)
        row = {"point": name, "hdim": d, "gqa": gqa, "causal": causal, "dropout_p": p, "schedule": order,
               "sequences": len(seqs) if seqs is not None else dense[0]}
        for n, ts in times.items():
            row[f"{n} ms"] = None if not ts else round(median_ms(ts), 3)
        for b, s_ in (("hopper", order), ("triton", "split")):
            with_, without = row[f"{b}-{s_}-p{p} ms"], row[f"{b}-{s_}-p0.0 ms"]
            row[f"{b} cost"] = None if not (with_ and without) else round(with_ / without, 3)
        hop, tri = row[f"hopper-{order}-p{p} ms"], row[f"triton-split-p{p} ms"]
        row["hopper/triton speed-up"] = None if not (hop and tri) else round(tri / hop, 2)
        print(f"{name} d{d} gqa{gqa} {'causal' if causal else 'full'} dropout {p}: "
              + " ".join(f"{n}={row[n]}" for n in row if n.endswith(("ms", "cost", "speed-up"))), flush=True)
        rows.append(row)
        with open(os.path.join(out_dir, "varlen_dropout.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        del t, q, k, v, do
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="docs,unequal,window")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="time forward + backward with this dropout against none instead (see above)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    env = gpu_environment()
    print(env, flush=True)
    if a.dropout > 0:
        return dropout_cost(env, a.points.split(","), a.dropout, a.repeat, a.out)
    fa4 = have_fa4()
    rows = []
    for name, seqs, dense, d, gqa, causal, left, right in points(a.points.split(",")):
        t = make(seqs, dense, d, gqa)
        q, k, v, do, kw = t["q"], t["k"], t["v"], t["do"], t["kw"]
        right = 0 if causal else right
        pairs = (sum(visible_pairs(sq, sk, left, right) for sq, sk in seqs) if seqs is not None
                 else dense[0] * visible_pairs(dense[1], dense[2], left, right))
        fwd_flops = 4 * d * q.shape[-2] * pairs
        mask = dict(causal=causal, window_left=left, window_right=-1 if causal else right)
        scale = d ** -0.5
        out, lse = dispatch.attention_forward(q, k, v, softmax_scale=scale, backend="hopper", **mask, **kw)

        def ours(schedule, backend="hopper"):
            return dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=scale, schedule=schedule,
                                               deterministic=schedule != "atomic", backend=backend, **mask, **kw)

        fa4_causal, _, fa4_left, fa4_right = fa4_mask_of(causal, left, right)
        fa4_mask = dict(causal=fa4_causal, window_size_left=fa4_left, window_size_right=fa4_right)
        bwd = {f"cute-{s}": (lambda s=s: ours(s)) for s in ("ascending", "spt", "descending", "atomic")}
        if causal and left < 0:
            bwd["cute-arrival"] = lambda: ours("arrival")
        bwd["triton-split"] = lambda: ours("split", backend="triton")
        fwd = {"cute-fwd": lambda: dispatch.attention_forward(q, k, v, softmax_scale=scale, backend="hopper",
                                                              **mask, **kw)}
        if fa4:
            from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
            fa4_lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("-inf")), lse)
            for det in (True, False):
                bwd["fa4-det" if det else "fa4"] = (
                    lambda det=det: _flash_attn_bwd(q, k, v, out, do, fa4_lse, softmax_scale=scale,
                                                    deterministic=det, **fa4_mask, **kw))
            fwd["fa4-fwd"] = lambda: _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True,
                                                     **fa4_mask, **kw)
        impls = {**bwd, **fwd}
        times = time_rounds(impls, a.repeat)
        row = {"point": name, "hdim": d, "gqa": gqa, "causal": causal, "window": [left, right],
               "sequences": len(seqs) if seqs is not None else dense[0],
               "lengths": [list(s) for s in seqs] if seqs is not None else list(dense), "fwd_gflop": fwd_flops / 1e9}
        for n, ts in times.items():
            flops = fwd_flops * (1 if n in fwd else 2.5)
            row[n] = None if not ts else round(flops / median_ms(ts) / 1e9, 1)
            if ts:
                row[f"{n} rounds"] = [round(flops / x / 1e9, 1) for x in ts]
        det = [row[n] for n in bwd if n.startswith("cute-") and n != "cute-atomic" and row[n]]
        best = max(det) if det else None
        ratios = ""
        if best and row.get("fa4-det"):
            ratios += f" best-det/fa4-det {best / row['fa4-det']:.2f}"
        if row.get("cute-fwd") and row.get("fa4-fwd"):
            ratios += f" fwd/fa4 {row['cute-fwd'] / row['fa4-fwd']:.2f}"
        print(f"{name} d{d} gqa{gqa} {'causal' if causal else 'full'} window{left},{right}: "
              + " ".join(f"{n}={row[n]}" for n in impls) + ratios, flush=True)
        rows.append(row)
        with open(os.path.join(a.out, "varlen_bench.json"), "w") as f:   # after every point: a run cut
            json.dump({"env": env, "rows": rows}, f, indent=1)             # short keeps what it measured
        del t, q, k, v, do, out, lse
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
