"""GPU check and side-by-side timing of the Hopper backward (kernels/hopper) against FA4.

Stages (each prints as it goes, so a run cut by its time limit still says how far it got):
  check  every schedule x mask x GQA against the float64 math oracle, and bit equality with
         FA4's deterministic backward where both run the same order (ascending on full masks,
         spt on causal ones), from the same out/lse;
  det    N backward passes per schedule, bitwise equal, while a side stream runs matmuls;
  time   backward TFLOP/s per schedule next to FA4 deterministic / non-deterministic and our
         Triton `split`, all on the same inputs in this process (2.5 x forward FLOPs).
Usage: python3 scripts/gpu_hopper_bwd.py [--stages check,det,time] [--passes N] [--masks causal,full] [--out DIR]
"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dash_plugin import dispatch  # noqa: E402
from dash_plugin.bench.clocks import ClockMonitor  # noqa: E402
from dash_plugin.schedules import registry  # noqa: E402
from dash_plugin.kernels import attn_fwd  # noqa: E402
from tests.math_attention import math_attention  # noqa: E402

DTYPE = torch.bfloat16


def make(b, s, hq, hkv, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *sh: torch.randn(*sh, device="cuda", dtype=DTYPE, generator=g)  # noqa: E731
    return mk(b, s, hq, d), mk(b, s, hkv, d), mk(b, s, hkv, d), mk(b, s, hq, d)


def forward(q, k, v, causal):
    return attn_fwd.attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=causal)


def ours(schedule, q, k, v, out, lse, do, causal, backend="hopper"):
    return dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=q.shape[-1] ** -0.5,
                                       causal=causal, schedule=schedule, backend=backend,
                                       deterministic=schedule != "atomic")


def fa4_bwd(q, k, v, out, lse, do, causal, deterministic):
    from flash_attn.cute.interface import _flash_attn_bwd
    return _flash_attn_bwd(q, k, v, out, do, lse, softmax_scale=q.shape[-1] ** -0.5,
                           causal=causal, deterministic=deterministic)[:3]


def same_bits(a, b):
    """Whether two tuples of tensors (outputs, gradients) are equal bit for bit."""
    return all(torch.equal(x, y) for x, y in zip(a, b))


def have_fa4():
    try:
        import flash_attn.cute.interface  # noqa: F401
        return True
    except Exception as exc:  # noqa: BLE001
        print("FA4 not importable:", exc)
        return False


def schedules_for(causal):
    """The registry's schedules the Hopper backend runs (arrival is for causal masks and falls
    back to descending under full ones)."""
    return tuple(s for s in registry.names() if "hopper" in registry.get(s).backends
                 and (causal or s != "arrival"))


def stage_check(results):
    fa4 = have_fa4()
    cases = [(2, 1024, 4, 4, 128), (2, 1000, 8, 2, 128), (2, 1024, 4, 4, 64), (1, 640, 4, 1, 64)]
    for (b, s, hq, hkv, d) in cases:
        for causal in (True, False):
            q, k, v, do = make(b, s, hq, hkv, d)
            out, lse = forward(q, k, v, causal)
            # oracle: one sequence at a time in float64 (CPU)
            refs = []
            for i in range(b):
                c = lambda t: t[i].detach().double().cpu().requires_grad_()  # noqa: E731
                qi, ki, vi = c(q), c(k), c(v)
                o, _ = math_attention(qi, ki, vi, causal=causal)
                refs.append(torch.autograd.grad(o, (qi, ki, vi), do[i].double().cpu()))
            ref = [torch.stack([r[j] for r in refs]) for j in range(3)]
            # plain bf16 math on the GPU: the error bar (FlashAttention papers' bar: within 2x)
            def bf16_math():
                qx, kx, vx = (t.detach().clone().requires_grad_() for t in (q, k, v))
                ke, ve = (t.repeat_interleave(hq // hkv, dim=2) for t in (kx, vx))
                sc = torch.einsum("bqhd,bkhd->bhqk", qx, ke) * d ** -0.5
                if causal:
                    sc = sc.masked_fill(torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
                o = torch.einsum("bhqk,bkhd->bqhd", sc.softmax(-1), ve)
                return torch.autograd.grad(o, (qx, kx, vx), do)
            base = [((a.double().cpu() - r).norm() / r.norm()).item() for a, r in zip(bf16_math(), ref)]
            fa4_det = fa4_bwd(q, k, v, out, lse, do, causal, True) if fa4 else None
            for sched in schedules_for(causal):
                name = f"check d{d} {'causal' if causal else 'full'} B{b} S{s} H{hq}/{hkv} {sched}"
                try:
                    grads = ours(sched, q, k, v, out, lse, do, causal)
                    torch.cuda.synchronize()
                    errs = [((g.double().cpu() - r).norm() / r.norm()).item() for g, r in zip(grads, ref)]
                    finite = all(torch.isfinite(g).all().item() for g in grads)
                    ok = finite and all(e <= max(2 * bl, 1e-3) for e, bl in zip(errs, base))
                    same_as_fa4 = None
                    if fa4_det is not None and sched == ("spt" if causal else "ascending"):
                        same_as_fa4 = same_bits(grads, fa4_det)
                    line = (f"{name}: {'OK' if ok else 'FAIL'} err dq/dk/dv "
                            f"{errs[0]:.2e}/{errs[1]:.2e}/{errs[2]:.2e} (bf16 math {base[0]:.2e}/{base[1]:.2e}/{base[2]:.2e})"
                            + ("" if same_as_fa4 is None else f" bits==FA4det: {same_as_fa4}"))
                    results["check"].append({"case": name, "ok": ok, "errs": errs, "base": base,
                                             "same_as_fa4": same_as_fa4})
                except Exception as exc:  # noqa: BLE001
                    line = f"{name}: ERROR {type(exc).__name__}: {str(exc)[:600]}"
                    results["check"].append({"case": name, "ok": False, "error": str(exc)[:2000]})
                print(line, flush=True)


def stage_det(results, passes):
    load_a = torch.randn(4096, 4096, device="cuda", dtype=DTYPE)
    side = torch.cuda.Stream()
    for causal, hkv in ((True, 4), (False, 4), (True, 1)):
        q, k, v, do = make(2, 2048, 8, hkv, 128, seed=3)
        out, lse = forward(q, k, v, causal)
        for sched in schedules_for(causal):
            t0 = time.time()
            first = ours(sched, q, k, v, out, lse, do, causal)
            mismatches = 0
            for _ in range(passes):
                with torch.cuda.stream(side):
                    for _ in range(2):
                        load_a @ load_a
                again = ours(sched, q, k, v, out, lse, do, causal)
                mismatches += not same_bits(first, again)
            torch.cuda.synchronize()
            name = f"det {'causal' if causal else 'full'} H8/{hkv} {sched}"
            print(f"{name}: {passes} passes, {mismatches} differ ({time.time() - t0:.1f}s)", flush=True)
            results["det"].append({"case": name, "passes": passes, "mismatches": mismatches})


def bench_ms(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_rounds(impls: dict, repeat: int, clocks=None, lowest: dict | None = None) -> dict:
    """{name: [ms per round] or None if it failed}: every column once per round, rounds
    interleaved, so a slow spell of the GPU hits all columns alike instead of one. With `clocks`
    (a ClockMonitor) and a dict `lowest`, lowest[name] gets the lowest SM clock seen in each of
    its rounds: a round timed in one of the power cap's clock dips reads slow
    (docs/benchmarks/clocks-2026-11-25-h100/)."""
    times = {name: [] for name in impls}
    for _ in range(repeat):
        for name, fn in impls.items():
            if times[name] is None:
                continue
            try:
                start = time.monotonic()
                times[name].append(bench_ms(fn))
                if clocks is not None and lowest is not None:
                    window = clocks.window(start, time.monotonic())
                    lowest.setdefault(name, []).append(window and window["sm_mhz_min"])
            except Exception as exc:  # noqa: BLE001
                times[name] = None
                if lowest is not None:
                    lowest.pop(name, None)
                print(f"  {name}: ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return times


def median_ms(ts):
    """The median of a column's rounds (the upper middle one for an even count), None if it failed."""
    return None if not ts else sorted(ts)[len(ts) // 2]


def gpu_environment() -> dict:
    """The GPU, its SM count, the versions and the date, for a record."""
    import triton
    props = torch.cuda.get_device_properties(0)
    env = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    try:
        from importlib.metadata import version
        env.update({"flash-attn-4": version("flash-attn-4"), "nvidia-cutlass-dsl": version("nvidia-cutlass-dsl")})
    except Exception:  # noqa: BLE001
        pass
    return env


def stage_time(results, hdims, seqlens, gqa, masks, repeat=1, triton_split=True, heads=None, orders=None,
               with_fa4=True):
    with ClockMonitor(torch.device("cuda")) as clocks:
        for hq in heads or [None]:
            _stage_time(results, hdims, seqlens, gqa, masks, repeat, triton_split, clocks.recording, hq, orders,
                        with_fa4)
    results["clock_monitor"] = clocks.describe()


def _stage_time(results, hdims, seqlens, gqa, masks, repeat, triton_split, clocks, heads, orders, with_fa4):
    fa4 = with_fa4 and have_fa4()
    for d in hdims:
        for causal in [m == "causal" for m in masks]:
            for s in seqlens:
                # 16k tokens per point at a model dim of 2048 unless the head count is given
                b, hq = 16384 // s, heads or 2048 // d
                hkv = hq // gqa
                q, k, v, do = make(b, s, hq, hkv, d, seed=7)
                out, lse = forward(q, k, v, causal)
                flops = 2.5 * 4 * b * hq * s * s * d / (2 if causal else 1)
                row = {"hdim": d, "causal": causal, "seqlen": s, "gqa": gqa, "heads": hq}
                impls = {f"cute-{x}": (lambda x=x: ours(x, q, k, v, out, lse, do, causal))
                         for x in schedules_for(causal) if not orders or x in orders}
                if triton_split:
                    impls["triton-split"] = lambda: ours("split", q, k, v, out, lse, do, causal, backend="triton")
                if fa4:
                    impls["fa4-det"] = lambda: fa4_bwd(q, k, v, out, lse, do, causal, True)
                    impls["fa4"] = lambda: fa4_bwd(q, k, v, out, lse, do, causal, False)
                lowest = {}
                times = time_rounds(impls, repeat, clocks, lowest)
                for name, ts in times.items():
                    row[name] = None if not ts else round(flops / median_ms(ts) / 1e9, 1)
                    if ts and repeat > 1:
                        row[f"{name} rounds"] = [round(flops / t / 1e9, 1) for t in ts]
                    if name in lowest:
                        row[f"{name} lowest MHz"] = lowest[name]
                det = [row[k_] for k_ in impls if k_.startswith("cute-") and k_ != "cute-atomic" and row[k_]]
                best = max(det) if det else None
                ratio = f" best/fa4-det {best / row['fa4-det']:.2f}" if best and row.get("fa4-det") else ""
                print(f"time d{d} h{hq} {'causal' if causal else 'full'} S{s} gqa{gqa}: "
                      + " ".join(f"{k_}={row[k_]}" for k_ in impls)
                      + ratio, flush=True)
                results["time"].append(row)
                del q, k, v, do, out, lse
                torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="check,det,time")
    ap.add_argument("--passes", type=int, default=100)
    ap.add_argument("--hdims", default="128,64")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--masks", default="causal,full", help="time stage: causal, full or both")
    ap.add_argument("--repeat", type=int, default=1, help="time stage: interleaved rounds per point (median kept)")
    ap.add_argument("--no-triton", action="store_true", help="time stage: leave out the Triton split column")
    ap.add_argument("--heads", default="", help="time stage: query head counts to run (default: 2048 / head dim)")
    ap.add_argument("--orders", default="", help="time stage: only these of our orders (default: all)")
    ap.add_argument("--no-fa4", action="store_true", help="time stage: leave out FA4's columns")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    heads = [int(x) for x in a.heads.split(",") if x]
    orders = [x for x in a.orders.split(",") if x]
    # Refused before any GPU work: a typo ran no order in silence, and a head count the GQA ratio
    # does not divide made every cell an error.
    unknown = sorted(set(orders) - set(schedules_for(True)))
    if unknown:
        ap.error(f"--orders: {', '.join(unknown)} not an order of this backend ({', '.join(schedules_for(True))})")
    if any(h % a.gqa for h in heads):
        ap.error(f"--heads {a.heads}: each must be a multiple of --gqa {a.gqa}")
    env = gpu_environment()
    print(env, flush=True)
    results = {"env": env, "check": [], "det": [], "time": []}
    stages = a.stages.split(",")
    try:
        if "check" in stages:
            stage_check(results)
        if "det" in stages:
            stage_det(results, a.passes)
        if "time" in stages:
            stage_time(results, [int(x) for x in a.hdims.split(",")], [int(x) for x in a.seqlens.split(",")], a.gqa,
                       a.masks.split(","), a.repeat, not a.no_triton,
                       heads, orders, not a.no_fa4)
    finally:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"hopper_bwd_{'_'.join(stages)}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
