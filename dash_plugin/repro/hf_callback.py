"""Fingerprints for the Hugging Face `Trainer`: a callback that writes the run-directory format
`dash-repro compare` reads (meta.json, steps.jsonl, final.json + model.safetensors; with save_weights=False no
weight file, and compare then says that it compared the final weights by their digests only).

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[FingerprintCallback("runs/a")])

Per step: the digests of the parameters the step starts from, of the gradients the optimizer applies (after
clipping: the Trainer calls no callback between its backward and its clipping, so where clipping acts, a
difference that changes the norm shows in every gradient), and the logged loss / grad norm / learning rate as
exact hex floats. With `logging_steps=1` the logged loss is the step's loss; with larger values only logged steps
carry one (the mean loss of the steps since the previous log), and the others have null there. A run resumed
from a checkpoint into its own directory keeps the records up to the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from dash_plugin.repro.fingerprint import (clear_final, exact, grad_digests, param_digests, read_jsonl,
                                           write_final, write_jsonl)

# TrainingArguments that define the training (compared between runs); paths and names are left out.
_KEY_ARGS = ("seed", "data_seed", "full_determinism", "learning_rate", "max_steps", "num_train_epochs",
             "per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "weight_decay",
             "lr_scheduler_type", "warmup_steps", "optim", "bf16", "fp16", "logging_steps")


def _model_config(model) -> dict | None:
    """The model's config as JSON values (compare notes where two runs' differ), without the fields that
    name the checkpoint or the library rather than the model. `dash_attention` (the schedule and mode a
    config may carry) stays: two runs that differ there differ in what they ran."""
    try:
        config = json.loads(model.config.to_json_string(use_diff=False))
    except (AttributeError, TypeError, ValueError):
        return None
    for k in ("_name_or_path", "transformers_version", "_attn_implementation_autoset"):
        config.pop(k, None)
    return config


class FingerprintCallback(TrainerCallback):
    def __init__(self, out_dir, save_weights: bool = True):
        self.out = Path(out_dir)
        self.save_weights = save_weights
        self._fh = None
        self._pending: dict[int, dict] = {}  # step -> record waiting for its logged loss

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        clear_final(self.out)
        names = [n for n, _ in model.named_parameters()]
        # first_step: a run resumed from a checkpoint (global_step already set) logs from there on, after
        # the records of the steps up to the checkpoint where this directory holds them all.
        kept, first_step = self._records_before(state.global_step)
        meta = {"args": {k: getattr(args, k, None) for k in _KEY_ARGS},
                "attention": getattr(model.config, "_attn_implementation", None), "param_names": names,
                "trainer": True, "first_step": first_step, "model_config": _model_config(model)}
        (self.out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        self._fh = open(self.out / "steps.jsonl", "w")
        for record in kept:
            write_jsonl(self._fh, record)

    def _records_before(self, resumed_at: int) -> tuple[list, int]:
        """(records to keep, first step of the log) for a run starting after step `resumed_at`: the earlier
        records of this directory when they run without a gap from its first step to `resumed_at` (the same
        run, stopped and resumed into its own directory), else none."""
        if resumed_at == 0:
            return [], 1
        try:
            first = json.loads((self.out / "meta.json").read_text()).get("first_step", 1)
            records = [r for r in read_jsonl(self.out / "steps.jsonl") if r["step"] <= resumed_at]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [], resumed_at + 1
        if [r["step"] for r in records] != list(range(first, resumed_at + 1)):
            return [], resumed_at + 1
        return records, first

    # The digests are taken on every process, not only the one that writes: a sharded (FSDP2) tensor's
    # digest gathers it, which every rank must join.
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._params = param_digests(model.named_parameters())

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._grads = grad_digests(model.named_parameters())

    def on_step_end(self, args, state, control, **kwargs):
        if self._fh is not None:
            self._pending[state.global_step] = {"step": state.global_step, "loss": None, "grad_norm": None,
                                                "lr": None, "params": self._params, "grads": self._grads}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._fh is None or not logs or "loss" not in logs:
            return
        record = self._pending.get(state.global_step)
        if record is not None:
            record.update(loss=exact(logs["loss"]), grad_norm=exact(logs.get("grad_norm")),
                          lr=exact(logs.get("learning_rate")), loss_float=float(logs["loss"]))
        self._flush()

    def _flush(self):
        for step in sorted(self._pending):
            write_jsonl(self._fh, self._pending.pop(step))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self._fh is None:
            return
        self._flush()
        self._fh.close()
        self._fh = None
        # The step the Trainer ended at: it may stop before max_steps (early stopping), and max_steps is -1
        # for a run given in epochs, so meta.json's arguments cannot say where the log must end.
        write_final(self.out, model.state_dict(), save_weights=self.save_weights, last_step=state.global_step)
