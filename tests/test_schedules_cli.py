"""dash-schedule CLI: the makespan table, the pictures, errors that name flag, value and allowed."""
import os
import subprocess
import sys

import pytest

from dash_plugin.schedules import registry
from dash_plugin.schedules.cli import main

SMALL = ["--seqlen", "512", "--block-m", "64", "--block-n", "64", "--heads", "8", "--sms", "8"]


def _table(text):
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] in registry.names() and parts[2].endswith("x"):
            rows[parts[0]] = (float(parts[1]), float(parts[2][:-1]), float(parts[3][:-1]))
    return rows


def test_table_and_pictures(tmp_path, capsys):
    out = tmp_path / "png"
    assert main(SMALL + ["--causal", "--schedules", "ascending,descending,shift",
                         "--png", str(out)]) == 0
    text = capsys.readouterr().out
    rows = _table(text)
    assert rows["ascending"][0] == 99.5 and rows["ascending"][1] == 1.0
    assert rows["descending"][0] == 57.5
    assert rows["descending"][1] == pytest.approx(99.5 / 57.5, abs=1e-3)
    assert rows["shift"][0] == 54.0 and rows["shift"][2] == 0.0  # no bubbles
    assert "shift-symmetric" in text
    for name in ("ascending", "descending", "shift"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_full_mask_and_fallback_named(capsys):
    main(["--seqlen", "512", "--block-m", "64", "--block-n", "64", "--heads", "1", "--sms", "8",
          "--schedules", "shift,ascending"])
    rows = _table(capsys.readouterr().out)
    assert rows["ascending"][0] == 15.5 and rows["shift"][0] == 12.0
    main(SMALL + ["--causal", "--seqlen", "448", "--schedules", "shift"])  # 7 tiles: odd
    assert "descending (fallback: odd number of KV tiles (7))" in capsys.readouterr().out


def test_varlen_gqa_window(capsys):
    main(["--varlen", "512,300,64", "--hdim", "64", "--heads", "8", "--kv-heads", "2",
          "--window-left", "128", "--window-right", "0", "--schedules", "ascending,shift,split"])
    rows = _table(capsys.readouterr().out)
    assert set(rows) == {"ascending", "shift", "split"}
    assert rows["shift"][0] <= rows["ascending"][0]


@pytest.mark.parametrize("argv, words", [
    (["--seqlen", "64", "--schedules", "ascending,fast"], ["--schedules", "'fast'", "allowed", "shift"]),
    (["--seqlen", "64", "--assignment", "random"], ["--assignment", "'random'", "dynamic, static"]),
    (["--seqlen", "64", "--hdim", "300"], ["--hdim", "300", "1..256"]),
    (["--seqlen", "64", "--heads", "8", "--kv-heads", "3"], ["--kv-heads", "3", "divisor"]),
    (["--hdim", "64"], ["give --seqlen", "--seqlen-q and --seqlen-k", "--varlen"]),
    (["--seqlen", "0"], ["--seqlen-q", "0", "positive int"]),
    (["--seqlen", "64", "--causal", "--window-right", "4"], ["--window-right", "4", "0 or -1"]),
    (["--varlen", "64,x"], ["--varlen", "'64,x'", "non-negative ints"]),
    (["--seqlen", "64", "--sms", "0"], ["--sms", "0", "positive int"]),
    (["--seqlen", "64", "--launch", "x"], ["--launch", "'x'", "head-major, group-major"]),
])
def test_bad_flags(argv, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    msg = str(e.value.code)
    for w in words:
        assert w in msg, (w, msg)
    assert "None" not in msg, msg   # a bad flag's message never shows an unset default


def test_every_option_has_help_text():
    from dash_plugin.schedules.cli import build_parser
    options = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 20
    assert [a.option_strings[0] for a in options if not (a.help or "").strip()] == []


def test_progress_is_reported_while_it_works(tmp_path, capsys):
    main(SMALL + ["--causal", "--schedules", "descending,shift", "--png", str(tmp_path)])
    err = capsys.readouterr().err.splitlines()
    assert err == ["dash-schedule: simulating descending (1/3)", "dash-schedule: simulating shift (2/3)",
                   "dash-schedule: simulating ascending (3/3), the baseline",
                   "dash-schedule: drawing descending (1/2)", "dash-schedule: drawing shift (2/2)"]


def test_gantt_legend_names_every_head_drawn(tmp_path, monkeypatch):
    """16 heads drawn, 16 in the legend (it listed the first 8); heads share one of 20 colours."""
    from dash_plugin.schedules import gantt
    from dash_plugin.schedules.cli import parse_args, run

    figures = []
    monkeypatch.setattr(gantt.plt, "close", figures.append)
    run(parse_args(["--seqlen", "256", "--block-m", "64", "--block-n", "64", "--heads", "16", "--sms", "8",
                    "--schedules", "ascending", "--png", str(tmp_path)]))
    labels = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert labels[:16] == [f"compute, head {h}" for h in range(16)] and len(labels) == 18
    assert [label for _, label in gantt.head_legend(range(45))][:2] == ["compute, heads 0, 20, 40",
                                                                        "compute, heads 1, 21, 41"]
    assert len(gantt.head_legend(range(45))) == 20


def test_argparse_type_error_names_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--seqlen", "abc"])
    assert e.value.code == 2
    assert "--seqlen" in capsys.readouterr().err


def test_python_dash_m():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "dash_plugin.schedules", "--seqlen", "256",
                        "--block-m", "64", "--block-n", "64", "--heads", "1", "--sms", "4",
                        "--schedules", "ascending,shift"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    rows = _table(r.stdout)
    assert rows["ascending"][0] == 7.5 and rows["shift"][0] == 6.0
