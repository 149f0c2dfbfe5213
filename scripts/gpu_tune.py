"""Tile sweep for the forward and the backward: which fixed (block_m, block_n, warps, stages) rows
should kernels/tile_config.py hold? Times each candidate at the points that decide the targets,
with SDPA cuDNN timed in the same process as the yardstick, and writes JSON to argv[1].

The table itself stays fixed (docs/DESIGN.md, "Determinism rules", rule 2): this only informs what is committed.
Usage: python scripts/gpu_tune.py OUT.json [fwd|bwd|split|all] [max_minutes] [hdims, default 64,128]
"""
import json
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from dash_plugin import dispatch
from dash_plugin.kernels import attn_fwd, tile_config

FWD_CANDIDATES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 4),
                  (64, 128, 4, 3)]
BWD_CANDIDATES = [(64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2), (128, 128, 8, 2)]
SPLIT_KV_CANDIDATES = [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 1), (32, 64, 4, 2),
                       (64, 64, 4, 3)]
SPLIT_DQ_CANDIDATES = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2),
                       (64, 64, 4, 3), (128, 32, 4, 2)]
# hdim 256: the fp32 accumulators alone take 128 registers per thread at a 128x256 tile on 8 warps,
# so the rows above mostly do not fit; these keep one side of each tile at 32-64 rows.
CANDIDATES_256 = dict(
    fwd=[(64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3)],
    ordered=[(32, 64, 8, 1), (64, 64, 8, 1), (64, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 2)],
    split_kv=[(32, 64, 8, 1), (64, 64, 8, 1), (64, 64, 8, 2), (32, 64, 4, 2), (32, 128, 8, 1), (16, 64, 4, 2)],
    split_dq=[(32, 64, 8, 1), (64, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 1)])
# (hdim, seqlen, batch, causal, schedules timed in the "bwd" sweep)
POINTS = [(128, 8192, 2, True, ("descending", "atomic")), (128, 8192, 2, False, ("shift", "atomic")),
          (128, 2048, 8, True, ("descending",)), (64, 2048, 8, False, ("shift", "ascending")),
          (256, 8192, 2, True, ("descending", "atomic")), (256, 2048, 8, False, ("shift", "atomic"))]


def _candidates(d, kernel):
    if d == 256:
        return CANDIDATES_256[kernel]
    return dict(fwd=FWD_CANDIDATES, ordered=BWD_CANDIDATES, split_kv=SPLIT_KV_CANDIDATES,
                split_dq=SPLIT_DQ_CANDIDATES)[kernel]


def _inputs(d, s, b):
    h = 2048 // d
    return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def _time(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def main(path, which="all", max_minutes=8.0, hdims=(64, 128)):
    t_end = time.time() + 60 * max_minutes
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                  open(path, "w"), indent=1)

    def bwd(base, flops, q, k, v, do, out, lse, kw, sched, extra):
        try:
            ms = _time(lambda: dispatch.attention_backward(do, q, k, v, out, lse, backend="triton", schedule=sched,
                                                           deterministic=sched != "atomic", **kw))
            record(dict(base, impl="bwd", schedule=sched, **extra, tflops=2.5 * flops / ms / 1e9))
        except Exception as exc:  # out of shared memory / registers for this row
            record(dict(base, impl="bwd", schedule=sched, **extra, error=repr(exc)[:200]))

    for d, s, b, causal, scheds in [p for p in POINTS if p[0] in hdims]:
        default = dict(fwd=tile_config._FWD_SM90[d], ordered=tile_config._BWD_SM90[d],
                       split_kv=tile_config._SPLIT_KV_SM90[d], split_dq=tile_config._SPLIT_DQ_SM90[d])
        q, k, v, do = _inputs(d, s, b)
        flops = 4 * b * (2048 // d) * s * s * d / (2 if causal else 1)
        kw = dict(softmax_scale=d ** -0.5, causal=causal)
        base = dict(hdim=d, seqlen=s, causal=causal)
        # yardstick: cuDNN through SDPA (B, H, S, D layout), forward and backward
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            t_fwd = _time(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            t_bwd = _time(lambda: torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2), retain_graph=True))
        record(dict(base, impl="cudnn", fwd_tflops=flops / t_fwd / 1e9, bwd_tflops=2.5 * flops / t_bwd / 1e9))
        if which in ("fwd", "all"):
            for cfg in _candidates(d, "fwd"):
                if time.time() > t_end:
                    break
                tile_config._FWD_SM90[d] = tile_config.Tiles(*cfg)
                try:
                    ms = _time(lambda: attn_fwd.attention_forward(q, k, v, **kw))
                    record(dict(base, impl="fwd", cfg=cfg, tflops=flops / ms / 1e9))
                except Exception as exc:  # out of shared memory / registers for this row
                    record(dict(base, impl="fwd", cfg=cfg, error=repr(exc)[:200]))
            tile_config._FWD_SM90[d] = default["fwd"]
        out, lse = attn_fwd.attention_forward(q, k, v, **kw)
        if which in ("bwd", "all"):
            for cfg in _candidates(d, "ordered"):
                if time.time() > t_end:
                    break
                tile_config._BWD_SM90[d] = tile_config.Tiles(*cfg)
                for sched in scheds:
                    if time.time() < t_end:
                        bwd(base, flops, q, k, v, do, out, lse, kw, sched, dict(cfg=cfg))
            tile_config._BWD_SM90[d] = default["ordered"]
        if which in ("split", "all"):
            # the two split kernels are independent: sweep one with the other at its default
            for table in ("split_kv", "split_dq"):
                rows_of = tile_config._BWD_TABLES[table]
                for cfg in _candidates(d, table):
                    if time.time() < t_end:
                        rows_of[d] = tile_config.Tiles(*cfg)
                        bwd(base, flops, q, k, v, do, out, lse, kw, "split", dict(kernel=table, cfg=cfg))
                rows_of[d] = default[table]
        del q, k, v, do, out, lse, qt, kt, vt, o
        torch.cuda.empty_cache()


if __name__ == "__main__":
    argv = sys.argv[1:] + [None] * 4
    main(argv[0], argv[1] or "all", float(argv[2] or 8.0),
         tuple(int(x) for x in (argv[3] or "64,128").split(",")))
