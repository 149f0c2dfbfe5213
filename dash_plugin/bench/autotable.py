"""The ``auto`` rule as data: the fastest deterministic schedule per (head dim, mask, seqlen range),
derived once from a benchmark results file and committed; never a timing at run time.

Table format (JSON, ``"format": "dash-auto-table/1"``)::

    {"format": "dash-auto-table/1",
     "source": {"gpu": ..., "sm_count": ..., "torch": ..., "triton": ..., "date": ..., "git_commit": ...},
     "candidates": ["ascending", "spt", "descending", "shift", "split"],
     "rules": [{"head_dim": 128, "mask": "causal", "seqlen_min": 0, "seqlen_max": 3072,
                "schedule": "descending",
                "measured": {"1024": {"ascending": 301.2, "descending": 340.5, ...}, "2048": {...}}},
               ...]}

A rule covers ``seqlen_min <= seqlen < seqlen_max`` (``seqlen_max`` null: no upper bound). Range
boundaries sit halfway between measured seqlens on a log scale (the geometric mean, rounded), and
neighbouring seqlens with the same winner share one rule. Only MHA points (no GQA rows) and only
cells that passed the bitwise check take part; ``measured`` keeps the backward TFLOP/s behind
each choice so a reviewer can see the margin. ``lookup`` shows how the table is read.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

from .peers import DETERMINISTIC_SCHEDULES
from .report import index_cells, ok_value

FORMAT = "dash-auto-table/1"


def _winner(cells: dict, point_key: str) -> tuple[Optional[str], dict]:
    measured = {}
    for schedule in DETERMINISTIC_SCHEDULES:
        name = f"dash-{schedule}"
        value = ok_value(cells, point_key, name, "bwd_tflops")
        if value is not None and cells[(point_key, name)].get("deterministic") is True:
            measured[schedule] = round(value, 2)
    if not measured:
        return None, measured
    # max over the fixed candidate order: a tie goes to the earlier (simpler) schedule
    best = max(measured.values())
    return next(s for s in DETERMINISTIC_SCHEDULES if measured.get(s) == best), measured


def _boundary(lo: int, hi: int) -> int:
    return int(round(math.sqrt(lo * hi)))


def derive_auto_table(results: dict) -> dict:
    cells = index_cells(results)
    groups: dict = {}
    for p in results["points"]:
        if p["heads_q"] != p["heads_kv"]:
            continue
        schedule, measured = _winner(cells, p["key"])
        if schedule is not None:
            groups.setdefault((p["hdim"], p["mask"]), []).append((p["seqlen"], schedule, measured))
    rules = []
    for (hdim, mask), entries in sorted(groups.items()):
        entries.sort()
        for i, (seqlen, schedule, measured) in enumerate(entries):
            lo = 0 if i == 0 else _boundary(entries[i - 1][0], seqlen)
            hi = None if i == len(entries) - 1 else _boundary(seqlen, entries[i + 1][0])
            if rules and rules[-1]["head_dim"] == hdim and rules[-1]["mask"] == mask \
                    and rules[-1]["schedule"] == schedule:
                rules[-1]["seqlen_max"] = hi
                rules[-1]["measured"][str(seqlen)] = measured
                continue
            rules.append({"head_dim": hdim, "mask": mask, "seqlen_min": lo, "seqlen_max": hi,
                          "schedule": schedule, "measured": {str(seqlen): measured}})
    env = results.get("env", {})
    return {"format": FORMAT,
            "source": {k: env.get(k) for k in ("gpu", "sm_count", "torch", "triton", "cuda", "date", "git_commit")},
            "metric": "backward TFLOP/s of the deterministic schedules (cells that passed the bitwise check)",
            "candidates": list(DETERMINISTIC_SCHEDULES),
            "rules": rules}


def lookup(table: dict, *, head_dim: int, causal: bool, seqlen: int) -> Optional[str]:
    """The schedule a table picks: rules of the nearest measured head dim (ties: the larger one),
    the rule whose seqlen range holds ``seqlen``. None if the table has no rule for that mask."""
    mask = "causal" if causal else "full"
    rules = [r for r in table["rules"] if r["mask"] == mask]
    if not rules:
        return None
    nearest = min({r["head_dim"] for r in rules}, key=lambda d: (abs(d - head_dim), -d))
    for r in rules:
        if r["head_dim"] == nearest and r["seqlen_min"] <= seqlen and (r["seqlen_max"] is None
                                                                        or seqlen < r["seqlen_max"]):
            return r["schedule"]
    return None


def write_auto_table(results: dict, path: str) -> dict:
    table = derive_auto_table(results)
    if not table["rules"]:
        raise ValueError("no deterministic dash schedule was measured successfully in these results: "
                         "cannot derive an auto table (run with --impls 'dash-*')")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return table
