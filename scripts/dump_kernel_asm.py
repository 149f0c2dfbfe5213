"""Compile the KV-stationary backward kernel for sm90 without a GPU and write its TTGIR, PTX and SASS,
to read what Triton made of the ordered waits (e.g. the causal symmetric shift's stall, which
happens with DASH_DEBUG_WAITS off and not with it on: docs/benchmarks/NOTES.md).
Usage: python scripts/dump_kernel_asm.py OUT_DIR [debug_waits 0|1] [persistent 0|1]
Needs the triton wheel's bundled ptxas; hdim 128 bf16 causal, 64x128 tiles, 8 warps, 3 stages."""
import os
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)   # must be unset before triton is imported

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dash_plugin.kernels import attn_bwd  # noqa: E402

POINTER_TYPES = {**dict.fromkeys(("Q", "K", "V", "DO", "DK", "DV"), "*bf16"),
                 **dict.fromkeys(("DQA", "LSE", "DELTA"), "*fp32"),
                 **dict.fromkeys(("CU_Q", "CU_K", "SEM", "ERR", "T_PERM", "T_NWORK", "T_SEGKV", "T_SEGEND",
                                  "T_QTILE", "T_RANK"), "*i32")}
FLOATS = ("scale", "scale_log2", "softcap", "inv_keep")


def main(out_dir, debug="0", persistent="0"):
    fn = attn_bwd._bwd_kv_kernel
    const = dict(PERSISTENT=persistent == "1", MODE=1, NO_WAIT=False, DEBUG_WAITS=debug == "1", VARLEN=False,
                 EVEN_D=True, HAS_WL=False, HAS_WR=True, SOFTCAP=False, DROPOUT=False,
                 BLOCK_M=64, BLOCK_N=128, BLOCK_D=128)
    sig = {n: "constexpr" if n in const else POINTER_TYPES.get(n, "fp32" if n in FLOATS else "i32")
           for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3, enable_fp_fusion=True))
    os.makedirs(out_dir, exist_ok=True)
    tag = f"bwd_kv_ordered_debug{debug}_persistent{persistent}"
    for ext in ("ttgir", "ptx"):
        with open(os.path.join(out_dir, f"{tag}.{ext}"), "w") as f:
            f.write(kernel.asm[ext])
    cubin = os.path.join(out_dir, f"{tag}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    # SASS: what ptxas made of the waits (where the release and the polls ended up)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    with open(os.path.join(out_dir, f"{tag}.sass"), "w") as f:
        f.write(sass)
    print(f"wrote {out_dir}/{tag}.ttgir, .ptx, .cubin and .sass")


if __name__ == "__main__":
    main(*sys.argv[1:4])
