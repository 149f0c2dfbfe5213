"""GPU end-to-end checks (marker `gpu`; skipped without CUDA): bf16 training with the dash kernels gives
bit-identical runs in separate processes, resume equals uninterrupted, and the `atomic` schedule diverges."""

from pathlib import Path

import pytest

from dash_plugin.repro.cli import find_script, run_twice
from dash_plugin.repro.compare import compare_runs

# Sequence 1024 gives many KV tiles per dQ tile, so atomic adds have an order to get wrong.
GPU_ARGS = ["--size", "small", "--seq-len", "1024", "--batch-size", "4", "--steps", "8"]


@pytest.mark.gpu
def test_gpu_two_processes_bit_identical(tmp_path):
    cmp = run_twice(GPU_ARGS, tmp_path, script=find_script())
    assert cmp.identical, cmp.report()
    meta = (Path(cmp.run_a) / "meta.json").read_text()
    assert '"mixed_precision": "bf16"' in meta and "deterministic=True" in meta


@pytest.mark.gpu
def test_gpu_resume_equals_uninterrupted(tmp_path):
    import subprocess
    import sys

    script = str(find_script())

    def train(out, *extra):
        subprocess.run([sys.executable, script, *GPU_ARGS, "--out", str(out), *extra], check=True)

    train(tmp_path / "straight")
    train(tmp_path / "first", "--stop-at", "3")
    train(tmp_path / "resumed", "--resume-from", str(tmp_path / "first" / "checkpoint"))
    cmp = compare_runs(tmp_path / "straight", tmp_path / "resumed")
    assert cmp.identical, cmp.report()


@pytest.mark.gpu
def test_gpu_atomic_schedule_diverges(tmp_path):
    """Two training runs with `atomic`, compared: where they differ, the first difference must be in
    the gradients. Atomics may, not must, reorder in a given run, so agreement is an xfail here; the
    tests that assert `atomic` differs are kernel-level and repeat passes until one does
    (test_gpu_kernels.py::test_atomic_is_not_bitwise_reproducible, test_gpu_hopper.py::test_atomic_differs_between_passes)."""
    cmp = run_twice(GPU_ARGS + ["--schedule", "atomic"], tmp_path, script=find_script())
    print(cmp.report())
    if cmp.identical:  # atomics may, not must, reorder: say so rather than pass or fail silently
        pytest.xfail("the two atomic runs happened to agree bit for bit")
    assert cmp.first.tensors["grads"], "a dQ-order difference must show first in the gradients"


def _two_gpus():
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


LAUNCH = f"{__import__('sys').executable} -m accelerate.commands.launch --num_processes 2"
MULTI = {
    "ddp": f"{LAUNCH} --multi_gpu",
    "fsdp2": f"{LAUNCH} --use_fsdp --fsdp_version 2 --fsdp_state_dict_type FULL_STATE_DICT",
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(MULTI))
def test_two_gpu_runs_bit_identical(tmp_path, kind, monkeypatch):
    if not _two_gpus():
        pytest.skip("needs 2 CUDA GPUs")
    monkeypatch.setenv("NCCL_ALGO", "Ring")  # pin NCCL's algorithm choice for both runs
    cmp = run_twice(["--size", "small", "--seq-len", "1024", "--batch-size", "4", "--steps", "8"], tmp_path,
                    script=find_script(), launch=MULTI[kind])
    assert cmp.identical, cmp.report()
    assert '"num_processes": 2' in (Path(cmp.run_a) / "meta.json").read_text()
