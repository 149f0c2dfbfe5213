"""Whether a forward at 1k tokens is timed by its kernel or by the host that launches it.

At hdim 128 causal 1k (B=16, H=16) the forward kernel runs about 150 us, while our API spends
100-200 us of host time per call on the GPU machine's CPU: a do_bench window in which the host is
slower than usual then times the host. This script times, in one process, three calls on the same
inputs: `ours` (dash_plugin.flash_attention with inputs that require grad, what dash-bench's
forward column runs), `cudnn` (SDPA's cuDNN backend) and `kernel` (our sm90 forward launched
directly, without the API); for each, five do_bench medians and the host microseconds per call
(wall time of 20 unsynchronised calls). Three rounds: quiet, with `nvidia-smi -lms 50` running
(what dash-bench's clock monitor does), quiet again.

    python scripts/gpu_host_jitter.py
"""
import os
import shutil
import subprocess
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import dash_plugin
from dash_plugin.kernels.hopper import fwd_sm90

sys.path.insert(0, os.path.dirname(__file__))
from gpu_host_cost import loop_us  # noqa: E402

B, S, H, D = 16, 1024, 16, 128


def main():
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    qd, kd, vd = (x.detach() for x in (q, k, v))

    def ours():
        return dash_plugin.flash_attention(q, k, v, causal=True)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def kernel():
        return fwd_sm90.attention_forward(qd, kd, vd, softmax_scale=D ** -0.5, causal=True)

    calls = dict(ours=ours, cudnn=cudnn, kernel=kernel)
    for fn in calls.values():   # compile and warm
        fn()
        fn()
    torch.cuda.synchronize()

    def round_(tag):
        for name, fn in calls.items():
            medians = [do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(5)]
            print(f"{tag:10s} {name:7s} do_bench ms {[round(m, 4) for m in medians]}  host {loop_us(fn, 20, 50)[0]:.1f} us/call",
                  flush=True)

    round_("quiet")
    smi = subprocess.Popen([shutil.which("nvidia-smi"), "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    round_("smi-50ms")
    smi.terminate()
    smi.wait()
    time.sleep(0.5)
    round_("quiet2")


if __name__ == "__main__":
    main()
