"""Review findings on dash-repro's verdict and the run files it reads (each test failed before its fix):
runs that both diverge to NaN/inf, records lost at the start of both logs, runs that do not say where they
ended, tied weights in the final weight file, and `run` options checked before --force deletes anything."""

import json
import os

import pytest
import torch

from dash_plugin.repro.cli import main
from dash_plugin.repro.compare import compare_runs
from dash_plugin.repro.fingerprint import write_final
from tests.repro_helpers import compare_cli, edit_json, edit_steps, write_run
from tests.test_repro_trainer import restore_process_state  # noqa: F401  (autouse: puts the flags and env back)


@pytest.fixture
def pair(tmp_path):
    return write_run(tmp_path / "a", 3), write_run(tmp_path / "b", 3)


# --- runs that both diverge ---------------------------------------------------------------------------------

def test_runs_that_both_hit_nan_say_so_in_the_verdict(pair, capsys):
    def diverge(records):
        records[1].update(grad_norm="inf")
        records[2].update(loss="nan", grad_norm="nan")
    for run in pair:
        edit_steps(run, diverge)
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0, out  # the runs reproduce each other, divergence included
    assert out.strip().splitlines()[-1] == ("IDENTICAL: 2 runs, 3 steps, losses/grads/weights bit-identical, "
                                            "but both runs hit NaN/inf from step 2 (grad_norm inf)")
    cmp = compare_runs(*pair)
    assert cmp.identical and cmp.nonfinite.step == 2 and cmp.nonfinite.scalars == {"grad_norm": ("inf", "inf")}


def test_a_nan_in_one_run_only_is_a_difference(pair, capsys):
    edit_steps(pair[1], lambda records: records[1].update(loss="nan"))
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 1 and "DIFFERENT: first difference at step 2: loss 0x1.3333333333333p+2 vs nan" in out, out


def test_finite_runs_have_no_nonfinite_step(pair):
    cmp = compare_runs(*pair)
    assert cmp.nonfinite is None and "NaN" not in cmp.verdict()


# --- where the logs start and end ---------------------------------------------------------------------------

def test_a_record_lost_at_the_start_of_both_logs_is_refused(pair, capsys):
    for run in pair:
        edit_steps(run, lambda records: records.pop(0))
    rc, out, err = compare_cli(capsys, *pair)
    assert rc == 2 and "IDENTICAL" not in out, out
    assert (f"{pair[0] / 'steps.jsonl'} line 1: the log starts at step 2, but the run started at step 1 "
            f"({pair[0] / 'meta.json'} records no 'first_step', so the log must start at step 1): the records "
            f"before it are lost") in err


def test_runs_that_started_later_compare_from_their_first_step(pair, capsys):
    # A Trainer run resumed from a checkpoint logs from there on, and FingerprintCallback records where.
    for run in pair:
        edit_steps(run, lambda records: records.pop(0))
        edit_json(run / "meta.json", lambda meta: meta.update(first_step=2))
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0 and out.strip().endswith("IDENTICAL: 2 runs, 2 steps, losses/grads/weights bit-identical"), out
    edit_json(pair[1] / "meta.json", lambda meta: meta.update(first_step=1))
    rc, _, err = compare_cli(capsys, *pair)
    assert rc == 2 and f"({pair[1] / 'meta.json'} records 'first_step': 1): the records before it are lost" in err
    edit_json(pair[1] / "meta.json", lambda meta: meta.update(first_step="2"))
    rc, _, err = compare_cli(capsys, *pair)
    assert rc == 2 and f"{pair[1] / 'meta.json'}: 'first_step' must be the integer step" in err, err


def test_a_run_that_does_not_say_where_it_ended_gets_a_note(pair, capsys):
    # A FingerprintCallback run written before final.json had 'last_step' (no args.steps either), whose last
    # record is lost in both runs: the end cannot be checked, and the output says so instead of passing silently.
    for run in pair:
        edit_json(run / "meta.json", lambda meta: (meta["args"].pop("steps"), meta.update(trainer=True)))
        edit_steps(run, lambda records: records.pop())
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0, out
    for name, run in zip("AB", pair):
        assert (f"note: run {name}'s last record is not checked: neither {run / 'final.json'} ('last_step') nor "
                f"{run / 'meta.json'} (args.steps) says at which step the run ended") in out
    edit_json(pair[0] / "final.json", lambda final: final.update(last_step=2))
    assert "run A's last record is not checked" not in compare_cli(capsys, *pair)[1]


# --- tied weights ---------------------------------------------------------------------------------------------

def test_tied_weights_are_written_and_compared(tmp_path, capsys):
    # A state dict with tied weights (lm_head.weight is embed_tokens.weight, as in most small HF models):
    # safetensors refused it, so FingerprintCallback crashed at the end of training.
    emb = torch.arange(12, dtype=torch.float32).view(4, 3)
    state = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(3), "lm_head.weight": emb}
    runs = []
    for name in ("a", "b"):
        run = write_run(tmp_path / name, 2)
        write_final(run, state)
        runs.append(run)
    from safetensors.torch import load_file

    saved = load_file(runs[0] / "model.safetensors")
    assert set(saved) == set(state) and all(torch.equal(saved[k], v) for k, v in state.items())
    assert state["lm_head.weight"].data_ptr() == emb.data_ptr()  # the caller's tensors are left as they were
    rc, out, _ = compare_cli(capsys, *runs)
    assert rc == 0 and out.strip().endswith("IDENTICAL: 2 runs, 2 steps, losses/grads/weights bit-identical"), out


def test_trainer_run_with_tied_weights_and_resumed_runs(tmp_path, capsys):
    """End to end with the Trainer: a tied-weights model finishes with its weights saved, and two runs resumed
    from one checkpoint compare (their logs start at step 3, which FingerprintCallback records)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from dash_plugin.repro.data import ByteBlocks, stdlib_corpus
    from dash_plugin.repro.hf_callback import FingerprintCallback

    data = ByteBlocks(stdlib_corpus(64 * 200), 64, "train")

    def run(out, resume=None):
        args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=4, per_device_train_batch_size=4,
                                 learning_rate=3e-3, logging_steps=1, seed=7, full_determinism=True, use_cpu=True,
                                 save_strategy="steps", save_steps=2, report_to=[], disable_tqdm=True)
        config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                             use_cache=False, tie_word_embeddings=True)
        config._attn_implementation = "dash"
        torch.manual_seed(0)
        trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data,
                          callbacks=[FingerprintCallback(out)])
        trainer.train(resume_from_checkpoint=resume)

    run(tmp_path / "full")   # full_determinism changes process-wide state: the fixture puts it back
    assert (tmp_path / "full" / "final.json").is_file()
    ckpt = str(tmp_path / "hf" / "checkpoint-2")
    run(tmp_path / "r1", ckpt)
    run(tmp_path / "r2", ckpt)
    assert json.loads((tmp_path / "r1" / "meta.json").read_text())["first_step"] == 3
    rc, out, _ = compare_cli(capsys, tmp_path / "r1", tmp_path / "r2")
    assert rc == 0 and out.strip().endswith("IDENTICAL: 2 runs, 2 steps, losses/grads/weights bit-identical"), out
    rc, _, err = compare_cli(capsys, tmp_path / "full", tmp_path / "r1")
    assert rc == 2 and "the logs are not aligned" in err and "resumed from a checkpoint" in err, err


# --- dash-repro run checks its options before --force deletes anything ------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps=0 is not allowed; pass a positive integer"),
    (["--steps", "3", "--stop-at", "4"], "--stop-at=4 is not allowed; pass a step in 1..--steps (3)"),
    (["--stop-at", "0"], "--stop-at=0 is not allowed; pass a step in 1..--steps (30)"),
    (["--step", "0"], "--steps=0 is not allowed; pass a positive integer"),  # the training script's abbreviation
])
def test_run_refuses_bad_steps_before_force_deletes_results(tmp_path, capsys, argv, message):
    earlier = write_run(tmp_path / "out" / "run1", 3)
    before = sorted(p.name for p in earlier.iterdir())
    rc = main(["run", "--out", str(tmp_path / "out"), "--force", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and f"dash-repro run: error: {message}" in err, err
    assert sorted(p.name for p in earlier.iterdir()) == before  # the earlier results are still there


def test_demo_refuses_bad_steps_before_training(tmp_path, capsys):
    rc = main(["demo", "--out", str(tmp_path / "demo"), "--steps", "-1", "--cpu"])
    assert rc == 2 and "dash-repro demo: error: --steps=-1 is not allowed" in capsys.readouterr().err
    assert not (tmp_path / "demo" / "tiny" / "run1").exists()


# --- sharded (FSDP2) tensors ------------------------------------------------------------------------------

def _digest_sharded(rank, world, port, full, results):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from dash_plugin.repro.fingerprint import tensor_digest
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sharded = distribute_tensor(full.clone(), mesh, [Shard(0)])
        results[rank] = tensor_digest(sharded)
    finally:
        dist.destroy_process_group()


def test_a_sharded_tensor_is_digested_whole_on_every_rank():
    """Before: each rank digested its own shard and the log held rank 0's, so a difference in another
    rank's shard did not show at its step. Now every rank gets the whole tensor's digest."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_digest_sharded, args=(2, port, full, shared), nprocs=2, join=True)
        results = dict(shared)
    from dash_plugin.repro.fingerprint import tensor_digest
    assert results[0] == results[1] == tensor_digest(full)
    changed = full.clone()
    changed[5, 3] += 1   # in rank 1's shard
    assert tensor_digest(changed) != tensor_digest(full)
