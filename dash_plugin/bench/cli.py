"""``dash-bench`` (also ``python -m dash_plugin.bench``): run the benchmark protocol
(docs/benchmarks/README.md) and write
results.json, results.md and results.png; optionally derive the ``auto`` schedule table.

    dash-bench --quick --out docs/benchmarks/quick          # a few points, under 3 minutes on an H100/H200
    dash-bench --gqa --hdim256 --max-minutes 9 --out out/   # the whole protocol within a time budget
    dash-bench --device cpu --tiny --out /tmp/tiny          # CPU pipeline check (CI)
    dash-bench --dropout 0.1 --hdims 128 --seqlens 2048,8192 --impls 'dash-*,sdpa-flash'   # the cost of dropout
    dash-bench --from-json out/results.json --write-auto-table auto_table.json
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

QUICK_BUDGET_MIN = 2.5   # --quick promises under 3 minutes (start-up and reports included): the rest is skipped
MODE_TIMING = {"full": (25.0, 100.0), "quick": (10.0, 50.0), "tiny": (2.0, 20.0)}   # warm-up, window (ms)


def _comma_list(text: str, name: str, convert=str, what: str = "names", allowed=None) -> list:
    """The items of a comma-list flag, each converted. Refuses an empty list and an item given
    twice: a point or a column listed twice would be measured twice, and the report keeps one cell
    per (point, column). `allowed`: (test, description); an item failing the test is refused with
    the description, before a run rather than as a traceback or error cells minutes into it."""
    try:
        items = [convert(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of {what}, got {text!r}") from None
    if not items:
        raise ValueError(f"{name} {text!r} is empty: give a comma list of {what}")
    if allowed is not None:
        test, description = allowed
        bad = list(dict.fromkeys(str(x) for x in items if not test(x)))   # each bad value once
        if bad:
            raise ValueError(f"{name} {text!r}: {', '.join(bad)} not allowed; allowed: {description}")
    twice = sorted({str(x) for x in items if items.count(x) > 1})
    if twice:
        raise ValueError(f"{name} {text!r}: {', '.join(twice)} given twice; list each once")
    return items


DROPOUT_ALLOWED = ("0 (no dropout) or a number above 2**-9 and below 1 - 2**-9 (the mask takes P in steps "
                   "of 2**-8; e.g. 0.1)")


def _dropout(text: str) -> float:
    """--dropout's value: a p the dropout mask takes; anything else names the flag, the value and the range."""
    from ..kernels.philox import dropout_threshold   # torch: imported only when the flag is given
    try:
        value = float(text)
        dropout_threshold(value)   # NaN, infinities, out of range and p the mask's steps lose
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: P must be {DROPOUT_ALLOWED}") from None
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dash-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="hdim 128 at 2k and 8k, hdim 64 at 2k, causal and full (under 3 minutes on the GPU)")
    mode.add_argument("--tiny", action="store_true",
                      help="miniature protocol (S=128/256, H=2, D=64, fp32) that runs on the CPU")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda; the CPU only runs --tiny")
    ap.add_argument("--impls", default=None,
                    help="comma list of implementation names or patterns (e.g. 'dash-*,sdpa-cudnn,flex'); "
                         "see --list")
    ap.add_argument("--list", action="store_true", help="list the implementations and whether they run here")
    ap.add_argument("--source-digest", action="store_true",
                    help="print the digest of the dash_plugin sources installed here (results files record it)")
    ap.add_argument("--hdims", default=None, help="comma list of distinct head dims (default 64,128)")
    ap.add_argument("--hdim256", action="store_true", help="add the hdim 256 row")
    ap.add_argument("--gqa", action="store_true", help="add the GQA 4:1 row (hdim 128)")
    ap.add_argument("--gqa-only", action="store_true", help="only the GQA 4:1 row (hdim 128)")
    ap.add_argument("--seqlens", default=None, help="comma list of distinct seqlens (default 512..16384)")
    ap.add_argument("--masks", default=None, help="comma list of causal,full (default both); a value "
                    "given twice in --hdims, --seqlens or --masks is refused (it would measure a point twice)")
    ap.add_argument("--repeats", type=int, default=6, help="backward passes compared bitwise (default 6)")
    ap.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 25; quick 10)")
    ap.add_argument("--rep-ms", type=float, default=None, help="do_bench measuring window (default 100; quick 50)")
    ap.add_argument("--seed", type=int, default=0, help="input seed; also the fixed dropout seed (default 0)")
    ap.add_argument("--dropout", type=_dropout, default=0.0, metavar="P",
                    help="also time forward + backward with dropout_p=P beside the same call without it, for "
                         "every implementation with dropout (ours, SDPA flash/efficient/math; FA4, cuDNN and "
                         "Flex are marked 'no dropout'), and report the cost ratio with / without; "
                         f"P is {DROPOUT_ALLOWED}")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="time budget: cells after it are recorded as skipped and the reports are still "
                         f"written (default: none; --quick: {QUICK_BUDGET_MIN})")
    ap.add_argument("--cell-timeout", type=float, default=240.0,
                    help="seconds one cell (compiles included) may take before the run is declared hung: "
                         "the reports are written with that cell marked 'hung' and the process exits with "
                         "status 3 (default 240; 0 disables)")
    ap.add_argument("--out", default="dash-bench-out", help="output folder (default ./dash-bench-out)")
    ap.add_argument("--from-json", default=None, metavar="RESULTS",
                    help="do not run: rebuild the reports (and/or the auto table) from a results.json, or "
                         "from several (comma list) that measured different points on the same GPU")
    ap.add_argument("--write-auto-table", default=None, metavar="PATH",
                    help="derive the auto schedule table from the results (this run's or --from-json's): "
                         "PATH.py in dash_plugin/schedules/auto_table.py's format, else JSON with the figures")
    ap.add_argument("--auto-table-backend", default="triton", choices=("triton", "reference"),
                    help="the backend whose cells decide the auto table (default triton: auto_table.py serves "
                         "the calls that run there; reference: the CPU pipeline check)")
    return ap


def _check_flags(args):
    """Values argparse's types let through: named, with what is allowed (exit 2, no traceback)."""
    from . import protocol
    if args.masks is not None:
        bad = [m for m in (x.strip() for x in args.masks.split(",")) if m not in protocol.MASKS]
        if bad or not args.masks.strip():
            raise ValueError(f"--masks {args.masks!r}: allowed: {', '.join(protocol.MASKS)} (comma list)")
        _comma_list(args.masks, "--masks")   # each once
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise ValueError(f"--max-minutes {args.max_minutes}: must be > 0 (or left out: no budget)")
    if not args.cell_timeout >= 0:
        raise ValueError(f"--cell-timeout {args.cell_timeout}: must be >= 0 seconds (0 disables the watchdog)")
    # torch.manual_seed takes up to 2**64-1, but the seed is also the dropout seed, which the API
    # takes in 0..2**63-1 (checks.INT64_MAX); a larger one failed at the first point, after start-up.
    from ..checks import INT64_MAX
    if not 0 <= args.seed <= INT64_MAX:
        raise ValueError(f"--seed {args.seed}: must be an int in 0..2**63-1 (it is also the dropout seed, which "
                         "the API takes in that range)")
    for preset, on in (("--tiny", args.tiny), ("--quick", args.quick)):
        if on and (args.hdims is not None or args.seqlens is not None):
            raise ValueError(f"{preset} runs its own points: drop --hdims / --seqlens")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out}: exists and is not a folder")
    table = args.write_auto_table
    if table is not None:   # checked before a run of minutes, not when it is written at the end
        if not table.strip():
            raise ValueError("--write-auto-table '': give a file path (PATH.py: auto_table.py's format, else JSON)")
        if os.path.isdir(table):
            raise ValueError(f"--write-auto-table {table}: is a folder; give a file path (PATH.py: auto_table.py's "
                             "format, else JSON)")
        parent = os.path.dirname(os.path.abspath(table))
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ValueError(f"--write-auto-table {table}: {parent} is not a folder")


def _points(args):
    from ..checks import HEAD_DIM_MAX, HEAD_DIM_MIN
    from . import protocol
    # Every dash-* column goes through the API, which takes these head dims on every backend (the
    # Triton kernels pad any of them; the Hopper kernel takes fewer): past them none of ours runs.
    hdim_allowed = (lambda d: HEAD_DIM_MIN <= d <= HEAD_DIM_MAX,
                    f"{HEAD_DIM_MIN}..{HEAD_DIM_MAX} (the head dims the API takes)")
    # Every point holds protocol.TOKENS_PER_POINT tokens, batch x seqlen (protocol.batch_for).
    tokens = protocol.TOKENS_PER_POINT
    seqlen_allowed = (lambda s: s > 0 and tokens % s == 0,
                      f"the divisors of {tokens} (every point is batch x seqlen = {tokens} tokens)")
    masks = tuple(_comma_list(args.masks, "--masks")) if args.masks is not None else protocol.MASKS
    if args.tiny:
        return protocol.tiny_points(masks=masks)
    if args.quick:
        return protocol.quick_points(masks=masks)
    if args.gqa_only and (args.hdims is not None or args.hdim256):
        raise ValueError("--gqa-only runs the GQA row alone: drop --hdims / --hdim256, or use --gqa")
    if args.gqa_only:
        hdims = []
    else:
        hdims = (_comma_list(args.hdims, "--hdims", int, "integers", hdim_allowed) if args.hdims is not None
                 else list(protocol.HDIMS))
    if args.hdim256 and 256 not in hdims:
        hdims.append(256)
    seqlens = (_comma_list(args.seqlens, "--seqlens", int, "integers", seqlen_allowed) if args.seqlens is not None
               else list(protocol.SEQLENS))
    return protocol.protocol_points(hdims=hdims, seqlens=seqlens, masks=masks, gqa=args.gqa or args.gqa_only)


def _finish(results, args, command) -> int:
    from . import report
    paths = report.write_reports(results, args.out, command=command)
    print("wrote " + ", ".join(p for p in paths.values() if p))
    for row in report.evaluate_targets(results):
        value = "-" if row["value"] is None else f"{row['value']:.{row.get('digits', 2)}f}x"
        print(f"  target: {row['title']}: {value} (goal {row['op']} {row['goal']:.2f}x) -> {row['verdict']}")
    if args.write_auto_table:
        from .autotable import CANDIDATES, unmeasured_candidates, write_auto_table
        rules = write_auto_table(results, args.write_auto_table, results_path=args.from_json,
                                 backend=args.auto_table_backend)
        print(f"wrote {args.write_auto_table} ({len(rules)} rules)")
        missing = unmeasured_candidates(results, args.auto_table_backend)
        if missing:
            key, which = next(iter(missing.items()))
            print(f"warning: the table picks among fewer than the {len(CANDIDATES)} candidates at {len(missing)} "
                  f"point(s) (e.g. {key}: no {args.auto_table_backend} cell of {', '.join(which)}); a schedule "
                  f"that was not measured at a point cannot win it. Measure every deterministic schedule on "
                  f"that backend before committing the table", file=sys.stderr)
    return 0


def _refuse_overwriting_inputs(files: list[str], args) -> None:
    """--from-json rewrites the reports into --out: never over one of the files it read (a merge
    written over its first part loses that part)."""
    from .report import report_paths
    writes = [("--out", args.out, path) for path in report_paths(args.out).values()]
    if args.write_auto_table:
        writes.append(("--write-auto-table", args.write_auto_table, args.write_auto_table))
    for f in files:
        for flag, value, path in writes:
            if os.path.exists(path) and os.path.samefile(f, path):
                raise ValueError(f"{flag} {value} would overwrite {f}, which --from-json reads: write elsewhere "
                                 "(--out's default: ./dash-bench-out)")


def _say_replaced(out: str) -> None:
    """--out replaces an earlier report there (by design: a rerun updates its folder); say which
    files, before the first of them is written."""
    from .report import report_paths
    existing = [os.path.basename(p) for p in report_paths(out).values() if os.path.exists(p)]
    if existing:
        print(f"replacing the earlier report in {out}: {', '.join(existing)}", flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    command = "dash-bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        return _main(args, command)
    except ValueError as exc:       # bad input anywhere below: one clear line, no traceback
        print(f"dash-bench: {exc}", file=sys.stderr)
        return 2


def _main(args, command) -> int:
    _check_flags(args)
    if args.from_json is not None:
        from . import report
        files = _comma_list(args.from_json, "--from-json", what="results files")
        results = report.merge_results([report.read_json(f) for f in files], files)
        _refuse_overwriting_inputs(files, args)
        _say_replaced(args.out)
        # the reports name the command that measured the figures, not this one
        return _finish(results, args, results.get("config", {}).get("command") or command)
    points = _points(args)   # a bad --hdims / --seqlens is named before anything else is asked

    # Under torch.use_deterministic_algorithms cuBLAS needs a fixed workspace; set before CUDA starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    from . import peers, runner

    if args.source_digest:
        print(runner.source_digest())
        return 0
    device_name = args.device or "cuda"
    if args.list:   # what would run on this machine, and why not where it would not
        device = torch.device(device_name if device_name == "cpu" or torch.cuda.is_available() else "cpu")
        selected = {i.name for i in peers.select_impls(args.impls, device, tiny=args.tiny)}
        for impl in peers.all_impls():
            reason = impl.unavailable_reason(device)
            state = reason or ("runs here" if impl.name in selected else "runs here, not in the default set")
            if impl.build_dropout is None:
                state += f"; {impl.no_dropout}"
            print(f"{impl.name:20s} {impl.description}\n{'':20s} -> on {device.type}: {state}")
        return 0
    if device_name == "cuda" and not torch.cuda.is_available():
        print("dash-bench: no CUDA device here. The protocol needs a GPU; for a pipeline check on the CPU "
              "run `dash-bench --device cpu --tiny`.", file=sys.stderr)
        return 2
    if device_name == "cpu" and not args.tiny:
        print("dash-bench: on the CPU only the miniature protocol runs: add --tiny.", file=sys.stderr)
        return 2
    device = torch.device(device_name)

    candidates = peers.select_impls(args.impls, device, tiny=args.tiny)
    unavailable = {i.name: r for i in candidates if (r := i.unavailable_reason(device)) is not None}
    impls = [i for i in candidates if i.name not in unavailable]
    for name, reason in unavailable.items():
        print(f"not run: {name}: {reason}")
    if not impls:
        print("dash-bench: no selected implementation can run here.", file=sys.stderr)
        return 2

    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    warmup, rep = MODE_TIMING[mode]
    settings = runner.Settings(repeats=args.repeats, seed=args.seed,
                               warmup_ms=warmup if args.warmup_ms is None else args.warmup_ms,
                               rep_ms=rep if args.rep_ms is None else args.rep_ms, dropout_p=args.dropout)
    if mode == "quick" and args.max_minutes is None:
        args.max_minutes = QUICK_BUDGET_MIN
    print(f"dash-bench ({mode}): {len(points)} points x {len(impls)} implementations on "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
          + (f"; dropout p={args.dropout} beside no dropout" if args.dropout > 0 else ""))
    if args.dropout > 0:
        without = [i.name for i in impls if i.build_dropout is None]
        if without:
            print(f"no dropout (marked so in the dropout table): {', '.join(without)}")
    _say_replaced(args.out)   # the JSON so far is written after the first point
    os.makedirs(args.out, exist_ok=True)
    from . import report
    partial = os.path.join(args.out, "results.json")

    results = runner.run_benchmark(
        points, impls, device, settings, unavailable=unavailable, max_minutes=args.max_minutes,
        config={"mode": mode, "command": command, "impls": args.impls},
        log=lambda line: print(line, flush=True),
        # the JSON so far after every point: a run killed from outside keeps what it measured
        on_point_done=lambda res: report.write_json(res, partial),
        cell_timeout_s=args.cell_timeout or None,
        on_hang=lambda res: _finish(res, args, command))
    return _finish(results, args, command)
