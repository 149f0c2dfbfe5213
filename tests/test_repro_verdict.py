"""The verdict of `dash-repro` never claims more than was checked (issue #16): a damaged, missing, incomplete or
malformed run is refused with exit 2 ("could not compare") and a message naming the file, never IDENTICAL, never
a traceback; `dash-repro run` leaves no training process behind when it is stopped, and never deletes or mixes
with the results of an earlier run unless told to (--force).

Runs are hand-made (tests/repro_helpers.py) or come from stand-in training scripts: the training itself is
tested in test_repro_train.py."""

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from dash_plugin.repro.cli import main
from dash_plugin.repro.compare import compare_runs
from dash_plugin.repro.fingerprint import write_final
from tests.repro_helpers import NAMES, compare_cli, edit_json, edit_steps, final_weights, write_run

ROOT = Path(__file__).resolve().parent.parent


def refused(capsys, a, b, *needles):
    """Compare must refuse (exit 2, no verdict, no traceback) with a message holding every needle."""
    rc, out, err = compare_cli(capsys, a, b)
    assert rc == 2, out + err
    assert "IDENTICAL" not in out and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture
def pair(tmp_path):
    return write_run(tmp_path / "a", 3), write_run(tmp_path / "b", 3)


def test_two_intact_runs_are_identical(pair, capsys):
    # The control for every test below: these two runs, untouched, compare identical.
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0 and out.strip().endswith("IDENTICAL: 2 runs, 3 steps, losses/grads/weights bit-identical")


# --- the weight files are read, not only final.json ---------------------------------------------------------

def test_changed_weight_file_is_refused(pair, capsys):
    # One weight +1 in run B's file, final.json left as the run wrote it.
    from safetensors.torch import save_file

    save_file(final_weights(change=True), pair[1] / "model.safetensors")
    refused(capsys, *pair, f"{pair[1] / 'model.safetensors'} does not hold the weights",
            f"1 tensors differ from the recorded digests ({NAMES[2]})")


def test_weight_file_of_random_bytes_is_refused(pair, capsys):
    (pair[0] / "model.safetensors").write_bytes(os.urandom(4096))
    refused(capsys, *pair, f"{pair[0] / 'model.safetensors'}: not a readable safetensors file")


def test_deleted_weight_file_is_refused(pair, capsys):
    (pair[1] / "model.safetensors").unlink()
    refused(capsys, *pair, f"{pair[1] / 'model.safetensors'} is missing")


def test_weight_file_with_other_bytes_but_same_tensors_is_refused(pair, capsys):
    # Same tensors, other file (metadata in the header): the file's sha256 no longer matches final.json.
    from safetensors.torch import save_file

    save_file(final_weights(), pair[0] / "model.safetensors", metadata={"edited": "yes"})
    refused(capsys, *pair, f"{pair[0] / 'model.safetensors'}: sha256", "the file changed after the run wrote it")


def test_final_weights_that_really_differ_are_found(tmp_path, capsys):
    # Both runs consistent, their weight files differ in one element of one tensor: DIFFERENT, exit 1.
    a, b = write_run(tmp_path / "a", 3), write_run(tmp_path / "b", 3, final_change=True)
    rc, out, _ = compare_cli(capsys, a, b)
    assert rc == 1 and "DIFFERENT: all 3 steps equal but the final weights differ: " + NAMES[2] in out


def test_runs_without_weight_files_say_digests_only(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", 2), write_run(tmp_path / "b", 2)
    for run in (a, b):
        (run / "model.safetensors").unlink()
        write_final(run, final_weights(), save_weights=False)  # what FingerprintCallback(save_weights=False) does
    cmp = compare_runs(a, b)
    assert cmp.identical and not cmp.weight_files
    assert cmp.verdict() == ("IDENTICAL: 2 runs, 2 steps, losses/grads/weight digests (no weight file saved) "
                             "bit-identical")
    assert "compared by their recorded digests only" in cmp.report()


def test_a_weight_file_that_final_json_does_not_name_is_not_read(pair, capsys):
    # "weights_file": null beside a model.safetensors: the note says what was compared, and that the file
    # was not read (not that the run saved none).
    edit_json(pair[0] / "final.json", lambda final: final.update(weights_file=None, weights_sha256=None))
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0 and "a run saved no weight file" not in out, out
    assert (f"note: run A's {pair[0] / 'final.json'} names no weight file (\"weights_file\": null): the final "
            f"weights are compared by their recorded digests only; the model.safetensors in it is not read") in out


# --- missing or incomplete runs, nothing to compare --------------------------------------------------------

def test_run_without_final_json_is_refused(pair, capsys):
    (pair[0] / "final.json").unlink()
    refused(capsys, *pair, f"{pair[0] / 'final.json'} is missing: the run did not finish")
    (pair[0] / "checkpoint").mkdir()  # a --stop-at run: the message says how to go on
    refused(capsys, *pair, f"continue it with --resume-from {pair[0] / 'checkpoint'}")


def test_runs_with_zero_steps_are_refused(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", 0), write_run(tmp_path / "b", 0)
    refused(capsys, a, b, f"{a / 'steps.jsonl'} has no steps: there is nothing to compare")
    refused(capsys, write_run(tmp_path / "c", 2), b, f"{b / 'steps.jsonl'} has no steps")


def test_run_marked_incomplete_is_refused(pair, capsys):
    (pair[1] / "INCOMPLETE").write_text("stopped by SIGTERM\n")
    refused(capsys, *pair, f"{pair[1]} is an incomplete run", "stopped by SIGTERM")
    (pair[0] / "INCOMPLETE").mkdir()  # a marker, whatever it is
    refused(capsys, *pair, f"{pair[0]} is an incomplete run ({pair[0] / 'INCOMPLETE'}: no reason given)")


def test_missing_meta_json_is_refused(pair, capsys):
    (pair[0] / "meta.json").unlink()
    refused(capsys, *pair, f"{pair[0] / 'meta.json'} is missing")


# --- malformed files: the file, the line and what was expected ---------------------------------------------

def _rewrite_line(path, lineno, text):
    lines = path.read_text().splitlines(True)
    lines[lineno - 1] = text + "\n"
    path.write_text("".join(lines))


@pytest.mark.parametrize("line, message", [
    ('{"loss": "0x1.0p+0"}', "line 2: a step record needs an integer 'step' (has None)"),
    ('{"step": "2"}', "line 2: a step record needs an integer 'step' (has '2')"),
    ('[1, 2]', "line 2: a step record must be a JSON object, not list"),
    ('{"step": 2, "params": []}', "line 2: 'params' must be an object of tensor name -> digest (has list)"),
    ('{"step": 2, "loss": 1.5}', "line 2: 'loss' must be a hex float string or null (has 1.5)"),
    ('{"step": 2, "loss": "garbage"}', "line 2: 'loss' must be a hex float string or null (has 'garbage')"),
    ('{"step": 2, "lr": "0x1.0000p+0"}',
     "line 2: 'lr' is '0x1.0000p+0', not float.hex's spelling of that value ('0x1.0000000000000p+0')"),
    ('{"step": 2, "grad_norm": "-nan"}', "line 2: 'grad_norm' is '-nan', not float.hex's spelling"),
    ('{"step": 2, "grads": {"w": 1}}', "line 2: 'grads' must map tensor names to digest strings ('w' has 1)"),
    ('{"step": 2, "loss": ', "line 2: not valid JSON (column 20: Expecting value)"),
    ('{"step": 1}', "steps.jsonl line 2: step 1 follows step 1; every step must follow the one before it"),
    ('{"step": 2}', "steps.jsonl: step 2 holds nothing to compare"),
    ('{"step": 2, "loss": null, "params": {}, "grads": {}}', "steps.jsonl: step 2 holds nothing to compare"),
])
def test_malformed_step_record_names_file_and_line(pair, capsys, line, message):
    _rewrite_line(pair[1] / "steps.jsonl", 2, line)
    refused(capsys, *pair, f"{pair[1] / 'steps.jsonl'}", message)


def test_records_with_nothing_to_compare_in_both_runs_are_refused(pair, capsys):
    # Equal because both are empty is no evidence: the verdict may not call such runs identical.
    for run in pair:
        for lineno in (1, 2, 3):
            _rewrite_line(run / "steps.jsonl", lineno, json.dumps({"step": lineno}))
    refused(capsys, *pair, "step 1 holds nothing to compare")


def test_the_same_step_missing_from_both_runs_is_refused(pair, capsys):
    for run in pair:
        lines = (run / "steps.jsonl").read_text().splitlines(True)
        (run / "steps.jsonl").write_text(lines[0] + lines[2])
    refused(capsys, *pair, "steps.jsonl line 2: step 3 follows step 1; every step must follow the one before it")


def test_a_final_json_that_is_a_directory_is_named_as_such(pair, capsys):
    (pair[1] / "final.json").unlink()
    (pair[1] / "final.json").mkdir()
    refused(capsys, *pair, f"{pair[1] / 'final.json'} is a directory, not the JSON file a run writes")


def test_the_verdict_names_only_what_both_runs_recorded(pair, capsys):
    # FingerprintCallback writes loss null on the steps the Trainer does not log: those steps compare
    # their digests, and the verdict says at how many steps the losses were compared.
    for run in pair:
        edit_steps(run, lambda records: records[1].update(loss=None, grad_norm=None, lr=None))
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0 and out.strip().endswith(
        "IDENTICAL: 2 runs, 3 steps, losses (at 2 of 3 steps)/grads/weights bit-identical"), out


def test_a_field_only_one_run_recorded_is_not_a_difference(pair, capsys):
    # Run A logged no loss at step 2 (a Trainer with logging_steps=2 against one with 1): nothing to compare
    # there, and its loss at step 3 covers steps 2-3 where run B's covers step 3 only: not compared either.
    edit_steps(pair[0], lambda records: records[1].update(loss=None, grad_norm=None, lr=None))
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0, out
    assert "note: loss not compared at 2 of 3 steps (recorded by one run only, or logged over other steps)" in out
    assert "note: grad_norm not compared at 1 of 3 steps (recorded by one run only)" in out
    assert out.strip().endswith("IDENTICAL: 2 runs, 3 steps, losses (at 1 of 3 steps)/grads/weights bit-identical")

    # Run B recorded no gradient digests at all: the gradients were not compared, and the verdict says so.
    edit_steps(pair[1], lambda records: [r.pop("grads") for r in records])
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0 and "note: grads not compared at 3 of 3 steps (recorded by one run only)" in out, out
    assert out.strip().endswith("IDENTICAL: 2 runs, 3 steps, losses (at 1 of 3 steps)/weights bit-identical")


def test_a_loss_logged_over_other_steps_is_not_compared(pair, capsys):
    # Run A logs every 2 steps: its loss at step 2 is the mean of steps 1-2, run B's the loss of step 2.
    def every_second(records):
        for r in records[0], records[2]:
            r.update(loss=None, grad_norm=None, lr=None)
        records[1]["loss"] = "0x1.3000000000000p+2"
    edit_steps(pair[0], every_second)
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0 and "note: loss not compared at 3 of 3 steps" in out, out
    assert out.strip().endswith("IDENTICAL: 2 runs, 3 steps, grads/weights bit-identical")
    edit_steps(pair[1], every_second)  # both log every 2 steps: the losses are compared again
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0 and out.strip().endswith("losses (at 1 of 3 steps)/grads/weights bit-identical"), out


def test_exact_values_in_both_runs_are_checked(pair, capsys):
    # The same malformed value in both runs must not compare equal.
    for run in pair:
        edit_steps(run, lambda records: records[1].update(loss="garbage"))
    refused(capsys, *pair, f"{pair[0] / 'steps.jsonl'} line 2: 'loss' must be a hex float string or null")


def test_inf_and_nan_as_the_writer_spells_them_are_accepted(pair, capsys):
    for run in pair:
        edit_steps(run, lambda records: records[1].update(loss="nan", grad_norm="inf", lr="-inf"))
    rc, out, _ = compare_cli(capsys, *pair)
    assert rc == 0, out
    assert "note: loss is NaN in both runs at 1 of 3 steps (first: step 2): float.hex records no sign" in out


def test_a_record_lost_at_the_end_is_refused(pair, capsys):
    # No gap shows it: the run's meta.json says how many steps the run took (args.steps).
    def drop_last(records):
        records.pop()
    edit_steps(pair[0], drop_last)
    message = (f"{pair[0] / 'steps.jsonl'} ends at step 2, but the run ended at step 3 "
               f"({pair[0] / 'meta.json'} records args.steps = 3): the records after it are lost")
    refused(capsys, *pair, message)
    edit_steps(pair[1], drop_last)  # both lost it: still no verdict over fewer steps
    refused(capsys, *pair, message)


def test_a_record_lost_at_the_end_of_a_trainer_run_is_refused(pair, capsys):
    # FingerprintCallback records the step the Trainer ended at in final.json (max_steps may be -1).
    for run in pair:
        edit_json(run / "meta.json", lambda meta: meta["args"].pop("steps"))
        edit_json(run / "final.json", lambda final: final.update(last_step=3))
    assert compare_cli(capsys, *pair)[0] == 0
    edit_steps(pair[1], lambda records: records.pop())
    refused(capsys, *pair, f"{pair[1] / 'steps.jsonl'} ends at step 2, but the run ended at step 3 "
                           f"({pair[1] / 'final.json'} records 'last_step': 3)")


def test_runs_of_other_lengths_differ(tmp_path, capsys):
    # Runs that really took other numbers of steps (--steps 3 and 5) are different runs: exit 1, with a note.
    rc, out, _ = compare_cli(capsys, write_run(tmp_path / "a", 3), write_run(tmp_path / "b", 5))
    assert rc == 1 and "note: argument steps differs: 3 vs 5" in out, out
    assert "DIFFERENT: run A has 3 steps, run B 5; the first 3 are bit-identical" in out


def test_the_same_run_twice_is_refused(pair, capsys):
    a = pair[0]
    (a.parent / "link").symlink_to(a)
    for other in (a, a.parent / ".." / a.parent.name / "a", f"{a}/", a.parent / "link"):
        refused(capsys, a, other, f"{a} and {other} are the same run directory")
    # plot too: one curve drawn against itself said nothing, with exit 0
    assert main(["plot", str(a), str(a.parent / "link"), "-o", str(a.parent / "self.png")]) == 2
    assert "are the same run directory: plot two different runs" in capsys.readouterr().err
    assert not (a.parent / "self.png").exists()


def test_logs_that_start_at_other_steps_name_the_file_and_line(pair, capsys):
    edit_steps(pair[0], lambda records: records.pop(0))  # run A lost its first record
    refused(capsys, *pair, f"{pair[0] / 'steps.jsonl'} line 1: the log starts at step 2, expected step 1, "
                           f"where {pair[1] / 'steps.jsonl'} starts")


def test_meta_json_that_is_a_list_is_refused(pair, capsys):
    (pair[0] / "meta.json").write_text("[1, 2]")
    refused(capsys, *pair, f"{pair[0] / 'meta.json'} must hold a JSON object, not list")


def test_meta_json_syntax_error_names_line_and_column(pair, capsys):
    (pair[0] / "meta.json").write_text('{"args": {},\n "param_names": [1,}\n')
    refused(capsys, *pair, f"{pair[0] / 'meta.json'}: not valid JSON at line 2, column 20")


def test_final_json_without_tensors_is_refused(pair, capsys):
    edit_json(pair[1] / "final.json", lambda final: final.pop("tensors"))
    refused(capsys, *pair, f"{pair[1] / 'final.json'}: 'tensors' must be a non-empty object")


def test_final_json_without_sha256_is_refused(pair, capsys):
    edit_json(pair[1] / "final.json", lambda final: final.pop("weights_sha256"))
    refused(capsys, *pair, f"{pair[1] / 'final.json'}: 'weights_sha256' must be the sha256 of model.safetensors")


def test_plot_of_a_missing_run_names_it(tmp_path, capsys):
    a = write_run(tmp_path / "a", 2)
    assert main(["plot", str(a), str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nope'} is not a run directory: no such directory" in err and "Errno" not in err


def test_plot_skips_steps_without_a_loss(pair, capsys, tmp_path):
    # A Trainer with logging_steps=2 writes loss null on the other steps.
    for run in pair:
        edit_steps(run, lambda records: records[0].update(loss=None))
    assert main(["plot", str(pair[0]), str(pair[1]), "-o", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    edit_steps(pair[1], lambda records: [r.update(loss=None) for r in records])  # no loss in both
    assert main(["plot", str(pair[0]), str(pair[1]), "-o", str(tmp_path / "q.png")]) == 2
    err = capsys.readouterr().err
    assert f"nothing to plot: no step of {pair[0]} and {pair[1]} has a loss logged by both runs" in err, err
    assert "Traceback" not in err and not (tmp_path / "q.png").exists()


def test_plot_prints_the_file_it_writes(pair, capsys, tmp_path):
    assert main(["plot", str(pair[0]), str(pair[1]), "-o", str(tmp_path / "noext")]) == 0
    assert capsys.readouterr().out.strip() == f"plot: {tmp_path / 'noext.png'}"
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "noext").exists()
    assert main(["plot", str(pair[0]), str(pair[1]), "-o", str(tmp_path)]) == 2
    assert f"{tmp_path} is a directory: pass the file to write, e.g. {tmp_path / 'loss.png'}" in capsys.readouterr().err


def test_plot_draws_an_unfinished_run(tmp_path):
    # A plot needs only the steps: a run still training (no final.json yet) can be drawn.
    from dash_plugin.repro.plot import plot_runs

    a, b = write_run(tmp_path / "a", 4), write_run(tmp_path / "b", 4, change=(3, "loss", None))
    (b / "final.json").unlink()
    assert plot_runs(a, b, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# --- dash-repro run: output directories ----------------------------------------------------------------------

@pytest.fixture
def stand_in(tmp_path):
    """A training script that writes a complete two-step run at once: a copy of a hand-made one (a copy needs
    no torch import, so each stand-in run takes a fraction of a second)."""
    template = write_run(tmp_path / "template", 2)
    script = tmp_path / "stand_in.py"
    script.write_text("import shutil, sys\n"
                      f"shutil.copytree({str(template)!r}, sys.argv[sys.argv.index('--out') + 1],"
                      " dirs_exist_ok=True)\n")
    return script


def test_run_refuses_a_directory_with_results_unless_force(tmp_path, stand_in, capsys):
    out = tmp_path / "runs"
    assert main(["run", "--out", str(out), "--script", str(stand_in), "--steps", "2"]) == 0
    assert "IDENTICAL: 2 runs, 2 steps" in capsys.readouterr().out
    old = (out / "run1" / "steps.jsonl").stat().st_mtime_ns
    (out / "run1" / "mine.txt").write_text("keep me")

    assert main(["run", "--out", str(out), "--script", str(stand_in), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'run1'} and {out / 'run2'} already hold results of an earlier run; pass --force" in err
    assert (out / "run1" / "mine.txt").read_text() == "keep me"  # nothing was deleted
    assert (out / "run1" / "steps.jsonl").stat().st_mtime_ns == old

    assert main(["run", "--out", str(out), "--script", str(stand_in), "--steps", "2", "--force"]) == 0
    assert "IDENTICAL: 2 runs, 2 steps" in capsys.readouterr().out
    assert not (out / "run1" / "mine.txt").exists() and not (out / "run1" / "INCOMPLETE").exists()


def test_force_never_deletes_the_checkpoint_it_is_to_resume_from(tmp_path, stand_in, capsys):
    out = tmp_path / "runs"
    assert main(["run", "--out", str(out), "--script", str(stand_in), "--steps", "2"]) == 0
    capsys.readouterr()
    ckpt = out / "run1" / "checkpoint"
    ckpt.mkdir()
    (ckpt / "state.json").write_text("{}")
    assert main(["run", "--out", str(out), "--script", str(stand_in), "--steps", "2", "--force",
                 "--resume-from", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert f"--force would delete {out / 'run1'}, which holds --resume-from {ckpt}; resume into another --out" in err
    assert (ckpt / "state.json").exists() and (out / "run2" / "steps.jsonl").exists()   # nothing was deleted


@pytest.mark.parametrize("option, says", [(["--size", "tnyi"], "argument --size: invalid choice: 'tnyi'"),
                                          (["--lr", "-1"], "--lr=-1.0 / --warmup=5 are not allowed")])
def test_force_deletes_nothing_when_the_training_script_refuses_an_option(tmp_path, capsys, option, says):
    """The bundled script's own parser runs before --force deletes (it would refuse the option only
    once the runs had started)."""
    from dash_plugin.repro.cli import find_script
    out = tmp_path / "runs"
    for d in (out / "run1", out / "run2"):
        write_run(d, 2)
    assert main(["run", "--out", str(out), "--script", str(find_script(None)), "--force", *option]) == 2
    err = capsys.readouterr().err
    assert f"the training script refuses these options ({says}" in err and "nothing was deleted" in err
    assert (out / "run1" / "steps.jsonl").exists() and (out / "run2" / "final.json").exists()


def test_run_with_out_that_is_a_file(tmp_path, stand_in, capsys):
    out = tmp_path / "file.txt"
    out.write_text("not a directory")
    assert main(["run", "--out", str(out), "--script", str(stand_in)]) == 2
    err = capsys.readouterr().err
    assert f"cannot make the run directory {out / 'run1'}: {out} is a file; pass a directory as --out" in err
    assert "Traceback" not in err


def screen(text: str) -> list[str]:
    """The lines a terminal shows after `text`, for the control sequences tqdm writes: carriage return,
    newline and cursor up (ESC [ A)."""
    lines, row, col, i = [""], 0, 0, 0
    while i < len(text):
        if text.startswith("\x1b[A", i):
            row, i = max(0, row - 1), i + 3
            continue
        ch = text[i]
        if ch == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif ch == "\r":
            col = 0
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1:]
            col += 1
        i += 1
    return [line.rstrip() for line in lines if line.strip()]


def test_progress_bars_of_sequential_runs_do_not_overwrite_each_other(tmp_path, stand_in, capsys):
    assert main(["run", "--out", str(tmp_path / "runs"), "--script", str(stand_in), "--steps", "2"]) == 0
    err = capsys.readouterr().err
    # The same two lines on a terminal and where cursor moves are not understood (a log file, a CI console):
    # one finished bar per run, run1's not drawn over by run2's, and no half-drawn bar left below them.
    for shown in (screen(err), screen(err.replace("\x1b[A", ""))):
        assert len(shown) == 2, shown
        assert shown[0].startswith("run1: 100%") and "2/2" in shown[0]
        assert shown[1].startswith("run2: 100%") and "2/2" in shown[1]


def test_screen_renders_cursor_moves():
    # The helper above, on what tqdm writes for a bar at position 1: it is drawn one line down.
    assert screen("a\rb\n\n\rc\x1b[A\rd\n") == ["b", "d", "c"]


# --- dash-repro run: SIGTERM -----------------------------------------------------------------------------

SLEEPER = """import os, subprocess, sys, time
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
# A worker of its own, as `accelerate launch` has: it must be stopped with the run. And one in a session
# of its own, as torchrun's and `accelerate launch --multi_gpu`'s elastic launcher starts its workers:
# not in the run's process group, and re-parented once its launcher is killed.
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
elastic = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
(out / "pids.tmp").write_text(f"{os.getpid()} {worker.pid} {elastic.pid}")
(out / "pids.tmp").rename(out / "pids")
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    """A process exists and is not a zombie (a killed process whose parent has not yet collected it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _group_members(pgid: int) -> list[int]:
    """Live processes of a process group, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _start_sleeper_run(tmp_path):
    """`dash-repro run` of SLEEPER, once its trainer and worker are up and the run's watchdog is
    running (INCOMPLETE names the process group after the watchdog started).
    Returns (dash-repro process, out folder, (trainer, worker, worker in a session of its own))."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    out = tmp_path / "runs"
    cli = subprocess.Popen([sys.executable, "-m", "dash_plugin.repro", "run", "--out", str(out),
                            "--script", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids, marker = out / "run1" / "pids", out / "run1" / "INCOMPLETE"
    deadline = time.monotonic() + 120  # the start of a Python process, however slow the machine
    while not (pids.exists() and marker.exists() and "(process group" in marker.read_text()) \
            and cli.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not pids.exists():
        cli.kill()
        raise AssertionError(cli.communicate(timeout=30))
    return cli, out, tuple(map(int, pids.read_text().split()))


def _leave_no_sleeper(cli, out):
    if cli.poll() is None:
        cli.kill()
    pids = out / "run1" / "pids"
    if pids.exists():  # whatever the outcome, leave no sleeper behind
        trainer, *workers = map(int, pids.read_text().split())
        for pid in {*_group_members(trainer), *(w for w in workers if _alive(w))}:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
def test_sigterm_stops_the_whole_run_and_marks_it_incomplete(tmp_path, capsys):
    cli, out, (trainer, worker, elastic) = _start_sleeper_run(tmp_path)
    try:
        assert _alive(trainer) and _alive(worker) and set(_group_members(trainer)) == {trainer, worker}
        assert _alive(elastic)
        assert f"(process group {trainer})" in (out / "run1" / "INCOMPLETE").read_text()  # while it trains

        cli.send_signal(signal.SIGTERM)
        _, err = cli.communicate(timeout=60)
        deadline = time.monotonic() + 10  # the worker is orphaned by the kill; init collects it
        while (_group_members(trainer) or _alive(elastic)) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Checked before the clean-up below, which kills whatever is left.
        assert _group_members(trainer) == [] and not _alive(trainer) and not _alive(worker)
        assert not _alive(elastic), "the worker in a session of its own outlived the stop"
    finally:
        _leave_no_sleeper(cli, out)
    assert cli.returncode == 2, err
    assert "stopped by SIGTERM; the training was killed and marked incomplete" in err and "Traceback" not in err
    marker = (out / "run1" / "INCOMPLETE").read_text()
    assert marker.startswith("stopped by SIGTERM") and f"process group {trainer} was killed" in marker
    assert not (out / "run2").exists()  # run2 never started

    write_run(out / "run2", 2)  # even against a good run, the stopped one is refused
    refused(capsys, out / "run1", out / "run2", f"{out / 'run1'} is an incomplete run", "stopped by SIGTERM")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
def test_sigkill_of_dash_repro_still_stops_the_run(tmp_path):
    """SIGKILL cannot be caught: the run's watchdog sees dash-repro's end of its pipe close and
    kills the run's process group (trainer and worker) and the workers in sessions of their own, so no
    training is left behind."""
    cli, out, (trainer, worker, elastic) = _start_sleeper_run(tmp_path)
    try:
        assert _alive(trainer) and _alive(worker) and _alive(elastic)
        cli.kill()
        cli.communicate(timeout=30)
        deadline = time.monotonic() + 30   # the watchdog reads end of file and kills the group
        while (_alive(trainer) or _alive(worker) or _alive(elastic)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(trainer) and not _alive(worker) and not _alive(elastic)
    finally:
        _leave_no_sleeper(cli, out)
    marker = (out / "run1" / "INCOMPLETE").read_text()
    assert f"(process group {trainer}) and did not see it finish" in marker


def test_a_finished_run_releases_its_watchdog_without_a_kill(tmp_path):
    """The watchdog of a run that ended is told so ("d") and exits without touching the group."""
    from dash_plugin.repro import cli
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        proc = types.SimpleNamespace(dash_watchdog=cli._start_watchdog(victim.pid))
        watchdog = proc.dash_watchdog
        cli._release_watchdog(proc)
        cli._release_watchdog(proc)   # idempotent
        assert watchdog.returncode == 0 and proc.dash_watchdog is None   # 0: released, killed nothing
        assert victim.poll() is None   # still running
        dead = cli._start_watchdog(victim.pid)
        dead.stdin.close()             # end of file without "d": what dash-repro's death looks like
        assert dead.wait(timeout=30) == cli.WATCHDOG_KILLED
        assert victim.wait(timeout=30) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()


def test_a_signal_while_a_run_starts_is_held_until_the_run_can_be_stopped():
    from dash_plugin.repro.cli import Interrupted, _SignalsStopRuns

    signals, steps = _SignalsStopRuns(), []
    with pytest.raises(Interrupted, match="stopped by SIGTERM"):
        with signals.held():
            signals(signal.SIGTERM, None)  # what the handler does when SIGTERM arrives here
            steps.append("the run is registered for the cleanup")
    assert steps == ["the run is registered for the cleanup"]
    with pytest.raises(Interrupted, match="stopped by SIGHUP"):
        signals(signal.SIGHUP, None)  # outside held(): at once


def test_failed_run_is_marked_incomplete(tmp_path, capsys):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    out = tmp_path / "runs"
    assert main(["run", "--out", str(out), "--script", str(script)]) == 2
    assert "failed (exit 3)" in capsys.readouterr().err
    assert (out / "run1" / "INCOMPLETE").read_text().startswith("the training failed (exit 3)")


# --- dash-repro run --help ---------------------------------------------------------------------------------

def test_run_help_shows_the_training_options_and_sizes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--force" in out and "Every other option goes to the training script" in out
    for option in ("--size", "--steps", "--seq-len", "--batch-size", "--stop-at", "--resume-from"):
        assert option in out, option
    flat = " ".join(out.split())  # argparse wraps the help text
    assert "tiny: 2 layers, hidden 64, 2 heads (1 KV), MLP 256, 0.156M parameters" in flat
    assert "1b: 16 layers, hidden 2048, 32 heads (8 KV), MLP 8192, 974M parameters" in flat


def test_main_never_reports_a_bug_as_a_difference(monkeypatch, tmp_path, capsys):
    # An unexpected exception is a bug: exit 2 ("could not compare"), never 1 ("the runs differ").
    from dash_plugin.repro import cli

    def broken(args):
        raise TypeError("something unexpected")

    monkeypatch.setattr(cli, "cmd_compare", broken)
    assert main(["compare", str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "TypeError: something unexpected" in err and "internal error (a bug in dash-repro" in err



def test_grads_are_named_in_the_recorded_backward_order(tmp_path):
    """meta.json's grad_order (the order the backward made the gradients) decides which differing
    gradient is named first, i.e. where the difference entered; both runs must have recorded it."""
    a, b = write_run(tmp_path / "a", 3), write_run(tmp_path / "b", 3)
    edit_steps(b, lambda records: [r["grads"].update({n: "other" for n in NAMES[1:3]}) for r in records[1:]])
    cmp = compare_runs(a, b)
    # Without a recorded order: model order reversed (layer 1 before layer 0).
    assert cmp.first.step == 2 and "grads (in backward order) of 2 tensors" in cmp.verdict()
    assert cmp.verdict().index(NAMES[2]) < cmp.verdict().index(NAMES[1])
    order = [NAMES[3], NAMES[1], NAMES[2], NAMES[0]]   # a backward that made layer 0's gradient first
    for run in (a, b):
        edit_json(Path(run) / "meta.json", lambda m: m.update(grad_order=order))
    verdict = compare_runs(a, b).verdict()
    assert verdict.index(NAMES[1]) < verdict.index(NAMES[2]), verdict
    edit_json(Path(b) / "meta.json", lambda m: m.update(grad_order=order[::-1]))   # the runs disagree: not used
    verdict = compare_runs(a, b).verdict()
    assert verdict.index(NAMES[2]) < verdict.index(NAMES[1]), verdict
