"""Where the Hopper dropout's time goes (a diagnostic, not a benchmark of record): forward and
backward timed apart, with and without dropout, for the mask drawn ahead by
kernels/dropout_bits.py (`ahead`, with the drawing kernels timed alone), and drawn in the kernels
by Philox with 10 rounds (the mask), 7 rounds, and a stand-in mixer of a few instructions (wrong
mask, shows the cost that is not Philox).

    python scripts/gpu_dropout_probe.py OUT_DIR [VARIANT,...]   (each variant in its own process;
                                                                default: philox10,philox7,mixer)
"""
import json
import os
import subprocess
import sys

import torch


def measure(variant):
    from dash_plugin import dispatch
    from dash_plugin.kernels import hopper
    from dash_plugin.kernels.hopper import dropout_sm90 as d
    from dash_plugin.kernels.dropout_bits import BitLayout, draw
    os.environ["DASH_DROPOUT_MASK"] = "ahead" if variant == "ahead" else "inline"
    if variant == "philox7":
        d.PHILOX_ROUNDS = 7
    elif variant == "mixer":
        def mixer(c0, c1, c2, c3, k0, k1):
            a = c0 * d.Uint32(0x9E3779B1) ^ c1 ^ k0
            return a, a * d.Uint32(0x85EBCA77), a ^ c2, (a >> 7) ^ c3 ^ k1
        d._philox = mixer
    from scripts.gpu_hopper_dropout import timed
    rows = {}
    for hd, causal in ((128, True), (128, False), (64, True)):
        s, b, h = 4096, 4, 16
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        res = {}
        for p in (0.0, 0.1):
            fwd = lambda: hopper.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal, dropout_p=p, seed=3)
            out, lse = fwd()
            bwd = lambda: dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=hd ** -0.5, causal=causal,
                                                      schedule="descending", backend="hopper", dropout_p=p, seed=3)
            res[p] = (timed(fwd), timed(bwd))
        ms = dict(fwd=res[0.0][0], fwd_drop=res[0.1][0], bwd=res[0.0][1], bwd_drop=res[0.1][1])
        if variant == "ahead":   # the drawing kernels alone, with the tiles the two kernels read
            from flash_attn.cute import interface as fa4
            fwd_tiles = fa4._tile_size_fwd_sm90(hd, hd, causal, False)
            bwd_tiles = hopper.bwd_tiles(hd, causal)
            window = (-1, 0) if causal else (-1, -1)
            for name, layout in (("draw_fwd", BitLayout(s, s, fwd_tiles.m_block_size, fwd_tiles.n_block_size, False)),
                                 ("draw_bwd", BitLayout(s, s, bwd_tiles[1], bwd_tiles[0], True))):
                ms[name] = timed(lambda: draw(3, 0.1, b, h, layout, *window, device="cuda"))
        rows[f"hd{hd} {'causal' if causal else 'full'} 4k"] = dict(
            fwd_cost=res[0.1][0] / res[0.0][0], bwd_cost=res[0.1][1] / res[0.0][1], ms=ms)
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        print(json.dumps(measure(sys.argv[2])))
        sys.exit(0)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    result = {}
    variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ("philox10", "philox7", "mixer")
    for variant in variants:
        text = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))).stdout
        result[variant] = json.loads(text.strip().splitlines()[-1])
        for key, r in result[variant].items():
            print(variant, key, f"fwd {r['fwd_cost']:.3f}  bwd {r['bwd_cost']:.3f}", {k: round(v, 3) for k, v in r["ms"].items()}, flush=True)
    with open(os.path.join(out, "probe.json"), "w") as f:
        json.dump(result, f, indent=1)
