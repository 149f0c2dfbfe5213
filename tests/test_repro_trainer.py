"""A real client: the Hugging Face Trainer with attn_implementation="dash" and full determinism gives two
runs with identical loss logs, gradients and weights (CPU, tiny model, a few steps)."""

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


def trainer_run(out, data):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out / "hf"), max_steps=4, per_device_train_batch_size=4,
                             learning_rate=3e-3, warmup_steps=1, logging_steps=1, seed=7, full_determinism=True,
                             use_cpu=True, save_strategy="no", report_to=[], dataloader_num_workers=0,
                             disable_tqdm=True)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = "dash"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=args, train_dataset=ByteBlocks(data, 64, "train"),
                      callbacks=[FingerprintCallback(out)])
    trainer.train()
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
