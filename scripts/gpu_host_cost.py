"""Host cost per call on the GPU: how many microseconds the Python side of each implementation
spends per forward and per forward+backward, next to FA4 and SDPA, in one process.

How: a tiny problem (default B=1, S=256, H=2, D=128), whose kernels take a few microseconds. A
short loop of calls with no synchronisation (25, so the launch queue never fills and blocks the
host) gives the host cost of one call: wall time until the last launch returns / calls. CUDA
events over the same loop give the time until the GPU finished: when it is the larger, the GPU
(kernels plus launch gaps), not the host, set the pace. Medians of many loops after a warm-up
that compiles everything.
Then a cProfile of our forward+backward, sorted by own time.

This is the figure behind short-sequence rows of dash-bench: at 1k tokens a forward kernel runs
about 50 us, so a host cost above that sets the measured time.

Usage: python scripts/gpu_host_cost.py [--impls dash-auto,fa4,...] [--shape B,S,H,D] [--full]
       [--calls N] [--out DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin.bench.peers import select_impls  # noqa: E402
from dash_plugin.bench.protocol import Point  # noqa: E402


def loop_us(fn, calls: int, loops: int, prepare=None, warm_loops: int = 0) -> tuple[float, float]:
    """(host us per call, GPU-busy us per call): medians over `loops` loops of `calls` calls.
    `prepare`, untimed before each loop, returns the argument tuples of its calls (default: none)."""
    host, gpu = [], []
    for loop in range(warm_loops + loops):
        call_args = prepare() if prepare else [()] * calls
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for a in call_args:
            fn(*a)
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        if loop >= warm_loops:
            host.append((t1 - t0) / calls * 1e6)
            gpu.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(host), statistics.median(gpu)


def _bwd_sm90_alone(do, q, k, v, out, lse, scale, causal):
    """The CuTe DSL backward's launcher with a plan built once: no dispatch, no plan lookup."""
    from dash_plugin import dispatch
    from dash_plugin.kernels.hopper import bwd_sm90
    captured = {}
    real = bwd_sm90.attention_backward

    def capture(*a, **kw):
        captured.update(kw)
        return real(*a, **kw)
    bwd_sm90.attention_backward = capture
    try:
        dispatch.attention_backward(do, q, k, v, out, lse, schedule="ascending", backend="hopper",
                                    softmax_scale=scale, causal=causal)
    finally:
        bwd_sm90.attention_backward = real
    return lambda: real(do, q, k, v, out, lse, **captured)


def _autograd_backward_rows(impls, point, base, args) -> dict:
    """Backward alone through autograd: `calls` forwards first (synchronised), then `calls`
    torch.autograd.backward calls timed (host until the last returns, and GPU by events)."""
    device = torch.device("cuda")
    rows = {}
    for impl in impls:
        if impl.unavailable_reason(device):
            continue
        fn = impl.build(point, device)
        q, k, v = (impl.from_bshd(x).requires_grad_() for x in base[:3])
        do = impl.from_bshd(base[3])
        with impl.context():
            h, g = loop_us(lambda o: torch.autograd.backward(o, do), args.calls, args.loops,
                            prepare=lambda: [(fn(q, k, v),) for _ in range(args.calls)], warm_loops=3)
        rows[impl.name + " bwd (autograd)"] = dict(host_us=h, gpu_us=g)
        print(f"{impl.name + ' bwd (autograd)':28s} {h:7.1f} us host ({g:6.1f} GPU)", flush=True)
    return rows


class _Timed:
    """Wraps callables (module attributes or dict entries) to add up their host time by name."""

    def __init__(self):
        self.us, self.calls, self._undo = {}, {}, []

    def wrap(self, owner, key, name, as_item=False):
        real = owner[key] if as_item else getattr(owner, key)

        # wraps: FA4's helpers keep their compile caches as attributes of the function object
        @functools.wraps(real)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                self.us[name] = self.us.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
                self.calls[name] = self.calls.get(name, 0) + 1
        if as_item:
            owner[key] = timed
            self._undo.append(lambda: owner.__setitem__(key, real))
        else:
            setattr(owner, key, timed)
            self._undo.append(lambda: setattr(owner, key, real))

    def undo(self):
        while self._undo:
            self._undo.pop()()


def _backward_breakdown(base, point, args) -> dict:
    """Where the host time of our backward goes when autograd runs it: the time inside our
    Function's backward (ops._backward, on autograd's device thread), inside the dispatch layer,
    inside bwd_sm90's launcher, and inside each FA4 helper and our kernel's launch. What
    torch.autograd.grad costs beyond ops._backward is the engine's own."""
    import dash_plugin
    from dash_plugin import dispatch, ops
    from dash_plugin.kernels.hopper import bwd_sm90
    q, k, v = (x.detach().clone().requires_grad_() for x in base[:3])
    do = base[3]
    for _ in range(20):
        torch.autograd.grad(dash_plugin.flash_attention(q, k, v, causal=point.causal), (q, k, v), do)
    timed = _Timed()
    timed.wrap(ops, "_backward", "ops._backward (inside the engine)")
    timed.wrap(dispatch, "attention_backward", "dispatch.attention_backward")
    timed.wrap(bwd_sm90, "attention_backward", "bwd_sm90.attention_backward")
    timed.wrap(bwd_sm90.fa4, "_bwd_preprocess", "FA4 _bwd_preprocess")
    timed.wrap(bwd_sm90.fa4, "_bwd_postprocess_convert", "FA4 _bwd_postprocess_convert")
    for key in list(bwd_sm90._compiled):
        timed.wrap(bwd_sm90._compiled, key, "our kernel's launch", as_item=True)
    n, grad_us = args.calls * args.loops, 0.0
    try:
        for _ in range(n):
            out = dash_plugin.flash_attention(q, k, v, causal=point.causal)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), do)
            grad_us += (time.perf_counter() - t0) * 1e6
            torch.cuda.synchronize()
    finally:
        timed.undo()
    rows = {"torch.autograd.grad (whole backward)": grad_us / n}
    rows.update({name: us / n for name, us in timed.us.items()})
    for name, us in rows.items():
        print(f"  {name:40s} {us:7.1f} us per backward", flush=True)
    return {"breakdown": rows}


def _kernel_module_rows(base, point, args) -> dict:
    """The Hopper backend's kernel-level functions called directly (no API, config, autograd or
    dispatch layers): what the layers above them cost is the difference to dash-auto."""
    from dash_plugin import dispatch
    from dash_plugin.kernels import hopper, hopper_backend
    if not hopper_backend._is_sm90("cuda") or not hopper.available():
        return {}
    q, k, v, do = (x.detach() for x in base)
    scale = q.shape[-1] ** -0.5
    out, lse = hopper.attention_forward(q, k, v, softmax_scale=scale, causal=point.causal)
    fwd = lambda: hopper.attention_forward(q, k, v, softmax_scale=scale, causal=point.causal)  # noqa: E731
    bwd = lambda: dispatch.attention_backward(do, q, k, v, out, lse, schedule="ascending", backend="hopper",  # noqa: E731
                                              softmax_scale=scale, causal=point.causal)
    for _ in range(20):
        fwd(), bwd()
    rows = {}
    for name, fn in (("hopper.attention_forward", fwd), ("dispatch.attention_backward", bwd),
                     ("bwd_sm90 alone", _bwd_sm90_alone(do, q, k, v, out, lse, scale, point.causal))):
        host, gpu = loop_us(fn, args.calls, args.loops)
        rows[name] = dict(host_us=host, gpu_us=gpu)
        print(f"{name:28s} {host:7.1f} us host ({gpu:6.1f} GPU)", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default="dash-auto,dash-descending,fa4,fa4-det,sdpa-cudnn,sdpa-flash")
    ap.add_argument("--shape", default="1,256,2,128", help="B,S,H,D (default 1,256,2,128)")
    ap.add_argument("--full", action="store_true", help="full mask (default causal)")
    # Few calls per loop: the launch queue must never fill, or a GPU-bound loop would block the
    # host and its host time would read as the GPU's.
    ap.add_argument("--calls", type=int, default=25)
    ap.add_argument("--loops", type=int, default=41)
    ap.add_argument("--trace", action="store_true", help="torch.profiler table of dash-auto's kernels")
    ap.add_argument("--breakdown", action="store_true", help="host time of our backward by part")
    ap.add_argument("--out", default=None, help="folder for host_cost.json and profile.txt")
    args = ap.parse_args(argv)
    b, s, h, d = (int(x) for x in args.shape.split(","))
    point = Point(batch=b, seqlen=s, heads_q=h, heads_kv=h, hdim=d, causal=not args.full)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    rows, profiled = {}, None
    for impl in select_impls(args.impls, device):
        reason = impl.unavailable_reason(device)
        if reason:
            print(f"{impl.name:18s} skipped: {reason}")
            continue
        fn = impl.build(point, device)
        q, k, v = (impl.from_bshd(x).requires_grad_() for x in base[:3])
        do = impl.from_bshd(base[3])
        with impl.context():
            fwd = lambda: fn(q, k, v)  # noqa: E731

            def fwd_bwd():
                torch.autograd.backward(fn(q, k, v), do)
            for _ in range(20):
                fwd_bwd()
            f_host, f_gpu = loop_us(fwd, args.calls, args.loops)
            fb_host, fb_gpu = loop_us(fwd_bwd, args.calls, args.loops)
            if impl.name == "dash-auto" and args.trace:
                # torch.profiler: which kernels the GPU ran and for how long. (The profiler
                # makes our calls take the custom-op path; kernel times are unaffected.)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as tprof:
                    for _ in range(10):
                        fwd_bwd()
                    torch.cuda.synchronize()
                print(tprof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
            if impl.name == "dash-auto":
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    fwd_bwd()
                prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                profiled = text.getvalue()
        rows[impl.name] = dict(fwd_host_us=f_host, fwd_gpu_us=f_gpu, fwd_bwd_host_us=fb_host, fwd_bwd_gpu_us=fb_gpu)
        print(f"{impl.name:18s} fwd {f_host:7.1f} us host ({f_gpu:6.1f} GPU)   "
              f"fwd+bwd {fb_host:7.1f} us host ({fb_gpu:6.1f} GPU)", flush=True)
    rows.update(_kernel_module_rows(base, point, args))
    rows.update(_autograd_backward_rows(select_impls(args.impls, device), point, base, args))
    if args.breakdown:
        print("our backward through autograd, by part (host time; synchronised before each call):")
        rows.update(_backward_breakdown(base, point, args))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape,
                    causal=not args.full, calls=args.calls, loops=args.loops)
        with open(os.path.join(args.out, "host_cost.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        if profiled:
            with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
                f.write(profiled)


if __name__ == "__main__":
    main()
