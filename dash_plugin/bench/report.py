"""Writers for a results dict: JSON, a markdown table with the target verdicts, a PNG plot.

Everything here reads only the results dict (as written to JSON), so ``dash-bench --from-json``
can rebuild the reports of an earlier run without a GPU.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

from ..schedules.builders import is_fallback
from .clocks import NOT_CUDA

MIB = 2.0 ** 20
# Two correct bf16 implementations differ by about 1e-2 of the largest value at most (rounding
# of out, differing accumulation orders of dq); far above that a result is wrong, however fast.
SUSPECT_ERR = 0.05
FORMAT = "dash-bench/1"   # the results file's format, written by runner.run_benchmark and checked on reading


# ---------------------------------------------------------------------------- access helpers
def ran_a_fallback(cell: dict) -> list[str]:
    """The fallback orders a dash cell's backward ran instead of its named schedule (empty: none;
    the runner records the launch plan's variants as `plan_variants`)."""
    return [v for v in cell.get("plan_variants", []) if is_fallback(v)]


def index_cells(results: dict) -> dict:
    return {(c["point"], c["impl"]): c for c in results["cells"]}


def ok_value(cells: dict, point: str, impl: str, metric: str) -> Optional[float]:
    """A cell's figure for the targets; None where it has none, or where its backward ran a fallback
    order (it is no evidence for the order its column names)."""
    cell = cells.get((point, impl))
    if cell is None or cell.get("status") != "ok" or cell.get(metric) is None or ran_a_fallback(cell):
        return None
    return float(cell[metric])


def impl_names(results: dict) -> list[str]:
    return [i["name"] for i in results["implementations"]]


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---------------------------------------------------------------------------- targets
# A numerator entry that stands for every deterministic implementation of ours in the run
# (family "dash", claims_deterministic): dash-auto and each deterministic schedule on each backend.
OURS_DETERMINISTIC = "@ours-deterministic"


@dataclass(frozen=True)
class Target:
    """A ratio with a goal. ``kind``: 'geomean' over every point where both sides were measured,
    'point' at one point, 'max' (worst case, for memory) over the points."""

    title: str
    metric: str                 # cell field compared
    numerator: tuple            # implementations; the best (largest) of them is taken
    denominator: Optional[str]  # None: the numerator's value itself is judged (a ratio already, e.g. a cost)
    goal: float
    kind: str = "geomean"
    point: Optional[str] = None
    higher_is_better: bool = True
    floor: float = 0.0          # denominator floor (memory: 1 MiB, so 0 bytes does not divide)
    where: tuple = ()           # point filter: for each tuple, the key must contain one of its strings
    per_impl: bool = False      # every numerator implementation must meet the goal (not only the best one)
    strict: bool = False        # "below"/"above" the goal rather than "at most"/"at least"
    digits: int = 2             # decimals of the value in the reports

    def meets(self, value: float) -> bool:
        if self.strict:
            return value > self.goal if self.higher_is_better else value < self.goal
        return value >= self.goal if self.higher_is_better else value <= self.goal

    @property
    def op(self) -> str:
        return (">" if self.higher_is_better else "<") + ("" if self.strict else "=")


# The targets, with its numbers. "min" kinds must hold at every point where both sides
# ran (the issue says "at every point"); ``where`` narrows the points (point-key substrings, all
# of which must match one of each tuple).
TARGETS = (
    Target("det backward (auto) vs SDPA cuDNN non-det backward, hdim 64/128, S>=2k", "bwd_tflops", ("dash-auto",),
           "sdpa-cudnn", 1.0, kind="min",
           where=(("hdim64-", "hdim128-"), ("-s2048", "-s4096", "-s8192", "-s16384"))),
    Target("det backward (auto) vs FlexAttention backward", "bwd_tflops", ("dash-auto",), "flex", 1.3, kind="min"),
    Target("det backward (auto) vs our atomic backward", "bwd_tflops", ("dash-auto",), "dash-atomic", 0.97,
           kind="min"),
    Target("DASH: best of descending/shift vs ascending, causal hdim128 S=16k", "bwd_tflops",
           ("dash-descending", "dash-shift"), "dash-ascending", 1.2, kind="point", point="hdim128-causal-s16384"),
    Target("DASH: shift vs ascending, full hdim64 S=2k", "bwd_tflops", ("dash-shift",), "dash-ascending", 1.1,
           kind="point", point="hdim64-full-s2048"),
    Target("det backward (auto) vs FA4 deterministic backward, hdim 64/128, S>=1k", "bwd_tflops", ("dash-auto",),
           "fa4-det", 1.0, kind="min", where=(("hdim64-", "hdim128-"), ("-s1024", "-s2048", "-s4096", "-s8192",
                                                                          "-s16384"))),
    Target("det backward (auto) vs FA4 deterministic backward, causal S>=8k", "bwd_tflops", ("dash-auto",),
           "fa4-det", 1.15, kind="min", where=(("-causal-",), ("-s8192", "-s16384"))),
    Target("forward vs FA4 forward, hdim 64/128", "fwd_tflops", ("dash-auto",), "fa4", 1.0, kind="min",
           where=(("hdim64-", "hdim128-"),)),
    Target("forward vs SDPA cuDNN forward, hdim 64/128", "fwd_tflops", ("dash-auto",), "sdpa-cudnn", 1.0,
           kind="min", where=(("hdim64-", "hdim128-"),)),
    Target("extra backward memory, det (auto) vs our atomic (worst point)", "bwd_extra_bytes", ("dash-auto",),
           "dash-atomic", 1.10, kind="max", higher_is_better=False, floor=MIB),
)

# With --dropout P: the cost of dropout (forward + backward with / without, one cell, one protocol),
# for every deterministic implementation of ours that ran with dropout (the worst one counts).
DROPOUT_TARGETS = (
    Target("dropout cost (fwd+bwd with / without), our deterministic impls, hdim128, S>=2k", "dropout_cost",
           (OURS_DETERMINISTIC,), None, 1.08, kind="max", higher_is_better=False, per_impl=True, digits=3,
           where=(("hdim128-",), ("-s2048", "-s4096", "-s8192", "-s16384"))),
    Target("dropout cost, our deterministic impls vs SDPA flash's dropout cost (every point)", "dropout_cost",
           (OURS_DETERMINISTIC,), "sdpa-flash", 1.0, kind="max", higher_is_better=False, per_impl=True,
           strict=True, digits=3),
)
# The field that says a cell of ours passed its bitwise check, per metric judged.
DETERMINISM_FIELD = {"bwd_tflops": "deterministic", "dropout_cost": "dropout_deterministic"}


def dropout_p(results: dict) -> float:
    return float(results.get("config", {}).get("dropout_p") or 0.0)


def _numerator_names(target: Target, results: dict) -> list:
    names = []
    for name in target.numerator:
        if name == OURS_DETERMINISTIC:
            names += [i["name"] for i in results["implementations"]
                      if i.get("family") == "dash" and i.get("claims_deterministic")]
        else:
            names.append(name)
    return names


def _best(cells, point, impls, metric) -> Optional[tuple]:
    found = [(v, name) for name in impls if (v := ok_value(cells, point, name, metric)) is not None]
    return max(found) if found else None


NOT_JUDGED = "not judged (CPU timings; the goals are for the GPU)"


def evaluate_target(target: Target, results: dict) -> dict:
    """{title, value, goal, op, verdict: met | not met | not measured | NOT_JUDGED, detail}. The
    goals are GPU goals: figures timed on another device show their ratios but get no verdict."""
    row = _evaluate(target, results)
    if results.get("env", {}).get("device") != "cuda":
        row["verdict"] = NOT_JUDGED
    return row


def _evaluate(target: Target, results: dict) -> dict:
    cells = index_cells(results)
    keys = [p["key"] for p in results["points"]] if target.kind != "point" else [target.point]
    keys = [k for k in keys if all(any(part in k for part in group) for group in target.where)]
    numerators = _numerator_names(target, results)
    ratios, zero = [], []
    for key in keys:
        if target.per_impl:
            nums = [(v, name) for name in numerators if (v := ok_value(cells, key, name, target.metric)) is not None]
        else:
            best = _best(cells, key, numerators, target.metric)
            nums = [] if best is None else [best]
        den = 1.0 if target.denominator is None else ok_value(cells, key, target.denominator, target.metric)
        if not nums or den is None:
            continue
        if max(den, target.floor) == 0:   # a legal 0 in the file: no ratio to take there
            zero.append(key)
            continue
        ratios += [(value / max(den, target.floor), key, name) for value, name in nums]
    row = {"title": target.title, "goal": target.goal, "op": target.op, "value": None, "verdict": "not measured",
           "points": len(ratios), "detail": "", "digits": target.digits}
    not_measurable = (f"not measurable where {target.denominator} reads 0 ({', '.join(zero[:3])}"
                      + (f" and {len(zero) - 3} more)" if len(zero) > 3 else ")")) if zero else ""
    if not ratios:
        who = " or ".join(target.numerator).replace(OURS_DETERMINISTIC, "a deterministic dash column")
        row["detail"] = not_measurable or (f"needs {who}" + (f" and {target.denominator}" if target.denominator else "")
                                           + " measured" + (f" at {target.point}" if target.point else ""))
        return row
    if target.per_impl:   # the worst (implementation, point) pair counts; name it
        worst = (max if target.kind == "max" else min)(ratios)
        row["value"] = worst[0]
        row["detail"] = (f"worst of {len(ratios)} (implementation, point) pairs "
                         f"({len({n for _, _, n in ratios})} implementations): {worst[2]} at {worst[1]}")
    elif target.kind == "geomean":
        row["value"] = geomean(r for r, _, _ in ratios)
        worst = min(ratios)
        row["detail"] = f"geomean of {len(ratios)} points; min {worst[0]:.2f} at {worst[1]}"
    elif target.kind == "min":
        worst = min(ratios)
        row["value"] = worst[0]
        row["detail"] = f"worst of {len(ratios)} points, at {worst[1]}"
    elif target.kind == "max":
        worst = max(ratios)
        row["value"] = worst[0]
        row["detail"] = f"worst of {len(ratios)} points, at {worst[1]}"
    else:
        row["value"], _, winner = ratios[0]
        row["detail"] = f"at {target.point}" + (f" ({winner})" if len(target.numerator) > 1 else "")
    if not_measurable:
        row["detail"] += "; " + not_measurable
    return _verdict(target, row, ratios, cells)


def _verdict(target: Target, row: dict, ratios: list, cells: dict) -> dict:
    met = target.meets(row["value"])
    # A deterministic figure (backward, dropout) only counts where its bitwise check passed.
    field = DETERMINISM_FIELD.get(target.metric)
    nondet = [k if not target.per_impl else f"{name}@{k}" for _, k, name in ratios
              if field and name.startswith("dash-") and name != "dash-atomic"
              and cells[(k, name)].get(field) is False]
    if nondet:
        met = False
        row["detail"] += f"; NOT bitwise deterministic at {', '.join(sorted(set(nondet)))}"
    # ... and no figure of ours counts if its results are wrong.
    wrong = [k for _, k, name in ratios if (cells[(k, name)].get("max_rel_err") or 0.0) > SUSPECT_ERR]
    if wrong:
        met = False
        row["detail"] += f"; WRONG results (error > {SUSPECT_ERR}) at {', '.join(sorted(set(wrong)))}"
    row["verdict"] = "met" if met else "not met"
    return row


def targets_of(results: dict) -> tuple:
    """The targets a run is judged on: the dropout ones only for a --dropout run."""
    return TARGETS + (DROPOUT_TARGETS if dropout_p(results) > 0 else ())


def evaluate_targets(results: dict) -> list[dict]:
    return [evaluate_target(t, results) for t in targets_of(results)]


# ---------------------------------------------------------------------------- dropout
def dropout_summary(results: dict) -> Optional[dict]:
    """The dropout section of results.json (None without --dropout): per point and implementation
    the forward + backward time with and without dropout and their ratio, or why there is none;
    and the dropout targets. Derived from the cells, so --from-json rebuilds it."""
    p = dropout_p(results)
    if p <= 0:
        return None
    cfg = results.get("config", {})
    rows = []
    for c in results["cells"]:
        row = {"point": c["point"], "impl": c["impl"]}
        if c.get("status") != "ok":
            row["status"] = c.get("status")
        elif c.get("dropout_status") == "ok":
            row.update(status="ok", with_ms=c["dropout_on_ms"], without_ms=c["dropout_off_ms"],
                       cost=c["dropout_cost"])
            if "dropout_deterministic" in c:
                row["deterministic"] = c["dropout_deterministic"]
        else:
            row["status"] = c.get("dropout_status", "not measured")
            if c.get("dropout_note") or c.get("dropout_error"):
                row["note"] = c.get("dropout_note") or c.get("dropout_error")
        rows.append(row)
    return {"dropout_p": p, "seed": cfg.get("seed"),
            "measured": "forward + torch.autograd.grad(out, (q, k, v), dout) per call, timed without and with "
                        "dropout in the same cell by the same timer; cost = with / without",
            "cells": rows,
            "targets": [evaluate_target(t, results) for t in DROPOUT_TARGETS]}


def _dropout_text(cell: Optional[dict]) -> str:
    if cell is None:
        return ""
    if cell.get("status") != "ok":
        return cell.get("status", "?")
    status = cell.get("dropout_status")
    if status is None:
        return "n/a"
    if status != "ok":
        return status                          # "no dropout", or how the dropout call failed
    text = f"{cell['dropout_cost']:.3f}x ({cell['dropout_on_ms']:.3g} / {cell['dropout_off_ms']:.3g} ms)"
    if cell.get("dropout_deterministic") is False:
        text += " nd"
    return text


def _dropout_table(results: dict) -> list[str]:
    return _point_table(results, _dropout_text)


# ---------------------------------------------------------------------------- JSON
def write_json(results: dict, path: str) -> None:
    """Atomic write (a reader, or a run killed at its time limit, never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str) -> dict:
    """A results file, checked (`check_results`): bad input gives one ValueError naming the file."""
    try:
        with open(path) as f:
            results = json.load(f)
    except OSError as e:
        raise ValueError(f"--from-json {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--from-json {path}: not JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--from-json {path}: not a text file ({e})") from None
    check_results(results, path)
    return results


# ---------------------------------------------------------------------------- the file's shape
# What the reports read from a results file, checked once when it is loaded, so the writers above
# and below may index it freely: each field, what it must be, and whether it must be there. A
# file that fails gets one line naming the file, the entry and the field (`dash-bench --from-json`
# on a hand-edited or truncated file), never a traceback or a silently wrong report.
class _Kind(NamedTuple):
    test: Callable[[object], bool]
    text: str


def _number(v) -> bool:
    return type(v) in (int, float)


_STR = _Kind(lambda v: isinstance(v, str), "a string")
_OPT_STR = _Kind(lambda v: v is None or isinstance(v, str), "a string or null")
_OBJECT = _Kind(lambda v: isinstance(v, dict), "an object")
_BOOL = _Kind(lambda v: type(v) is bool, "true or false")
_OPT_BOOL = _Kind(lambda v: v is None or type(v) is bool, "true, false or null")
_COUNT = _Kind(lambda v: type(v) is int and v >= 0, "an int >= 0")
# Times, TFLOP/s, bytes, errors: a negative, NaN or infinite figure would flip a ratio's verdict.
_FIGURE = _Kind(lambda v: _number(v) and math.isfinite(v) and v >= 0, "a finite number >= 0")
_OPT_FIGURE = _Kind(lambda v: v is None or _FIGURE.test(v), "a finite number >= 0 or null")
_STR_LIST = _Kind(lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings")
_FIGURE_LIST = _Kind(lambda v: isinstance(v, list) and all(_FIGURE.test(x) for x in v),
                     "a list of finite numbers >= 0")
_CLOCKS = _Kind(lambda v: isinstance(v, dict) and all(
    w is None or (isinstance(w, dict) and _FIGURE.test(w.get("sm_mhz_median")) and _FIGURE.test(w.get("sm_mhz_min")))
    for w in v.values()), "an object of {sm_mhz_median, sm_mhz_min} per timing")
_DROPOUT_P = _Kind(lambda v: v is None or (_number(v) and 0 <= v < 1), "a number in [0, 1) or null")

# name -> (kind, required)
_TOP_FIELDS = {"format": (_STR, True), "env": (_OBJECT, True), "config": (_OBJECT, False),
               "implementations": (_Kind(lambda v: isinstance(v, list), "a list"), True),
               "points": (_Kind(lambda v: isinstance(v, list), "a list"), True),
               "cells": (_Kind(lambda v: isinstance(v, list), "a list"), True),
               "unavailable": (_Kind(lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                                     "an object of strings"), False),
               "merged_from": (_Kind(lambda v: isinstance(v, list) and all(isinstance(m, dict) for m in v),
                                     "a list of objects"), False),
               "clock_monitor": (_Kind(lambda v: v is None or isinstance(v, dict), "an object or null"), False)}
_CONFIG_FIELDS = {"dropout_p": (_DROPOUT_P, False), "command": (_OPT_STR, False), "mode": (_OPT_STR, False)}
_IMPL_FIELDS = {"name": (_STR, True), "description": (_STR, True), "family": (_OPT_STR, False),
                "claims_deterministic": (_OPT_BOOL, False)}
_POINT_FIELDS = {"key": (_STR, True), "row": (_STR, True), "mask": (_STR, True), "seqlen": (_COUNT, True),
                 "batch": (_COUNT, True), "heads_q": (_COUNT, True), "heads_kv": (_COUNT, True),
                 "hdim": (_COUNT, True)}
_CELL_FIELDS = {"point": (_STR, True), "impl": (_STR, True), "status": (_STR, True),
                **{f: (_FIGURE, False) for f in ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "max_rel_err",
                                                 "seconds", "dropout_on_ms", "dropout_off_ms", "dropout_cost")},
                **{f: (_OPT_FIGURE, False) for f in ("fwd_extra_bytes", "bwd_extra_bytes")},
                **{f: (_COUNT, False) for f in ("det_runs", "det_mismatches", "dropout_det_runs",
                                                "dropout_det_mismatches")},
                "deterministic": (_BOOL, False), "dropout_deterministic": (_BOOL, False),
                "plan_variants": (_STR_LIST, False), "fwd_ms_runs": (_FIGURE_LIST, False),
                "sm_clock": (_CLOCKS, False), "error": (_STR, False), "kernel": (_OPT_STR, False),
                "schedule_resolved": (_OPT_STR, False), "dropout_status": (_STR, False),
                "dropout_note": (_OPT_STR, False), "dropout_error": (_OPT_STR, False)}
# Fields a cell must have once another says it measured: (condition, fields).
_CELL_NEEDS = ((lambda c: c["status"] == "ok", ("deterministic", "det_runs", "det_mismatches")),
               (lambda c: "dropout_deterministic" in c, ("dropout_det_runs", "dropout_det_mismatches")),
               (lambda c: c.get("dropout_status") == "ok", ("dropout_on_ms", "dropout_off_ms", "dropout_cost")))


def _check_fields(path: str, where: str, entry, fields: dict) -> None:
    """`where`: the entry's place in the file ("cells[3]"; "" for the top level)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: {where} is {type(entry).__name__} {entry!r:.60}, not an object")
    for name, (kind, required) in fields.items():
        if name not in entry:
            if required:
                raise ValueError(f"{path}: {where or 'the file'} has no {name!r}")
        elif not kind.test(entry[name]):
            raise ValueError(f"{path}: {where + '.' if where else ''}{name} = {entry[name]!r:.60} is not {kind.text}")


def check_results(results, path: str) -> None:
    """Refuse a results file the reports cannot read faithfully (ValueError, one line naming `path`):
    a missing or mistyped field, a negative or non-finite figure, a cell given twice, a cell of
    an unknown point or implementation, another format than FORMAT."""
    if not isinstance(results, dict):
        raise ValueError(f"{path}: not a dash-bench results file (not a JSON object)")
    for name in ("format", "points", "cells", "implementations"):
        if name not in results:
            raise ValueError(f"{path}: not a dash-bench results file (no {name!r})")
    if results["format"] != FORMAT:
        raise ValueError(f"{path}: format {results['format']!r} is not {FORMAT!r}, the one dash-bench writes")
    _check_fields(path, "", results, _TOP_FIELDS)
    _check_fields(path, "config", results.get("config", {}), _CONFIG_FIELDS)
    for n, m in enumerate(results.get("merged_from", [])):
        _check_fields(path, f"merged_from[{n}]", m, {"command": (_OPT_STR, False), "date": (_OPT_STR, False)})
    names, keys = set(), set()
    for n, impl in enumerate(results["implementations"]):
        _check_fields(path, f"implementations[{n}]", impl, _IMPL_FIELDS)
        if impl["name"] in names:
            raise ValueError(f"{path}: implementation {impl['name']!r} is listed twice")
        names.add(impl["name"])
    for n, point in enumerate(results["points"]):
        _check_fields(path, f"points[{n}]", point, _POINT_FIELDS)
        if point["key"] in keys:
            raise ValueError(f"{path}: point {point['key']!r} is listed twice")
        keys.add(point["key"])
    seen = set()
    for n, cell in enumerate(results["cells"]):
        where = f"cells[{n}]"
        _check_fields(path, where, cell, _CELL_FIELDS)
        for applies, needed in _CELL_NEEDS:
            missing = [f for f in needed if applies(cell) and f not in cell]
            if missing:
                raise ValueError(f"{path}: {where} ({cell['impl']} at {cell['point']}) has no {missing[0]!r}")
        if cell["point"] not in keys:
            raise ValueError(f"{path}: {where} is at point {cell['point']!r}, which is not in points")
        if cell["impl"] not in names:
            raise ValueError(f"{path}: {where} is of implementation {cell['impl']!r}, which is not in implementations")
        # One cell per (point, implementation): a second would silently replace the first.
        if (cell["point"], cell["impl"]) in seen:
            raise ValueError(f"{path}: {where} gives {cell['impl']} at {cell['point']} a second time")
        seen.add((cell["point"], cell["impl"]))


def merge_results(parts: list[dict], names: list[str]) -> dict:
    """One results dict from runs that measured different points on the same GPU (a full protocol
    split over several commands). Every point keeps all its cells from one process, so each ratio is
    still taken side by side; a point measured twice is an error rather than a silent choice."""
    if len(parts) == 1:
        return parts[0]
    gpus = {part["env"].get("gpu") for part in parts}
    if len(gpus) != 1:
        raise ValueError(f"cannot merge results from different devices: {sorted(map(str, gpus))}")
    dropouts = {dropout_p(part) for part in parts}
    if len(dropouts) != 1:
        raise ValueError(f"cannot merge runs with different --dropout values: {sorted(dropouts)}")
    merged = dict(parts[0], points=[], cells=[], implementations=[], unavailable={})
    seen = {}
    for part, name in zip(parts, names):
        for p in part["points"]:
            if p["key"] in seen:
                raise ValueError(f"point {p['key']} is in both {seen[p['key']]} and {name}: merge disjoint runs")
            seen[p["key"]] = name
            merged["points"].append(p)
        merged["cells"] += part["cells"]
        known = {i["name"] for i in merged["implementations"]}
        merged["implementations"] += [i for i in part["implementations"] if i["name"] not in known]
        merged["unavailable"].update(part.get("unavailable", {}))
    merged["complete"] = all(part.get("complete") for part in parts)
    merged["stop_reason"] = "; ".join(part["stop_reason"] for part in parts if part.get("stop_reason")) or None
    merged["elapsed_s"] = round(sum(part.get("elapsed_s") or 0.0 for part in parts), 1)
    merged["merged_from"] = [{"file": name, "date": part["env"].get("date"),
                              "command": part.get("config", {}).get("command")} for part, name in zip(parts, names)]
    return merged


# ---------------------------------------------------------------------------- markdown
def _cell_text(cell: Optional[dict], metric: str) -> str:
    if cell is None:
        return ""
    if cell.get("status") != "ok":
        return cell.get("status", "?")
    value = cell.get(metric)
    if metric == "deterministic":
        return "yes" if value else f"**no** ({cell['det_mismatches']}/{cell['det_runs'] - 1})"
    if value is None:
        return "n/a"
    if metric.endswith("_bytes"):
        return f"{value / MIB:.1f}"
    if metric == "max_rel_err":
        return f"{value:.1e}"
    text = f"{value:.1f}" if value >= 10 else f"{value:.3g}"   # CPU runs give tiny figures
    if metric == "bwd_tflops" and cell.get("deterministic") is False:
        text += " nd"
    if metric == "bwd_tflops" and ran_a_fallback(cell):
        text += " fb"
    if metric.endswith("_tflops") and (cell.get("max_rel_err") or 0.0) > SUSPECT_ERR:
        text += " WRONG"
    return text


def _metric_table(results: dict, metric: str) -> list[str]:
    return _point_table(results, lambda cell: _cell_text(cell, metric))


def _point_table(results: dict, text_of) -> list[str]:
    """One row per point, one column per implementation, each cell rendered by `text_of`."""
    names = impl_names(results)
    cells = index_cells(results)
    lines = ["| row | mask | seqlen | B x Hq/Hkv | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for p in results["points"]:
        heads = f"{p['heads_q']}" if p["heads_q"] == p["heads_kv"] else f"{p['heads_q']}/{p['heads_kv']}"
        texts = [text_of(cells.get((p["key"], n))) for n in names]
        lines.append(f"| {p['row']} | {p['mask']} | {p['seqlen']} | {p['batch']} x {heads} | "
                     + " | ".join(texts) + " |")
    return lines


def _fmt_value(row: dict) -> str:
    return "-" if row["value"] is None else f"{row['value']:.{row.get('digits', 2)}f}x"


def render_markdown(results: dict, *, command: Optional[str] = None) -> str:
    env, cfg = results["env"], results.get("config", {})
    where = (f"{env.get('gpu')} ({env.get('sm_count')} SMs, sm {env.get('capability')})" if env.get("gpu")
             else f"CPU ({env.get('cpu')}, {env.get('threads')} threads): pipeline check, not a measurement")
    out = ["# dash-bench results", "",
           f"- Device: {where}",
           f"- Versions: torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, "
           f"cuDNN {env.get('cudnn')}, Python {env.get('python')}; dash_plugin commit {env.get('git_commit')}"
           + (f", source digest {env['source_digest']}" if env.get("source_digest") else ""),
           f"- Date: {env.get('date')}; run {'complete' if results.get('complete') else 'INCOMPLETE'}"
           + (f" ({results.get('stop_reason')})" if results.get("stop_reason") else "")
           + f"; {results.get('elapsed_s', '?')} s"]
    if results.get("merged_from"):
        out.append(f"- Merged from {len(results['merged_from'])} runs on this GPU; all figures of one point come "
                   "from one process: " + "; ".join(f"`{m.get('command')}` ({m.get('date')})"
                                                    for m in results["merged_from"]))
    elif command:
        out.append(f"- Command: `{command}`")
    shapes = ("miniature shapes (--tiny)" if cfg.get("mode") == "tiny"
              else "16k tokens per point, model dim 2048 (heads = 2048 / hdim, rounded)")
    timer = "do_bench, CUDA events" if env.get("device") == "cuda" else "wall clock"
    on_reference = sorted({f"{c['impl']}@{c['point']}" for c in results["cells"]
                           if c.get("kernel") == "reference" and env.get("device") == "cuda"})
    if on_reference:
        out.append(f"- **WARNING: our cells ran the plain-PyTorch reference, not the Triton kernels** "
                   f"(figures not comparable): {', '.join(on_reference[:8])}" + (" ..." if len(on_reference) > 8 else ""))
    resolved = {c["point"]: c["schedule_resolved"] for c in results["cells"]
                if c["impl"] == "dash-auto" and c.get("schedule_resolved")}
    if resolved:
        out.append("- dash-auto ran: " + ", ".join(f"{k} -> {v}" for k, v in resolved.items()))
    fallbacks = [f"{c['impl']} at {c['point']} -> {'; '.join(ran_a_fallback(c))}" for c in results["cells"]
                 if ran_a_fallback(c)]
    if fallbacks:
        out.append("- `fb`: a column whose named order does not apply to the point ran the fallback its launch "
                   "plan names: " + ", ".join(fallbacks))
    # Runs before 2026-11-24 timed the forward once; a re-rendered old run must not claim two.
    twice = any("fwd_ms_runs" in c for c in results["cells"])
    fwd_timing = "; forward: the faster of two medians, timed before and after the backward" if twice else ""
    out += [f"- Protocol: {shapes}, forward FLOPs "
            f"4*B*H*S^2*D (halved causal), backward 2.5x; median time ({timer}, warm-up "
            f"{cfg.get('warmup_ms')} ms, window {cfg.get('rep_ms')} ms{fwd_timing}); backward = "
            f"`torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`; determinism: "
            f"{cfg.get('repeats')} backward passes on the same inputs compared with `torch.equal`."
            + (f" Dropout: p = {dropout_p(results)}, seed {cfg.get('seed')} (see the dropout section)."
               if dropout_p(results) > 0 else ""),
            "", "## Targets (ratios of cells measured in this run)", "",
            "| target | measured | goal | verdict | detail |", "|---|---|---|---|---|"]
    for row in evaluate_targets(results):
        out.append(f"| {row['title']} | {_fmt_value(row)} | {row['op']} {row['goal']:.2f}x | "
                   f"{row['verdict']} | {row['detail']} |")
    sections = [
        ("Backward TFLOP/s", "bwd_tflops", "`nd`: the bitwise check found differing gradients (non-deterministic). "
         f"`WRONG`: error against the point's reference above {SUSPECT_ERR}. `fb`: the named order does not "
         "apply here and the backward ran its fallback (listed above)."),
        ("Forward TFLOP/s", "fwd_tflops", "Forward with inputs that require grad (the training forward)."),
        ("Bitwise-deterministic backward (checked)", "deterministic",
         "`no (k/n)`: k of the n repeated backward passes differed from the first."),
        ("Peak extra memory of one backward (MiB)", "bwd_extra_bytes",
         "max_memory_allocated during one backward, minus memory held before it and minus dq/dk/dv."),
        ("Max relative error vs the point's reference", "max_rel_err",
         "max |x - ref| / max |ref| over out, dq, dk, dv; the reference is the first implementation that ran "
         "at that point (normally an SDPA backend). A large value flags a wrong kernel."),
    ]
    for title, metric, note in sections:
        out += ["", f"## {title}", "", note, ""] + _metric_table(results, metric)
    if dropout_p(results) > 0:
        p = dropout_p(results)
        out += ["", f"## Dropout (p = {p}): forward + backward with dropout / without", "",
                "Each figure: `cost (with / without ms)`, cost = with / without. Both are one forward plus "
                "`torch.autograd.grad(out, (q, k, v), dout)`, timed in the same cell, one after the other, by the "
                f"same timer and window as above, on the same inputs; the dropout call has a fixed seed "
                f"({cfg.get('seed')}: ours pass it as `dropout_seed`, SDPA's generator is seeded with it once). "
                "`no dropout`: the implementation has none (FA4, cuDNN, Flex): no figure. `nd`: our fixed-seed "
                "dropout passes differed bitwise. `refused`/`error`: the dropout call failed (see Errors).", ""]
        out += _dropout_table(results)
        out += ["", "Its targets are the `dropout cost` rows of the Targets table: at most "
                f"{DROPOUT_TARGETS[0].goal:.2f}x for every deterministic column of ours at hdim 128, S >= 2k "
                "(causal and full), and below SDPA flash's own cost at every point."]
    out += ["", "## Implementations", "", "| name | what | claims deterministic |", "|---|---|---|"]
    for impl in results["implementations"]:
        out.append(f"| {impl['name']} | {impl['description']} | {impl.get('claims_deterministic')} |")
    for name, reason in results.get("unavailable", {}).items():
        out.append(f"| {name} | not run: {reason} | |")
    spent = {}
    for c in results["cells"]:
        if c.get("seconds") is not None:
            spent[c["impl"]] = spent.get(c["impl"], 0.0) + c["seconds"]
    if spent:
        out += ["", "Wall time per implementation, compiles and checks included (s): "
                + ", ".join(f"{name} {sec:.0f}" for name, sec in spent.items())]
    out += _clock_section(results)
    errors = {}
    for c in results["cells"]:
        if c.get("status") not in ("ok", "skipped"):
            errors.setdefault((c["impl"], c.get("error", "")), []).append(c["point"])
        elif c.get("dropout_error"):
            errors.setdefault((c["impl"], "with dropout: " + c["dropout_error"]), []).append(c["point"])
    if errors:
        out += ["", "## Errors", ""]
        for (impl, message), points in errors.items():
            first_line = message.splitlines()[0][:300] if message else ""
            out.append(f"- {impl} at {', '.join(points)}: {first_line}")
    return "\n".join(out) + "\n"


CLOCK_DIP = 0.9   # a timing whose lowest clock fell below this fraction of its point's median


def clock_dips(results: dict, below: float = CLOCK_DIP) -> tuple[dict, list[tuple]]:
    """({point: median SM clock over its timings}, [(point, impl, phase, lowest MHz)] for the
    timings during which the clock fell below `below` times its point's median). Points are
    compared within themselves: at its power cap an H100 holds ~1,650 MHz through long kernels
    and ~1,980 through short ones, so only a dip below what the other columns of the same point
    ran at makes one column read slow against them."""
    windows: dict = {}
    for c in results["cells"]:
        for phase, w in (c.get("sm_clock") or {}).items():
            if w:
                windows.setdefault(c["point"], []).append((c["impl"], phase, w))
    medians = {p: statistics.median(w["sm_mhz_median"] for *_, w in ws) for p, ws in windows.items()}
    dips = [(p, impl, phase, w["sm_mhz_min"]) for p, ws in windows.items() for impl, phase, w in ws
            if w["sm_mhz_min"] < below * medians[p]]
    return medians, dips


def _clock_section(results: dict) -> list[str]:
    monitor = results.get("clock_monitor") or {}
    medians, dips = clock_dips(results)
    if not medians:
        reason = monitor.get("reason")
        if not monitor or reason == NOT_CUDA:
            return []
        return ["", f"SM clock not recorded: {reason or 'no timing had a clock sample'}."]
    below = f"{CLOCK_DIP:.0%}".replace("%", " %")
    out = ["", "## SM clock during the timings", "",
           f"Median SM clock of each point's timings (nvidia-smi, every {monitor.get('interval_ms', '?')} ms): "
           + ", ".join(f"{p} {mhz:.0f} MHz" for p, mhz in medians.items()) + ". A board at its power cap "
           "dips for a few hundred milliseconds as the power ramps up, and a timing in a dip reads slow "
           "against the other columns of its point."]
    if monitor.get("reason"):
        out.append(f"Sampling stopped early: {monitor['reason']}.")
    if dips:
        out += [f"Timed while the clock fell below {below} of its point's median:", ""]
        out += [f"- {impl} at {point}, {phase}: down to {mhz} MHz" for point, impl, phase, mhz in dips]
    else:
        out.append(f"No timing saw the clock below {below} of its point's median.")
    return out


def write_markdown(results: dict, path: str, *, command: Optional[str] = None) -> None:
    with open(path, "w") as f:
        f.write(render_markdown(results, command=command))


# ---------------------------------------------------------------------------- PNG
def write_plot(results: dict, path: str) -> None:
    """Backward TFLOP/s against seqlen, one line per implementation, a panel per (row, mask).
    Solid lines: every measured cell passed the bitwise check; dashed: at least one did not."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = index_cells(results)
    rows = list(dict.fromkeys(p["row"] for p in results["points"]))
    masks = list(dict.fromkeys(p["mask"] for p in results["points"]))
    names = impl_names(results)
    fig, axes = plt.subplots(len(rows), len(masks), figsize=(5.5 * len(masks), 3.8 * len(rows)),
                             squeeze=False, sharex=True)
    colors = plt.get_cmap("tab20").colors
    for r, row in enumerate(rows):
        for m, mask in enumerate(masks):
            ax = axes[r][m]
            points = [p for p in results["points"] if p["row"] == row and p["mask"] == mask]
            for n, name in enumerate(names):
                xs, ys, det = [], [], True
                for p in points:
                    value = ok_value(cells, p["key"], name, "bwd_tflops")
                    if value is not None:
                        xs.append(p["seqlen"])
                        ys.append(value)
                        det = det and bool(cells[(p["key"], name)].get("deterministic"))
                if xs:
                    ax.plot(xs, ys, marker="o", markersize=3,
                            color="black" if name == "dash-auto" else colors[n % len(colors)],
                            linestyle="-" if det else "--", linewidth=2.0 if name == "dash-auto" else 1.2,
                            label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{row}, {mask}")
            ax.set_ylabel("backward TFLOP/s")
            ax.grid(True, alpha=0.3)
            if points:
                ax.set_xticks([p["seqlen"] for p in points])
                ax.set_xticklabels([str(p["seqlen"]) for p in points], fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("seqlen (16k tokens per point)")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="center left", bbox_to_anchor=(1.0, 0.5),
                   fontsize=8, title="solid: checked deterministic")
    env = results["env"]
    fig.suptitle(f"dash-bench backward, {env.get('gpu') or 'CPU'}, torch {env.get('torch')}, {env.get('date')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def report_paths(out_dir: str, stem: str = "results") -> dict:
    """{json, md, png: path} of the reports `write_reports` writes into out_dir."""
    return {ext: os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "md", "png")}


def write_reports(results: dict, out_dir: str, *, command: Optional[str] = None, stem: str = "results") -> dict:
    """results.json, results.md, results.png in out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = report_paths(out_dir, stem)
    summary = dropout_summary(results)
    write_json(results if summary is None else dict(results, dropout=summary), paths["json"])
    write_markdown(results, paths["md"], command=command)
    try:
        write_plot(results, paths["png"])
    except Exception as exc:   # the figures are in the JSON and the table; a plot failure must not lose them
        print(f"dash-bench: could not draw {paths['png']}: {type(exc).__name__}: {exc}")
        paths["png"] = None
    return paths
