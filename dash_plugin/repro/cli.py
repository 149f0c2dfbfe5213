"""`dash-repro`: prove that two training runs give identical bits (or show where they do not).

    dash-repro demo                         tiny model twice on the CPU (+ the atomic schedule on a GPU)
    dash-repro run --size tiny --steps 30   the same training twice, in separate processes, then compare
    dash-repro run --launch "accelerate launch --num_processes 2" --size small   the same with DDP
    dash-repro run --parallel --devices 0,1 --size base   both runs at once, run1 on GPU 0, run2 on GPU 1
    dash-repro compare RUN_A RUN_B          the first step where two runs differ, and which tensors
    dash-repro plot RUN_A RUN_B -o loss.png both loss curves and their difference

Exit code: 0 when the runs are bit-identical, 1 when they differ, 2 when they could not be compared (bad input,
a missing, unreadable or incomplete run file, no steps, a failed or stopped run). Runs that agree but both hit
a NaN or infinite loss, grad norm or lr get an IDENTICAL verdict that says so and from which step, with exit
0: they reproduce each other (a NaN is compared as NaN: float.hex records none of its bits). `run` refuses an
--out that already holds runs unless --force. Also runs as `python -m dash_plugin.repro`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from dash_plugin.repro import proctree
from dash_plugin.repro.compare import INCOMPLETE, compare_runs

SCRIPT_ENV = "DASH_REPRO_SCRIPT"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunFailed(RuntimeError):
    pass


class Interrupted(RunFailed):
    """dash-repro itself got SIGINT / SIGTERM / SIGHUP while runs were training."""

    def __init__(self, signum: int, message: str | None = None):
        self.signum = signum
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")


class _SignalsStopRuns:
    """While installed, the stop signals raise Interrupted in the main thread, so that run_training's cleanup
    ends the runs' process groups: each run is a session of its own, which no signal to dash-repro reaches.

    While `held()`, a signal is only recorded and raised at the end of the block: starting a run and
    registering it for the cleanup must not be split by it, nor may the cleanup itself be interrupted."""

    def __init__(self):
        self.holding, self.caught = False, None

    def __call__(self, signum, frame):
        if self.holding:
            self.caught = self.caught or signum
        else:
            raise Interrupted(signum)

    @contextmanager
    def held(self, *, raise_after: bool = True):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if raise_after and self.caught is not None:
            raise Interrupted(self.caught)

    @contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():  # handlers only exist there
            yield self
            return
        previous = {s: signal.signal(s, self) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def find_script(explicit: str | None = None) -> Path:
    """The training script: --script, else $DASH_REPRO_SCRIPT, else examples/train_accelerate.py:
    the installed copy (`dash_plugin.examples`), or the checkout's next to this package (a source
    tree on PYTHONPATH)."""
    import importlib.util

    import dash_plugin

    for given, what in ((explicit, "--script"), (os.environ.get(SCRIPT_ENV), SCRIPT_ENV)):
        if given:   # a script that was named must exist: never fall back to another one
            if not Path(given).is_file():
                raise RunFailed(f"{what}={given}: no such file (the training script to run)")
            return Path(given)
    spec = importlib.util.find_spec("dash_plugin.examples")
    folders = list(spec.submodule_search_locations) if spec else []
    folders.append(Path(dash_plugin.__file__).resolve().parent.parent / "examples")
    candidates = [Path(folder) / "train_accelerate.py" for folder in folders]
    for script in candidates:
        if script.is_file():
            return script
    raise RunFailed(f"cannot find the training script: pass --script PATH or set {SCRIPT_ENV} "
                    f"(looked for {', '.join(map(str, candidates))})")


# The attention implementations the training script documents (its --attn). transformers knows a value only
# once the model is built, minutes into a run: dash-repro checks it before any run starts.
ATTN_CHOICES = ("dash", "sdpa", "eager")


class _TrainingOptions(argparse.ArgumentParser):
    """A parser whose errors (an ambiguous abbreviation too, which argparse reports with error()) are RunFailed."""

    def error(self, message):
        raise RunFailed(message)


def _training_options(train_args: list[str]) -> argparse.Namespace:
    """The training options dash-repro reads (--steps, --stop-at, --attn, --resume-from), checked: a bad one
    is a RunFailed before any run starts, reported as dash-repro run's own error (this parser has no usage
    line of its own to show)."""
    # Abbreviations as the training script's parser takes them (--step 0 is its --steps 0): else such an option
    # would pass unchecked here.
    p = _TrainingOptions(add_help=False, exit_on_error=False)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--attn", choices=ATTN_CHOICES, default=None)
    p.add_argument("--resume-from", type=Path, default=None)
    try:
        known, _ = p.parse_known_args(train_args)
    except argparse.ArgumentError as e:
        raise RunFailed(str(e)) from None
    # The same checks as the training script's, made here: with --force a run refused later would already
    # have cost the earlier results.
    if known.steps < 1:
        raise RunFailed(f"--steps={known.steps} is not allowed; pass a positive integer")
    if known.stop_at is not None and not 1 <= known.stop_at <= known.steps:
        raise RunFailed(f"--stop-at={known.stop_at} is not allowed; pass a step in 1..--steps ({known.steps})")
    return known


def _check_with_the_bundled_parser(script: Path, train_args: list[str]) -> None:
    """Run the bundled training script's own option parser on `train_args`, here and now: with --force, an
    option it would refuse must not cost the results about to be deleted. Other scripts are not imported
    (their module code could do anything); for them only the options above are checked first."""
    try:
        bundled = find_script(None)
    except RunFailed:
        return
    if script.resolve() != bundled.resolve():
        return
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("_dash_repro_training_script", bundled)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            module.parse_args([*train_args, "--out", "unused"])
    except SystemExit:
        reason = (said.getvalue().strip().splitlines() or ["its option parser exited"])[-1]
        raise RunFailed(f"the training script refuses these options ({reason.split('error: ', 1)[-1]}); nothing "
                        f"was deleted") from None


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


def _file_in_the_way(d: Path) -> Path | None:
    """The file (not a directory) that stands where `d` or one of its parents must be a directory, if any."""
    for p in (d, *d.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def _holding_results(dirs: list[Path]) -> list[Path]:
    """The run directories that hold anything (results of an earlier run)."""
    return [d for d in dirs if d.is_dir() and any(d.iterdir())]


def claim_run_dirs(dirs: list[Path], replace: bool = False, resume_from: Path | None = None) -> None:
    """Make sure every run directory can be written and holds nothing: results of an earlier run are never
    silently deleted, nor mixed with the new ones. replace=True (--force) deletes them first, but never the
    checkpoint the runs are to resume from."""
    for d in dirs:
        blocker = _file_in_the_way(d)
        if blocker is not None:
            raise RunFailed(f"cannot make the run directory {d}: {blocker} is a file; pass a directory as --out "
                            f"(it is made if missing)")
    taken = _holding_results(dirs)
    if replace and resume_from is not None:
        holder = next((d for d in taken if resume_from.resolve().is_relative_to(d.resolve())), None)
        if holder is not None:
            raise RunFailed(f"--force would delete {holder}, which holds --resume-from {resume_from}; resume into "
                            f"another --out (the checkpoint stays where it is)")
    if taken and not replace:
        raise RunFailed(f"{' and '.join(map(str, taken))} already hold{'s' if len(taken) == 1 else ''} results "
                        f"of an earlier run; pass --force to delete and replace them, or choose another --out")
    for d in taken:
        shutil.rmtree(d)


def _mark_incomplete(d: Path, why: str) -> None:
    """`dash-repro compare` refuses a run directory with this marker (it names the reason)."""
    (d / INCOMPLETE).write_text(why + "\n")


# Run by a small watchdog process per run: it waits on a pipe from dash-repro. A "done" byte means the run
# ended and was handled; end of file without it means dash-repro died without cleaning up (SIGKILL, a crash
# of the interpreter, the OOM killer), and the watchdog kills the run's process group so no training is left
# writing into its directory (or holding a GPU) with no one to stop it.
_WATCHDOG = """import importlib.util, sys
pgid = int(sys.argv[1])
if sys.stdin.buffer.read(1) != b"d":
    spec = importlib.util.spec_from_file_location("proctree", sys.argv[2])
    proctree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proctree)
    proctree.kill_tree(pgid)
    sys.exit(3)
"""
WATCHDOG_KILLED = 3   # the watchdog's exit status when it killed (or found gone) the run's group


def _start_watchdog(pgid: int) -> subprocess.Popen:
    # A session of its own: a Ctrl-C at the terminal reaches dash-repro, which stops the runs itself.
    return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(pgid), proctree.__file__],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _release_watchdog(proc: subprocess.Popen) -> None:
    """Tell the run's watchdog that dash-repro saw the run end (idempotent)."""
    watchdog = getattr(proc, "dash_watchdog", None)
    if watchdog is None:
        return
    proc.dash_watchdog = None
    try:
        watchdog.stdin.write(b"d")
        watchdog.stdin.close()
    except OSError:   # it is gone already
        pass
    watchdog.wait()


def _start_run(d: Path, cmd: list[str], env: dict, shown_env: str):
    """Start one training process in a session of its own (so a launcher's workers can be stopped with it),
    logging to OUT/train.log, with a watchdog that kills that session if dash-repro dies without stopping
    it. Returns (process, open log)."""
    d.mkdir(parents=True, exist_ok=True)
    _mark_incomplete(d, "dash-repro run started this run and did not see it finish")
    log = open(d / "train.log", "w")
    log.write("$ " + shown_env + " ".join(cmd) + "\n")
    log.flush()
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    except OSError:
        log.close()
        raise
    try:
        proc.dash_watchdog = _start_watchdog(proc.pid)
    except OSError:
        proctree.kill_tree(proc.pid)
        proc.wait()
        log.close()
        raise
    # If dash-repro itself is killed (SIGKILL cannot be caught), its watchdog stops the run; this says which.
    _mark_incomplete(d, f"dash-repro run started this run (process group {proc.pid}) and did not see it finish")
    return proc, log


def _finished(d: Path, proc: subprocess.Popen, bar, total: int) -> bool:
    """Bring the run's progress bar up to date; True once the run has ended with exit 0 (its INCOMPLETE marker
    is then removed), RunFailed with the log's tail if it failed."""
    ended = proc.poll() is not None  # before counting: an ended run has written all its steps
    done = min(total, _count_lines(d / "steps.jsonl"))
    if done > bar.n:
        bar.update(done - bar.n)
    if not ended:
        return False
    if proc.returncode != 0:   # _stop_runs releases its watchdog after killing what the run left
        _mark_incomplete(d, f"the training failed (exit {proc.returncode}); see {d / 'train.log'}")
        tail = "".join((d / "train.log").read_text().splitlines(True)[-25:])
        raise RunFailed(f"training run {d} failed (exit {proc.returncode}); end of {d / 'train.log'}:\n{tail}")
    _release_watchdog(proc)
    (d / INCOMPLETE).unlink()
    return True


def _stop_runs(running: list, why: str) -> list[Path]:
    """Kill the whole process group of every run in `running` (a failed launcher may leave workers), wait for
    it, and mark the runs that were still training incomplete. Returns those runs' directories."""
    stopped = []
    for d, proc, log, _ in running:
        was_training = proc.poll() is None  # else it failed by itself, and its marker says how
        proctree.kill_tree(proc.pid)  # SIGKILL: nothing of a half-done run is worth saving
        proc.wait()
        _release_watchdog(proc)
        log.close()
        if was_training:
            _mark_incomplete(d, f"{why}; its process group {proc.pid} was killed")
            stopped.append(d)
    running.clear()
    return stopped


def run_training(train_args: list[str], out_dirs: list[Path], *, script: Path, parallel: bool = False,
                 desc: str = "", launch: str | None = None, devices: list[str] | None = None,
                 replace: bool = False) -> None:
    """Run the training script once per output directory, with identical arguments, showing progress.

    Each run is a fresh Python process (nothing cached in memory is shared), with its output in
    OUT/train.log. `devices` gives each run its own CUDA_VISIBLE_DEVICES (one entry per run), so parallel
    runs can train on different GPUs. Directories that hold results are refused unless `replace`.

    A run is marked OUT/INCOMPLETE until it ends with exit 0. If a run fails, or dash-repro gets SIGINT,
    SIGTERM or SIGHUP, the process groups of all running runs are killed (none is left to write into its
    directory later) and RunFailed is raised, with the log's tail for a failed run. If dash-repro is
    killed outright (SIGKILL), each run's watchdog kills its process group.
    """
    from tqdm import tqdm

    if any(a == "--out" or a.startswith("--out=") for a in train_args):
        raise RunFailed("do not pass --out to the training: dash-repro chooses one directory per run")
    if devices is not None and len(devices) != len(out_dirs):
        raise RunFailed(f"devices={devices} gives {len(devices)} devices for {len(out_dirs)} runs")
    known = _training_options(train_args)  # first: a bad option must not cost an earlier run's results (--force)
    total = known.stop_at or known.steps
    if replace and _holding_results(out_dirs):
        _check_with_the_bundled_parser(script, train_args)
    claim_run_dirs(out_dirs, replace, known.resume_from)
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")  # the same string hashing in every run
    pending = list(enumerate(out_dirs))
    running: list[tuple[Path, subprocess.Popen, object, object]] = []  # (dir, process, log, bar)
    bars = []
    signals = _SignalsStopRuns()
    with signals.installed():
        try:
            while pending or running:
                while pending and (parallel or not running):
                    i, d = pending.pop(0)
                    cmd = build_command(script, train_args, d, launch)
                    run_env, shown = env, ""
                    if devices is not None:
                        run_env = {**env, "CUDA_VISIBLE_DEVICES": devices[i]}
                        shown = f"CUDA_VISIBLE_DEVICES={devices[i]} "
                    # Parallel runs draw one line each (fixed positions, cursor moves). A sequential run's bar
                    # is closed when the run ends, so the next one simply starts on the line below: no cursor
                    # moves, which consoles and log files without them turn into bars over bars.
                    bar = tqdm(total=total, desc=f"{desc}{d.name}", unit="step", position=i if parallel else None,
                               leave=True, dynamic_ncols=True, mininterval=0.5)
                    bars.append(bar)
                    with signals.held():  # a run that has started is always in `running`, for the cleanup
                        proc, log = _start_run(d, cmd, run_env, shown)
                        running.append((d, proc, log, bar))
                time.sleep(0.2)
                for item in list(running):
                    d, proc, log, bar = item
                    if _finished(d, proc, bar, total):
                        log.close()
                        running.remove(item)
                        if not parallel:
                            bar.close()
        except BaseException as e:
            why = (str(e) if isinstance(e, Interrupted) else "stopped because another run failed"
                   if isinstance(e, RunFailed) else f"stopped after an error in dash-repro ({type(e).__name__})")
            with signals.held(raise_after=False):  # the cleanup must finish, whatever arrives meanwhile
                stopped = _stop_runs(running, why)
            if isinstance(e, Interrupted):
                marked = ", ".join(str(d / INCOMPLETE) for d in stopped) or "no run was training"
                raise Interrupted(e.signum, f"{e}; the training was killed and marked incomplete: {marked}") from None
            raise
        finally:
            for bar in bars:
                bar.close()


def run_twice(train_args, out: Path, *, script: Path, parallel: bool = False, desc: str = "",
              launch: str | None = None, devices: list[str] | None = None, replace: bool = False):
    dirs = [out / "run1", out / "run2"]
    run_training(list(train_args), dirs, script=script, parallel=parallel, desc=desc, launch=launch,
                 devices=devices, replace=replace)
    return compare_runs(dirs[0], dirs[1])


# --- subcommands ---------------------------------------------------------------------------------------

def cmd_run(args, train_args) -> int:
    script = find_script(args.script)
    if args.launch and args.parallel:
        raise RunFailed("--parallel with --launch would put two multi-process runs on the same devices")
    if args.launch and args.devices:
        raise RunFailed("--devices gives each run one entry of CUDA_VISIBLE_DEVICES; with --launch set "
                        "CUDA_VISIBLE_DEVICES for the launcher instead")
    if args.launch:   # a launcher that is not there is named now, not after run 1 has started
        launcher = shlex.split(args.launch)
        if not launcher or shutil.which(launcher[0]) is None:
            raise RunFailed(f"--launch {args.launch!r}: {launcher[0] if launcher else 'an empty command'} "
                            "is not a program on PATH")
    devices = parse_devices(args.devices, 2)
    out = Path(args.out)
    cmp = run_twice(train_args, out, script=script, parallel=args.parallel, launch=args.launch,
                    devices=devices, replace=args.force)
    print(cmp.report())
    if args.plot:
        from dash_plugin.repro.plot import plot_runs

        png = plot_runs(cmp.run_a, cmp.run_b, out / "loss.png")
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

    # The demo owns its output directory: a second `make demo` replaces the first one's runs.
    cmp = run_twice(train_args, out / name, script=script, desc=f"{name} ", replace=True)
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


def training_help(script: Path) -> str:
    """The option list of the training script (its own --help), for `dash-repro run --help`: dash-repro passes
    those options through unchanged, so the script is the one place that describes them."""
    try:
        res = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(`{script} --help` could not be run: {e})"
    if res.returncode != 0:
        return f"(`{script} --help` failed with exit {res.returncode}: {res.stderr.strip()[-500:]})"
    start = res.stdout.find("options:")  # skip the script's usage line: its --out is set by dash-repro
    return res.stdout[start:] if start >= 0 else res.stdout


def run_epilog(argv: list[str]) -> str:
    """The end of `dash-repro run --help`: the training script's options, found as `run` would find them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--script", default=None)
    known, _ = pre.parse_known_args(argv)
    try:
        script = find_script(known.script)
    except RunFailed as e:
        return f"training options: {e}"
    intro = (f"Every other option goes to the training script ({script}) unchanged, the same for both runs; "
             f"`--` ends dash-repro's own options. dash-repro sets the script's --out to OUT/run1 and OUT/run2.")
    return f"{textwrap.fill(intro, 100)}\n\ntraining {training_help(script)}"


def build_parser(run_epilog_text: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dash-repro", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the same training twice and compare (other options go to the training)",
                       description="Train twice with the same arguments, each run a fresh process, and compare "
                                   "the runs bit for bit.",
                       epilog=run_epilog_text or "Other options go to the training script; "
                                                 "`dash-repro run --help` lists them.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--out", default="dash-repro-run", help="directory for run1/ and run2/ (default %(default)s)")
    r.add_argument("--force", action="store_true",
                   help="delete the results of an earlier run in OUT/run1, OUT/run2 and run again (without it "
                        "such an --out is refused)")
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
    d.add_argument("--attn", default="dash", choices=ATTN_CHOICES)
    d.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    d.add_argument("--script", default=None)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_run_help = argv[:1] == ["run"] and bool({"-h", "--help"} & set(argv[1:]))
    parser = build_parser(run_epilog(argv[1:]) if wants_run_help else None)
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
    except (RunFailed, ValueError, OSError) as e:  # ValueError includes the RunFileError of a bad run file
        print(f"dash-repro {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training (e.g. while hashing weights)
        print(f"dash-repro {args.command}: interrupted", file=sys.stderr)
        return 2
    except Exception:
        # A bug in dash-repro, not a verdict: show it, and never exit 1, which would mean "the runs differ".
        traceback.print_exc()
        print(f"dash-repro {args.command}: internal error (a bug in dash-repro: please report the traceback "
              f"above); the runs were not compared", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
