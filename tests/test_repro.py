"""Unit tests of dash_plugin.repro: dataset, digests, comparison of logs, plot, and the determinism helper."""

import os

import pytest
import torch

from dash_plugin.repro.compare import compare_runs
from dash_plugin.repro.data import ByteBlocks, stdlib_corpus
from dash_plugin.repro.fingerprint import exact, from_exact, layer_of, tensor_digest
from tests.repro_helpers import NAMES, write_run


# --- data -------------------------------------------------------------------------------------------------

def test_stdlib_corpus_is_deterministic_and_sized():
    a, b = stdlib_corpus(50_000), stdlib_corpus(50_000)
    assert a == b and len(a) == 50_000
    assert stdlib_corpus(60_000)[:50_000] == a  # a longer read extends, never reorders


def test_stdlib_corpus_bad_input():
    with pytest.raises(ValueError, match="num_bytes"):
        stdlib_corpus(0)
    with pytest.raises(ValueError, match="more than"):
        stdlib_corpus(10**12)


def test_byte_blocks_split_by_position():
    data = bytes(range(256)) * 40  # 10240 bytes -> 80 blocks of 128
    train, val = ByteBlocks(data, 128, "train", val_every=10), ByteBlocks(data, 128, "val", val_every=10)
    assert len(train) + len(val) == 80 and len(val) == 8
    all_blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(80, 128)
    assert torch.equal(val.blocks, all_blocks[::10])  # blocks 0, 10, 20, ...
    item = train[0]
    assert torch.equal(item["input_ids"], all_blocks[1].long()) and torch.equal(item["labels"], item["input_ids"])
    with pytest.raises(ValueError, match="split"):
        ByteBlocks(data, 128, "test")
    with pytest.raises(ValueError, match="seq_len"):
        ByteBlocks(data, 1)


# --- digests ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_digest_sees_every_single_bit_flip(dtype):
    torch.manual_seed(0)
    t = torch.randn(7, 33).to(dtype)
    base = tensor_digest(t)
    assert tensor_digest(t.clone()) == base
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    for pos in (0, 100, t.numel() - 1):
        u = t.clone()
        u.view(-1)[pos:pos + 1].view(ints).bitwise_xor_(1)  # lowest mantissa bit
        assert tensor_digest(u) != base, pos


def test_digest_covers_shape_dtype_and_order():
    t = torch.arange(12, dtype=torch.float32)
    assert tensor_digest(t) != tensor_digest(t.view(3, 4))
    assert tensor_digest(t) != tensor_digest(t.flip(0))  # swapped elements are seen (position weights)
    assert tensor_digest(t.view(3, 4).t()) == tensor_digest(t.view(3, 4).t().contiguous())  # layout-free
    assert tensor_digest(torch.zeros(3)) != tensor_digest(-torch.zeros(3))  # -0.0 has other bits
    assert tensor_digest(torch.zeros(0)) == tensor_digest(torch.zeros(0))


def test_exact_roundtrip():
    x = torch.tensor(1.0 / 3.0, dtype=torch.float32)
    assert from_exact(exact(x)) == x.item()
    assert exact(None) is None


def test_layer_of():
    assert layer_of("model.layers.12.self_attn.q_proj.weight") == "layer 12"
    assert layer_of("model.embed_tokens.weight") == "embeddings"
    assert layer_of("lm_head.weight") == "lm_head"
    assert layer_of("model.norm.weight") == "norm"


# --- compare on hand-made logs ----------------------------------------------------------------------------

def test_compare_identical(tmp_path):
    cmp = compare_runs(write_run(tmp_path / "a", 5), write_run(tmp_path / "b", 5))
    assert cmp.identical and cmp.first is None and cmp.final_equal
    assert cmp.verdict() == "IDENTICAL: 2 runs, 5 steps, losses/grads/weights bit-identical"


def test_compare_finds_first_step_and_tensor(tmp_path):
    a = write_run(tmp_path / "a", 6)
    b = write_run(tmp_path / "b", 6, change=(4, "grads", NAMES[2]))
    cmp = compare_runs(a, b)
    assert not cmp.identical and cmp.first.step == 4
    assert cmp.first.tensors == {"params": [], "grads": [NAMES[2]]} and cmp.first.scalars == {}
    assert cmp.verdict().startswith("DIFFERENT: first difference at step 4: grads")
    assert "model.layers.1.mlp.up_proj.weight (layer 1)" in cmp.verdict()
    assert "grads differ in layer 1: model.layers.1.mlp.up_proj.weight" in cmp.report()


def test_compare_loss_difference_shows_exact_values(tmp_path):
    a = write_run(tmp_path / "a", 5)
    b = write_run(tmp_path / "b", 5, change=(2, "loss", None))
    cmp = compare_runs(a, b)
    assert cmp.first.step == 2 and set(cmp.first.scalars) == {"loss"}
    la, lb = cmp.first.scalars["loss"]
    assert f"loss {la} vs {lb}" in cmp.verdict() and la == exact(4.8)


def test_compare_lengths_and_final_weights(tmp_path):
    cmp = compare_runs(write_run(tmp_path / "a", 5), write_run(tmp_path / "b", 3))
    assert not cmp.identical and "run A has 5 steps, run B 3" in cmp.verdict()
    cmp = compare_runs(write_run(tmp_path / "c", 3), write_run(tmp_path / "d", 3, final_change=True))
    assert not cmp.identical and cmp.final_tensors == [NAMES[2]] and "final weights differ" in cmp.verdict()


def test_compare_bad_directory(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="no steps.jsonl"):
        compare_runs(tmp_path / "a", tmp_path / "b")


def test_cli_compare_exit_codes(tmp_path, capsys):
    from dash_plugin.repro.cli import main

    a, b = write_run(tmp_path / "a", 4), write_run(tmp_path / "b", 4)
    c = write_run(tmp_path / "c", 4, change=(3, "params", NAMES[1]))
    assert main(["compare", str(a), str(b)]) == 0
    assert capsys.readouterr().out.strip().endswith("IDENTICAL: 2 runs, 4 steps, losses/grads/weights bit-identical")
    assert main(["compare", str(a), str(c)]) == 1
    assert "first difference at step 3: weights of 1 tensors in layer 0" in capsys.readouterr().out
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2


def test_plot_writes_png(tmp_path):
    from dash_plugin.repro.plot import plot_runs

    a, b = write_run(tmp_path / "a", 6), write_run(tmp_path / "b", 6, change=(3, "loss", None))
    png = plot_runs(a, b, tmp_path / "out" / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# --- the determinism helper -------------------------------------------------------------------------------

def test_setup_deterministic_training_sets_and_reports(monkeypatch):
    from dash_plugin.integrations.accelerate import setup_deterministic_training

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        setup = setup_deterministic_training(123)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.initial_seed() == 123
        first = torch.rand(3)
        setup_deterministic_training(123)
        assert torch.equal(torch.rand(3), first)
        assert "torch.use_deterministic_algorithms = True (warn_only=False)" in setup.summary()
        cfg = setup.dataloader_config
        assert cfg.use_seedable_sampler and cfg.data_seed == 123
        assert setup.generator().initial_seed() == 123   # (two unseeded generators would agree as well)
        assert torch.equal(torch.randint(0, 99, (5,), generator=setup.generator()),
                           torch.randint(0, 99, (5,), generator=setup.generator()))
        with pytest.raises(ValueError, match="seed="):
            setup_deterministic_training(-1)
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def test_setup_deterministic_training_warns_of_what_it_keeps(monkeypatch):
    """Values set before are kept (and reported); where they undo what the call asked for, a
    warning says so."""
    from dash_plugin.integrations.accelerate import setup_deterministic_training

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "garbage")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        first = setup_deterministic_training(7)
        assert any("CUBLAS_WORKSPACE_CONFIG='garbage' (set before) is kept" in w for w in first.warnings)
        assert not any("PYTHONHASHSEED" in w for w in first.warnings)
        second = setup_deterministic_training(11)   # the first call's PYTHONHASHSEED stays
        assert os.environ["PYTHONHASHSEED"] == "7"
        assert any("PYTHONHASHSEED=7 (set before, e.g. by an earlier call) is kept" in w and "seed 11" in w
                   for w in second.warnings)
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        monkeypatch.delenv("PYTHONHASHSEED")
        big = setup_deterministic_training(2**32 + 5)
        assert big.warnings == [] or all("CUDA was initialised" in w for w in big.warnings)
        assert f"= {2**32 + 5} (numpy: 5, seed mod 2**32)" in big.summary()
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def test_setup_deterministic_training_switches_the_nan_fill(monkeypatch):
    import torch.utils.deterministic as deterministic

    from dash_plugin.integrations.accelerate import setup_deterministic_training

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           deterministic.fill_uninitialized_memory)
    try:
        setup = setup_deterministic_training(0, fill_uninitialized_memory=False)
        assert torch.are_deterministic_algorithms_enabled() and deterministic.fill_uninitialized_memory is False
        assert "fill_uninitialized_memory = False" in setup.summary()
        setup = setup_deterministic_training(0)   # the default puts PyTorch's fill back
        assert deterministic.fill_uninitialized_memory is True
        assert torch.isnan(torch.empty(64)).all()   # what the fill does, and what False skips
        assert "fill_uninitialized_memory = True (dash_plugin's GPU kernels skip it" in setup.summary()
        with pytest.raises(ValueError, match="fill_uninitialized_memory=1"):
            setup_deterministic_training(0, fill_uninitialized_memory=1)
        deterministic.fill_uninitialized_memory = True
        for name in ("warn_only", "set_env"):   # refused before anything is set
            with pytest.raises(ValueError, match=f"{name}='no' is not allowed; pass True or False"):
                setup_deterministic_training(0, fill_uninitialized_memory=False, **{name: "no"})
            assert deterministic.fill_uninitialized_memory is True
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        deterministic.fill_uninitialized_memory = was[2]


def test_seed_worker_seeds_python_and_numpy_from_the_worker_seed():
    import random

    import numpy as np

    from dash_plugin.integrations.accelerate import seed_worker

    state = torch.get_rng_state()
    try:
        draws = []
        for _ in range(2):
            torch.manual_seed(1234)  # what DataLoader does in a worker: base_seed + worker_id
            seed_worker(0)
            draws.append((random.random(), float(np.random.rand())))
        torch.manual_seed(99)
        seed_worker(0)
        assert draws[0] == draws[1] and (random.random(), float(np.random.rand())) != draws[0]
    finally:
        torch.set_rng_state(state)
