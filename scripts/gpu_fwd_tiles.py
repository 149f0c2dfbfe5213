"""The Hopper forward at short sequences with other tile shapes than FA4's, next to cuDNN, in
one process on one GPU: is the gap to cuDNN at 1k-2k (hdim 64 causal 1k: 0.76x) a matter of
tiles? Times FA4's sm90 forward kernel (kernels/hopper/fwd_sm90.py) with FA4's tile choice and
with the alternatives below, and SDPA's cuDNN forward, on the same inputs (bf16, 16k tokens per
point, model dim 2048, the dash-bench protocol's shapes). An alternative's output is compared
with the default's (the same math in another order: close, not equal).

    python scripts/gpu_fwd_tiles.py OUT_DIR

Writes OUT_DIR/fwd_tiles.json and prints a table of forward TFLOP/s.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin.bench.protocol import fwd_flops, random_inputs  # noqa: E402
from dash_plugin.kernels.hopper import fwd_sm90  # noqa: E402

# (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); None is FA4's own choice
ALTERNATIVES = {64: [None, (128, 128, True, True), (128, 176, True, True), (192, 96, True, True)],
                128: [None, (128, 96, True, True), (128, 176, True, True), (128, 128, False, True)]}
POINTS = [(hd, causal, s) for hd in (64, 128) for causal in (True, False) for s in (1024, 2048, 4096)]


def with_tiles(tiles):
    """fwd_sm90 compiling with `tiles` (None: FA4's choice); its compile cache is emptied."""
    fa4 = fwd_sm90.fa4
    original = getattr(fa4, "_original_tile_size_fwd_sm90", fa4._tile_size_fwd_sm90)
    fa4._original_tile_size_fwd_sm90 = original
    if tiles is None:
        fa4._tile_size_fwd_sm90 = original
    else:
        cfg_type = type(original(128, 128, True, False))
        fa4._tile_size_fwd_sm90 = lambda *a, **k: cfg_type(*tiles)
    fwd_sm90._compiled.clear()


def main(out_dir):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for hd, causal, s in POINTS:
        q, k, v = random_inputs(hd, s, 3)
        flops = fwd_flops(q.shape[0], q.shape[2], s, hd, causal)
        row = dict(head_dim=hd, causal=causal, seqlen=s)
        reference = None
        for tiles in ALTERNATIVES[hd]:
            name = "fa4-tiles" if tiles is None else "x".join(map(str, tiles[:2])) + ("" if tiles[2] else "-noRS")
            try:
                with_tiles(tiles)
                call = lambda: fwd_sm90.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal)
                out, _ = call()
                if reference is None:
                    reference = out
                err = float((out.float() - reference.float()).abs().max())
                ms = triton.testing.do_bench(call, warmup=25, rep=100)
                row[name] = dict(tflops=flops / ms / 1e9, max_diff_to_default=err)
            except Exception as e:   # a shape the kernel does not support: recorded, not fatal
                row[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        with_tiles(None)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = triton.testing.do_bench(
                lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), warmup=25, rep=100)
        row["sdpa-cudnn"] = dict(tflops=flops / ms / 1e9)
        rows.append(row)
        cells = "  ".join(f"{k}={v['tflops']:.1f}" if "tflops" in v else f"{k}=ERR"
                          for k, v in row.items() if isinstance(v, dict))
        print(f"hdim{hd} {'causal' if causal else 'full'} {s}: {cells}", flush=True)
    with open(os.path.join(out_dir, "fwd_tiles.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
