"""End-to-end CPU checks of the fingerprinted trainer (examples/train_accelerate.py), in this process:
two runs are bit-identical, an injected one-bit change is found at the right step and tensor, and a run
stopped and resumed equals the uninterrupted one."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dash_plugin  # noqa: F401  (registers attn_implementation="dash")
from dash_plugin.repro.compare import compare_runs, load_run
from dash_plugin.repro.fingerprint import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("train_accelerate", ROOT / "examples" / "train_accelerate.py")
train_accelerate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_accelerate)

# 3000 bytes -> 46 blocks of 64, 43 for training -> 5 batches of 8 per epoch: 7 steps cross an epoch boundary.
ARGS = ["--size", "tiny", "--steps", "7", "--seq-len", "64", "--batch-size", "8", "--data-bytes", "3000",
        "--cpu", "--attn", "dash"]
PERTURBED = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module", autouse=True)
def restore_process_state():
    """The trainer turns on process-wide determinism and Accelerate state; give other tests theirs back."""
    det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED")}
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(det[0], warn_only=det[1])
    torch.set_num_threads(threads)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def train(out, *extra):
    assert train_accelerate.main([*ARGS, "--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    return train(tmp_path_factory.mktemp("runs") / "a")


def test_two_runs_are_bit_identical(run_a, tmp_path):
    run_b = train(tmp_path / "b")
    cmp = compare_runs(run_a, run_b)
    assert cmp.identical, cmp.report()
    assert cmp.verdict() == "IDENTICAL: 2 runs, 7 steps, losses/grads/weights bit-identical"
    # The claim, checked on the tensors themselves, not only on the digests.
    wa, wb = load_file(run_a / "model.safetensors"), load_file(run_b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # Not vacuous: the run trained (weights and loss changed) and crossed an epoch boundary.
    steps = read_jsonl(run_a / "steps.jsonl")
    assert [s["epoch"] for s in steps] == [0] * 5 + [1] * 2
    assert len({s["loss"] for s in steps}) == 7
    assert steps[0]["params"][PERTURBED] != steps[-1]["params"][PERTURBED]
    assert all(len(s["grads"]) == len(s["params"]) == 21 for s in steps)
    meta = json.loads((run_a / "meta.json").read_text())
    assert meta["args"]["attn"] == "dash" and len(meta["param_names"]) == 21
    assert "deterministic=True" in meta["dash_resolved"]  # the dash attention ran, deterministically
    # The order the backward produced the gradients in: the head first, each layer's MLP before its
    # attention, the embedding last (not the reverse of the registration order, which puts the norms first).
    order = meta["grad_order"]
    assert sorted(order) == sorted(meta["param_names"]) and order[0] == "lm_head.weight"
    at = order.index
    assert at("model.layers.1.mlp.down_proj.weight") < at("model.layers.1.post_attention_layernorm.weight") \
        < at("model.layers.1.self_attn.o_proj.weight") < at("model.layers.1.self_attn.q_proj.weight") \
        < at("model.layers.1.input_layernorm.weight") < at("model.layers.0.mlp.down_proj.weight")
    assert order[-1] == "model.embed_tokens.weight"


def test_compare_finds_injected_difference(run_a, tmp_path):
    run_c = train(tmp_path / "c", "--perturb", f"4:{PERTURBED}")
    cmp = compare_runs(run_a, run_c)
    assert not cmp.identical and cmp.first.step == 4
    assert cmp.first.tensors["params"] == [PERTURBED]  # exactly the tensor that was changed
    assert f"weights of 1 tensors in layer 1: {PERTURBED} (layer 1)" in cmp.verdict()
    assert cmp.final_equal is False
    assert any("perturb" in n for n in cmp.notes)  # the argument difference is reported too


# mid-epoch 0, exactly at its end (the checkpoint still says epoch 0), and inside epoch 1 (the epoch read back)
@pytest.mark.parametrize("stop", [3, 5, 6])
def test_resume_equals_uninterrupted(run_a, tmp_path, stop):
    first = train(tmp_path / "first", "--stop-at", str(stop))
    ckpt = first / "checkpoint"
    assert len(read_jsonl(first / "steps.jsonl")) == stop and not (first / "final.json").exists()
    assert {p.name for p in ckpt.iterdir()} >= {"model.safetensors", "optimizer.pt", "rng_0.pt", "state.json"}
    resumed = train(tmp_path / "resumed", "--resume-from", str(ckpt))
    cmp = compare_runs(run_a, resumed)
    assert cmp.identical, cmp.report()
    wa, wr = load_file(run_a / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(wa[k], wr[k]) for k in wa)


def test_resume_rejects_other_arguments(tmp_path):
    first = train(tmp_path / "first", "--stop-at", "1")
    with pytest.raises(SystemExit, match="other arguments.*lr"):
        train(tmp_path / "resumed", "--resume-from", str(first / "checkpoint"), "--lr", "0.01")


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "0"], "--seq-len=0 is not allowed; pass a positive integer"),   # refused, not replaced by a default
    (["--batch-size", "0"], "--batch-size=0 is not allowed"),
    (["--threads", "0"], "--threads=0 is not allowed"),
    (["--seed", "-1"], "--seed=-1 is not allowed"),
    (["--lr", "-1"], "--lr=-1.0 / --warmup=5 are not allowed"),
    (["--schedule", "bogus"], "--schedule='bogus' is not allowed; pass one of auto, atomic"),
])
def test_bad_values_are_refused_by_name(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        train_accelerate.parse_args(["--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_bad_arguments_name_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_accelerate.parse_args(["--out", str(tmp_path), "--stop-at", "9", "--steps", "3"])
    assert "--stop-at=9 is not allowed; pass a step in 1..--steps (3)" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no parameter named"):
        train(tmp_path / "p", "--steps", "1", "--perturb", "1:model.nope")


def test_stop_at_says_where_the_checkpoint_is_and_the_run_is_not_finished(tmp_path, capsys):
    # An earlier finished run in the same directory: its final.json must not make this stopped run look finished.
    from dash_plugin.repro.fingerprint import write_final

    out = tmp_path / "stopped"
    out.mkdir()
    write_final(out, {"w": torch.ones(2)})
    train(out, "--stop-at", "1", "--steps", "2")
    ckpt = out / "checkpoint"
    assert (f"stopped at step 1 of 2; checkpoint in {ckpt} (continue with --resume-from {ckpt} --out NEW_DIR)"
            in capsys.readouterr().out)
    assert not (out / "final.json").exists() and not (out / "model.safetensors").exists()
    with pytest.raises(ValueError, match="final.json is missing: the run did not finish .*--resume-from"):
        load_run(out)


def test_resume_from_a_damaged_checkpoint_names_the_file(tmp_path):
    first = train(tmp_path / "first", "--stop-at", "1")
    ckpt = first / "checkpoint"
    with pytest.raises(SystemExit, match=f"--resume-from {tmp_path / 'nope'}: no such checkpoint directory"):
        train(tmp_path / "r0", "--resume-from", str(tmp_path / "nope"))
    (ckpt / "model.safetensors").write_bytes(os.urandom(2048))
    with pytest.raises(SystemExit, match=f"--resume-from: {ckpt / 'model.safetensors'} cannot be loaded "
                                         r"\(SafetensorError: "):
        train(tmp_path / "r1", "--resume-from", str(ckpt))
    (ckpt / "state.json").write_text('{"step": 1,')
    with pytest.raises(SystemExit, match=f"--resume-from: {ckpt / 'state.json'}: not valid JSON at line 1"):
        train(tmp_path / "r2", "--resume-from", str(ckpt))
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(SystemExit, match="not a complete checkpoint, missing optimizer.pt"):
        train(tmp_path / "r3", "--resume-from", str(ckpt))


def test_a_perturb_step_that_never_comes_is_refused(tmp_path, capsys):
    # Before: --perturb 0:... (or a step after --steps) trained without perturbing anything, with exit 0.
    for step in ("0", "8"):
        with pytest.raises(SystemExit):
            train_accelerate.parse_args(["--out", str(tmp_path), "--steps", "7", "--perturb", f"{step}:{PERTURBED}"])
        assert (f"--perturb='{step}:{PERTURBED}' is not allowed; its STEP must be in 1..--steps (7)"
                in capsys.readouterr().err)


def test_resume_with_a_stop_at_the_checkpoint_has_passed_is_refused(tmp_path):
    # Before: the resumed run never reached its --stop-at, trained to the end and saved neither final weights
    # nor a checkpoint, with exit 0.
    first = train(tmp_path / "first", "--stop-at", "3")
    ckpt = first / "checkpoint"
    for stop in ("2", "3"):
        with pytest.raises(SystemExit, match=f"--stop-at={stop} is not allowed with --resume-from {ckpt}, which "
                                             r"continues after step 3; pass a step in 4\.\.--steps \(7\)"):
            train(tmp_path / f"resumed{stop}", "--resume-from", str(ckpt), "--stop-at", stop)
    # A --stop-at still ahead of the checkpoint stops there, as before.
    resumed = train(tmp_path / "resumed5", "--resume-from", str(ckpt), "--stop-at", "5")
    assert len(read_jsonl(resumed / "steps.jsonl")) == 5 and (resumed / "checkpoint" / "state.json").is_file()
