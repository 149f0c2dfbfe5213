"""Per point of this record's runs: the fastest deterministic order, what `auto` picks with the
rules of the checked-out tree, and that pick's loss against the fastest (backward TFLOP/s, median
of the run's interleaved rounds). Run from the repository root:
    python docs/benchmarks/auto-head-dims-2026-11-26-h100/table.py"""
import glob
import json
import os

from dash_plugin.schedules import auto

HERE = os.path.dirname(os.path.abspath(__file__))
ORDERS = ("ascending", "spt", "descending", "shift", "arrival")

rows = []
for path in sorted(glob.glob(os.path.join(HERE, "run*", "**", "hopper_bwd_time.json"), recursive=True)):
    run = os.path.relpath(path, HERE).split(os.sep)[0]
    for r in json.load(open(path))["time"]:
        measured = {o: r[f"cute-{o}"] for o in ORDERS if r.get(f"cute-{o}")}
        best = max(measured, key=measured.get)
        pick = auto.choose_schedule(causal=r["causal"], head_dim=r["hdim"], seqlen_q=r["seqlen"],
                                    seqlen_k=r["seqlen"], backend="hopper")
        mask = ("causal" if r["causal"] else "full") + (f" GQA {r['gqa']}:1" if r.get("gqa", 1) > 1 else "")
        rows.append((r["hdim"], mask, r["seqlen"], run, best, measured[best],
                     pick, measured.get(pick), r["cute-atomic"], r.get("fa4-det")))

print("| hdim | mask | S | run | fastest order (TFLOP/s) | auto picks | pick / fastest | pick / atomic | pick / FA4 det |")
print("|---|---|---|---|---|---|---|---|---|")
for d, mask, s, run, best, bv, pick, pv, atomic, fa4 in sorted(rows):
    fa4_ratio = f"{pv / fa4:.2f}" + (" (FA4 wrong)" if d % 32 else "") if fa4 else "-"
    print(f"| {d} | {mask} | {s // 1024}k | {run[3]} | {best} {bv} | {pick} {pv} | {pv / bv:.3f} | "
          f"{pv / atomic:.2f} | {fa4_ratio} |")
