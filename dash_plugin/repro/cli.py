"""`dash-repro`: prove that two training runs give identical bits (or show where they do not).

    dash-repro demo                         tiny model twice on the CPU (+ the atomic schedule on a GPU)
    dash-repro run --size tiny --steps 30   the same training twice, in separate processes, then compare
    dash-repro run --launch "accelerate launch --num_processes 2" --size small   the same with DDP
    dash-repro run --parallel --devices 0,1 --size base   both runs at once, run1 on GPU 0, run2 on GPU 1
    dash-repro compare RUN_A RUN_B          the first step where two runs differ, and which tensors
    dash-repro plot RUN_A RUN_B -o loss.png both loss curves and their difference

Exit code: 0 when the runs are bit-identical, 1 when they differ, 2 on bad input or a failed run.
Also runs as `python -m dash_plugin.repro`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from dash_plugin.repro.compare import compare_runs

SCRIPT_ENV = "DASH_REPRO_SCRIPT"


class RunFailed(RuntimeError):
    pass


def find_script(explicit: str | None = None) -> Path:
    """The training script: --script, else $DASH_REPRO_SCRIPT, else examples/train_accelerate.py of the
    checkout this package lives in (an editable or source install)."""
    import dash_plugin

    candidates = [explicit, os.environ.get(SCRIPT_ENV),
                  Path(dash_plugin.__file__).resolve().parent.parent / "examples" / "train_accelerate.py"]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    raise RunFailed(f"cannot find the training script: pass --script PATH or set {SCRIPT_ENV} "
                    f"(looked for {candidates[-1]})")


def _steps_in(train_args: list[str]) -> int:
    """The --steps the training script will run (its default is 30)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--stop-at", type=int, default=None)
    known, _ = p.parse_known_args(train_args)
    return known.stop_at or known.steps


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except FileNotFoundError:
        return 0


def build_command(script: Path, train_args: list[str], out: Path, launch: str | None = None) -> list[str]:
    """The command of one run: `python SCRIPT ARGS --out OUT`, or with a launcher (e.g. "accelerate launch
    --num_processes 2") in place of `python`."""
    prefix = shlex.split(launch) if launch else [sys.executable]
    return [*prefix, str(script), *train_args, "--out", str(out)]


def parse_devices(value: str | None, runs: int) -> list[str] | None:
    """--devices "0,1" -> ["0", "1"]: the CUDA_VISIBLE_DEVICES of each run, one entry per run."""
    if value is None:
        return None
    devices = [d.strip() for d in value.split(",")]
    if len(devices) != runs or not all(devices):
        raise RunFailed(f"--devices={value!r} is not allowed; pass one device per run ({runs}), comma-separated, "
                        f"e.g. --devices 0,1 (run1 on GPU 0, run2 on GPU 1)")
    return devices


def run_training(train_args: list[str], out_dirs: list[Path], *, script: Path, parallel: bool = False,
                 desc: str = "", launch: str | None = None, devices: list[str] | None = None) -> None:
    """Run the training script once per output directory, with identical arguments, showing progress.

    Each run is a fresh Python process (nothing cached in memory is shared), with its output in
    OUT/train.log. `devices` gives each run its own CUDA_VISIBLE_DEVICES (one entry per run), so parallel
    runs can train on different GPUs. Raises RunFailed with the log's tail if a run fails.
    """
    from tqdm import tqdm

    if any(a == "--out" or a.startswith("--out=") for a in train_args):
        raise RunFailed("do not pass --out to the training: dash-repro chooses one directory per run")
    if devices is not None and len(devices) != len(out_dirs):
        raise RunFailed(f"devices={devices} gives {len(devices)} devices for {len(out_dirs)} runs")
    total = _steps_in(train_args)
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")  # the same string hashing in every run
    bars = {}  # index -> bar, created when that run starts (so its clock is the run's)
    pending = list(enumerate(out_dirs))
    running: list[tuple[int, Path, subprocess.Popen, object]] = []
    try:
        while pending or running:
            while pending and (parallel or not running):
                i, d = pending.pop(0)
                d.mkdir(parents=True, exist_ok=True)
                for stale in ("steps.jsonl", "meta.json", "final.json", "model.safetensors"):
                    (d / stale).unlink(missing_ok=True)  # a failed rerun must not leave old results
                log = open(d / "train.log", "w")
                cmd = build_command(script, train_args, d, launch)
                run_env, shown = env, ""
                if devices is not None:
                    run_env = {**env, "CUDA_VISIBLE_DEVICES": devices[i]}
                    shown = f"CUDA_VISIBLE_DEVICES={devices[i]} "
                log.write("$ " + shown + " ".join(cmd) + "\n")
                log.flush()
                # Own process group: a launcher's workers (accelerate launch) can be stopped with it.
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env,
                                        start_new_session=True)
                running.append((i, d, proc, log))
                bars[i] = tqdm(total=total, desc=f"{desc}{d.name}", unit="step", position=i, leave=True,
                               dynamic_ncols=True, mininterval=0.5)
            time.sleep(0.2)
            for item in list(running):
                i, d, proc, log = item
                done = min(total, _count_lines(d / "steps.jsonl"))
                if done > bars[i].n:
                    bars[i].update(done - bars[i].n)
                if proc.poll() is not None:
                    log.close()
                    running.remove(item)
                    if proc.returncode != 0:
                        tail = "".join((d / "train.log").read_text().splitlines(True)[-25:])
                        raise RunFailed(f"training run {d} failed (exit {proc.returncode}); "
                                        f"end of {d / 'train.log'}:\n{tail}")
    finally:
        for _, _, proc, log in running:  # only our own children's groups, on an error or Ctrl-C
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            log.close()
        for b in bars.values():
            b.close()


def run_twice(train_args, out: Path, *, script: Path, parallel: bool = False, desc: str = "",
              launch: str | None = None, devices: list[str] | None = None):
    dirs = [out / "run1", out / "run2"]
    run_training(list(train_args), dirs, script=script, parallel=parallel, desc=desc, launch=launch,
                 devices=devices)
    return compare_runs(dirs[0], dirs[1])


# --- subcommands ---------------------------------------------------------------------------------------

def cmd_run(args, train_args) -> int:
    script = find_script(args.script)
    if args.launch and args.parallel:
        raise RunFailed("--parallel with --launch would put two multi-process runs on the same devices")
    if args.launch and args.devices:
        raise RunFailed("--devices gives each run one entry of CUDA_VISIBLE_DEVICES; with --launch set "
                        "CUDA_VISIBLE_DEVICES for the launcher instead")
    devices = parse_devices(args.devices, 2)
    cmp = run_twice(train_args, Path(args.out), script=script, parallel=args.parallel, launch=args.launch,
                    devices=devices)
    print(cmp.report())
    if args.plot:
        from dash_plugin.repro.plot import plot_runs

        png = plot_runs(cmp.run_a, cmp.run_b, Path(args.out) / "loss.png")
        print(f"plot: {png}")
    return 0 if cmp.identical else 1


def cmd_compare(args) -> int:
    cmp = compare_runs(args.run_a, args.run_b)
    print(cmp.report() if args.verbose else "\n".join([*("note: " + n for n in cmp.notes), cmp.verdict()]))
    return 0 if cmp.identical else 1


def cmd_plot(args) -> int:
    from dash_plugin.repro.plot import plot_runs

    png = plot_runs(args.run_a, args.run_b, args.output, title=args.title)
    print(f"plot: {png}")
    return 0


def _demo_pair(name, title, train_args, out: Path, script: Path):
    """Two runs, the full report, and a plot titled with the verdict (never a claim made in advance)."""
    from dash_plugin.repro.plot import plot_runs

    cmp = run_twice(train_args, out / name, script=script, desc=f"{name} ")
    print(cmp.report())
    outcome = "identical bits" if cmp.identical else f"first bit difference at step {cmp.first.step}" \
        if cmp.first else "different"
    print(f"plot: {plot_runs(cmp.run_a, cmp.run_b, out / f'{name}.png', title=f'{title}: {outcome}')}")
    return cmp


def cmd_demo(args) -> int:
    import torch

    script = find_script(args.script)
    out = Path(args.out)
    cuda = torch.cuda.is_available() and not args.cpu
    base = ["--size", "tiny", "--steps", str(args.steps), "--attn", args.attn]
    print(f"dash-repro demo on {'GPU ' + torch.cuda.get_device_name() if cuda else 'the CPU'}; outputs in {out}")
    print(f"1) the same training twice ({' '.join(base)}), each in a fresh process")
    tiny = _demo_pair("tiny", "tiny model, two runs", base + ([] if cuda else ["--cpu"]), out, script)
    summary = [f"tiny model: {tiny.verdict()}"]
    ok = tiny.identical
    if cuda:
        # Atomic dQ adds can only come out in another order with 3+ contributions per dQ tile: a longer
        # sequence gives many KV tiles per Q tile.
        gpu = ["--size", "small", "--seq-len", "1024", "--steps", str(args.steps), "--attn", args.attn]
        print(f"2) a deterministic dash schedule on the GPU, twice ({' '.join(gpu)})")
        det = _demo_pair("gpu-deterministic", "deterministic schedule, two runs", gpu, out, script)
        summary.append(f"deterministic schedule: {det.verdict()}")
        ok = ok and det.identical
        print("3) the same with the nondeterministic `atomic` schedule, twice (expected to diverge)")
        atomic = _demo_pair("gpu-atomic", "atomic schedule, two runs", gpu + ["--schedule", "atomic"], out, script)
        if atomic.identical:
            summary.append("atomic schedule: the two runs happened to agree this time (atomics may, not must, "
                           "reorder)")
        else:
            summary.append(f"atomic schedule (the check can fail): {atomic.verdict()}")
    print()
    print("\n".join(summary))
    print("DEMO PASSED: deterministic runs are bit-identical" if ok else
          "DEMO FAILED: deterministic runs differ (see above)")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dash-repro", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the same training twice and compare (other options go to the training)")
    r.add_argument("--out", default="dash-repro-run", help="directory for run1/ and run2/ (default %(default)s)")
    r.add_argument("--script", default=None, help="training script (default: examples/train_accelerate.py)")
    r.add_argument("--parallel", action="store_true", help="run both at once (give each --threads on the CPU)")
    r.add_argument("--devices", default=None, metavar="D1,D2",
                   help="CUDA_VISIBLE_DEVICES of run1 and run2, e.g. 0,1: run1 on GPU 0, run2 on GPU 1 "
                        "(with --parallel both train at once, one per GPU)")
    r.add_argument("--plot", action="store_true", help="also write OUT/loss.png")
    r.add_argument("--launch", default=None, metavar="CMD",
                   help='launcher instead of python, e.g. "accelerate launch --num_processes 2" (DDP/FSDP)')
    c = sub.add_parser("compare", help="first step and tensors where two runs differ")
    c.add_argument("run_a")
    c.add_argument("run_b")
    c.add_argument("-v", "--verbose", action="store_true", help="full report: every differing tensor by layer")
    pl = sub.add_parser("plot", help="both loss curves and their difference, as a PNG")
    pl.add_argument("run_a")
    pl.add_argument("run_b")
    pl.add_argument("-o", "--output", default="loss.png")
    pl.add_argument("--title", default=None)
    d = sub.add_parser("demo", help="one command: identical runs on the CPU; on a GPU also the atomic schedule")
    d.add_argument("--out", default="dash-repro-demo")
    d.add_argument("--steps", type=int, default=30)
    d.add_argument("--attn", default="dash")
    d.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    d.add_argument("--script", default=None)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "run":
        args, train_args = parser.parse_known_args(argv)
        if train_args and train_args[0] == "--":
            train_args = train_args[1:]
    else:
        args, train_args = parser.parse_args(argv), []
    try:
        if args.command == "run":
            return cmd_run(args, train_args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "plot":
            return cmd_plot(args)
        return cmd_demo(args)
    except (RunFailed, FileNotFoundError, ValueError) as e:
        print(f"dash-repro {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
