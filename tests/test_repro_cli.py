"""`dash-repro run` / `demo`: the features that are about separate processes, run as separate processes."""

import sys
from pathlib import Path

import pytest

from dash_plugin.repro.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_demo_cpu_runs_twice_in_fresh_processes(tmp_path, capsys):
    rc = main(["demo", "--steps", "2", "--cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tiny model: IDENTICAL: 2 runs, 2 steps, losses/grads/weights bit-identical" in out
    assert out.rstrip().endswith("DEMO PASSED: deterministic runs are bit-identical")
    png = tmp_path / "tiny.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    for run in ("run1", "run2"):  # each run was its own process with its own log
        log = (tmp_path / "tiny" / run / "train.log").read_text()
        assert log.startswith(f"$ {sys.executable}") and f"--out {tmp_path / 'tiny' / run}" in log
    w1 = (tmp_path / "tiny" / "run1" / "model.safetensors").read_bytes()
    assert w1 == (tmp_path / "tiny" / "run2" / "model.safetensors").read_bytes()


def test_run_reports_a_difference_with_exit_code_1(tmp_path, capsys):
    # A training script that behaves differently in the second run: flips one bit of one weight at step 2.
    script = tmp_path / "train_flaky.py"
    script.write_text(
        "import sys, importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('t', {str(ROOT / 'examples' / 'train_accelerate.py')!r})\n"
        "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)\n"
        "argv = sys.argv[1:]\n"
        "if argv[-1].endswith('run2'):\n"
        "    argv += ['--perturb', '2:model.layers.0.self_attn.k_proj.weight']\n"
        "sys.exit(t.main(argv))\n")
    rc = main(["run", "--out", str(tmp_path / "runs"), "--script", str(script), "--plot",
               "--size", "tiny", "--steps", "3", "--seq-len", "64", "--batch-size", "4", "--cpu"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert ("DIFFERENT: first difference at step 2: weights of 1 tensors in layer 0: "
            "model.layers.0.self_attn.k_proj.weight (layer 0)") in out
    assert (tmp_path / "runs" / "loss.png").is_file()


def test_run_failure_shows_the_log_and_exit_code_2(tmp_path, capsys):
    rc = main(["run", "--out", str(tmp_path), "--size", "huge"])
    err = capsys.readouterr().err
    assert rc == 2 and "training run" in err and "invalid choice: 'huge'" in err


def test_run_refuses_out_in_training_args(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path), "--", "--out", "x"]) == 2
    assert "do not pass --out" in capsys.readouterr().err


def test_module_entry_point_help():
    import subprocess

    res = subprocess.run([sys.executable, "-m", "dash_plugin.repro", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "dash-repro" in res.stdout and "demo" in res.stdout
    text = " ".join(res.stdout.split())  # the exit codes, as the help states them
    assert "0 when the runs are bit-identical, 1 when they differ, 2 when they could not be compared" in text


def test_build_command_with_and_without_launcher(tmp_path):
    from dash_plugin.repro.cli import build_command

    script = tmp_path / "t.py"
    assert build_command(script, ["--steps", "3"], tmp_path / "r1") == [
        sys.executable, str(script), "--steps", "3", "--out", str(tmp_path / "r1")]
    cmd = build_command(script, ["--size", "small"], tmp_path / "r2", "accelerate launch --num_processes 2")
    assert cmd == ["accelerate", "launch", "--num_processes", "2", str(script), "--size", "small",
                   "--out", str(tmp_path / "r2")]


def test_demo_gpu_branch_reports_all_three_pairs(tmp_path, capsys, monkeypatch):
    """The GPU part of the demo, with the runs replaced by fixed comparisons (no GPU here)."""
    import torch

    from dash_plugin.repro import cli
    from dash_plugin.repro.compare import Comparison, StepDifference

    calls = []

    def fake_pair(name, title, train_args, out, script):
        calls.append((name, train_args))
        first = StepDifference(1, {}, {"params": [], "grads": ["model.layers.3.self_attn.q_proj.weight"]})
        return Comparison("a", "b", 2, 2, first if name == "gpu-atomic" else None, name != "gpu-atomic")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FAKE GPU")
    monkeypatch.setattr(cli, "_demo_pair", fake_pair)
    assert main(["demo", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [c[0] for c in calls] == ["tiny", "gpu-deterministic", "gpu-atomic"]
    assert "--cpu" not in calls[0][1] and calls[2][1][-2:] == ["--schedule", "atomic"]
    assert ("atomic schedule (the check can fail): DIFFERENT: first difference at step 1: grads (in backward "
            "order) of 1 tensors in layer 3: model.layers.3.self_attn.q_proj.weight (layer 3)") in out
    assert out.rstrip().endswith("DEMO PASSED: deterministic runs are bit-identical")


def test_failed_run_stops_the_other_parallel_run(tmp_path, capsys):
    # Run 1 fails at once; run 2 (same script, run in parallel) would sleep: it must be killed, not waited for.
    import time

    script = tmp_path / "t.py"
    script.write_text("import sys, time\n"
                      "if sys.argv[-1].endswith('run1'): sys.exit(3)\n"
                      "time.sleep(60)\n")
    t0 = time.monotonic()
    rc = main(["run", "--parallel", "--out", str(tmp_path / "runs"), "--script", str(script)])
    assert rc == 2 and time.monotonic() - t0 < 20
    assert "failed (exit 3)" in capsys.readouterr().err
    # run 2 did start, and was killed (not left running, not waited for): its marker says so
    marker = (tmp_path / "runs" / "run2" / "INCOMPLETE").read_text()
    assert "stopped because another run failed" in marker and "killed" in marker, marker


def test_run_devices_puts_each_parallel_run_on_its_own_gpu(tmp_path, capsys):
    # A stand-in trainer: records its CUDA_VISIBLE_DEVICES, then waits for the other run to have started
    # (so the runs must overlap in time), then writes a complete run (a copy of a hand-made one).
    from tests.repro_helpers import write_run

    template = write_run(tmp_path / "template", 1)
    script = tmp_path / "t.py"
    script.write_text(
        "import os, shutil, sys, time\n"
        "from pathlib import Path\n"
        "out = Path(sys.argv[-1]); out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'devices.txt').write_text(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))\n"
        "other = out.parent / ('run2' if out.name == 'run1' else 'run1') / 'devices.txt'\n"
        "deadline = time.time() + 30\n"
        "while not other.exists() and time.time() < deadline: time.sleep(0.05)\n"
        "if not other.exists(): sys.exit(5)\n"
        f"shutil.copytree({str(template)!r}, out, dirs_exist_ok=True)\n")
    runs = tmp_path / "runs"
    rc = main(["run", "--parallel", "--devices", "0,1", "--out", str(runs), "--script", str(script),
               "--steps", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "IDENTICAL: 2 runs, 1 steps" in out
    assert (runs / "run1" / "devices.txt").read_text() == "0"
    assert (runs / "run2" / "devices.txt").read_text() == "1"
    assert (runs / "run2" / "train.log").read_text().startswith(f"$ CUDA_VISIBLE_DEVICES=1 {sys.executable} ")


def test_run_devices_needs_one_entry_per_run_and_no_launcher(tmp_path, capsys):
    assert main(["run", "--devices", "0", "--out", str(tmp_path)]) == 2
    assert "--devices='0' is not allowed; pass one device per run (2)" in capsys.readouterr().err
    assert main(["run", "--devices", "0,", "--out", str(tmp_path)]) == 2
    assert "--devices='0,' is not allowed" in capsys.readouterr().err
    assert main(["run", "--devices", "0,1", "--launch", "accelerate launch", "--out", str(tmp_path)]) == 2
    assert "with --launch set CUDA_VISIBLE_DEVICES for the launcher" in capsys.readouterr().err


def test_a_named_script_that_does_not_exist_is_refused(tmp_path, capsys, monkeypatch):
    """--script (or DASH_REPRO_SCRIPT) that names no file is an error, never a silent run of the
    default training script."""
    rc = main(["run", "--out", str(tmp_path / "runs"), "--script", str(tmp_path / "nope.py")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--script={tmp_path / 'nope.py'}: no such file" in err, err
    assert not (tmp_path / "runs" / "run1").exists()


def test_a_launcher_that_is_not_a_program_is_named_before_any_run(tmp_path, capsys):
    rc = main(["run", "--out", str(tmp_path / "runs"), "--launch", "no-such-launcher --x"])
    err = capsys.readouterr().err
    assert rc == 2 and "--launch 'no-such-launcher --x': no-such-launcher is not a program on PATH" in err, err
    assert not (tmp_path / "runs" / "run1").exists()


def test_a_bad_training_option_is_dash_repro_runs_own_error(tmp_path, capsys):
    # Checked before any run starts (no run directory is made), and reported as `dash-repro run`'s error,
    # without a usage line of an inner parser.
    assert main(["run", "--out", str(tmp_path / "runs"), "--size", "tiny", "--steps", "abc"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "dash-repro run: error: argument --steps: invalid int value: 'abc'", err
    assert main(["run", "--out", str(tmp_path / "runs"), "--attn", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "dash-repro run: error: argument --attn: invalid choice: 'bogus' (choose from 'dash', 'sdpa', 'eager')" \
        in err, err
    assert not (tmp_path / "runs").exists()


def test_demo_refuses_an_unknown_attention_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", "2", "--attn", "bogus", "--out", str(tmp_path / "demo")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "dash-repro demo: error: argument --attn: invalid choice: 'bogus' (choose from 'dash', 'sdpa', 'eager')" \
        in err, err
    assert not (tmp_path / "demo").exists()
