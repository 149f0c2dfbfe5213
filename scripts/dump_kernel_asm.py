"""Compile the Triton backward for sm90 without a GPU, exactly as the Triton backend launches it,
and write the TTGIR, PTX and SASS of every launch; or compare two such dumps.

    python scripts/dump_kernel_asm.py OUT_DIR                # dump every case below
    python scripts/dump_kernel_asm.py --compare DIR_A DIR_B  # same PTX per launch?

It also dumps a checkout from before the launch plan (7fa4cbb): put that checkout's
dash_plugin first on PYTHONPATH (with kernels/ reachable as dash_plugin/kernels).

How: a stub Triton driver that reports an sm90 target, and a JIT hook that compiles each launch
(with the specializations the real launch would get from these arguments) instead of running it;
the host code is the backend's own (launch plan, grid, flags), run on CPU tensors. Needs the
triton wheel's bundled ptxas/cuobjdump. Used to show a device-code refactor changed no generated
instruction (PTX equal after dropping debug line info), and to read what Triton made of the
ordered waits (docs/benchmarks/NOTES.md).
"""
import hashlib
import json
import os
import re
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)   # must be unset before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

try:
    from dash_plugin import dispatch
    from dash_plugin.kernels import backends, triton_backend
    from dash_plugin.schedules import plan as launch_plans
except ImportError:   # a checkout from before the launch plan (7fa4cbb and older): its own launcher
    dispatch = None

SM90 = GPUTarget("cuda", 90, 32)

# name -> ((B, Sq, Sk, Hq, Hkv, D) dense or (lengths, Hq, Hkv, D) varlen, keywords, schedules, environment)
CASES = {
    "causal_gqa_d128": ((2, 512, 512, 4, 2, 128), dict(causal=True), ("atomic", "ascending", "shift", "split"), {}),
    "causal_nonpersistent": ((2, 512, 512, 4, 2, 128), dict(causal=True), ("shift",),
                             {"DASH_PERSISTENT_CYCLIC": "0"}),
    "causal_debugwaits": ((2, 512, 512, 4, 2, 128), dict(causal=True), ("descending", "shift"),
                          {"DASH_DEBUG_WAITS": "1"}),
    "full_d64": ((2, 384, 384, 4, 4, 64), {}, ("atomic", "spt", "split"), {}),
    "varlen_window_drop_cap_d96": (([130, 1, 300, 64], 4, 2, 96),
                                   dict(window_left=100, window_right=30, dropout_p=0.2, seed=1234, softcap=20.0),
                                   ("atomic", "ascending", "split"), {}),
    "hdim256_causal": ((1, 256, 256, 2, 1, 256), dict(causal=True), ("descending", "split"), {}),
}


class _Sm90Driver:
    """Just what JITFunction.run asks of a driver before it launches."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return SM90


_launches = []
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    _launches.append((self.fn.__name__, kernel))
    return kernel


def _inputs(spec, kw, gen):
    if isinstance(spec[0], list):
        lens, hq, hkv, d = spec
        t = sum(lens)
        q, k = torch.randn(t, hq, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
        lse = torch.zeros(hq, t)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        kw = dict(kw, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    else:
        b, sq, sk, hq, hkv, d = spec
        q, k = torch.randn(b, sq, hq, d, generator=gen), torch.randn(b, sk, hkv, d, generator=gen)
        lse = torch.zeros(b, hq, sq)
    q, k = q.bfloat16(), k.bfloat16()
    return q, k, torch.randn_like(k), lse, dict(kw, softmax_scale=d ** -0.5)


def _backward(schedule, q, k, v, lse, kw):
    """The Triton backend's backward with a plan for an H100 (132 resident programs)."""
    out, dout = torch.randn_like(q), torch.randn_like(q)
    if dispatch is None:   # before the launch plan: the kernel module launched itself
        from dash_plugin.kernels import attn_bwd
        attn_bwd._resident_programs = lambda device: 132
        attn_bwd.attention_backward(dout, q, k, v, out, lse, schedule=schedule, deterministic=schedule != "atomic",
                                    **kw)
        return
    be = triton_backend.BACKEND
    _spec, request = dispatch.request(q, k, schedule, **kw)
    shape = launch_plans.AttentionShape.of(q, k, cu_seqlens_q=kw.get("cu_seqlens_q"),
                                           cu_seqlens_k=kw.get("cu_seqlens_k"), causal=kw.get("causal", False),
                                           window_left=kw.get("window_left", -1),
                                           window_right=kw.get("window_right", -1))
    plan = launch_plans.launch_plan(shape, schedule, tiles=be.tiles(request),
                                    device=backends.DeviceProps(resident_programs=132))
    be.backward(plan, dout, q, k, v, out, lse, **kw)


def dump(out_dir):
    driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only
    os.makedirs(out_dir, exist_ok=True)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    index = {}
    gen = torch.Generator().manual_seed(0)
    for case, (spec, kw, schedules, env) in CASES.items():
        q, k, v, lse, kw = _inputs(spec, kw, gen)
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            for schedule in schedules:
                _launches.clear()
                _backward(schedule, q, k, v, lse, kw)
                for fn_name, kernel in _launches:
                    tag = f"{fn_name}-{hashlib.sha256(kernel.asm['ptx'].encode()).hexdigest()[:16]}"
                    if not os.path.exists(os.path.join(out_dir, f"{tag}.ptx")):
                        for ext in ("ttgir", "ptx"):
                            with open(os.path.join(out_dir, f"{tag}.{ext}"), "w") as f:
                                f.write(kernel.asm[ext])
                        cubin = os.path.join(out_dir, f"{tag}.cubin")
                        with open(cubin, "wb") as f:
                            f.write(kernel.asm["cubin"])
                        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                                              capture_output=True, text=True).stdout
                        with open(os.path.join(out_dir, f"{tag}.sass"), "w") as f:
                            f.write(sass)
                    index.setdefault(f"{case}/{schedule}/{fn_name}", []).append(tag)
                    print(f"{case}/{schedule}/{fn_name}: {tag}", flush=True)
        finally:
            for name, value in saved.items():
                os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)


def code_lines(ptx: str) -> list:
    """PTX without debug information (.loc/.file lines, debug sections, comments)."""
    out = []
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            break
        code = line.split("//")[0].rstrip()
        if code.strip() and not code.strip().startswith((".loc", ".file", "$L__tmp", "$L__func")):
            out.append(code)
    return out


def renamed(lines: list) -> list:
    """Registers, parameters and labels renamed in order of first use: equal lists then differ only in names."""
    names, counts = {}, {}

    def sub(m):
        tok = m.group(0)
        if tok not in names:
            kind = re.sub(r"\d+$", "", tok)
            counts[kind] = counts.get(kind, 0) + 1
            names[tok] = f"{kind}#{counts[kind]}"
        return names[tok]

    pattern = re.compile(r"%[a-z]+\d+|_param_\d+|\$L__BB\d+_\d+")
    return [pattern.sub(sub, line) for line in lines]


def compare(dir_a, dir_b) -> int:
    index_a, index_b = (json.load(open(os.path.join(d, "index.json"))) for d in (dir_a, dir_b))
    if set(index_a) != set(index_b):
        print(f"different launches: {sorted(set(index_a) ^ set(index_b))}")
        return 1
    counts = {"identical": 0, "identical up to names": 0, "DIFFERENT": 0}
    for key in sorted(index_a):
        for tag_a, tag_b in zip(index_a[key], index_b[key]):
            a, b = (code_lines(open(os.path.join(d, f"{t}.ptx")).read()) for d, t in ((dir_a, tag_a), (dir_b, tag_b)))
            verdict = "identical" if a == b else "identical up to names" if renamed(a) == renamed(b) else "DIFFERENT"
            counts[verdict] += 1
            print(f"{key}: {verdict} ({len(a)} / {len(b)} PTX lines)")
    print(", ".join(f"{n} {v}" for v, n in counts.items()))
    return 1 if counts["DIFFERENT"] else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(*sys.argv[2:4]))
    dump(sys.argv[1])
