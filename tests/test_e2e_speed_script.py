"""scripts/gpu_e2e_speed.py end to end on the CPU, at the tiny size: every variant is measured (or recorded as
unavailable, with the reason) and the JSON and markdown reports carry the figures and the 3 % verdict."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import script_modules

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2


def test_e2e_speed_script_tiny_on_cpu(tmp_path):
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_e2e_speed.py"), str(tmp_path), "--cpu", "--size", "tiny",
         "--seqlens", "64", "--tokens-per-step", "256", "--steps", str(STEPS), "--warmup", "1", "--rounds", "1"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "e2e_speed.json").read_text())
    assert report["meta"]["complete"] and report["meta"]["size"] == "tiny"
    cells = {r["variant"]: r for r in report["results"]}
    assert {"dash_det", "dash_atomic", "sdpa_cudnn", "sdpa_det"} <= set(cells)

    cudnn = cells.pop("sdpa_cudnn")
    assert cudnn["status"] == "unavailable" and "CPU" in cudnn["reason"] and not cudnn["times"]
    if os.environ.get("TRITON_INTERPRET") != "1":   # CPU tensors reach Triton in its interpreter only
        triton = cells.pop("dash_triton_det")
        assert triton["status"] == "unavailable" and "TRITON_INTERPRET=1" in triton["reason"]
    for name, cell in cells.items():
        assert cell["status"] == "ok", (name, cell)
        assert (cell["seqlen"], cell["batch"]) == (64, 4)
        assert len(cell["times"]) == STEPS and min(cell["times"]) > 0
        assert cell["step_s_median"] > 0 and cell["tokens_per_s"] == 256 / cell["step_s_median"]
        assert cell["mfu"] is None and cell["peak_gib"] is None  # no peak FLOP/s or GPU memory on the CPU
    # The ops each variant really ran, recorded during its first step.
    for name in ("dash_det", "dash_det_noflag", "dash_atomic"):
        assert cells[name]["ops"][:2] == ["dash.fwd.default (reference)", "dash.bwd.default"], cells[name]["ops"]
        assert cells[name]["attention_backend"] == "dash reference"
    assert any("scaled_dot_product" in op for op in cells["sdpa_det"]["ops"])
    assert cells["sdpa_det"]["torch_deterministic"] and not cells["dash_atomic"]["torch_deterministic"]
    assert "deterministic=True" in cells["dash_det"]["dash_resolved"]
    assert "schedule=atomic" in cells["dash_atomic"]["dash_resolved"]
    assert "deterministic=False" in cells["dash_atomic"]["dash_resolved"]

    ratios = {r["deterministic"]: r for r in report["ratios"]}
    expected = cells["dash_det"]["step_s_median"] / cells["dash_atomic"]["step_s_median"]
    assert ratios["dash_det"]["ratio"] == expected
    assert ratios["dash_det"]["within_3pct"] == (expected <= 1.03)
    verdict = "YES" if expected <= 1.03 else "NO"
    assert f"seqlen 64: step time dash det / dash atomic = {expected:.3f}" in res.stdout
    assert f"-> within 3%: {verdict}" in res.stdout

    md = (tmp_path / "e2e_speed.md").read_text()
    assert "| seqlen | batch | variant |" in md
    assert "| 64 | 4 | sdpa_cudnn | off | - |" in md and "unavailable: cuDNN attention is a CUDA backend" in md
    assert f"step time dash det / dash atomic = {expected:.3f}" in md


def load_script():
    return script_modules.load_script("gpu_e2e_speed")


def test_e2e_speed_script_rejects_bad_arguments(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the script sets it on import
    speed = load_script()
    for argv, message in ((["--variants", "dash_det,flash4"], "--variants: unknown ['flash4']"),
                          (["--warmup", "0"], "--warmup=0 is not allowed"),
                          (["--seqlens", "1"], "--seqlens: pass sequence lengths >= 2")):
        with pytest.raises(SystemExit) as exc:
            speed.parse_args([str(tmp_path), *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_failing_variant_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    import torch

    # The script and its set-up change process-wide state: let monkeypatch put it back afterwards.
    for var in ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED"):
        monkeypatch.setenv(var, "0" if var == "PYTHONHASHSEED" else ":4096:8")
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    flag = torch.are_deterministic_algorithms_enabled()
    speed = load_script()
    real_step = speed.train_step

    def step(model, *args):
        if model.config._attn_implementation == "sdpa":
            raise RuntimeError("No available kernel. Aborting execution.\nmore detail")
        return real_step(model, *args)

    monkeypatch.setattr(speed, "train_step", step)
    try:
        assert speed.main([str(tmp_path), "--cpu", "--size", "tiny", "--seqlens", "32", "--tokens-per-step", "64",
                           "--steps", "1", "--warmup", "1", "--rounds", "2", "--variants", "sdpa_det,dash_atomic"]) == 0
    finally:
        torch.use_deterministic_algorithms(flag)
    cells = {r["variant"]: r for r in json.loads((tmp_path / "e2e_speed.json").read_text())["results"]}
    assert cells["sdpa_det"]["status"] == "failed"
    assert cells["sdpa_det"]["reason"] == "RuntimeError: No available kernel. Aborting execution."
    assert cells["dash_atomic"]["status"] == "ok" and len(cells["dash_atomic"]["times"]) == 2  # both rounds
    assert "| 32 | 2 | sdpa_det | on | - | - | - | - | - | - | failed: RuntimeError" in \
        (tmp_path / "e2e_speed.md").read_text()
