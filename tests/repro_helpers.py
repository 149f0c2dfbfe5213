"""Hand-made run directories for the dash-repro tests: the files a training run writes (meta.json, steps.jsonl,
model.safetensors, final.json) with real digests, in milliseconds and without training.

Also used by stand-in training scripts that tests start as subprocesses (tests/ is put on sys.path there)."""

import json
from pathlib import Path

import torch

from dash_plugin.repro.fingerprint import exact, write_final

NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
         "lm_head.weight"]


def final_weights(change: bool = False) -> dict[str, torch.Tensor]:
    """Small tensors, one per name; change=True adds 1 to one element of layer 1's tensor."""
    weights = {n: torch.arange(6, dtype=torch.float32).view(2, 3) + i for i, n in enumerate(NAMES)}
    if change:
        weights[NAMES[2]][0, 0] += 1
    return weights


def write_run(path, steps, *, change=None, final_change=False):
    """A fake complete run: `change=(step, kind, name)` alters one digest (or the loss) from that step on;
    final_change=True gives other final weights."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # args.steps as the training script records it: compare checks that the log ends there.
    (path / "meta.json").write_text(json.dumps({"args": {"seed": 0, "steps": steps, "out": str(path)},
                                                "param_names": NAMES}))
    with open(path / "steps.jsonl", "w") as fh:
        for s in range(1, steps + 1):
            rec = {"step": s, "loss": exact(5.0 - s / 10), "grad_norm": exact(1.5), "lr": exact(1e-3),
                   "tokens_per_s": 1000.0 + s * (path.name == "b"),  # timing differs: never compared
                   "params": {n: f"p{s}{i}" for i, n in enumerate(NAMES)},
                   "grads": {n: f"g{s}{i}" for i, n in enumerate(NAMES)}}
            if change and s >= change[0]:
                if change[1] == "loss":
                    rec["loss"] = exact(5.0 - s / 10 + 1e-7)
                else:
                    rec[change[1]][change[2]] += "x"
            fh.write(json.dumps(rec) + "\n")
    write_final(path, final_weights(final_change))
    return path


def edit_json(path, edit):
    """Rewrite the JSON file at `path` after edit(value) has changed the value in place."""
    path = Path(path)
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def edit_steps(run, edit):
    """Rewrite a run's steps.jsonl after edit(records) has changed the list of records in place."""
    path = Path(run) / "steps.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    edit(records)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def compare_cli(capsys, a, b):
    """(exit code, stdout, stderr) of `dash-repro compare A B`."""
    from dash_plugin.repro.cli import main
    rc = main(["compare", str(a), str(b)])
    out, err = capsys.readouterr()
    return rc, out, err
