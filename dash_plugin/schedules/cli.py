"""`dash-schedule`: makespan table of the schedules for one shape, and Gantt pictures.

By default it draws each schedule's launch plan, as the kernel runs it (its launch order, and
its persistent grid where it has one); --assignment, --launch or --group-size switch to the
model with those choices instead.

Example:
    dash-schedule --seqlen 8192 --hdim 128 --causal --schedules ascending,descending,shift --png out/
"""
from __future__ import annotations

import argparse
import os
import sys

from types import SimpleNamespace

from dash_plugin.kernels.backends import DeviceProps

from . import registry
from .plan import AttentionShape, ResidencyError, launch_plan
from .schedule import build_schedule
from .simulate import simulate, simulate_plan

# FA3's sm90 backward tiles (block_m, block_n) per head dim, causal / full (flash-attention's
# hopper/flash_bwd_launch_template.h). Only a default for the model; pass --block-m/--block-n
# for other kernels.
FA3_TILES = {64: ((128, 128), (128, 128)), 96: ((64, 128), (64, 128)),
             128: ((64, 128), (80, 128)), 192: ((64, 96), (64, 96)), 256: ((64, 80), (64, 80))}


def default_tiles(hdim: int, causal: bool) -> tuple[int, int]:
    for d in sorted(FA3_TILES):
        if hdim <= d:
            return FA3_TILES[d][0 if causal else 1]
    raise ValueError(f"--hdim {hdim}: allowed 1..256")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit 2 with argparse's message, which names flag and value
        self.print_usage(sys.stderr)
        self.exit(2, f"dash-schedule: error: {message}\n")


def _bad(flag, value, allowed):
    raise SystemExit(f"dash-schedule: error: {flag} {value!r} is not allowed; allowed: {allowed}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dash-schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, help="query and key length (or use --seqlen-q/--seqlen-k)")
    p.add_argument("--seqlen-q", type=int, help="query length (default: --seqlen)")
    p.add_argument("--seqlen-k", type=int, help="key length (default: --seqlen)")
    p.add_argument("--varlen", type=str, default=None,
                   help="comma-separated sequence lengths of a packed batch (q = k); replaces --seqlen")
    p.add_argument("--hdim", type=int, default=128, help="head dim 1..256 (picks default tiles; default 128)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 2048 // hdim)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (GQA; default = heads)")
    p.add_argument("--batch", type=int, default=1, help="sequences of --seqlen (default 1)")
    p.add_argument("--causal", action="store_true", help="causal mask (bottom-right aligned)")
    p.add_argument("--window-left", type=int, default=-1,
                   help="sliding window: keys this far left of the diagonal (default -1: unbounded)")
    p.add_argument("--window-right", type=int, default=-1,
                   help="sliding window: keys this far right of the diagonal (default -1: unbounded)")
    p.add_argument("--block-m", type=int, default=None, help="Q tile rows (default: FA3's sm90 tile for --hdim)")
    p.add_argument("--block-n", type=int, default=None, help="KV tile rows (default: FA3's sm90 tile for --hdim)")
    p.add_argument("--group-size", type=int, default=None,
                   help="model: cyclic group size G of shift (default: the schedule's rule)")
    p.add_argument("--sms", type=int, default=132, help="SMs in the model (default 132)")
    p.add_argument("--assignment", default=None,
                   help="model: dynamic (first free SM) or static (default: as the kernel launches it)")
    p.add_argument("--launch", default=None,
                   help="model: launch order head-major (grid (W, H_kv, B)) or group-major (default: the "
                        "kernel's)")
    p.add_argument("--c", type=float, default=1.0, help="compute cost per (Q, KV) tile pair")
    p.add_argument("--r", type=float, default=0.5, help="ordered reduction cost per pair")
    p.add_argument("--schedules", default=",".join(s.name for s in registry.specs() if s.ordered),
                   help=f"comma-separated, from {','.join(registry.names())} (default: the ordered ones)")
    p.add_argument("--png", default=None, help="write one Gantt PNG per schedule into this folder")
    return p


def parse_args(argv):
    a = build_parser().parse_args(argv)

    names = [s.strip() for s in a.schedules.split(",") if s.strip()]
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
        try:
            lens = [int(x) for x in a.varlen.split(",")]
        except ValueError:
            _bad("--varlen", a.varlen, "comma-separated non-negative ints")
        if not lens or min(lens) < 0:
            _bad("--varlen", a.varlen, "comma-separated non-negative ints")
        a.seqlens_q = a.seqlens_k = lens
        a.varlen = True
    else:
        sq = a.seqlen_q if a.seqlen_q is not None else a.seqlen
        sk = a.seqlen_k if a.seqlen_k is not None else a.seqlen
        if sq is None or sk is None:
            raise SystemExit("dash-schedule: error: give --seqlen (or --seqlen-q and --seqlen-k, or --varlen)")
        for flag, v in (("--seqlen-q", sq), ("--seqlen-k", sk)):
            if v < 1:
                _bad(flag, v, "a positive int")
        a.seqlens_q, a.seqlens_k = [sq] * a.batch, [sk] * a.batch
        a.varlen = False
    if a.batch < 1:
        _bad("--batch", a.batch, "a positive int")
    if a.heads is None:
        a.heads = max(1, 2048 // a.hdim)
    if a.kv_heads is None:
        a.kv_heads = a.heads
    if a.heads < 1:
        _bad("--heads", a.heads, "a positive int")
    if a.kv_heads < 1 or a.heads % a.kv_heads:
        _bad("--kv-heads", a.kv_heads, f"a positive divisor of --heads {a.heads}")
    if a.sms < 1:
        _bad("--sms", a.sms, "a positive int")
    if a.c < 0 or a.r < 0:
        _bad("--c/--r", (a.c, a.r), "non-negative costs")
    if a.causal and a.window_right > 0:
        _bad("--window-right", a.window_right, "0 or -1 with --causal")
    bm, bn = default_tiles(a.hdim, a.causal)
    a.block_m = a.block_m if a.block_m is not None else bm
    a.block_n = a.block_n if a.block_n is not None else bn
    for flag, v in (("--block-m", a.block_m), ("--block-n", a.block_n)):
        if v < 1:
            _bad(flag, v, "a positive int")
    if a.group_size is not None and a.group_size < 1:
        _bad("--group-size", a.group_size, "a positive int")
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
            raise SystemExit(f"dash-schedule: error: {name} on --sms {a.sms}: {e}") from None
        return plan.schedule, simulate_plan(plan, c=a.c, r=a.r, record=record)
    sched = build_schedule(name, seqlens_q=a.seqlens_q, seqlens_k=a.seqlens_k, block_m=a.block_m,
                           block_n=a.block_n, causal=a.causal, window_left=a.window_left,
                           window_right=a.window_right, group_size=a.group_size)
    return sched, simulate(sched, num_heads=a.heads, num_kv_heads=a.kv_heads, num_sms=a.sms, c=a.c, r=a.r,
                           assignment=a.assignment or "dynamic", launch=a.launch or "head-major",
                           record=record)


def _progress(message):
    """One line on stderr per step: a long shape takes seconds per schedule and per picture."""
    print(f"dash-schedule: {message}", file=sys.stderr, flush=True)


def run(a, out=None):
    out = sys.stdout if out is None else out
    names = list(a.schedule_names)
    record = a.png is not None
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
          f"causal={a.causal} window=({a.window_left},{a.window_right}) SMs={a.sms} "
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
        os.makedirs(a.png, exist_ok=True)
        xmax = max(results[n][1].makespan for n in names) * 1.01
        mask = "causal" if a.causal else ("window" if a.window_left >= 0 or a.window_right >= 0 else "full")
        for i, name in enumerate(names):
            _progress(f"drawing {name} ({i + 1}/{len(names)})")
            path = os.path.join(a.png, f"{name}.png")
            draw_gantt(results[name][1], path, xmax=xmax,
                       title=f"{name} ({mask}, {a.heads} heads, {a.sms} SMs)")
            print(f"wrote {path}", file=out)
    return results


def _short(lens):
    return str(lens[0]) if len(set(lens)) == 1 and len(lens) == 1 else str(lens)


def main(argv=None) -> int:
    run(parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
