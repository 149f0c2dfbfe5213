"""Measure every (point, implementation) cell: forward and backward time, bitwise determinism of
the backward, peak extra memory, and the error against the point's first successful implementation.
With a dropout probability (``dash-bench --dropout P``) also forward + backward timed without and
with dropout, side by side in the same cell, and their ratio (the cost of dropout).

A cell that fails records its status and message and the run goes on. All figures of one run
come from one process, so every ratio in the report compares numbers taken side by side.
"""
from __future__ import annotations

import datetime
import functools
import math
import os
import platform
import statistics
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .clocks import ClockMonitor
from .peers import Impl, first_output
from .protocol import Point
from .report import FORMAT

MIB = 2.0 ** 20


@dataclass
class Settings:
    repeats: int = 6          # backward passes compared bitwise (>= 2)
    warmup_ms: float = 25.0   # do_bench warm-up
    rep_ms: float = 100.0     # do_bench measuring window
    seed: int = 0
    dropout_p: float = 0.0    # > 0: also time forward + backward with this dropout (seed: `seed`)

    def __post_init__(self):
        if not isinstance(self.repeats, int) or self.repeats < 2:
            raise ValueError(f"repeats must be an int >= 2 (the first backward is compared with the others), "
                             f"got {self.repeats!r}")
        if not (0 <= self.warmup_ms < math.inf and 0 < self.rep_ms < math.inf):   # NaN fails both
            raise ValueError(f"warmup_ms must be a finite number >= 0 and rep_ms one > 0, got {self.warmup_ms}, "
                             f"{self.rep_ms}")
        if not (isinstance(self.dropout_p, (int, float)) and 0.0 <= self.dropout_p < 1.0):
            raise ValueError(f"dropout_p must be a number in [0, 1) (0: no dropout), got {self.dropout_p!r}")


# ---------------------------------------------------------------------------- timing
def bench_ms(fn: Callable, device: torch.device, *, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds of fn(): triton.testing.do_bench (CUDA events) on the GPU, wall clock on the CPU."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _cuda_event_bench(fn, warmup_ms, rep_ms)
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return _wall_clock_bench(fn, warmup_ms, rep_ms)


def _runs_for(estimate_ms: float, window_ms: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, window_ms / max(estimate_ms, 1e-3))))


def _wall_clock_bench(fn, warmup_ms, rep_ms) -> float:
    t = time.perf_counter()
    fn()
    estimate = (time.perf_counter() - t) * 1e3
    for _ in range(_runs_for(estimate, warmup_ms, 0, 100)):
        fn()
    times = []
    for _ in range(_runs_for(estimate, rep_ms, 3, 1000)):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _cuda_event_bench(fn, warmup_ms, rep_ms) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end)
    for _ in range(_runs_for(estimate, warmup_ms, 0, 100)):
        fn()
    times = []
    for _ in range(_runs_for(estimate, rep_ms, 3, 1000)):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ---------------------------------------------------------------------------- memory
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure_extra_memory(fn: Callable, device: torch.device):
    """Run fn once; return (its result, peak bytes allocated during it beyond what it returns).

    Tensors that exist before the call (inputs, the forward's output and saved activations) are
    the baseline; what fn returns (out, or dq/dk/dv) is subtracted from the peak, so the figure is
    the workspace: fp32 dQ accumulators, semaphores, split buffers, saved statistics.
    None on the CPU, which has no allocator statistics.
    """
    if device.type != "cuda":
        return fn(), None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    returned = [result] if isinstance(result, torch.Tensor) else list(result)
    return result, max(0, peak - base - _nbytes(returned))


# ---------------------------------------------------------------------------- inputs and checks
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_inputs(point: Point, device: torch.device, seed: int):
    """q, k, v, dout in (B, S, H, D), random normal (never all zeros), the same for every implementation."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = DTYPES[point.dtype]

    def rand(heads):
        x = torch.randn(point.batch, point.seqlen, heads, point.hdim, generator=gen, dtype=torch.float32)
        return x.to(device=device, dtype=dtype)
    return rand(point.heads_q), rand(point.heads_kv), rand(point.heads_kv), rand(point.heads_q)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32."""
    a, b = a.float(), b.float()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def classify_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if "No available kernel" in text:
        return "refused"
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    if isinstance(exc, oom) or "out of memory" in text.lower():
        return "oom"
    return "error"


def device_usable(device: torch.device) -> bool:
    """After an error on the GPU: can we still launch work? (An illegal address poisons the context.)"""
    if device.type != "cuda":
        return True
    try:
        torch.zeros(1, device=device).add_(1)
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


# ---------------------------------------------------------------------------- one cell
def run_cell(impl: Impl, point: Point, inputs, device: torch.device, settings: Settings,
             reference: Optional[dict], clocks: Optional[ClockMonitor] = None) -> tuple[dict, Optional[dict]]:
    """Measure one implementation at one point. Returns (cell, tensors for the accuracy reference or None).
    With `clocks`, the cell also records the SM clock during each of its timings (`sm_clock`)."""
    cell = {"point": point.key, "impl": impl.name, "status": "ok"}
    started = time.perf_counter()
    ref_tensors = None
    try:
        with impl.context():
            fn = impl.build(point, device)
            q, k, v = (impl.from_bshd(x).detach().requires_grad_() for x in inputs[:3])
            dout = impl.from_bshd(inputs[3])

            def forward():
                return first_output(fn(q, k, v))

            # Warm-up: compiles (Triton, torch.compile) and the allocator's first growth stay out of
            # every figure below.
            out = forward()
            if impl.call_info is not None:
                cell.update(impl.call_info(q, k, point))
            torch.autograd.grad(out, (q, k, v), dout)
            del out
            _sync(device)

            out, cell["fwd_extra_bytes"] = measure_extra_memory(forward, device)

            def backward():
                return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

            first, cell["bwd_extra_bytes"] = measure_extra_memory(backward, device)
            if not _all_finite([out, *first]):
                raise FloatingPointError("non-finite values in the output or the gradients")

            # Determinism, checked: every further backward on the same inputs must equal the first bitwise.
            mismatches = 0
            for _ in range(settings.repeats - 1):
                again = backward()
                if not all(torch.equal(a, b) for a, b in zip(first, again)):
                    mismatches += 1
                del again
            cell["det_runs"] = settings.repeats
            cell["det_mismatches"] = mismatches
            cell["deterministic"] = mismatches == 0

            # The forward is timed before and after the backward and the faster median kept. In
            # H100 runs, dash-auto (our first column at a point) read up to 24 % fewer TFLOP/s
            # than our other columns running the same forward kernel; a one-off state at the start
            # of a cell would explain that. Both medians are recorded, so a run shows whether the
            # first is the outlier.
            instants = [time.monotonic()]
            fwd_first = bench_ms(forward, device, warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms)
            instants.append(time.monotonic())
            cell["bwd_ms"] = bench_ms(backward, device, warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms)
            instants.append(time.monotonic())
            fwd_again = bench_ms(forward, device, warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms)
            instants.append(time.monotonic())
            if clocks is not None:
                cell["sm_clock"] = {phase: clocks.window(a, b) for phase, a, b in
                                    zip(("fwd_first", "bwd", "fwd_again"), instants, instants[1:])}
            cell["fwd_ms_runs"] = [fwd_first, fwd_again]
            cell["fwd_ms"] = min(fwd_first, fwd_again)
            cell["fwd_tflops"] = point.fwd_flops / (cell["fwd_ms"] * 1e-3) / 1e12
            cell["bwd_tflops"] = point.bwd_flops / (cell["bwd_ms"] * 1e-3) / 1e12

            mine = {"out": impl.to_bshd(out.detach()),
                    **{n: impl.to_bshd(g) for n, g in zip(("dq", "dk", "dv"), first)}}
            if reference is None:
                ref_tensors = {"impl": impl.name, **mine}
                cell["max_rel_err"] = 0.0
            else:
                cell["max_rel_err"] = max(max_rel_err(mine[n], reference[n]) for n in ("out", "dq", "dk", "dv"))
            cell["err_ref"] = impl.name if reference is None else reference["impl"]
            del out, first, mine
            if settings.dropout_p > 0:
                cell.update(measure_dropout(impl, point, (q, k, v, dout), fn, device, settings))
            del q, k, v, dout
    except Exception as exc:  # a failing implementation must never stop the run
        cell["status"] = classify_error(exc)
        cell["error"] = f"{type(exc).__name__}: {str(exc).strip()}"[:2000]
        ref_tensors = None
    cell["seconds"] = round(time.perf_counter() - started, 3)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cell, ref_tensors


# ---------------------------------------------------------------------------- dropout
def measure_dropout(impl: Impl, point: Point, tensors, fn: Callable, device: torch.device,
                    settings: Settings) -> dict:
    """The dropout figures of one cell (called inside the implementation's context, after its other
    figures): one training step, forward + ``torch.autograd.grad``, timed by ``bench_ms`` without
    dropout and with ``settings.dropout_p`` (seed ``settings.seed``), back to back with the same
    protocol and inputs, and their ratio ``dropout_cost`` = with / without. With a fixed seed
    (ours) the dropout steps are also compared bitwise (``settings.repeats`` of them).

    An implementation without dropout gets ``dropout_status`` "no dropout", and no figure; a
    failure of the dropout call is recorded in ``dropout_status``/``dropout_error`` alone (the
    cell's other figures stand)."""
    if impl.build_dropout is None:
        return {"dropout_status": "no dropout", "dropout_note": impl.no_dropout}
    q, k, v, dout = tensors
    fig = {"dropout_status": "ok"}
    try:
        with_fn = impl.build_dropout(point, device, settings.dropout_p, settings.seed)

        def step(f):
            def run():
                out = first_output(f(q, k, v))
                return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
            return run

        without, with_dropout = step(fn), step(with_fn)
        first = with_dropout()   # warm-up: a dropout variant may compile
        if not _all_finite(first):
            raise FloatingPointError("non-finite values in the output or the gradients with dropout")
        if impl.family == "dash":
            # A fixed seed: the same mask on every pass, so a deterministic schedule repeats its bits.
            mismatches = 0
            for _ in range(settings.repeats - 1):
                again = with_dropout()
                mismatches += not all(torch.equal(a, b) for a, b in zip(first, again))
                del again
            fig.update(dropout_det_runs=settings.repeats, dropout_det_mismatches=mismatches,
                       dropout_deterministic=mismatches == 0)
        del first
        _sync(device)
        fig["dropout_off_ms"] = bench_ms(without, device, warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms)
        fig["dropout_on_ms"] = bench_ms(with_dropout, device, warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms)
        fig["dropout_cost"] = fig["dropout_on_ms"] / fig["dropout_off_ms"]
    except Exception as exc:
        status = classify_error(exc)
        if status == "error" and isinstance(exc, ValueError) and "cannot run this call" in str(exc):
            status = "refused"   # a named backend without dropout says so by name
        fig = {"dropout_status": status, "dropout_error": f"{type(exc).__name__}: {str(exc).strip()}"[:2000]}
    return fig


def dropout_failed(cell: dict) -> bool:
    return cell.get("dropout_status") not in (None, "ok", "no dropout")


# ---------------------------------------------------------------------------- environment
def _git_commit() -> Optional[str]:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def source_digest(roots: Optional[list] = None) -> str:
    """sha256 (first 16 hex digits) of the Python sources that ran: the dash_plugin package and its
    kernels, by relative path and content. It names the code even where the checkout's git metadata
    does not match its files (a copied working tree, uncommitted edits); `dash-bench --source-digest`
    prints it for the tree installed here, to match a results file to a commit."""
    import hashlib

    if roots is None:
        import dash_plugin
        import dash_plugin.kernels
        roots = [os.path.dirname(dash_plugin.__file__), os.path.dirname(dash_plugin.kernels.__file__)]
    digest = hashlib.sha256()
    for root in sorted(set(os.path.realpath(r) for r in roots)):
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, os.path.dirname(root)).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def environment(device: torch.device) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
        "source_digest": source_digest(),
        "gpu": None,
        "sm_count": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(props.total_memory / 2 ** 30, 1))
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


# ---------------------------------------------------------------------------- the run
def _fmt_cell(cell: dict) -> str:
    if cell["status"] != "ok":
        return f"{cell['status']}: {cell.get('error', '')[:160]}"
    mem = cell.get("bwd_extra_bytes")
    mem_s = f", bwd extra {mem / MIB:.1f} MiB" if mem is not None else ""
    det = "yes" if cell["deterministic"] else f"NO ({cell['det_mismatches']}/{cell['det_runs'] - 1} differ)"
    text = (f"fwd {cell['fwd_tflops']:.1f} TFLOP/s, bwd {cell['bwd_tflops']:.1f} TFLOP/s, det {det}{mem_s}, "
            f"err {cell['max_rel_err']:.1e}")
    bwd_clock = (cell.get("sm_clock") or {}).get("bwd")
    if bwd_clock:
        text += f", bwd at {bwd_clock['sm_mhz_median']:.0f} MHz (min {bwd_clock['sm_mhz_min']})"
    status = cell.get("dropout_status")
    if status == "ok":
        text += (f"; dropout fwd+bwd {cell['dropout_on_ms']:.3g} ms vs {cell['dropout_off_ms']:.3g} ms without "
                 f"({cell['dropout_cost']:.3f}x)")
        if cell.get("dropout_deterministic") is False:
            text += f", NOT bitwise ({cell['dropout_det_mismatches']}/{cell['dropout_det_runs'] - 1} differ)"
    elif status == "no dropout":
        text += "; no dropout"
    elif status is not None:
        text += f"; dropout {status}: {cell.get('dropout_error', '')[:160]}"
    return text


def _exit_after_hang() -> None:
    # A kernel spinning on the GPU cannot be cancelled; the process must go (tests replace this).
    os._exit(3)


def _hang_results(results: dict, points: list[Point], impls: list[Impl], point: Point, impl: Impl,
                  timeout_s: float) -> dict:
    """A copy of the results with the hung cell and every later cell recorded, for the reports."""
    reason = f"{impl.name} at {point.key} did not finish within {timeout_s:.0f} s (hung?); run aborted"
    snapshot = dict(results, cells=list(results["cells"]), complete=False, stop_reason=reason)
    snapshot["cells"].append({"point": point.key, "impl": impl.name, "status": "hung", "error": reason})
    later = False
    for p in points:
        for i in impls:
            if later:
                snapshot["cells"].append({"point": p.key, "impl": i.name, "status": "skipped", "error": reason})
            later = later or (p is point and i is impl)
    return snapshot


@contextmanager
def _watchdog(seconds: Optional[float], fire: Callable[[], None]):
    """Calls `fire` (from another thread) if the block still runs after `seconds`; none if 0/None."""
    if not seconds:
        yield
        return
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _hung(log, on_hang, results, points, impls, point, impl, seconds):
    """A cell's watchdog fired: report the results with that cell marked hung, then exit."""
    log(f"  WATCHDOG: {impl.name} at {point.key} still running after {seconds:.0f} s")
    if on_hang is not None:
        on_hang(_hang_results(results, points, impls, point, impl, seconds))
    _exit_after_hang()


def run_benchmark(points: list[Point], impls: list[Impl], device: torch.device, settings: Settings, *,
                  unavailable: Optional[dict] = None, config: Optional[dict] = None,
                  max_minutes: Optional[float] = None, log: Callable[[str], None] = print,
                  on_point_done: Optional[Callable[[dict], None]] = None,
                  cell_timeout_s: Optional[float] = None,
                  on_hang: Optional[Callable[[dict], None]] = None) -> dict:
    """Measure every cell; returns the results dict (the JSON written by report.write_json).

    ``max_minutes``: once the budget is spent, the remaining cells are recorded as skipped and the
    run ends cleanly. ``on_point_done`` gets the results so far after every point (for saving).
    ``cell_timeout_s``: a watchdog for one cell (compiles included). When it fires, ``on_hang`` gets
    the results with that cell marked ``hung`` (to write the reports), then the process exits with
    status 3: a deadlocked kernel (a semaphore wait that never ends) cannot be stopped otherwise.
    """
    started = time.perf_counter()
    deadline = None if max_minutes is None else started + 60.0 * max_minutes
    results = {
        "format": FORMAT,
        "env": environment(device),
        "config": dict(config or {}, repeats=settings.repeats, warmup_ms=settings.warmup_ms,
                       rep_ms=settings.rep_ms, seed=settings.seed, max_minutes=max_minutes,
                       dropout_p=settings.dropout_p),
        "implementations": [i.describe() for i in impls],
        "unavailable": dict(unavailable or {}),
        "points": [p.to_dict() for p in points],
        "cells": [],
        "complete": False,
    }
    stop_reason = None
    total = len(points) * len(impls)
    done = 0
    # The SM clock during each timing: a Hopper board at its power cap dips for a few hundred
    # milliseconds as the power ramps up, and a cell timed in a dip reads 10-15 % slow (clocks.py).
    with ClockMonitor(device) as clocks:
        sampled = clocks.recording
        for n, point in enumerate(points, 1):
            log(f"[{n}/{len(points)}] {point.key}: B={point.batch} S={point.seqlen} Hq={point.heads_q} "
                f"Hkv={point.heads_kv} D={point.hdim} {point.mask} {point.dtype}")
            inputs = make_inputs(point, device, settings.seed + n) if stop_reason is None else None
            reference = None
            for impl in impls:
                done += 1
                if stop_reason is None and deadline is not None and time.perf_counter() > deadline:
                    stop_reason = f"time budget of {max_minutes} min spent"
                    log(f"  stopping: {stop_reason}; the remaining cells are marked skipped")
                if stop_reason is not None:
                    results["cells"].append({"point": point.key, "impl": impl.name, "status": "skipped",
                                             "error": stop_reason})
                    continue
                log(f"  ({done}/{total}) {impl.name} ...")
                hung = functools.partial(_hung, log, on_hang, results, points, impls, point, impl, cell_timeout_s)
                with _watchdog(cell_timeout_s, hung):
                    cell, ref = run_cell(impl, point, inputs, device, settings, reference, sampled)
                if reference is None and ref is not None:
                    reference = ref
                results["cells"].append(cell)
                log(f"  ({done}/{total}) {impl.name}: {_fmt_cell(cell)}  [{cell['seconds']:.1f}s]")
                if (cell["status"] != "ok" or dropout_failed(cell)) and not device_usable(device):
                    stop_reason = f"the GPU context is unusable after {impl.name} failed at {point.key}"
                    log(f"  stopping: {stop_reason}")
            del inputs, reference
            results["elapsed_s"] = round(time.perf_counter() - started, 1)
            if on_point_done is not None:
                on_point_done(results)
    results["clock_monitor"] = clocks.describe()
    results["complete"] = stop_reason is None
    results["stop_reason"] = stop_reason
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    return results
