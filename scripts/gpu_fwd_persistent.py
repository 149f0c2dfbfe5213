"""The Hopper forward on its persistent grid (kernels/hopper/fwd_persistent.py) against FA4's
one-tile-per-CTA grid, with and without tail-aligned Q tiles (fwd_tail_aligned.py), and what
`auto` picks.

Per point, on the same inputs in one process: the output and LSE of the persistent grid compared
bit for bit with FA4's grid (with dropout too at the first point), of tail-aligned tiles with
FA4's tiling where the point moves them, and of the product with the `fa4` column when it is
timed. The `one-tile` and `persistent` columns run with tail-aligned tiles where the point moves
them (FA4's tiling is `fa4` or `auto-fa4-tiling`); then forward TFLOP/s of the chosen columns (the grids
as named, `auto` as the product runs, `auto-fa4-tiling` the same without tail alignment, `fa4`
FA4's kernel on its own grid with its tiling, SDPA's cuDNN backend), every column once per round over interleaved rounds, the median kept. 16k
tokens per point, model dim 2048, bf16.

    python3 scripts/gpu_fwd_persistent.py OUT_DIR [--points 128:causal:1024,64:full:2048,...]
        [--gqa 1] [--repeat 5] [--dropout P] [--columns one-tile,persistent,cudnn]
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gpu_hopper_bwd import gpu_environment, median_ms, same_bits, time_rounds  # noqa: E402
from dash_plugin.bench.protocol import fwd_flops  # noqa: E402
from dash_plugin.kernels.hopper import fwd_sm90  # noqa: E402

POINTS = ",".join(f"{d}:{m}:{s}" for d in (128, 64) for m in ("causal", "full") for s in (1024, 2048, 4096, 16384))


COLUMNS = ("one-tile", "persistent", "auto", "auto-fa4-tiling", "fa4", "cudnn")


def forward(q, k, v, grid, causal, tail_align=True, **kw):
    """`grid`: one of fwd_sm90.GRIDS."""
    fwd_sm90.GRID, fwd_sm90.TAIL_ALIGN = grid, tail_align
    try:
        return fwd_sm90.attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=causal, **kw)
    finally:
        fwd_sm90.GRID, fwd_sm90.TAIL_ALIGN = "auto", True


def column(name, q, k, v, causal, drop):
    """A callable timing column `name` (COLUMNS)."""
    if name == "cudnn":
        return lambda: cudnn(q, k, v, causal)
    if name == "auto-fa4-tiling":
        return lambda: forward(q, k, v, "auto", causal, tail_align=False, **drop)
    if name == "fa4":   # FA4's kernel as FA4 runs it: its grid, its tiling (our launch, not its host code)
        return lambda: forward(q, k, v, "one-tile", causal, tail_align=False, **drop)
    return lambda: forward(q, k, v, name, causal, **drop)


def cudnn(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                enable_gqa=kt.shape[1] != qt.shape[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--points", default=POINTS, help="hdim:causal|full:seqlen,...")
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dropout", type=float, default=0.0, help="time the forward with this dropout (cuDNN: without)")
    ap.add_argument("--columns", default="one-tile,persistent,cudnn", help=f"timed, of {','.join(COLUMNS)}")
    ap.add_argument("--tile", help="M,N: every forward with these tiles instead of FA4's (an experiment; other bits)")
    args = ap.parse_args()
    columns = args.columns.split(",")
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        ap.error(f"--columns {','.join(unknown)}: expected some of {','.join(COLUMNS)}")
    if args.tile:
        _force_tiles(*(int(x) for x in args.tile.split(",")))
    results = {"env": gpu_environment(), "dropout": args.dropout, "tile": args.tile, "rows": []}
    print(results["env"], flush=True)
    os.makedirs(args.out, exist_ok=True)
    drop = dict(dropout_p=args.dropout, seed=7) if args.dropout else {}
    for n, point in enumerate(args.points.split(",")):
        d, mask, s = point.split(":")
        d, s, causal = int(d), int(s), mask == "causal"
        b, hq = 16384 // s, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(5)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, s, hq // args.gqa, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        plan = fwd_sm90.plan_of(q, k, v, causal=causal, dropout_p=args.dropout)
        row = {"hdim": d, "mask": mask, "seqlen": s, "gqa": args.gqa,
               "auto takes": "persistent" if plan.ctas else "one-tile", "q_shift": plan.q_shift,
               "same_bits": same_bits(forward(q, k, v, "one-tile", causal, **drop),
                                      forward(q, k, v, "persistent", causal, **drop))}
        product = forward(q, k, v, "auto", causal, **drop)
        if row["q_shift"]:
            row["same_bits, FA4's tiling"] = same_bits(product, column("auto-fa4-tiling", q, k, v, causal, drop)())
        if "fa4" in columns:   # the timed FA4 column gives the product's bits
            row["same_bits, FA4's kernel"] = same_bits(product, column("fa4", q, k, v, causal, drop)())
        if n == 0:   # the other side of dropout too: the same mask and bits on both grids
            other = {} if drop else dict(dropout_p=0.1, seed=7)
            row["same_bits, dropout " + ("off" if drop else "on")] = same_bits(
                forward(q, k, v, "one-tile", causal, **other), forward(q, k, v, "persistent", causal, **other))
        flops = fwd_flops(b, hq, s, d, causal)
        impls = {name: column(name, q, k, v, causal, drop) for name in columns}
        times = time_rounds(impls, args.repeat)
        for name, ts in times.items():
            row[name] = None if not ts else round(flops / median_ms(ts) / 1e9, 1)
            row[f"{name} rounds"] = [round(flops / t / 1e9, 1) for t in ts or []]
        bits = ", ".join(f"{k} {v}" for k, v in row.items() if k.startswith("same_bits"))
        print(f"d{d} {mask} S{s} gqa{args.gqa} (auto: {row['auto takes']}, q_shift {row['q_shift']}): {bits}; "
              + " ".join(f"{name} {row[name]}" for name in impls) + " TFLOP/s", flush=True)
        results["rows"].append(row)
        with open(os.path.join(args.out, "fwd_persistent.json"), "w") as f:
            json.dump(results, f, indent=1)
        del q, k, v
        torch.cuda.empty_cache()


def _force_tiles(tile_m, tile_n):
    fa4 = fwd_sm90.fa4
    original = fa4._tile_size_fwd_sm90
    fa4._tile_size_fwd_sm90 = lambda *a, **kw: dataclasses.replace(original(*a, **kw), m_block_size=tile_m,
                                                                    n_block_size=tile_n)


if __name__ == "__main__":
    main()
