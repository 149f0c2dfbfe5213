"""Helpers shared by tests/test_gpu_hardening.py and tests/test_debug_waits.py.

Importable without CUDA or Triton (the kernels are imported inside the functions that run them).
Also a small command line for the child processes the GPU tests start (run from the repo root):

    python -m tests.hardening_helpers load STOP_FILE     # bf16 matmuls on the GPU until STOP_FILE exists
    python -m tests.hardening_helpers hashes SPEC_JSON [DEVICE]   # sha256 of out/dq/dk/dv per (case, schedule)
"""
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- inputs

def dense_inputs(shape, dtype, device, seed=0):
    """q, k, v, dout of a dense problem (B, Sq, Sk, Hq, Hkv, D), drawn from a seeded generator on `device`,
    so another process that asks for the same (shape, dtype, device, seed) gets the same bits."""
    b, sq, sk, hq, hkv, d = shape
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dtype)

    return draw(b, sq, hq, d), draw(b, sk, hkv, d), draw(b, sk, hkv, d), draw(b, sq, hq, d)


def cu_seqlens(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def varlen_inputs(lens, hq, hkv, d, dtype, device, seed=0):
    """Packed q, k, v, dout (T, H, D) and the kernel keywords of a varlen batch with sq == sk per sequence."""
    t = sum(lens)
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dtype)

    q, k, v, do = draw(t, hq, d), draw(t, hkv, d), draw(t, hkv, d), draw(t, hq, d)
    cu = cu_seqlens(lens, device)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    return q, k, v, do, kw


# The GPU cases of the determinism-under-load and fresh-process tests: name -> (kind, spec, mask keywords).
# Varlen lengths are ragged, include a length-1 and a length-2 sequence, and span several 64-row tiles.
CASES = {
    "gqa4_causal": ("dense", (2, 1024, 1024, 16, 4, 128), dict(causal=True)),
    "gqa4_full": ("dense", (2, 1024, 1024, 16, 4, 128), dict()),   # the cyclic shift runs only without a mask
    "varlen_causal": ("varlen", ([1, 700, 129, 1024, 63, 300, 2, 511], 8, 2, 64), dict(causal=True)),
    "window256": ("dense", (2, 1024, 1024, 8, 8, 64), dict(window_left=256, window_right=0)),
}


def build_case(name, device="cuda", dtype=torch.bfloat16, seed=0):
    """(q, k, v, dout, kernel keywords) of CASES[name]."""
    kind, spec, mask = CASES[name]
    if kind == "dense":
        q, k, v, do = dense_inputs(spec, dtype, device, seed)
        kw = {}
    else:
        lens, hq, hkv, d = spec
        q, k, v, do, kw = varlen_inputs(lens, hq, hkv, d, dtype, device, seed)
    kw.update(mask, softmax_scale=q.shape[-1] ** -0.5)
    return q, k, v, do, kw


def api_keywords(kw):
    """Kernel keywords -> dash_plugin.flash_attention keywords."""
    out = {n: kw[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "causal",
                             "softmax_scale") if n in kw}
    out["window"] = (kw.get("window_left", -1), kw.get("window_right", -1))
    return out


# ---------------------------------------------------------------- bitwise comparison

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """The tensor's bits as integers: comparing these is bitwise (NaN == NaN, -0.0 != 0.0)."""
    return t.contiguous().view(_SAME_SIZE_INT[t.element_size()])


def bitwise_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def count_mismatching_passes(run, passes, reference=None):
    """Call `run()` (returns a tuple of tensors) `passes` times; count the passes whose result differs
    in any bit from `reference` (default: the first call's result). The count stays on the device, so
    passes are not separated by host syncs (the load keeps overlapping them)."""
    ref = run() if reference is None else reference
    bad = torch.zeros((), dtype=torch.int64, device=ref[0].device)
    for _ in range(passes):
        again = run()
        differs = torch.stack([(bits(x) != bits(y)).any() for x, y in zip(ref, again)]).any()
        bad += differs
    return int(bad.item())


def sha256(t):
    return hashlib.sha256(bits(t.detach()).cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------- records

def record(line, **fields):
    """Print one result line; with DASH_HARDENING_OUT set, also append it (and the fields) as JSON to
    $DASH_HARDENING_OUT/hardening.jsonl, so the closing note can quote the counts."""
    print(line, flush=True)
    out = os.environ.get("DASH_HARDENING_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / "hardening.jsonl", "a") as f:
            f.write(json.dumps(dict(fields, line=line, time=time.strftime("%Y-%m-%d %H:%M:%S"))) + "\n")


# ---------------------------------------------------------------- another process loading the GPU

def _load_loop(stop_file, size=8192, per_check=10):
    """Child: bf16 matmuls on the GPU until `stop_file` exists or the parent is gone."""
    parent = os.getppid()
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    print("ready", flush=True)
    n = 1
    while not os.path.exists(stop_file) and os.getppid() == parent:
        for _ in range(per_check):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        n += per_check
    print(f"matmuls {n}", flush=True)


class LoadProcess:
    """Another process looping bf16 matmuls on the same GPU; `stop()` ends it (and kills it if it
    does not end) and sets `matmuls`, the number it ran."""

    def __init__(self, ready_timeout=120):
        self._dir = tempfile.TemporaryDirectory()
        self.stop_file = os.path.join(self._dir.name, "stop")
        self._err = open(os.path.join(self._dir.name, "stderr"), "w+")
        self.matmuls = None
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.hardening_helpers", "load", self.stop_file],
                                     cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self._err, text=True)
        try:
            ready, _, _ = select.select([self.proc.stdout], [], [], ready_timeout)
            line = self.proc.stdout.readline() if ready else ""
            if line.strip() != "ready":
                raise RuntimeError(f"load process did not start (got {line!r}): {self.stderr()}")
        except BaseException:
            self.stop()
            raise

    def alive(self):
        return self.proc.poll() is None

    def stderr(self):
        self._err.flush()
        self._err.seek(0)
        return self._err.read()[-2000:]

    def stop(self):
        if self.proc.poll() is None:
            Path(self.stop_file).touch()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rest = self.proc.stdout.read()
        self.proc.stdout.close()
        m = re.search(r"matmuls (\d+)", rest)
        self.matmuls = int(m.group(1)) if m else None
        self._err.close()
        self._dir.cleanup()


@contextlib.contextmanager
def gpu_load():
    """A LoadProcess for the duration of the block; afterwards it must have kept the GPU busy."""
    proc = LoadProcess()
    try:
        yield proc
    finally:
        proc.stop()
    assert proc.matmuls and proc.matmuls > 10, "the load process did not keep the GPU busy"


@contextlib.contextmanager
def hang_guard(seconds):
    """Turn a hang into a crash with every thread's traceback on stderr (run pytest with -s to see it):
    faulthandler's watchdog is a C thread, so it fires even while Python waits on a spinning kernel."""
    import faulthandler
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------- fresh process: hashes of the gradients

def api_hashes(case, schedule, device="cuda"):
    """sha256 of out, dq, dk, dv of one forward + backward through dash_plugin.flash_attention."""
    import dash_plugin

    q, k, v, do, kw = build_case(case, device)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = dash_plugin.flash_attention(q, k, v, schedule=schedule, deterministic=True, **api_keywords(kw))
    out.backward(do)
    return {name: sha256(t) for name, t in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad))}


def hashes_in_fresh_process(pairs, device="cuda", timeout=600):
    """api_hashes for each (case, schedule), computed by a new Python process."""
    spec = json.dumps([list(p) for p in pairs])
    res = subprocess.run([sys.executable, "-m", "tests.hardening_helpers", "hashes", spec, device], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"child process failed ({res.returncode}):\n{res.stderr[-3000:]}")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return {tuple(k.split("/")): v for k, v in got.items()}


# ---------------------------------------------------------------- stuck-wait injection

def stuck_rank_plan(plan, row=None, bump=1000):
    """A copy of a launch plan (dash_plugin/schedules/plan.py) in which one wait can never be satisfied.

    In table row `row` (default: the one with the most steps) take the dQ tile with the most
    contributors and raise the rank of its LAST contributor by `bump`: the counter of that tile stops at
    that rank, so this is the only wait that fails (nobody waits after the last contributor), whatever
    the debug option does after giving up. The cached plan is not touched.
    Returns (plan, facts about the injected wait)."""
    tables = plan.tables
    q_tile, rank, seg_kv, seg_end = tables.q_tile, tables.rank, tables.seg_kv, tables.seg_end
    if row is None:
        row = int((q_tile >= 0).flatten(1).sum(1).argmax())
    tiles = q_tile[row]
    valid = tiles >= 0
    if not valid.any():
        raise ValueError(f"sequence row {row} has no ordered dQ adds to break")
    counts = torch.bincount(tiles[valid])
    m = int(counts.argmax())
    last = int(rank[row][tiles == m].max())
    w, s = [int(i) for i in ((tiles == m) & (rank[row] == last)).nonzero()[0]]
    seg = 0 if s < int(seg_end[row, w, 0]) else 1
    new_rank = rank.clone()
    new_rank[row, w, s] += bump
    broken = dataclasses.replace(plan, tables=dataclasses.replace(tables, rank=new_rank))
    info = dict(row=row, worker=w, step=s, q_tile=m, kv_tile=int(seg_kv[row, w, seg]), rank=last,
                waited_for=last + bump, contributors=int(counts[m]))
    return broken, info


def inject_stuck_wait(monkeypatch, polls):
    """Turn on DASH_DEBUG_WAITS with `polls` polls and make every backward's launch plan carry one wait that
    can never be satisfied (`stuck_rank_plan`). Returns the dict that receives the injected wait's facts;
    `monkeypatch.setattr(plan, "launch_plan", <the saved original>)` ends the injection."""
    from dash_plugin.schedules import plan as launch_plans

    monkeypatch.setenv("DASH_DEBUG_WAITS", "1")
    monkeypatch.setenv("DASH_DEBUG_WAIT_POLLS", str(polls))
    real = launch_plans.launch_plan
    injected = {}

    def with_stuck_wait(*args, **kwargs):
        broken, info = stuck_rank_plan(real(*args, **kwargs))
        injected.update(info)
        return broken

    monkeypatch.setattr(launch_plans, "launch_plan", with_stuck_wait)
    return injected


def check_stuck_message(message, info, sequence=None):
    """The StuckWaitError message names the dQ tile, the rank waited for, the counter value seen (the
    injected wait's own rank: every earlier contributor has added), the waiting program's KV tile and,
    if given, the sequence (varlen: the table row is the sequence; dense rows are shared by all)."""
    def named(pattern, what):
        assert re.search(pattern, message, re.IGNORECASE), f"{what} not named in the message: {message!r}"

    named(rf"(?<!\d){info['waited_for']}(?!\d)", f"rank waited for ({info['waited_for']})")
    named(rf"\bd?q[ _-]?tile\W{{0,3}}{info['q_tile']}(?!\d)", f"dQ tile {info['q_tile']}")
    named(rf"counter\D{{0,20}}(?<!\d){info['rank']}(?!\d)", f"counter value seen ({info['rank']})")
    named(rf"\bkv[ _-]?tile\W{{0,3}}{info['kv_tile']}(?!\d)", f"KV tile {info['kv_tile']}")
    if sequence is not None:
        named(rf"\b(sequence|batch)\W{{0,3}}{sequence}(?!\d)", f"sequence {sequence}")


# ---------------------------------------------------------------- command line (child processes)

def _main(argv):
    if argv[0] == "load":
        _load_loop(argv[1])
    elif argv[0] == "hashes":
        pairs = json.loads(argv[1])
        device = argv[2] if len(argv) > 2 else "cuda"
        print(json.dumps({f"{c}/{s}": api_hashes(c, s, device) for c, s in pairs}), flush=True)
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    _main(sys.argv[1:])
