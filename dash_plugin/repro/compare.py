"""Compare two fingerprinted training runs: the first step where they differ, and what differs there.

A run directory (written by examples/train_accelerate.py or hf_callback.FingerprintCallback) holds meta.json,
steps.jsonl (one record per step: exact loss / grad norm / lr, a digest per parameter and per gradient),
model.safetensors (the final weights) and final.json (the weight file's sha256 and a digest per tensor,
written last). Timing fields (tokens/s, MFU) are never compared.

The verdict must never claim more than was checked, so a run is refused (RunFileError, exit 2 in the CLI)
when any of these is missing, unreadable or malformed, when it is marked INCOMPLETE, when its weight file
does not match its final.json, when its log does not start and end at the steps the run started and ended at,
or when there is no step to compare; and the same directory given twice is refused. The weight files
themselves are read: their sha256 and a digest of every tensor in them are compared, not only what
final.json says. At each step only what both runs recorded is compared; the notes say what was not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dash_plugin.repro.fingerprint import (FINAL_FILE, WEIGHTS_FILE, RunFileError, exact, file_sha256, from_exact,
                                           layer_of, read_json, read_jsonl, tensor_digest)

EXACT_FIELDS = ("loss", "grad_norm", "lr")  # exact hex floats, as float.hex writes them
NONFINITE = ("nan", "inf", "-inf")  # float.hex's spellings of the values that are not finite
DIGEST_FIELDS = ("params", "grads")  # name -> digest
# Arguments that may differ between two runs of the same training.
FREE_ARGS = {"out", "progress", "stop_at", "resume_from"}


@dataclass
class StepDifference:
    step: int
    scalars: dict[str, tuple[str, str]]  # field -> (A, B), only the differing ones
    tensors: dict[str, list[str]]  # "params" / "grads" -> differing tensor names, in model order
    # The order in which the run's backward produced its gradients (meta.json's "grad_order"), if recorded
    backward_order: list[str] = field(default_factory=list)

    def describe(self, limit: int = 4) -> str:
        parts = [f"{k} {a} vs {b}" for k, (a, b) in self.scalars.items()]
        for kind, names in self.tensors.items():
            if names:
                what = "weights" if kind == "params" else "grads (in backward order)"
                if kind == "grads":
                    # The first name shown is the earliest computed gradient that differs, i.e. where the
                    # difference entered: in the recorded backward order, else model order reversed (the
                    # backward computes the last layers' gradients first).
                    names = in_backward_order(names, self.backward_order)
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
    # The first compared step where both runs recorded NaN or inf (a diverged training), and the values there
    nonfinite: StepDifference | None = None

    @property
    def identical(self) -> bool:
        return self.first is None and self.steps_a == self.steps_b and self.final_equal

    def verdict(self) -> str:
        if self.identical:
            weights = "weights" if self.weight_files else "weight digests (no weight file saved)"
            verdict = f"IDENTICAL: 2 runs, {self.steps_a} steps, {self._checked()}/{weights} bit-identical"
            if self.nonfinite is not None:  # reproducible, but not a healthy training: say so in the verdict
                values = ", ".join(f"{k} {a}" for k, (a, _) in self.nonfinite.scalars.items())
                verdict += f", but both runs hit NaN/inf from step {self.nonfinite.step} ({values})"
            return verdict
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
    end_checked: bool = True  # False: the run recorded no step it ended at, so a lost last record cannot show


def _exact_problem(key: str, value) -> str | None:
    """What is wrong with an exact value, or None. Exact values are compared as written, so each must be
    float.hex's own spelling of its value (what the writers' `exact` gives, 'inf' and 'nan' included): then
    equal strings are equal bits, and another spelling of the same value cannot pass for a difference."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            canonical = float.fromhex(value).hex()
        except ValueError:
            canonical = None
        if canonical == value:
            return None
        if canonical is not None:
            return (f"'{key}' is {value!r}, not float.hex's spelling of that value ({canonical!r}): exact values "
                    f"are compared as written")
    return f"'{key}' must be a hex float string or null (has {value!r}); float.hex writes e.g. {exact(2.5)!r}"


def _step_problem(record) -> str | None:
    """What is wrong with one line of steps.jsonl, or None."""
    if not isinstance(record, dict):
        return f"a step record must be a JSON object, not {type(record).__name__}"
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return f"a step record needs an integer 'step' (has {step!r})"
    for key in EXACT_FIELDS:
        problem = _exact_problem(key, record.get(key))
        if problem:
            return problem
    for key in DIGEST_FIELDS:
        digests = record.get(key, {})
        if not isinstance(digests, dict):
            return f"'{key}' must be an object of tensor name -> digest (has {type(digests).__name__})"
        for name, digest in digests.items():
            if not isinstance(digest, str):  # digests are compared with ==: 1 and true would be equal
                return f"'{key}' must map tensor names to digest strings ({name!r} has {digest!r})"
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
    for k, (before, after) in enumerate(zip(steps, steps[1:]), start=1):
        if after["step"] != before["step"] + 1:
            # Both writers (the training example, FingerprintCallback) record every optimizer step: a gap
            # is a lost record, and two runs that lost the same one would otherwise compare equal.
            raise RunFileError(f"{path / STEPS} line {_record_line(path / STEPS, k)}: step {after['step']} follows "
                               f"step {before['step']}; every step must follow the one before it (step + 1)")
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
    if path.is_dir():
        raise RunFileError(f"{path} is a directory, not the JSON file a run writes")
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
    first = meta.get("first_step", 1)
    if not isinstance(first, int) or isinstance(first, bool) or first < 1:
        raise RunFileError(f"{path / META}: 'first_step' must be the integer step (1 or more) the run's log starts "
                           f"at (has {first!r})")
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
    last = final.get("last_step")
    if last is not None and (not isinstance(last, int) or isinstance(last, bool)):
        raise RunFileError(f"{path / FINAL}: 'last_step' must be the integer step the run ended at (has {last!r})")
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


def _check_log_start(path: Path, steps: list[dict], meta: dict) -> None:
    """A run's log must start at the step the run started at: meta.json's 'first_step' (FingerprintCallback, for
    a Trainer resumed from a checkpoint), else step 1 (the training script's log always starts there, a resumed
    run's too). A record lost at the start of both logs would leave them aligned, and pass for shorter runs."""
    first = meta.get("first_step", 1)
    if steps and steps[0]["step"] != first:
        source = (f"{path / META} records 'first_step': {first}" if "first_step" in meta
                  else f"{path / META} records no 'first_step', so the log must start at step 1")
        what = ("the records before it are lost" if steps[0]["step"] > first
                else "it holds steps before the run started")
        raise RunFileError(f"{path / STEPS} line {_record_line(path / STEPS, 0)}: the log starts at step "
                           f"{steps[0]['step']}, but the run started at step {first} ({source}): {what}")


def _check_log_end(path: Path, steps: list[dict], meta: dict, final: dict) -> bool:
    """A finished run's log must end at the step the run ended at: a record lost at the end leaves no gap to
    see, and would pass for a shorter run. That step is final.json's 'last_step' (FingerprintCallback: the
    Trainer may stop before max_steps) or else meta.json's args.steps (the training script writes final.json
    only after its last step). Returns False for a run that recorded neither (a FingerprintCallback run written
    before 'last_step' existed): its end is not checked, and compare says so in a note."""
    steps_arg = meta.get("args", {}).get("steps")
    if "last_step" in final:
        last, source = final["last_step"], f"{path / FINAL} records 'last_step': {final['last_step']}"
    elif isinstance(steps_arg, int) and not isinstance(steps_arg, bool):
        last, source = steps_arg, f"{path / META} records args.steps = {steps_arg}"
    else:
        return False
    if steps and steps[-1]["step"] != last:
        what = ("the records after it are lost" if steps[-1]["step"] < last
                else "it holds steps after the run's end")
        raise RunFileError(f"{path / STEPS} ends at step {steps[-1]['step']}, but the run ended at step {last} "
                           f"({source}): {what}")
    return True


def load_run(path) -> Run:
    """A complete run directory, every file checked; RunFileError (naming the file) for anything wrong."""
    path = Path(path)
    marker = path / INCOMPLETE
    if marker.exists() or marker.is_symlink():  # whatever it is (a file, a directory), it marks the run
        reason = (marker.read_text().strip() if marker.is_file() else "") or "no reason given"
        raise RunFileError(f"{path} is an incomplete run ({marker}: {reason})")
    steps = load_steps(path)
    meta = _read_meta(path)
    final = _read_final(path)
    end_checked = _check_log_end(path, steps, meta, final)
    if final["weights_file"] is None:  # written without a weight file: the recorded digests are all there is
        return Run(path, meta, steps, None, final["tensors"], end_checked)
    sha, digests = _check_weights(path, final)
    return Run(path, meta, steps, sha, digests, end_checked)


# --- comparing ------------------------------------------------------------------------------------------

def diff_step(a: dict, b: dict, order: list[str], fields: set[str]) -> StepDifference | None:
    """The differences between two records of the same step in `fields` (what both recorded); None if they
    are equal."""
    scalars = {k: (a[k], b[k]) for k in EXACT_FIELDS if k in fields and a[k] != b[k]}
    tensors = {}
    for kind in DIGEST_FIELDS:
        da, db = (a[kind], b[kind]) if kind in fields else ({}, {})
        names = [n for n in order if da.get(n) != db.get(n)]
        names += sorted(n for n in set(da) | set(db) if n not in set(order) and da.get(n) != db.get(n))
        tensors[kind] = names
    if not scalars and not any(tensors.values()):
        return None
    return StepDifference(a["step"], scalars, tensors)


def in_backward_order(names: list[str], backward_order: list[str]) -> list[str]:
    """`names` (in model order) in the order the backward produced them: by `backward_order` where it is
    recorded (names it lacks last, in reverse model order), else model order reversed."""
    if not backward_order:
        return names[::-1]
    rank = {n: i for i, n in enumerate(backward_order)}
    return sorted(names[::-1], key=lambda n: rank.get(n, len(rank)))


def param_order(meta: dict, steps: list[dict]) -> list[str]:
    """Parameter names in model order: from meta.json, else from the first step's record."""
    return meta.get("param_names") or (list(steps[0].get("params", {})) if steps else [])


def _record_line(path: Path, index: int) -> int:
    """The line number of record `index` (0 = the first) of a JSON-lines file (read_jsonl skips blank lines)."""
    with open(path) as fh:
        records = (n for n, line in enumerate(fh, start=1) if line.strip())
        return next((n for k, n in enumerate(records) if k == index), 1)



def check_aligned(run_a, steps_a: list[dict], run_b, steps_b: list[dict]) -> None:
    """Both logs must start at the same step. Each log's steps follow one another (load_steps), so then every
    step is aligned; else the log that starts later has lost its first records (or began elsewhere)."""
    if not steps_a or not steps_b or steps_a[0]["step"] == steps_b[0]["step"]:
        return
    (late, late_steps), (early, early_steps) = sorted(((Path(run_a), steps_a), (Path(run_b), steps_b)),
                                                      key=lambda run: -run[1][0]["step"])
    raise RunFileError(f"{late / STEPS} line {_record_line(late / STEPS, 0)}: the log starts at step "
                       f"{late_steps[0]['step']}, expected step {early_steps[0]['step']}, where {early / STEPS} "
                       f"starts: the logs are not aligned (records lost at the start of {late / STEPS}, or a Trainer "
                       f"run resumed from a checkpoint? compare runs that start at the same step)")


def shared_fields(steps_a: list[dict], steps_b: list[dict]) -> list[set[str]]:
    """For each step both (aligned) logs have, the fields both runs recorded there: only those are compared.
    A logged loss covers the steps since the run's previous logged loss (a Trainer with logging_steps=n logs
    the mean of the last n steps' losses), so a loss counts only where both runs also logged the previous one
    at the same step."""
    shared, last_a, last_b = [], None, None
    for a, b in zip(steps_a, steps_b):
        fields = _compared_fields(a) & _compared_fields(b)
        if last_a != last_b:
            fields.discard("loss")
        last_a = a["step"] if a.get("loss") is not None else last_a
        last_b = b["step"] if b.get("loss") is not None else last_b
        shared.append(fields)
    return shared


def first_difference(steps_a: list[dict], steps_b: list[dict], order: list[str]) -> StepDifference | None:
    """The first of the steps both (aligned) runs have where what both recorded differs; None if equal."""
    for a, b, fields in zip(steps_a, steps_b, shared_fields(steps_a, steps_b)):
        diff = diff_step(a, b, order, fields)
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
    config_a, config_b = meta_a.get("model_config"), meta_b.get("model_config")   # FingerprintCallback's
    if isinstance(config_a, dict) and isinstance(config_b, dict):
        for k in sorted(set(config_a) | set(config_b)):
            if config_a.get(k) != config_b.get(k):
                notes.append(f"model config {k} differs: {config_a.get(k)!r} vs {config_b.get(k)!r}")
    return notes


def _not_compared(steps_a: list[dict], steps_b: list[dict], shared: list[set[str]]) -> list[str]:
    """Notes on the fields a run recorded at a step but that were not compared there (the verdict counts no
    difference in them), and on NaN values, whose bits float.hex does not record."""
    notes = []
    recorded = [_compared_fields(a) | _compared_fields(b) for a, b in zip(steps_a, steps_b)]
    for key in (*EXACT_FIELDS, *DIGEST_FIELDS):
        n = sum(key in r and key not in s for r, s in zip(recorded, shared))
        if n:
            why = "recorded by one run only" + (", or logged over other steps" if key == "loss" else "")
            notes.append(f"{key} not compared at {n} of {len(shared)} steps ({why})")
    for key in EXACT_FIELDS:
        nan = [a["step"] for a, b, s in zip(steps_a, steps_b, shared) if key in s and a[key] == b[key] == "nan"]
        if nan:
            notes.append(f"{key} is NaN in both runs at {len(nan)} of {len(shared)} steps (first: step {nan[0]}): "
                         f"float.hex records no sign or payload of a NaN, so those are equal as NaNs, not as bits")
    return notes


def first_nonfinite(steps_a: list[dict], steps_b: list[dict], shared: list[set[str]]) -> StepDifference | None:
    """The first step where both runs recorded the same NaN or inf loss, grad norm or lr, with those values."""
    for a, b, fields in zip(steps_a, steps_b, shared):
        found = {k: (a[k], b[k]) for k in EXACT_FIELDS if k in fields and a[k] == b[k] and a[k] in NONFINITE}
        if found:
            return StepDifference(a["step"], found, {})
    return None


def refuse_one_run_twice(run_a, run_b, verb: str) -> None:
    """One run checked against itself proves nothing (a typo, `..`, a symlink to the same directory)."""
    if Path(run_a).exists() and Path(run_b).exists() and os.path.samefile(run_a, run_b):
        raise RunFileError(f"{run_a} and {run_b} are the same run directory: {verb} two different runs")


def compare_runs(run_a, run_b) -> Comparison:
    refuse_one_run_twice(run_a, run_b, "compare")
    a, b = load_run(run_a), load_run(run_b)
    for run in (a, b):
        if not run.steps:  # zero steps would make every check vacuous
            raise RunFileError(f"{run.path / STEPS} has no steps: there is nothing to compare")
    check_aligned(run_a, a.steps, run_b, b.steps)
    for run in (a, b):  # aligned logs may still both have lost their first records
        _check_log_start(run.path, run.steps, run.meta)
    shared = shared_fields(a.steps, b.steps)
    if not any(shared):
        raise RunFileError(f"{a.path / STEPS} and {b.path / STEPS} have nothing in common to compare at any step "
                           f"(no loss, grad norm, lr or digests recorded by both)")
    order = param_order(a.meta, a.steps)
    first = first_difference(a.steps, b.steps, order)
    if first is not None and a.meta.get("grad_order") == b.meta.get("grad_order"):
        first.backward_order = list(a.meta.get("grad_order") or [])
    ta, tb = a.tensors, b.tensors
    final_tensors = [n for n in sorted(set(ta) | set(tb), key=lambda n: (n not in order, order.index(n)
                                                                         if n in order else 0, n))
                     if ta.get(n) != tb.get(n)]
    weight_files = a.weights_sha256 is not None and b.weights_sha256 is not None
    # Files also differ where the tensors agree but the header does (names, metadata).
    final_equal = not final_tensors and (a.weights_sha256 == b.weights_sha256 if weight_files else True)
    notes = _notes(a.meta, b.meta) + _not_compared(a.steps, b.steps, shared)
    for name, run in (("A", a), ("B", b)):
        if not run.end_checked:
            notes.append(f"run {name}'s last record is not checked: neither {run.path / FINAL} ('last_step') nor "
                         f"{run.path / META} (args.steps) says at which step the run ended (a FingerprintCallback "
                         f"run written before final.json had 'last_step'?), so a record lost at the end of "
                         f"{run.path / STEPS} would not show")
        if run.weights_sha256 is None:
            unread = f"; the {WEIGHTS_FILE} in it is not read" if (run.path / WEIGHTS_FILE).exists() else ""
            notes.append(f"run {name}'s {run.path / FINAL} names no weight file (\"weights_file\": null): the final "
                         f"weights are compared by their recorded digests only{unread}")
    coverage = {key: sum(key in fields for fields in shared) for key in (*EXACT_FIELDS, *DIGEST_FIELDS)}
    return Comparison(str(run_a), str(run_b), len(a.steps), len(b.steps), first, final_equal, final_tensors, notes,
                      weight_files, coverage, first_nonfinite(a.steps, b.steps, shared))
