"""Instruction counts of the Hopper kernels' machine code (SASS), without a GPU.

Compiles the Hopper forward or backward for sm_90a under torch's FakeTensorMode (nothing is
launched), has the CuTe DSL keep the SASS, and counts its instructions: all of them and the
opcodes that dropout adds work to (integer multiply-adds, logic ops, selects, compares, float
multiplies, shifts, shuffles), next to the MUFU.EX2 and HGMMA the kernel has anyway, and its
local-memory stores and loads (STL, LDL: register spills). Use it to
see what a change to a per-score step costs before spending GPU time on it: the forward's time
with dropout has followed its instruction count (docs/benchmarks/dq-release-dropout-2026-11-23-h100/).

Needs the `hopper` extra (CuTe DSL, flash-attn-4) and nvdisasm >= 13.4 on PATH
(pip install nvidia-cuda-nvdisasm; the wheel puts it in site-packages/nvidia/cu13/bin).

    CUTE_DSL_ARCH=sm_90a python scripts/sass_counts.py --kernel fwd --head-dim 128 --dropout 0.1

The backward's host-side helpers from FA4 (its pre- and post-processing kernels, and a tensor
conversion that asks the CUDA driver) are replaced by no-ops here: only our kernel compiles.
"""
from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import sys
import tempfile

# STL / LDL: local-memory stores and loads, which in these kernels are register spills (ptxas's
# "bytes spill stores/loads"); a change that makes them appear inside a step loop costs time
# (docs/benchmarks/dropout-overlap-2026-11-24-h100/).
OPCODES = ("HGMMA", "MUFU.EX2", "IMAD", "LOP3", "FSEL", "ISETP", "FMUL", "SHF", "SHFL", "STL", "LDL")


def count(sass_text: str) -> dict:
    """{"total": instructions, opcode: instructions whose opcode starts with it}."""
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass_text, re.M)
    counts = {"total": len(ops)}
    for name in OPCODES:
        counts[name] = sum(op == name or op.startswith(name + ".") for op in ops)
    return counts


def register_split(sass_text: str) -> list:
    """The registers a thread that `setmaxnreg` asks for, in the listing's order (the producer
    warpgroup's decrease first, then the consumers' increases): the kernel's register split."""
    return [int(r, 16) for r in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:U?P\w+, )?(0x[0-9a-f]+)", sass_text)]


def _without_launch(compile_fn):
    """`compile_fn` that compiles as before and returns a kernel that launches nothing."""
    return lambda *a, **kw: (compile_fn(*a, **kw), lambda *args: None)[1]


def _set_switches(kernel_cls, switches) -> None:
    """--set NAME=VALUE on the kernel class, for switches it lists in its SWITCHES."""
    for name, value in switches:
        if name not in kernel_cls.SWITCHES:
            raise SystemExit(f"--set {name}: not one of {kernel_cls.__name__}.SWITCHES "
                             f"({', '.join(kernel_cls.SWITCHES)})")
        setattr(kernel_cls, name, value)


def _compile(kernel: str, head_dim: int, causal: bool, dropout: float, heads_kv: int,
             schedule: str = "descending", seqlen: int = 512, grid: str = "one-tile", switches=(),
             tail_align: bool = True) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    def inputs():
        q = torch.empty(2, seqlen, 4, head_dim, dtype=torch.bfloat16, device="cuda")
        return q, torch.empty(2, seqlen, heads_kv, head_dim, dtype=torch.bfloat16, device="cuda")

    if kernel == "fwd":
        from dash_plugin.kernels.hopper import dropout_sm90, fwd_sm90
        _set_switches(dropout_sm90.DropoutForwardSm90, switches)
        fwd_sm90._compile = _without_launch(fwd_sm90._compile)
        fwd_sm90.GRID = grid
        fwd_sm90.TAIL_ALIGN = tail_align
        with FakeTensorMode():
            q, k = inputs()
            fwd_sm90.attention_forward(q, k, k, softmax_scale=head_dim ** -0.5, causal=causal,
                                       dropout_p=dropout, seed=1)
        return
    from dash_plugin import dispatch
    from dash_plugin.kernels.backends import DeviceProps
    from dash_plugin.kernels.hopper import bwd_sm90, check_waits_follow_launch, tables_of
    from dash_plugin.kernels.hopper_backend import BACKEND
    from dash_plugin.schedules.plan import AttentionShape, launch_plan

    bwd_sm90.fa4._bwd_preprocess = lambda *a, **kw: None
    bwd_sm90.fa4._bwd_postprocess_convert = lambda *a, **kw: None
    bwd_sm90.fa4_utils.convert_from_dlpack_leading_static = (
        lambda t, leading_dim, alignment, stride_order: bwd_sm90.to_cute_tensor(
            t, assumed_align=alignment, leading_dim=leading_dim))
    bwd_sm90.cute.compile = _without_launch(bwd_sm90.cute.compile)
    _set_switches(bwd_sm90.OrderedBackwardSm90, switches)   # imported only now (the DSL reads its dump settings then)
    # Orders the kernel reads from tables (the causal symmetric shift): fake tables of their shape.
    bwd_sm90._tables_on_device = lambda tables, batch, heads, device: tuple(
        torch.empty(batch, heads, *t.shape, dtype=torch.int32, device="cuda")
        for t in (tables.count, tables.q_tile, tables.rank))
    bwd_sm90.visits_every_q_tile = lambda tables, q_tiles: True   # reads the tables; nothing to compile
    fake = FakeTensorMode()
    with fake:
        q, k = inputs()
        _, req = dispatch.request(q, k, schedule, causal=causal, dropout_p=dropout)
        shape = AttentionShape.of(q, k, causal=causal)
    # The plan is built from real tensors, outside the fake mode, as the backend builds it.
    plan = launch_plan(shape, schedule, tiles=BACKEND.tiles(req), device=DeviceProps(132))
    tables = tables_of(plan.schedule.sequences[0])
    check_waits_follow_launch(tables)
    with fake:
        lse = torch.empty(2, 4, seqlen, dtype=torch.float32, device="cuda")
        bwd_sm90.attention_backward(q, q, k, k, q, lse, softmax_scale=head_dim ** -0.5, causal=causal,
                                    tables=tables, deterministic=True, dropout_p=dropout, seed=1)


def _switch(text: str):
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected NAME=VALUE")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--full", action="store_true", help="full mask (default: causal)")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--heads-kv", type=int, default=4, help="K/V heads for 4 query heads (default 4: MHA)")
    ap.add_argument("--save-sass", metavar="PATH", help="also write the SASS listing there")
    ap.add_argument("--schedule", default="descending", help="bwd: the deterministic schedule compiled (default descending)")
    ap.add_argument("--grid", choices=("one-tile", "persistent"), default="one-tile",
                    help="fwd: FA4's grid (default) or the persistent one (kernels/hopper/fwd_persistent.py)")
    ap.add_argument("--seqlen", type=int, default=512,
                    help="tokens per sequence (default 512; the bwd plan, e.g. arrival's groups, follows it)")
    ap.add_argument("--no-tail-align", action="store_true",
                    help="fwd: FA4's Q tiling even where tail-aligned tiles cut KV steps (fwd_sm90.TAIL_ALIGN)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", type=_switch,
                    help="set a switch of the kernel class (bwd: OrderedBackwardSm90, fwd: DropoutForwardSm90; "
                         "a Python literal, else a string), e.g. READ_TURN_AHEAD=False; repeatable")
    args = ap.parse_args(argv)
    if os.environ.get("CUTE_DSL_ARCH") != "sm_90a":
        print("set CUTE_DSL_ARCH=sm_90a (no GPU here to ask)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as dump:
        os.environ.update(CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=dump)
        _compile(args.kernel, args.head_dim, not args.full, args.dropout, args.heads_kv, args.schedule,
                 args.seqlen, args.grid, args.set, not args.no_tail_align)
        files = glob.glob(os.path.join(dump, "*.sass"))
        if len(files) != 1:
            print(f"expected one SASS file, found {len(files)} in {dump}", file=sys.stderr)
            return 1
        with open(files[0]) as f:
            sass = f.read()
        counts = count(sass)
        if args.save_sass:
            with open(args.save_sass, "w") as f:
                f.write(sass)
    print(f"{args.kernel} hdim{args.head_dim} {'full' if args.full else 'causal'} dropout={args.dropout}: "
          + " ".join(f"{k}={v}" for k, v in counts.items()))
    split = register_split(sass)
    if split:
        print("register split (setmaxnreg):", " / ".join(map(str, split)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
