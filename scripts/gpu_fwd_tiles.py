"""The Hopper forward with other tile shapes than FA4's, next to cuDNN, in one process on one GPU:
is the gap to cuDNN at short sequences (hdim 64 causal 1k) a matter of tiles, and is the forward
with dropout (latency-bound at hdim 128) faster on narrower tiles? Times FA4's sm90 forward kernel
as kernels/hopper/fwd_sm90.py launches it (its grid and tail-aligned tiles included, re-planned
for each tile shape) with FA4's tile choice and with alternatives, and SDPA's cuDNN forward, on
the same inputs (bf16, 16k tokens per point, model dim 2048, the dash-bench protocol's shapes).
Columns are timed in interleaved rounds (each round times every column once, in turn) and the
median is reported, so a slow spell of the GPU's clock lands on one round, not one column. An
alternative's output is compared with the default's (the same math in another order: close, not
equal).

    python scripts/gpu_fwd_tiles.py OUT_DIR [--points 64:causal:1024,...] [--rounds 3]
                                            [--dropout 0.1] [--tiles 64=128x128,192x96;128=128x96]

Writes OUT_DIR/fwd_tiles.json and prints a table of forward TFLOP/s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin.bench.protocol import fwd_flops, random_inputs  # noqa: E402
from dash_plugin.kernels.hopper import fwd_sm90  # noqa: E402

# (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); None is FA4's own choice
DEFAULT_TILES = {64: [None, (128, 128, True, True), (128, 176, True, True), (192, 96, True, True)],
                 128: [None, (128, 96, True, True), (128, 176, True, True), (128, 128, False, True)]}
DEFAULT_POINTS = [f"{hd}:{mask}:{s}" for hd in (64, 128) for mask in ("causal", "full") for s in (1024, 2048, 4096)]


_caches: dict = {}   # tiles -> (compiled kernels, plans) of fwd_sm90 for that tile shape


def with_tiles(tiles):
    """fwd_sm90 compiling and planning with `tiles` (None: FA4's choice). Each tile shape gets its
    own compile and plan caches (a plan deals the tiles of one shape, so a shared one would be
    wrong, not slow), so interleaved rounds compile each shape once."""
    fa4 = fwd_sm90.fa4
    original = getattr(fa4, "_original_tile_size_fwd_sm90", fa4._tile_size_fwd_sm90)
    fa4._original_tile_size_fwd_sm90 = original
    if tiles is None:
        fa4._tile_size_fwd_sm90 = original
    else:
        cfg_type = type(original(128, 128, True, False))
        fa4._tile_size_fwd_sm90 = lambda *a, **k: cfg_type(*tiles)
    fwd_sm90._compiled, fwd_sm90._plans = _caches.setdefault(tiles, ({}, {}))


def tile_name(tiles) -> str:
    return "fa4-tiles" if tiles is None else "x".join(map(str, tiles[:2])) + ("" if tiles[2] else "-noRS")


def parse_tiles(text: str) -> dict:
    """'64=128x128,192x96;128=128x96-noRS' -> {64: [None, (128, 128, True, True), ...], ...}"""
    table = {}
    for part in text.split(";"):
        hd, shapes = part.split("=")
        row = [None]
        for shape in shapes.split(","):
            rs = not shape.endswith("-noRS")
            m, n = shape.removesuffix("-noRS").split("x")
            row.append((int(m), int(n), rs, True))
        table[int(hd)] = row
    return table


def time_point(hd, causal, s, tiles_list, rounds, dropout):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = random_inputs(hd, s, 3)
    flops = fwd_flops(q.shape[0], q.shape[2], s, hd, causal)
    calls, errors, row = {}, {}, {}
    reference = None
    for tiles in tiles_list:   # compile each and check it against FA4's tiles before any timing
        name = tile_name(tiles)
        try:
            with_tiles(tiles)
            out, _ = fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal,
                                                dropout_p=dropout, seed=1234)
            reference = out if reference is None else reference
            errors[name] = float((out.float() - reference.float()).abs().max())
            calls[name] = tiles
        except Exception as e:   # a shape the kernel does not support: recorded, not fatal
            row[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    times = {name: [] for name in [*calls, "sdpa-cudnn"]}
    for _ in range(rounds):
        for name, tiles in calls.items():
            with_tiles(tiles)
            call = lambda: fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal,
                                                      dropout_p=dropout, seed=1234)
            times[name].append(triton.testing.do_bench(call, warmup=25, rep=100))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            times["sdpa-cudnn"].append(triton.testing.do_bench(
                lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                warmup=25, rep=100))
    with_tiles(None)
    for name, ms in times.items():
        row[name] = dict(tflops=flops / statistics.median(ms) / 1e9, ms=ms,
                         **({} if name == "sdpa-cudnn" else dict(max_diff_to_default=errors[name])))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--points", default=",".join(DEFAULT_POINTS), help="hdim:causal|full:seqlen,...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p of our forward (cuDNN runs without)")
    parser.add_argument("--tiles", default=None, help="alternatives per head dim, e.g. 64=128x128,192x96;128=128x96")
    args = parser.parse_args(argv)
    tiles_table = parse_tiles(args.tiles) if args.tiles else DEFAULT_TILES
    os.makedirs(args.out_dir, exist_ok=True)
    rows = []
    for point in args.points.split(","):
        hd, mask, s = point.split(":")
        hd, s, causal = int(hd), int(s), mask == "causal"
        if mask not in ("causal", "full"):
            raise SystemExit(f"--points: mask {mask!r} in {point!r}: expected causal or full")
        row = dict(head_dim=hd, causal=causal, seqlen=s, dropout_p=args.dropout,
                   **time_point(hd, causal, s, tiles_table[hd], args.rounds, args.dropout))
        rows.append(row)
        cells = "  ".join(f"{k}={v['tflops']:.1f}" if "tflops" in v else f"{k}=ERR"
                          for k, v in row.items() if isinstance(v, dict))
        print(f"hdim{hd} {mask} {s} p={args.dropout}: {cells}", flush=True)
    with open(os.path.join(args.out_dir, "fwd_tiles.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rounds=args.rounds,
                       grid=fwd_sm90.GRID, tail_align=fwd_sm90.TAIL_ALIGN, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
