"""Every point of this record's kernel-level runs: the head count, the fastest deterministic order
measured there, `auto`'s pick with the rules of the checked-out tree, and the pick against the
fastest ("-" where the run did not time the pick). Run from the repository root:
    python docs/benchmarks/hdim56-heads-2026-11-26-h100/table.py"""
import glob
import json
import os

from dash_plugin.schedules import auto

HERE = os.path.dirname(os.path.abspath(__file__))

print("| run | hdim | heads | mask | S | fastest order (TFLOP/s) | auto picks | pick / fastest |")
print("|---|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(HERE, "*", "**", "hopper_bwd_time.json"), recursive=True)):
    run = os.path.dirname(os.path.relpath(path, HERE))
    for r in json.load(open(path))["time"]:
        timed = {k[5:]: v for k, v in r.items()
                 if k.startswith("cute-") and k != "cute-atomic" and isinstance(v, float)}
        best = max(timed, key=timed.get)
        pick = auto.choose_schedule(causal=r["causal"], head_dim=r["hdim"], seqlen_q=r["seqlen"],
                                    seqlen_k=r["seqlen"], backend="hopper")
        mask = ("causal" if r["causal"] else "full") + (f" GQA {r['gqa']}:1" if r["gqa"] > 1 else "")
        ratio = f"{timed[pick] / timed[best]:.3f}" if pick in timed else "-"
        print(f"| {run} | {r['hdim']} | {r['heads']} | {mask} | {r['seqlen'] // 1024}k | {best} {timed[best]} | "
              f"{pick} {timed.get(pick, '')} | {ratio} |")
