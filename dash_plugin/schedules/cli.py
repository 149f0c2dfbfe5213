"""`dash-schedule`: makespan table of the schedules for one shape, and Gantt pictures.

By default it draws each schedule's launch plan, as the Hopper kernel runs it (its tiles, its
launch order, and its persistent grid where it has one); --assignment, --launch or --group-size
switch to the model with those choices instead. Bubbles are the idle share of all --sms SMs.

Example:
    dash-schedule --seqlen 8192 --hdim 128 --causal --schedules ascending,descending,shift --png out/
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from types import SimpleNamespace

import torch

from dash_plugin import checks
from dash_plugin.kernels import backends
from dash_plugin.kernels.backends import DeviceProps

from . import registry
from .auto import mask_kind
from .plan import AttentionShape, ResidencyError, launch_plan
from .schedule import build_schedule
from .simulate import SimulationDeadlock, simulate, simulate_plan

# Upper bounds of the sizes: the model runs on the CPU, and past these a run exhausts memory
# rather than answering. Sequences per launch: the kernel's grid takes at most 65535.
LIMITS = {"--seqlen": 1 << 20, "--seqlen-q": 1 << 20, "--seqlen-k": 1 << 20, "--varlen": 1 << 20,
          "--batch": 65535, "--heads": 4096, "--sms": 4096, "--block-m": 1024,
          "--block-n": 1024, "--group-size": 4096}
# The steps simulated (query heads x (Q, KV) tile pairs, counted as for a full mask): about 20 s
# and 1.5 GB per schedule at this bound (a 64k-token causal head dim 128 shape reaches it).
MAX_STEPS = 1 << 23


def kernel_tiles(hdim: int, causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """(block_m, block_n) of the Hopper backward for this head dim and mask: the backend's own
    `tiles` (one source: a window tiles like causal there). ValueError for a head dim it has no
    tiles for."""
    request = backends.Request(torch.device("cuda"), torch.bfloat16, hdim, causal=causal,
                               window_left=window_left, window_right=window_right)
    tiles = backends.get("hopper").tiles(request)
    return tiles.block_m, tiles.block_n


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit 2 with argparse's message, which names flag and value
        self.print_usage(sys.stderr)
        self.exit(2, f"dash-schedule: error: {message}\n")


def _error(message):
    """Exit 2 with one line, as argparse does for the errors it finds itself."""
    print(f"dash-schedule: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _bad(flag, value, allowed):
    _error(f"{flag} {value!r} is not allowed; allowed: {allowed}")


def _size(flag, value, low=1):
    if not low <= value <= LIMITS[flag]:
        _bad(flag, value, f"an int in {low}..{LIMITS[flag]}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dash-schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, help="query and key length (or use --seqlen-q/--seqlen-k)")
    p.add_argument("--seqlen-q", type=int, help="query length (default: --seqlen)")
    p.add_argument("--seqlen-k", type=int, help="key length (default: --seqlen)")
    p.add_argument("--varlen", type=str, default=None,
                   help="comma-separated sequence lengths of a packed batch (q = k); instead of --seqlen* "
                        "and --batch")
    p.add_argument("--hdim", type=int, default=128,
                   help="head dim 1..256 (default 128): picks the Hopper kernel's tiles (it has them for "
                        "multiples of 8 but 104 and 112; another head dim needs --block-m and --block-n) and the "
                        "default --heads")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 2048 // hdim)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (GQA; default = heads)")
    p.add_argument("--batch", type=int, default=None, help="sequences of --seqlen (default 1)")
    p.add_argument("--causal", action="store_true", help="causal mask (bottom-right aligned)")
    p.add_argument("--window-left", type=int, default=-1,
                   help="sliding window: keys this far left of the diagonal (default -1: unbounded)")
    p.add_argument("--window-right", type=int, default=-1,
                   help="sliding window: keys this far right of the diagonal (default -1: unbounded; "
                        "0 with no left limit is the causal mask)")
    p.add_argument("--block-m", type=int, default=None,
                   help="Q tile rows (default: the Hopper kernel's tile for --hdim and the mask)")
    p.add_argument("--block-n", type=int, default=None,
                   help="KV tile rows (default: the Hopper kernel's tile for --hdim and the mask)")
    p.add_argument("--group-size", type=int, default=None,
                   help="model: cyclic group size G of shift (default: the schedule's rule)")
    p.add_argument("--sms", type=int, default=132, help="SMs in the model (default 132, an H100's)")
    p.add_argument("--assignment", default=None,
                   help="model: dynamic (first free SM) or static (default: as the kernel launches it)")
    p.add_argument("--launch", default=None,
                   help="model: launch order head-major (grid (W, H_kv, B)) or group-major (default: the "
                        "kernel's)")
    p.add_argument("--c", type=float, default=1.0, help="compute cost per (Q, KV) tile pair (> 0; default 1)")
    p.add_argument("--r", type=float, default=0.5,
                   help="ordered reduction cost per pair (>= 0, 0: free reductions; default 0.5)")
    p.add_argument("--schedules", default=",".join(s.name for s in registry.specs() if s.ordered),
                   help=f"comma-separated, from {','.join(registry.names())} (default: the ordered ones; "
                        "one named twice is drawn once)")
    p.add_argument("--png", default=None, help="write one Gantt PNG per schedule into this folder")
    return p


def parse_args(argv):
    a = build_parser().parse_args(argv)

    names = list(dict.fromkeys(s.strip() for s in a.schedules.split(",") if s.strip()))
    for s in names:
        if s not in registry.names():
            _bad("--schedules", s, ", ".join(registry.names()))
    if not names:
        _bad("--schedules", a.schedules, ", ".join(registry.names()))
    a.schedule_names = names
    if a.assignment not in (None, "dynamic", "static"):
        _bad("--assignment", a.assignment, "dynamic, static")
    if a.launch not in (None, "head-major", "group-major"):
        _bad("--launch", a.launch, "head-major, group-major")
    if not 1 <= a.hdim <= 256:
        _bad("--hdim", a.hdim, "1..256")
    if a.varlen is not None:
        given = [f for f, v in (("--seqlen", a.seqlen), ("--seqlen-q", a.seqlen_q), ("--seqlen-k", a.seqlen_k),
                                ("--batch", a.batch)) if v is not None]
        if given:
            _error(f"--varlen gives every sequence's length: drop {', '.join(given)}")
        try:
            lens = [int(x) for x in a.varlen.split(",")]
        except ValueError:
            _bad("--varlen", a.varlen, "comma-separated non-negative ints")
        if not lens or min(lens) < 0:
            _bad("--varlen", a.varlen, "comma-separated non-negative ints")
        for n in lens:
            _size("--varlen", n, low=0)
        if len(lens) > LIMITS["--batch"]:
            _bad("--varlen", f"{len(lens)} sequences", f"at most {LIMITS['--batch']}")
        a.seqlens_q = a.seqlens_k = lens
        a.varlen = True
    else:
        for flag, v in (("--seqlen", a.seqlen), ("--seqlen-q", a.seqlen_q), ("--seqlen-k", a.seqlen_k)):
            if v is not None:   # named as the user typed it
                _size(flag, v)
        sq = a.seqlen_q if a.seqlen_q is not None else a.seqlen
        sk = a.seqlen_k if a.seqlen_k is not None else a.seqlen
        if sq is None or sk is None:
            _error("give --seqlen (or --seqlen-q and --seqlen-k, or --varlen)")
        a.batch = 1 if a.batch is None else a.batch
        _size("--batch", a.batch)
        a.seqlens_q, a.seqlens_k = [sq] * a.batch, [sk] * a.batch
        a.varlen = False
    if a.heads is None:
        a.heads = max(1, 2048 // a.hdim)
    if a.kv_heads is None:
        a.kv_heads = a.heads
    _size("--heads", a.heads)
    if a.kv_heads < 1 or a.heads % a.kv_heads:
        _bad("--kv-heads", a.kv_heads, f"a positive divisor of --heads {a.heads}")
    _size("--sms", a.sms)
    if not (math.isfinite(a.c) and a.c > 0):
        _bad("--c", a.c, "a finite number > 0")
    if not (math.isfinite(a.r) and a.r >= 0):
        _bad("--r", a.r, "a finite number >= 0 (0: free reductions)")
    # The window as the API takes it: -1..2**63-1 per side, causal meaning right = 0, and a side
    # longer than both sequences written as unbounded.
    try:
        left, right = checks.check_window((a.window_left, a.window_right), a.causal)
    except ValueError as exc:
        _error(f"--window-left {a.window_left} --window-right {a.window_right}: {exc}")
    a.window_left, a.window_right = checks.unbounded_beyond(left, right, max(a.seqlens_q), max(a.seqlens_k))
    a.mask = mask_kind(a.causal, a.window_left, a.window_right)   # as the kernels read the mask
    if a.block_m is None or a.block_n is None:
        try:
            bm, bn = kernel_tiles(a.hdim, a.causal, a.window_left, a.window_right)
        except ValueError as exc:
            _error(f"--hdim {a.hdim}: {exc}; for another head dim give --block-m and --block-n")
        a.block_m = bm if a.block_m is None else a.block_m
        a.block_n = bn if a.block_n is None else a.block_n
    _size("--block-m", a.block_m)
    _size("--block-n", a.block_n)
    if a.group_size is not None:
        _size("--group-size", a.group_size)
    steps = a.heads * sum(-(-q // a.block_m) * -(-k // a.block_n) for q, k in zip(a.seqlens_q, a.seqlens_k))
    if steps > MAX_STEPS:
        _error(f"the shape has {steps} (query head, Q tile, KV tile) steps to simulate; at most {MAX_STEPS} are "
               "allowed (the model runs on the CPU): fewer --heads, shorter sequences, a smaller --batch or "
               "larger tiles")
    return a


def _simulate(a, name, record):
    """(schedule, result): the launch plan as the kernel runs it, or the model's choices."""
    if a.assignment is None and a.launch is None and a.group_size is None:
        shape = AttentionShape(len(a.seqlens_q), a.heads, a.kv_heads,
                               tuple(a.seqlens_q) if a.varlen else (a.seqlens_q[0],),
                               tuple(a.seqlens_k) if a.varlen else (a.seqlens_k[0],), a.varlen, a.causal,
                               a.window_left, a.window_right)
        try:
            plan = launch_plan(shape, name, tiles=SimpleNamespace(block_m=a.block_m, block_n=a.block_n),
                               device=DeviceProps(resident_programs=a.sms))
        except ResidencyError as e:
            _error(f"{name} on --sms {a.sms}: {e}")
        return plan.schedule, simulate_plan(plan, c=a.c, r=a.r, record=record)
    sched = build_schedule(name, seqlens_q=a.seqlens_q, seqlens_k=a.seqlens_k, block_m=a.block_m,
                           block_n=a.block_n, causal=a.causal, window_left=a.window_left,
                           window_right=a.window_right, group_size=a.group_size)
    try:
        return sched, simulate(sched, num_heads=a.heads, num_kv_heads=a.kv_heads, num_sms=a.sms, c=a.c, r=a.r,
                               assignment=a.assignment or "dynamic", launch=a.launch or "head-major",
                               record=record)
    except SimulationDeadlock as e:   # a group waiting cyclically on more workers than --sms holds
        _error(f"{name} on --sms {a.sms} with the model's options: {e}; give more --sms, smaller groups, or pick "
               "'descending' or 'ascending'")


def _progress(message):
    """One line on stderr per step: a long shape takes seconds per schedule and per picture."""
    print(f"dash-schedule: {message}", file=sys.stderr, flush=True)


def _png_folder(folder, names):
    """Create the pictures' folder, and refuse a path the pictures cannot be written to, before
    the simulation (minutes on a long shape) rather than after it."""
    if not folder.strip():
        _bad("--png", folder, "a folder path")
    if os.path.exists(folder) and not os.path.isdir(folder):
        _error(f"--png {folder}: exists and is not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        _error(f"--png {folder}: cannot create the folder ({exc.strerror})")
    for name in names:
        path = os.path.join(folder, f"{name}.png")
        if os.path.isdir(path):
            _error(f"--png {folder}: {path} is a folder, where the picture of {name} goes")
    if not os.access(folder, os.W_OK):
        _error(f"--png {folder}: not writable")


def run(a, out=None):
    out = sys.stdout if out is None else out
    names = list(a.schedule_names)
    record = a.png is not None
    if record:
        _png_folder(a.png, names)
    results = {}
    todo = list(dict.fromkeys(names + ["ascending"]))
    for i, name in enumerate(todo):
        _progress(f"simulating {name} ({i + 1}/{len(todo)})" + ("" if name in names else ", the baseline"))
        results[name] = _simulate(a, name, record and name in names)
    base = results["ascending"][1].makespan
    launch = ("the kernel's launch plan" if a.assignment is None and a.launch is None and a.group_size is None
              else f"model: {a.assignment or 'dynamic'} {a.launch or 'head-major'}")
    print(f"shape: seqlens_q={_short(a.seqlens_q)} seqlens_k={_short(a.seqlens_k)} "
          f"heads={a.heads} kv_heads={a.kv_heads} tiles {a.block_m}x{a.block_n} "
          f"mask={a.mask} window=({a.window_left},{a.window_right}) SMs={a.sms} "
          f"{launch} c={a.c:g} r={a.r:g}", file=out)
    print(f"{'schedule':<11} {'makespan':>10} {'vs asc':>7} {'bubbles':>8}  variant", file=out)
    for name in names:
        sched, res = results[name]
        variants = ", ".join(sorted(set(sched.variants)))
        speed = base / res.makespan if res.makespan else 1.0
        print(f"{name:<11} {res.makespan:>10g} {speed:>6.3f}x {100 * res.bubble_fraction:>7.1f}%"
              f"  {variants}", file=out)
    print("vs asc = ascending makespan / this makespan (> 1: faster than the FA3 baseline)", file=out)
    if record:
        from .gantt import draw_gantt
        xmax = max(results[n][1].makespan for n in names) * 1.01
        for i, name in enumerate(names):
            _progress(f"drawing {name} ({i + 1}/{len(names)})")
            path = os.path.join(a.png, f"{name}.png")
            draw_gantt(results[name][1], path, xmax=xmax,
                       title=f"{name} ({a.mask}, {a.heads} heads, {a.sms} SMs)")
            print(f"wrote {path}", file=out)
    return results


SHAPE_LENGTHS = 8   # lengths the shape line lists in full; a longer list shows its ends


def _short(lens):
    """The lengths for the shape line: one as a number, a short list in full, a long one (a packed
    batch holds up to 65535 sequences: a line of hundreds of KB) as its first and last few, with
    the count and the total."""
    if len(lens) == 1:
        return str(lens[0])
    if len(lens) <= SHAPE_LENGTHS:
        return str(lens)
    ends = SHAPE_LENGTHS // 2 - 1
    shown = ", ".join(map(str, lens[:ends])) + ", ..., " + ", ".join(map(str, lens[-ends:]))
    return f"[{shown}] ({len(lens)} sequences, {sum(lens)} tokens)"


def main(argv=None) -> int:
    run(parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
