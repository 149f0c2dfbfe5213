"""The ``auto`` rule as data: the fastest deterministic schedule per (head dim, mask, seqlen range),
derived once from a benchmark results file and committed; never a timing at run time.

Two outputs of ``--write-auto-table PATH``:

* ``PATH`` ending in ``.py``: a drop-in ``dash_plugin/schedules/auto_table.py`` (the format
  ``dash_plugin/schedules/auto.py`` reads: ``RULES``, a list of dicts, first match wins; keys
  ``mask``, ``head_dim_max`` and ``seqlen_max`` (inclusive bounds, absent = any), ``equal_lengths``,
  ``varlen``, ``schedule``, ``source``). The rules the benchmark cannot measure (window masks,
  varlen, unequal lengths: the rules with those keys) are kept from the current table, first;
  the measured rules follow, ending with a catch-all per mask.
* any other ``PATH``: the same choices as JSON with every measured figure behind them
  (``"format": "dash-auto-table/1"``), for review::

    {"format": "dash-auto-table/1", "source": {"gpu": ..., "sm_count": ..., "date": ...},
     "candidates": ["ascending", "spt", "descending", "shift", "arrival", "split"], "backend": "triton",
     "rules": [{"head_dim": 128, "mask": "causal", "seqlen_min": 0, "seqlen_max": 2896,
                "schedule": "descending", "measured": {"1024": {"ascending": 301.2, ...}, ...}}]}

  There a rule covers ``seqlen_min <= seqlen < seqlen_max`` (null: unbounded).

Choices: at each measured MHA point, the candidate with the highest backward TFLOP/s among the
cells that ran on the Triton backend and passed the bitwise check (ties: the earlier candidate):
``dash-<schedule>`` and ``dash-triton-<schedule>`` columns whose recorded kernel is Triton, since
this table serves the calls that run there (the Hopper backend has its own, auto_table_hopper.py;
on an sm90 machine the ``dash-<schedule>`` columns run the Hopper kernels and are left out). A cell
whose backward ran its plan's fallback order is not counted for the order it names. Neighbouring seqlens
with the same winner merge; a range boundary sits at the geometric mean of the two measured
seqlens around it. A head dim maps to the smallest measured head dim at least as large (kernels
pad head dims up), the largest measured one covering everything above.
"""
from __future__ import annotations

import json
import math
import os
import pprint
from typing import Optional

from dash_plugin.schedules import registry

from .report import index_cells, ok_value

FORMAT = "dash-auto-table/1"
CANDIDATES = registry.names(deterministic=True)   # what auto may return
STRUCTURAL_KEYS = ("equal_lengths", "varlen")   # shapes the benchmark does not measure
BACKEND = "triton"   # the backend whose calls auto_table.py serves (tests of the CPU pipeline pass another)


def _counts(cells: dict, point_key: str, name: str, backend: str) -> Optional[float]:
    """A cell's backward TFLOP/s if it may decide the table: it ran on `backend` (cells of runs that
    did not record a kernel predate the Hopper backend: Triton) and passed the bitwise check."""
    value = ok_value(cells, point_key, name, "bwd_tflops")
    cell = cells.get((point_key, name))
    if value is None or cell.get("deterministic") is not True or cell.get("kernel", "triton") != backend:
        return None
    return round(value, 1)


def _winner(cells: dict, point_key: str, backend: str) -> tuple[Optional[str], dict]:
    measured = {}
    for schedule in CANDIDATES:
        found = [v for name in (f"dash-{schedule}", f"dash-{backend}-{schedule}")
                 if (v := _counts(cells, point_key, name, backend)) is not None]
        if found:
            measured[schedule] = max(found)
    # A run may leave out a schedule's own column because dash-auto already runs it: the auto
    # cell then measures the schedule it resolved to.
    auto = cells.get((point_key, "dash-auto"))
    value = _counts(cells, point_key, "dash-auto", backend)
    if value is not None and auto.get("schedule_resolved") in CANDIDATES and auto["schedule_resolved"] not in measured:
        measured[auto["schedule_resolved"]] = value
    if not measured:
        return None, measured
    best = max(measured.values())
    return next(s for s in CANDIDATES if measured.get(s) == best), measured


def _boundary(lo: int, hi: int) -> int:
    """Where the rule of seqlen `lo` hands over to that of `hi`: their geometric mean, but past `lo`
    (it rounded down to `lo` itself for seqlens one or two apart, giving `lo` its neighbour's rule)."""
    return max(lo + 1, int(math.sqrt(lo * hi)))


def _point_winners(results: dict, backend: str):
    """(point, winner, measured figures) of every MHA point that has a winner on `backend`."""
    cells = index_cells(results)
    for p in results["points"]:
        if p["heads_q"] == p["heads_kv"]:
            schedule, measured = _winner(cells, p["key"], backend)
            if schedule is not None:
                yield p, schedule, measured


def unmeasured_candidates(results: dict, backend: str = BACKEND) -> dict[str, list[str]]:
    """{point key: the candidates with no usable cell there} for the MHA points that have a winner: a
    schedule that was not measured at a point cannot win it, so a table from a run that measured one
    or two candidates says little (the CLI warns)."""
    return {p["key"]: [c for c in CANDIDATES if c not in measured]
            for p, _, measured in _point_winners(results, backend) if len(measured) < len(CANDIDATES)}


def derive_auto_table(results: dict, backend: str = BACKEND) -> dict:
    """The winners among the cells that ran on `backend`, as JSON-ready data (rules sorted by mask,
    head dim, seqlen)."""
    groups: dict = {}
    for p, schedule, measured in _point_winners(results, backend):
        groups.setdefault((p["mask"], p["hdim"]), []).append((p["seqlen"], schedule, measured))
    rules = []
    for (mask, hdim), entries in sorted(groups.items()):
        entries.sort()
        for i, (seqlen, schedule, measured) in enumerate(entries):
            lo = 0 if i == 0 else _boundary(entries[i - 1][0], seqlen)
            hi = None if i == len(entries) - 1 else _boundary(seqlen, entries[i + 1][0])
            last = rules[-1] if rules else None
            if last and (last["mask"], last["head_dim"], last["schedule"]) == (mask, hdim, schedule):
                last["seqlen_max"] = hi
                last["measured"][str(seqlen)] = measured
                continue
            rules.append({"head_dim": hdim, "mask": mask, "seqlen_min": lo, "seqlen_max": hi,
                          "schedule": schedule, "measured": {str(seqlen): measured}})
    env = results.get("env", {})
    return {"format": FORMAT,
            "source": {k: env.get(k) for k in ("gpu", "sm_count", "torch", "triton", "cuda", "date", "git_commit")},
            "metric": "backward TFLOP/s of the deterministic schedules (cells that passed the bitwise check)",
            "candidates": list(CANDIDATES), "backend": backend,
            "rules": rules}


def lookup(table: dict, *, head_dim: int, causal: bool, seqlen: int) -> Optional[str]:
    """The schedule the JSON table picks (same head-dim mapping as the .py rules). None: no rule."""
    mask = "causal" if causal else "full"
    rules = [r for r in table["rules"] if r["mask"] == mask]
    if not rules:
        return None
    dims = sorted({r["head_dim"] for r in rules})
    dim = next((d for d in dims if d >= head_dim), dims[-1])
    for r in rules:
        if r["head_dim"] == dim and r["seqlen_min"] <= seqlen and (r["seqlen_max"] is None or seqlen < r["seqlen_max"]):
            return r["schedule"]
    return None


def _source_text(rule: dict, env: dict) -> str:
    figures = "; ".join(f"s={s}: " + ", ".join(f"{k} {v}" for k, v in sorted(m.items(), key=lambda kv: -kv[1]))
                        for s, m in rule["measured"].items())
    return (f"measured {env.get('gpu')} {str(env.get('date', ''))[:10]}, hdim{rule['head_dim']} {rule['mask']} "
            f"bwd TFLOP/s {figures}")


def _checked_table(results: dict, backend: str) -> dict:
    table = derive_auto_table(results, backend)
    if not table["rules"]:
        raise ValueError(f"no deterministic dash schedule ran successfully on the {backend} backend in these "
                         f"results: cannot derive an auto table (run with --impls 'dash-*,dash-{backend}-*')")
    return table


def auto_table_rules(results: dict, structural: list[dict], backend: str = BACKEND) -> list[dict]:
    """Rules in auto_table.py's format: the structural ones (kept as they are), then the measured ones."""
    table = _checked_table(results, backend)
    env = results.get("env", {})
    out = [dict(r) for r in structural if r.get("mask") == "window" or any(k in r for k in STRUCTURAL_KEYS)]
    for mask in ("causal", "full"):
        measured = [r for r in table["rules"] if r["mask"] == mask]
        if not measured:
            # keep the existing rules for a mask this run did not measure
            out += [dict(r) for r in structural if r.get("mask") == mask and r not in out]
            continue
        dims = sorted({r["head_dim"] for r in measured})
        for rule in measured:
            entry = {"mask": mask}
            if rule["head_dim"] != dims[-1]:
                entry["head_dim_max"] = rule["head_dim"]
            if rule["seqlen_max"] is not None:
                entry["seqlen_max"] = rule["seqlen_max"] - 1    # inclusive there, exclusive here
            entry["schedule"] = rule["schedule"]
            entry["source"] = _source_text(rule, env)
            out.append(entry)
    return out


def render_auto_table_py(results: dict, structural: list[dict], *, results_path: Optional[str] = None,
                         backend: str = BACKEND) -> str:
    env = results.get("env", {})
    rules = auto_table_rules(results, structural, backend)
    body = ",\n".join("    " + pprint.pformat(r, width=110, sort_dicts=False).replace("\n", "\n    ")
                      for r in rules)
    return (f'"""Data for schedule=\'auto\' (read by auto.py). First matching rule wins.\n\n'
            f"Keys: mask (full | causal | window: any sliding window, causal or not); head_dim_max and\n"
            f"seqlen_max (inclusive upper bounds, absent = any; seqlen is max(seqlen_q, seqlen_k), for varlen\n"
            f"the longest sequence); equal_lengths (True/False: seqlen_q == seqlen_k); varlen (True/False);\n"
            f"schedule (a deterministic schedule of the registry); source (why). These rules serve the\n"
            f"calls that run on the Triton backend (the Hopper backend's come first, auto_table_hopper.py).\n\n"
            f"Generated by `dash-bench --write-auto-table` from {results_path or 'a dash-bench run'}\n"
            f"({env.get('gpu')}, {env.get('sm_count')} SMs, torch {env.get('torch')}, triton {env.get('triton')}, "
            f"{env.get('date')}, commit {env.get('git_commit')}).\n"
            f"Measured rules: the fastest deterministic schedule per (mask, head dim, seqlen range); rules\n"
            f"for shapes the benchmark does not measure (window, varlen, unequal lengths) are kept from the\n"
            f"previous table. A fixed table, never a timing taken at run time.\n"
            f'"""\n\nRULES = [\n{body},\n]\n')


def current_structural_rules() -> list[dict]:
    try:
        from dash_plugin.schedules import auto_table
        return list(auto_table.RULES)
    except Exception:
        return []


def write_auto_table(results: dict, path: str, *, results_path: Optional[str] = None, backend: str = BACKEND):
    """Write the table of the cells that ran on `backend` (.py: auto_table.py format; otherwise JSON).
    Returns the rules written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".py"):
        text = render_auto_table_py(results, current_structural_rules(), results_path=results_path, backend=backend)
        namespace: dict = {}
        exec(compile(text, path, "exec"), namespace)   # never write a file that does not load
        with open(path, "w") as f:
            f.write(text)
        return namespace["RULES"]
    table = _checked_table(results, backend)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return table["rules"]
