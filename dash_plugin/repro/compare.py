"""Compare two fingerprinted training runs: the first step where they differ, and what differs there.

A run directory (written by examples/train_accelerate.py) holds meta.json, steps.jsonl (one record per step:
exact loss / grad norm / lr, a digest per parameter and per gradient) and final.json (the final weights' sha256
and per-tensor digests). Timing fields (tokens/s, MFU) are never compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dash_plugin.repro.fingerprint import from_exact, layer_of, read_jsonl

EXACT_FIELDS = ("loss", "grad_norm", "lr")  # exact hex floats
DIGEST_FIELDS = ("params", "grads")  # name -> digest
# Arguments that may differ between two runs of the same training.
FREE_ARGS = {"out", "progress", "stop_at", "resume_from"}


@dataclass
class StepDifference:
    step: int
    scalars: dict[str, tuple[str, str]]  # field -> (A, B), only the differing ones
    tensors: dict[str, list[str]]  # "params" / "grads" -> differing tensor names, in model order

    def describe(self, limit: int = 4) -> str:
        parts = [f"{k} {a} vs {b}" for k, (a, b) in self.scalars.items()]
        for kind, names in self.tensors.items():
            if names:
                what = "weights" if kind == "params" else "grads (in backward order)"
                if kind == "grads":
                    # The backward computes the last layers' gradients first: the first name shown is
                    # the earliest computed gradient that differs, i.e. where the difference entered.
                    names = names[::-1]
                shown = ", ".join(f"{n} ({layer_of(n)})" for n in names[:limit])
                more = f" and {len(names) - limit} more" if len(names) > limit else ""
                layers = sorted({layer_of(n) for n in names}, key=_layer_key)
                parts.append(f"{what} of {len(names)} tensors in {', '.join(layers)}: {shown}{more}")
        return "; ".join(parts) if parts else "no difference"


@dataclass
class Comparison:
    run_a: str
    run_b: str
    steps_a: int
    steps_b: int
    first: StepDifference | None  # the first step with any difference
    final_equal: bool | None  # None: a run has no final weights
    final_tensors: list[str] = field(default_factory=list)  # final tensors that differ
    notes: list[str] = field(default_factory=list)  # argument / environment mismatches

    @property
    def identical(self) -> bool:
        return self.first is None and self.steps_a == self.steps_b and self.final_equal is not False

    def verdict(self) -> str:
        if self.identical:
            weights = "weights" if self.final_equal else "weights (no final weights saved)"
            return f"IDENTICAL: 2 runs, {self.steps_a} steps, losses/grads/{weights} bit-identical"
        if self.first is not None:
            return f"DIFFERENT: first difference at step {self.first.step}: {self.first.describe()}"
        if self.steps_a != self.steps_b:
            return (f"DIFFERENT: run A has {self.steps_a} steps, run B {self.steps_b}; "
                    f"the first {min(self.steps_a, self.steps_b)} are bit-identical")
        return (f"DIFFERENT: all {self.steps_a} steps equal but the final weights differ: "
                f"{', '.join(self.final_tensors[:4]) or 'file hash'}")

    def report(self) -> str:
        lines = [f"A: {self.run_a} ({self.steps_a} steps)", f"B: {self.run_b} ({self.steps_b} steps)"]
        lines += [f"note: {n}" for n in self.notes]
        if self.first is not None:
            lines.append(f"first differing step: {self.first.step}")
            for k, (a, b) in self.first.scalars.items():
                lines.append(f"  {k}: {a} ({from_exact(a)!r}) vs {b} ({from_exact(b)!r})")
            for kind, names in self.first.tensors.items():
                by_layer: dict[str, list[str]] = {}
                for n in names:
                    by_layer.setdefault(layer_of(n), []).append(n)
                for layer in sorted(by_layer, key=_layer_key):
                    lines.append(f"  {kind} differ in {layer}: {', '.join(by_layer[layer])}")
        if self.final_equal is not None:
            lines.append("final weights: " + ("bit-identical" if self.final_equal else
                                              f"differ ({len(self.final_tensors)} tensors)"))
        lines.append(self.verdict())
        return "\n".join(lines)


def _layer_key(layer: str):
    """Order: embeddings, layer 0, 1, ..., then the rest (final norm, lm_head)."""
    if layer == "embeddings":
        return (0, 0, "")
    if layer.startswith("layer "):
        return (1, int(layer.split()[1]), "")
    return (2, 0, layer)


def load_run(path) -> tuple[dict, list[dict], dict | None]:
    path = Path(path)
    if not (path / "steps.jsonl").is_file():
        raise FileNotFoundError(f"{path} is not a run directory: it has no steps.jsonl "
                                f"(write one with examples/train_accelerate.py --out {path})")
    meta = json.loads((path / "meta.json").read_text()) if (path / "meta.json").is_file() else {}
    final = json.loads((path / "final.json").read_text()) if (path / "final.json").is_file() else None
    return meta, read_jsonl(path / "steps.jsonl"), final


def diff_step(a: dict, b: dict, order: list[str]) -> StepDifference | None:
    """The differences between two records of the same step; None if they are equal."""
    scalars = {k: (a.get(k), b.get(k)) for k in EXACT_FIELDS if a.get(k) != b.get(k)}
    tensors = {}
    for kind in DIGEST_FIELDS:
        da, db = a.get(kind, {}), b.get(kind, {})
        names = [n for n in order if da.get(n) != db.get(n)]
        names += sorted(n for n in set(da) | set(db) if n not in set(order) and da.get(n) != db.get(n))
        tensors[kind] = names
    if not scalars and not any(tensors.values()):
        return None
    return StepDifference(a["step"], scalars, tensors)


def compare_runs(run_a, run_b) -> Comparison:
    meta_a, steps_a, final_a = load_run(run_a)
    meta_b, steps_b, final_b = load_run(run_b)
    order = meta_a.get("param_names") or (list(steps_a[0].get("params", {})) if steps_a else [])
    notes = []
    args_a, args_b = meta_a.get("args", {}), meta_b.get("args", {})
    for k in sorted((set(args_a) | set(args_b)) - FREE_ARGS):
        if args_a.get(k) != args_b.get(k):
            notes.append(f"argument {k} differs: {args_a.get(k)!r} vs {args_b.get(k)!r}")
    for k in ("data_sha256", "device_name", "torch", "num_processes", "mixed_precision"):
        if k in meta_a and k in meta_b and meta_a[k] != meta_b[k]:
            notes.append(f"{k} differs: {meta_a[k]!r} vs {meta_b[k]!r}")

    first = None
    for a, b in zip(steps_a, steps_b):
        if a["step"] != b["step"]:
            raise ValueError(f"step numbering differs ({a['step']} vs {b['step']}): logs are not aligned")
        first = diff_step(a, b, order)
        if first is not None:
            break
    final_equal, final_tensors = None, []
    if final_a is not None and final_b is not None:
        ta, tb = final_a["tensors"], final_b["tensors"]
        final_tensors = [n for n in sorted(set(ta) | set(tb), key=lambda n: (n not in order, order.index(n)
                                                                             if n in order else 0, n))
                         if ta.get(n) != tb.get(n)]
        final_equal = final_a["weights_sha256"] == final_b["weights_sha256"] and not final_tensors
    return Comparison(str(run_a), str(run_b), len(steps_a), len(steps_b), first, final_equal, final_tensors, notes)
