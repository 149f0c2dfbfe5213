"""sha256 digests of out, lse, dq, dk and dv for every schedule over a small fixed set of shapes,
through the public API only (`dash_plugin.flash_attention(..., schedule=, deterministic=)`), so the
same file runs on any commit that has that API: run it at two commits and compare the JSON files
to show a change left every bit as it was.

    python scripts/gpu_digests.py --out before.json      # at the old commit (copy this file there)
    python scripts/gpu_digests.py --out after.json       # at the new one
    python scripts/gpu_digests.py --compare before.json after.json

Each (case, schedule) runs `--repeat` times (default 2) in this process; "stable" says the runs
agreed. `atomic` adds in arrival order, so its dq (and what depends on it) may differ between
runs: --compare leaves its dq out and says so. `--device cpu` runs the reference path (a smoke
test of the script itself).
"""
import argparse
import hashlib
import json
import platform
import subprocess
import sys

import torch

import dash_plugin

# name -> (dense shape (B, Sq, Sk, Hq, Hkv, D) or varlen (lengths, Hq, Hkv, D), keywords, seed)
CASES = {
    "causal_d128": ((2, 512, 512, 4, 4, 128), dict(causal=True), 1),
    "full_d64": ((2, 384, 384, 4, 4, 64), dict(), 2),
    "gqa4_causal_d128": ((2, 512, 512, 8, 2, 128), dict(causal=True), 3),
    "window_d64": ((2, 512, 512, 4, 2, 64), dict(window=(100, 30)), 4),
    "varlen_causal_d64": (([130, 1, 300, 64], 4, 2, 64), dict(causal=True), 5),
    "full_shift_d128": ((1, 1024, 1024, 4, 4, 128), dict(), 6),
    "dropout_softcap_d64": ((2, 384, 384, 4, 2, 64), dict(causal=True, softcap=20.0, dropout_p=0.1,
                                                         dropout_seed=1234), 7),
}
TENSORS = ("out", "lse", "dq", "dk", "dv")


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def inputs(spec, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)

    if isinstance(spec[0], list):   # varlen
        lens, hq, hkv, d = spec
        t = sum(lens)
        q, k, v, do = draw(t, hq, d), draw(t, hkv, d), draw(t, hkv, d), draw(t, hq, d)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        return q, k, v, do, dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    b, sq, sk, hq, hkv, d = spec
    return draw(b, sq, hq, d), draw(b, sk, hkv, d), draw(b, sk, hkv, d), draw(b, sq, hq, d), {}


def run_once(case, schedule, device):
    spec, kw, seed = CASES[case]
    q, k, v, do, extra = inputs(spec, seed, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = dash_plugin.flash_attention(q, k, v, schedule=schedule, deterministic=schedule != "atomic",
                                           return_lse=True, **kw, **extra)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    if device == "cuda":
        torch.cuda.synchronize()
    return dict(zip(TENSORS, (digest(t) for t in (out, lse, dq, dk, dv))))


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return None


def collect(device, repeat, schedules=None, cases=None):
    schedules = schedules or list(dash_plugin.SCHEDULES)   # "auto" included: it resolves per shape
    result = {"meta": {"commit": _commit(), "torch": torch.__version__, "python": platform.python_version(),
                       "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"},
              "digests": {}}
    try:
        import triton
        result["meta"]["triton"] = triton.__version__
    except ImportError:
        pass
    for case in cases or CASES:
        for schedule in schedules:
            runs = [run_once(case, schedule, device) for _ in range(repeat)]
            entry = dict(runs[0], stable=all(r == runs[0] for r in runs),
                         resolved=dash_plugin.last_resolved().describe())
            result["digests"][f"{case}/{schedule}"] = entry
            print(f"{case}/{schedule}: dq {entry['dq'][:16]} dk {entry['dk'][:16]} dv {entry['dv'][:16]} "
                  f"stable={entry['stable']}", flush=True)
    return result


def compare(path_a, path_b) -> int:
    """Print per (case, schedule) whether every digest is equal; 0 iff all deterministic ones are."""
    a, b = (json.load(open(p))["digests"] for p in (path_a, path_b))
    bad = 0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"{key}: only in {path_a if key in a else path_b}")
            bad += 1
            continue
        names = [n for n in TENSORS if not (key.endswith("/atomic") and n == "dq")]
        differ = [n for n in names if a[key][n] != b[key][n]]
        note = " (atomic: dq not compared)" if key.endswith("/atomic") else ""
        print(f"{key}: {'equal' if not differ else 'DIFFERENT: ' + ', '.join(differ)}{note}")
        bad += bool(differ)
    print(f"{len(set(a) | set(b)) - bad} equal, {bad} different or missing")
    return 1 if bad else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the digests as JSON here")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--schedules", default=None, help="comma-separated (default: every one, and auto)")
    p.add_argument("--cases", default=None, help=f"comma-separated, from {','.join(CASES)} (default: all)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two JSON files and exit")
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    result = collect(a.device, a.repeat, a.schedules.split(",") if a.schedules else None,
                     a.cases.split(",") if a.cases else None)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        print(f"wrote {a.out}")
    return 0 if all(e["stable"] for k, e in result["digests"].items() if not k.endswith("/atomic")) else 1


if __name__ == "__main__":
    sys.exit(main())
