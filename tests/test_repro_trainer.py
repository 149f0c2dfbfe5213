"""A real client: the Hugging Face Trainer with attn_implementation="dash" and full determinism gives two
runs with identical loss logs, gradients and weights (CPU, tiny model, a few steps)."""

import json
import os

import pytest
import torch

import dash_plugin  # noqa: F401  (registers "dash")
from dash_plugin.repro.compare import compare_runs
from dash_plugin.repro.data import ByteBlocks, stdlib_corpus
from dash_plugin.repro.fingerprint import from_exact, read_jsonl
from dash_plugin.repro.hf_callback import FingerprintCallback

ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "ASCEND_LAUNCH_BLOCKING", "HCCL_DETERMINISTIC",
       "FLASH_ATTENTION_DETERMINISTIC")


@pytest.fixture(autouse=True)
def restore_process_state():
    """enable_full_determinism changes process-wide flags and env vars: put them back for other tests."""
    det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    env = {k: os.environ.get(k) for k in ENV}
    yield
    torch.use_deterministic_algorithms(det[0], warn_only=det[1])
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def trainer_run(out, data, *, gpu=False, steps=4, seq_len=64, hidden=64, heads=2, kv_heads=1, layers=2,
                logging_steps=1, stop_at=None, resume=None):
    """One Trainer run with fingerprints in OUT. On the CPU in fp32; with gpu=True on CUDA with bf16 mixed
    precision, where the dash attention runs its Triton kernels."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from transformers import TrainerCallback

    class StopAt(TrainerCallback):   # a run cut short after a checkpoint, as by a crash or a time limit
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_save = control.should_training_stop = True

    args = TrainingArguments(output_dir=str(out / "hf"), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=3e-3, warmup_steps=1, logging_steps=logging_steps, seed=7,
                             full_determinism=True, use_cpu=not gpu, bf16=gpu, report_to=[],
                             save_strategy="steps" if stop_at else "no", save_steps=stop_at or 500,
                             dataloader_num_workers=0, disable_tqdm=True)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=seq_len, use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = "dash"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=args, train_dataset=ByteBlocks(data, seq_len, "train"),
                      callbacks=[FingerprintCallback(out)] + ([StopAt()] if stop_at else []))
    trainer.train(resume_from_checkpoint=resume)
    assert model.config._attn_implementation == "dash"
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_two_runs_identical(tmp_path, monkeypatch):
    from transformers import AttentionInterface

    calls = []
    dash_fn = AttentionInterface._global_mapping["dash"]

    def counting(*args, **kwargs):  # proves the Trainer's model really ran the "dash" attention
        calls.append(1)
        return dash_fn(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "dash", counting)
    data = stdlib_corpus(64 * 200)
    losses_a = trainer_run(tmp_path / "a", data)
    losses_b = trainer_run(tmp_path / "b", data)
    assert len(calls) == 2 * 4 * 2  # 2 runs x 4 steps x 2 layers
    assert len(losses_a) == 4 and losses_a == losses_b  # the Trainer's own loss log, exact floats
    cmp = compare_runs(tmp_path / "a", tmp_path / "b")
    assert cmp.identical, cmp.report()
    steps = read_jsonl(tmp_path / "a" / "steps.jsonl")
    assert [from_exact(s["loss"]) for s in steps] == losses_a
    assert len(set(losses_a)) == 4 and steps[0]["params"] != steps[-1]["params"]  # it trained
    assert all(s["grads"] for s in steps)
    assert json.loads((tmp_path / "a" / "final.json").read_text())["last_step"] == 4  # where the log must end


def test_trainer_run_stopped_and_resumed_into_its_directory_equals_an_uninterrupted_one(tmp_path):
    """The callback keeps the records up to the checkpoint when the run resumes into the same directory
    (it truncated them before, and compare then refused the pair as not aligned)."""
    data = stdlib_corpus(64 * 200)
    trainer_run(tmp_path / "whole", data, steps=6)
    trainer_run(tmp_path / "cut", data, steps=6, stop_at=3)
    assert [s["step"] for s in read_jsonl(tmp_path / "cut" / "steps.jsonl")] == [1, 2, 3]
    trainer_run(tmp_path / "cut", data, steps=6, resume=str(tmp_path / "cut" / "hf" / "checkpoint-3"))
    assert [s["step"] for s in read_jsonl(tmp_path / "cut" / "steps.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "cut" / "meta.json").read_text())["first_step"] == 1
    cmp = compare_runs(tmp_path / "whole", tmp_path / "cut")
    assert cmp.identical, cmp.report()
    # Into a directory of its own the resumed run logs from the checkpoint on, as before.
    trainer_run(tmp_path / "fresh", data, steps=6, resume=str(tmp_path / "cut" / "hf" / "checkpoint-3"))
    assert json.loads((tmp_path / "fresh" / "meta.json").read_text())["first_step"] == 4


def test_trainer_runs_of_other_model_widths_say_which_config_field_differs(tmp_path):
    data = stdlib_corpus(64 * 200)
    trainer_run(tmp_path / "a", data, steps=2)
    trainer_run(tmp_path / "b", data, steps=2, hidden=32)
    cmp = compare_runs(tmp_path / "a", tmp_path / "b")
    assert not cmp.identical
    assert "model config hidden_size differs: 64 vs 32" in cmp.notes, cmp.notes
    assert "model config intermediate_size differs: 128 vs 64" in cmp.notes


def test_trainer_runs_with_other_logging_steps(tmp_path, capsys):
    """logging_steps=2 logs the mean loss of two steps at every second step (null between): compare and plot
    use the losses both runs logged over the same steps, and nothing else counts as a difference."""
    from dash_plugin.repro.cli import main

    data = stdlib_corpus(64 * 200)
    runs = {name: tmp_path / name for name in ("a", "b", "c")}
    for name, logging_steps in (("a", 2), ("b", 2), ("c", 1)):
        trainer_run(runs[name], data, logging_steps=logging_steps)
    assert main(["compare", str(runs["a"]), str(runs["b"])]) == 0
    assert "IDENTICAL: 2 runs, 4 steps, losses (at 2 of 4 steps)/grads/weights" in capsys.readouterr().out
    assert main(["plot", str(runs["a"]), str(runs["b"]), "-o", str(tmp_path / "ab.png")]) == 0
    assert main(["compare", str(runs["a"]), str(runs["c"])]) == 0
    out = capsys.readouterr().out
    assert "note: loss not compared at 4 of 4 steps (recorded by one run only, or logged over other steps)" in out
    assert out.strip().endswith("IDENTICAL: 2 runs, 4 steps, grads/weights bit-identical"), out
    assert main(["plot", str(runs["a"]), str(runs["c"]), "-o", str(tmp_path / "ac.png")]) == 2
    assert "no step of" in capsys.readouterr().err


@pytest.mark.gpu
def test_trainer_two_runs_identical_gpu(tmp_path, monkeypatch):
    """The same on the GPU: bf16, sequences of 1024 (16 KV tiles per dQ tile, so the order of dQ additions
    matters), head dim 64, GQA 2:1, 20 steps, through the dash Triton kernels."""
    from transformers import AttentionInterface

    import dash_plugin

    seen = []
    dash_fn = AttentionInterface._global_mapping["dash"]

    def recording(module, query, *args, **kwargs):  # what the Trainer's model handed to the "dash" attention
        seen.append((query.device.type, torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")))
        return dash_fn(module, query, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "dash", recording)
    steps, seq_len, layers = 20, 1024, 4
    data = stdlib_corpus(seq_len * 4 * steps * 2)
    shape = dict(gpu=True, steps=steps, seq_len=seq_len, hidden=256, heads=4, kv_heads=2, layers=layers)
    losses_a = trainer_run(tmp_path / "a", data, **shape)
    losses_b = trainer_run(tmp_path / "b", data, **shape)
    # CUDA inputs under bf16 autocast: the dash attention casts q/k/v to bf16 and runs the Triton kernels.
    assert seen and set(seen) == {("cuda", torch.bfloat16)} and len(seen) == 2 * steps * layers
    assert dash_plugin.ops.kernel_path(torch.zeros(1, device="cuda", dtype=torch.bfloat16)) == "triton"
    resolved = dash_plugin.last_resolved()
    assert resolved is not None and resolved.deterministic, resolved
    print(resolved.describe())
    assert len(losses_a) == steps and losses_a == losses_b
    cmp = compare_runs(tmp_path / "a", tmp_path / "b")
    assert cmp.identical, cmp.report()
    print(cmp.verdict())
    steps_a = read_jsonl(tmp_path / "a" / "steps.jsonl")
    assert len(set(losses_a)) > steps // 2 and steps_a[0]["params"] != steps_a[-1]["params"]  # it trained
