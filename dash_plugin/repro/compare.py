"""Compare two fingerprinted training runs: the first step where they differ, and what differs there.

A run directory (written by examples/train_accelerate.py or hf_callback.FingerprintCallback) holds meta.json,
steps.jsonl (one record per step: exact loss / grad norm / lr, a digest per parameter and per gradient),
model.safetensors (the final weights) and final.json (the weight file's sha256 and a digest per tensor,
written last). Timing fields (tokens/s, MFU) are never compared.

The verdict must never claim more than was checked, so a run is refused (RunFileError, exit 2 in the CLI)
when any of these is missing, unreadable or malformed, when it is marked INCOMPLETE, when its weight file
does not match its final.json, or when there is no step to compare. The weight files themselves are read:
their sha256 and a digest of every tensor in them are compared, not only what final.json says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dash_plugin.repro.fingerprint import (FINAL_FILE, WEIGHTS_FILE, RunFileError, file_sha256, from_exact,
                                           layer_of, read_json, read_jsonl, tensor_digest)

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
    final_equal: bool  # the final weights (files and per-tensor digests) are equal
    final_tensors: list[str] = field(default_factory=list)  # final tensors that differ
    notes: list[str] = field(default_factory=list)  # argument / environment mismatches
    weight_files: bool = True  # False: a run saved no weight file, only the digests were compared
    # field -> the number of compared steps where both runs recorded it (what the verdict may claim)
    coverage: dict[str, int] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.first is None and self.steps_a == self.steps_b and self.final_equal

    def verdict(self) -> str:
        if self.identical:
            weights = "weights" if self.weight_files else "weight digests (no weight file saved)"
            return f"IDENTICAL: 2 runs, {self.steps_a} steps, {self._checked()}/{weights} bit-identical"
        if self.first is not None:
            return f"DIFFERENT: first difference at step {self.first.step}: {self.first.describe()}"
        if self.steps_a != self.steps_b:
            return (f"DIFFERENT: run A has {self.steps_a} steps, run B {self.steps_b}; "
                    f"the first {min(self.steps_a, self.steps_b)} are bit-identical")
        return (f"DIFFERENT: all {self.steps_a} steps equal but the final weights differ: "
                f"{', '.join(self.final_tensors[:4]) or 'file hash'}")

    def _checked(self) -> str:
        """'losses/grads', naming only what both runs recorded, and at how many steps where not at all."""
        parts = []
        for key, name in (("loss", "losses"), ("grads", "grads")):
            n = self.coverage.get(key, self.steps_a)
            if n:
                parts.append(name if n == self.steps_a else f"{name} (at {n} of {self.steps_a} steps)")
        return "/".join(parts) or "per-step records"

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


# --- reading a run directory ------------------------------------------------------------------------------

STEPS, META, FINAL = "steps.jsonl", "meta.json", FINAL_FILE
INCOMPLETE = "INCOMPLETE"  # written by `dash-repro run` while a run trains; left with the reason if it did not end


@dataclass
class Run:
    path: Path
    meta: dict
    steps: list[dict]
    weights_sha256: str | None  # of the weight file, as read now; None where the run saved none
    tensors: dict[str, str]  # name -> digest of every final tensor (computed from the weight file)


def _step_problem(record) -> str | None:
    """What is wrong with one line of steps.jsonl, or None."""
    if not isinstance(record, dict):
        return f"a step record must be a JSON object, not {type(record).__name__}"
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return f"a step record needs an integer 'step' (has {step!r})"
    for key in EXACT_FIELDS:
        if not isinstance(record.get(key), (str, type(None))):
            return f"'{key}' must be a hex float string or null (has {record[key]!r})"
    for key in DIGEST_FIELDS:
        if not isinstance(record.get(key, {}), dict):
            return f"'{key}' must be an object of tensor name -> digest (has {type(record[key]).__name__})"
    return None


def load_steps(path) -> list[dict]:
    """The step records of a run directory, checked (an integer step on each, steps increasing)."""
    path = Path(path)
    if not path.is_dir():
        raise RunFileError(f"{path} is not a run directory: {'no such directory' if not path.exists() else 'a file'}")
    if not (path / STEPS).is_file():
        raise RunFileError(f"{path} is not a run directory: it has no {STEPS} "
                           f"(write one with examples/train_accelerate.py --out {path})")
    steps = read_jsonl(path / STEPS, check=_step_problem)
    for before, after in zip(steps, steps[1:]):
        if after["step"] != before["step"] + 1:
            # Both writers (the training example, FingerprintCallback) record every optimizer step: a gap
            # is a lost record, and two runs that lost the same one would otherwise compare equal.
            raise RunFileError(f"{path / STEPS}: step {after['step']} follows step {before['step']}; "
                               f"every step must follow the one before it (step + 1)")
    for record in steps:
        if not _compared_fields(record):
            raise RunFileError(f"{path / STEPS}: step {record['step']} holds nothing to compare (no loss, grad "
                               f"norm or lr, no parameter or gradient digests)")
    return steps


def _compared_fields(record: dict) -> set[str]:
    """The fields of a step record that carry something to compare."""
    return ({k for k in EXACT_FIELDS if record.get(k) is not None}
            | {k for k in DIGEST_FIELDS if record.get(k)})


def _read_object(path: Path, what: str) -> dict:
    if not path.is_file():
        raise RunFileError(f"{path} is missing: {what}")
    value = read_json(path)
    if not isinstance(value, dict):
        raise RunFileError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _read_meta(path: Path) -> dict:
    meta = _read_object(path / META, "every run writes one when it starts (arguments, device, versions)")
    if not isinstance(meta.get("args", {}), dict):
        raise RunFileError(f"{path / META}: 'args' must be an object of argument -> value")
    names = meta.get("param_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RunFileError(f"{path / META}: 'param_names' must be a list of parameter names")
    return meta


def _read_final(path: Path) -> dict:
    """final.json, checked: 'tensors' (name -> digest), and 'weights_file' (set where an older run has none)
    with 'weights_sha256'."""
    hint = "the run did not finish"
    if (path / "checkpoint").is_dir():
        hint += f" (it stopped early: continue it with --resume-from {path / 'checkpoint'})"
    final = _read_object(path / FINAL, hint)
    tensors = final.get("tensors")
    if not isinstance(tensors, dict) or not tensors or not all(isinstance(v, str) for v in tensors.values()):
        raise RunFileError(f"{path / FINAL}: 'tensors' must be a non-empty object of tensor name -> digest "
                           f"(has {tensors!r:.60})")
    weights_file = final.setdefault("weights_file", WEIGHTS_FILE)  # older runs always saved model.safetensors
    if weights_file not in (WEIGHTS_FILE, None):
        raise RunFileError(f"{path / FINAL}: 'weights_file' must be {WEIGHTS_FILE!r} or null, "
                           f"not {weights_file!r}")
    if weights_file and not isinstance(final.get("weights_sha256"), str):
        raise RunFileError(f"{path / FINAL}: 'weights_sha256' must be the sha256 of {WEIGHTS_FILE}")
    return final


def _digests_of(weights: Path) -> dict[str, str]:
    """A digest of every tensor in a safetensors file, one tensor in memory at a time."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(weights, framework="pt") as f:
            return {name: tensor_digest(f.get_tensor(name)) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise RunFileError(f"{weights}: not a readable safetensors file ({e})") from None


def _check_weights(path: Path, final: dict) -> tuple[str, dict[str, str]]:
    """Read and hash the weight file; it must be the one final.json describes. Returns (sha256, digests)."""
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise RunFileError(f"{weights} is missing: {path / FINAL} says the run saved its final weights there")
    digests = _digests_of(weights)
    recorded = final["tensors"]
    changed = [n for n in sorted(set(digests) | set(recorded)) if digests.get(n) != recorded.get(n)]
    if changed:
        raise RunFileError(f"{weights} does not hold the weights {path / FINAL} describes: {len(changed)} "
                           f"tensors differ from the recorded digests ({', '.join(changed[:3])}"
                           f"{', ...' if len(changed) > 3 else ''}); the file changed after the run wrote it")
    sha = file_sha256(weights)
    if sha != final["weights_sha256"]:
        raise RunFileError(f"{weights}: sha256 {sha} but {path / FINAL} records {final['weights_sha256']}; "
                           f"the file changed after the run wrote it")
    return sha, digests


def load_run(path) -> Run:
    """A complete run directory, every file checked; RunFileError (naming the file) for anything wrong."""
    path = Path(path)
    if (path / INCOMPLETE).is_file():
        reason = (path / INCOMPLETE).read_text().strip() or "no reason given"
        raise RunFileError(f"{path} is an incomplete run ({path / INCOMPLETE}: {reason})")
    steps = load_steps(path)
    meta = _read_meta(path)
    final = _read_final(path)
    if final["weights_file"] is None:  # written without a weight file: the recorded digests are all there is
        return Run(path, meta, steps, None, final["tensors"])
    sha, digests = _check_weights(path, final)
    return Run(path, meta, steps, sha, digests)


# --- comparing ------------------------------------------------------------------------------------------

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


def param_order(meta: dict, steps: list[dict]) -> list[str]:
    """Parameter names in model order: from meta.json, else from the first step's record."""
    return meta.get("param_names") or (list(steps[0].get("params", {})) if steps else [])


def first_difference(steps_a: list[dict], steps_b: list[dict], order: list[str]) -> StepDifference | None:
    """The first of the steps both runs have where they differ; None if those steps are equal."""
    for a, b in zip(steps_a, steps_b):
        if a["step"] != b["step"]:
            raise RunFileError(f"step numbering differs ({a['step']} vs {b['step']}): the logs are not aligned")
        diff = diff_step(a, b, order)
        if diff is not None:
            return diff
    return None


def _notes(meta_a: dict, meta_b: dict) -> list[str]:
    """Arguments and environment that differ between the runs (reported, not part of the verdict)."""
    notes = []
    args_a, args_b = meta_a.get("args", {}), meta_b.get("args", {})
    for k in sorted((set(args_a) | set(args_b)) - FREE_ARGS):
        if args_a.get(k) != args_b.get(k):
            notes.append(f"argument {k} differs: {args_a.get(k)!r} vs {args_b.get(k)!r}")
    for k in ("data_sha256", "device_name", "torch", "num_processes", "mixed_precision"):
        if k in meta_a and k in meta_b and meta_a[k] != meta_b[k]:
            notes.append(f"{k} differs: {meta_a[k]!r} vs {meta_b[k]!r}")
    return notes


def compare_runs(run_a, run_b) -> Comparison:
    a, b = load_run(run_a), load_run(run_b)
    for run in (a, b):
        if not run.steps:  # zero steps would make every check vacuous
            raise RunFileError(f"{run.path / STEPS} has no steps: there is nothing to compare")
    order = param_order(a.meta, a.steps)
    first = first_difference(a.steps, b.steps, order)
    ta, tb = a.tensors, b.tensors
    final_tensors = [n for n in sorted(set(ta) | set(tb), key=lambda n: (n not in order, order.index(n)
                                                                         if n in order else 0, n))
                     if ta.get(n) != tb.get(n)]
    weight_files = a.weights_sha256 is not None and b.weights_sha256 is not None
    # Files also differ where the tensors agree but the header does (names, metadata).
    final_equal = not final_tensors and (a.weights_sha256 == b.weights_sha256 if weight_files else True)
    notes = _notes(a.meta, b.meta)
    if not weight_files:
        notes.append("a run saved no weight file: its final weights are compared by their recorded digests only")
    both = [_compared_fields(x) & _compared_fields(y) for x, y in zip(a.steps, b.steps)]
    coverage = {key: sum(key in fields for fields in both) for key in (*EXACT_FIELDS, *DIGEST_FIELDS)}
    return Comparison(str(run_a), str(run_b), len(a.steps), len(b.steps), first, final_equal, final_tensors, notes,
                      weight_files, coverage)
