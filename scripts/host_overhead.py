"""Host (Python) cost of one call of the public API, measured on the CPU with the kernels stubbed.

What it measures: the microseconds that `dash_plugin.flash_attention` spends on the host per call
when a given backend runs it, without any kernel: config resolution, backend and schedule choice,
the autograd Function, the `dash::fwd` / `dash::bwd` ops, the launch plan lookup and the
backend's own Python up to the point where it would launch. Three timings per backend, each the
median over many calls after a warm-up (the first call builds the plan; later ones must not):

  fwd (grad)  `flash_attention(q, k, v, causal=...)` with inputs that require grad (what
              dash-bench's forward column runs);
  bwd         `torch.autograd.backward(out, dout)` of such a forward (timed alone);
  fwd+bwd     both, one after the other;

plus `stubs alone`, what the stubs themselves cost (their empty allocations), to subtract.
A cProfile of fwd+bwd calls follows, sorted by own time and by cumulative time.

How: the machine has no GPU, so the script makes the backend selection pick the backend on CPU
tensors, for this process only:
  - `backends.AUTO_ORDER["cpu"]` = the CUDA order, and `Request.device_type` says "cuda", so the
    backends' real `supports` checks run;
  - hopper: `hopper_backend._is_sm90` and `hopper.available` say yes, and
    `hopper.attention_forward` / `attention_backward` (FA4's forward, our CuTe DSL backward) are
    stubs returning empty tensors of the right shapes;
  - triton (--backend triton): `_is_sm90` says no (a non-Hopper GPU), `attn_fwd.attention_forward`
    and `triton_backend._backward` are stubs, so the Triton backend's own launch code (strides,
    grids, ~20-40 kernel arguments) is not counted, only the layers both backends share;
  - `torch.cuda.get_device_properties` answers a fixed 132-SM device (its real cost on a GPU,
    a few us, is not counted where a backend calls it per call).
Everything else is the installed code, unchanged. Inputs are CPU tensors of the given shape.
Batch and heads change no host work, only the size of the stubs' allocations: the default
(B=2, H=8) keeps those in the heap, where B=16, H=16 maps and unmaps 64 MB per tensor and adds
~25 us (`stubs alone` says how much). S and D pick the schedule and the plan.

Usage: python scripts/host_overhead.py [--backend hopper|triton|both] [--shape B,S,H,D]
       [--full] [--calls N] [--profile-calls N] [--top N]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
import types
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dash_plugin  # noqa: E402
from dash_plugin.kernels import attn_fwd, backends, hopper, hopper_backend, triton_backend  # noqa: E402


def _fwd_stub(q, k, v, **_):
    """(out, lse) as the forward kernels return them: like q, and fp32 (B, H, S), packed (H, T)."""
    lse_shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty_like(q), torch.empty(lse_shape, device=q.device, dtype=torch.float32)


def _bwd_stub(dout, q, k, v, *_, **__):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _triton_bwd_stub(plan, dout, q, k, v, *_, **__):
    return _bwd_stub(dout, q, k, v)


@contextlib.contextmanager
def stubbed(backend: str):
    """Within the block, `backend="auto"` calls on CPU tensors run `backend` ("hopper" or
    "triton") with its kernels replaced by stubs (see the module doc)."""
    fake_props = types.SimpleNamespace(multi_processor_count=132)
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(mock.patch.dict(backends.AUTO_ORDER, {"cpu": backends.AUTO_ORDER["cuda"]}))
        patch(mock.patch.object(backends.Request, "device_type", property(lambda self: "cuda")))
        patch(mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: fake_props))
        patch(mock.patch.object(hopper_backend, "_is_sm90", lambda device: backend == "hopper"))
        patch(mock.patch.object(hopper, "available", lambda: True))
        patch(mock.patch.object(hopper, "attention_forward", _fwd_stub))
        patch(mock.patch.object(hopper, "attention_backward", _bwd_stub))
        patch(mock.patch.object(attn_fwd, "attention_forward", _fwd_stub))
        patch(mock.patch.object(triton_backend, "_backward", _triton_bwd_stub))
        yield


def _median_us(fn, calls: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        times.append(fn())
    return statistics.median(times) / 1e3


def measure(backend: str, shape, causal: bool, calls: int, warmup: int, profile_calls: int, top: int):
    b, s, h, d = shape
    q, k, v = (torch.empty(b, s, h, d, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = torch.empty(b, s, h, d, dtype=torch.bfloat16)

    def clear():
        q.grad = k.grad = v.grad = None   # no accumulation into the last call's gradients

    def fwd():
        t0 = time.perf_counter_ns()
        dash_plugin.flash_attention(q, k, v, causal=causal)
        return time.perf_counter_ns() - t0

    def bwd():
        out = dash_plugin.flash_attention(q, k, v, causal=causal)
        clear()
        t0 = time.perf_counter_ns()
        torch.autograd.backward(out, dout)
        return time.perf_counter_ns() - t0

    def fwd_bwd():
        clear()
        t0 = time.perf_counter_ns()
        torch.autograd.backward(dash_plugin.flash_attention(q, k, v, causal=causal), dout)
        return time.perf_counter_ns() - t0

    def stubs_alone():
        t0 = time.perf_counter_ns()
        _fwd_stub(q, k, v)
        _bwd_stub(dout, q, k, v)
        return time.perf_counter_ns() - t0

    with stubbed(backend):
        fwd_bwd()
        ran = dash_plugin.last_resolved()
        if ran.concrete_backend != backend:
            raise SystemExit(f"expected the {backend} backend to run, got: {ran.describe()}")
        print(f"\n== {backend}: B={b} S={s} H={h} D={d} bf16 causal={causal}: {ran.describe()}")
        for name, fn in (("fwd (grad)", fwd), ("bwd", bwd), ("fwd+bwd", fwd_bwd), ("stubs alone", stubs_alone)):
            print(f"{name:12s} {_median_us(fn, calls, warmup):8.1f} us per call (median of {calls})")
        if profile_calls:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(profile_calls):
                fwd_bwd()
            profiler.disable()
            stats = pstats.Stats(profiler, stream=sys.stdout).strip_dirs()
            print(f"-- cProfile of {profile_calls} fwd+bwd calls, by own time")
            stats.sort_stats("tottime").print_stats(top)
            print("-- by cumulative time")
            stats.sort_stats("cumulative").print_stats(top)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("hopper", "triton", "both"), default="both")
    p.add_argument("--shape", default="2,1024,8,128", help="B,S,H,D (default: %(default)s)")
    p.add_argument("--full", action="store_true", help="full mask (default: causal)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--profile-calls", type=int, default=500, help="0: no profile")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    if len(shape) != 4:
        p.error(f"--shape={args.shape!r}: expected B,S,H,D")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for backend in (("hopper", "triton") if args.backend == "both" else (args.backend,)):
        measure(backend, shape, not args.full, args.calls, args.warmup, args.profile_calls, args.top)


if __name__ == "__main__":
    main()
