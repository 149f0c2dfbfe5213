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


def test_a_sequence_without_kv_tiles_is_not_called_odd(capsys):
    """An empty sequence of a packed batch has 0 KV tiles: the fallback said "odd number of KV tiles
    (0)" (causal) and "one KV tile" (full)."""
    shape = ["--varlen", "0,512", "--block-m", "64", "--block-n", "64", "--heads", "1", "--sms", "8",
             "--schedules", "shift"]
    main(shape + ["--causal"])
    out = capsys.readouterr().out
    assert "descending (fallback: no KV tiles (no keys)), shift-symmetric" in out and "odd" not in out, out
    main(shape)
    out = capsys.readouterr().out
    assert "ascending (fallback: no KV tiles (no keys)), shift-cyclic" in out and "one KV tile" not in out, out
    main(SMALL + ["--causal", "--seqlen", "64", "--schedules", "shift"])   # 1 tile: odd, as before
    assert "descending (fallback: odd number of KV tiles (1))" in capsys.readouterr().out


def _shape_line(text):
    return next(line for line in text.splitlines() if line.startswith("shape: "))


def test_the_shape_line_abbreviates_a_long_length_list(capsys):
    """65535 sequences printed a shape line of about 200 KB: a long list shows its ends, the count
    and the total; a short one is unchanged."""
    from dash_plugin.schedules.cli import _short
    assert _short([1] * 65535) == "[1, 1, 1, ..., 1, 1, 1] (65535 sequences, 65535 tokens)"
    assert _short(list(range(1, 9))) == "[1, 2, 3, 4, 5, 6, 7, 8]" and _short([5]) == "5"
    lens = ",".join(map(str, [1, 2, 3] + [64] * 4090 + [7, 8, 9]))
    main(["--varlen", lens, "--block-m", "64", "--block-n", "64", "--heads", "1", "--schedules", "ascending"])
    line = _shape_line(capsys.readouterr().out)
    listed = "[1, 2, 3, ..., 7, 8, 9] (4096 sequences, 261790 tokens)"
    assert line.startswith(f"shape: seqlens_q={listed} seqlens_k={listed} heads=1 ") and len(line) < 300, line
    main(["--seqlen", "64", "--batch", "5000", "--block-m", "64", "--block-n", "64", "--heads", "1",
          "--schedules", "ascending"])   # a uniform batch as well
    assert "seqlens_q=[64, 64, 64, ..., 64, 64, 64] (5000 sequences, 320000 tokens) " in capsys.readouterr().out
    main(["--varlen", "512,300,64", "--schedules", "ascending"])
    assert _shape_line(capsys.readouterr().out).startswith("shape: seqlens_q=[512, 300, 64] seqlens_k=[512, 300, 64] ")


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
    (["--seqlen", "0"], ["--seqlen 0", "1..1048576"]),
    (["--seqlen", "64", "--seqlen-k", "0"], ["--seqlen-k 0", "1..1048576"]),
    (["--seqlen", "64", "--causal", "--window-right", "4"], ["--window-right", "4", "0 or -1"]),
    (["--varlen", "64,x"], ["--varlen", "'64,x'", "non-negative ints"]),
    (["--seqlen", "64", "--sms", "0"], ["--sms", "0", "1..4096"]),
    (["--seqlen", "64", "--launch", "x"], ["--launch", "'x'", "head-major, group-major"]),
    # costs: NaN and infinities passed a `< 0` check and printed nonsense
    (["--seqlen", "64", "--c", "nan"], ["--c nan", "a finite number > 0"]),
    (["--seqlen", "64", "--c", "0"], ["--c 0.0", "a finite number > 0"]),
    (["--seqlen", "64", "--r", "inf"], ["--r inf", "a finite number >= 0"]),
    # sizes: no bound exhausted the machine's memory without a word
    (["--seqlen", "99999999999999999999999"], ["--seqlen 99999999999999999999999", "1..1048576"]),
    (["--seqlen", "64", "--sms", "100000000000"], ["--sms 100000000000", "1..4096"]),
    (["--seqlen", "64", "--heads", "100000000"], ["--heads 100000000", "1..4096"]),
    (["--seqlen", "64", "--batch", "70000"], ["--batch 70000", "1..65535"]),
    (["--seqlen", "64", "--block-m", "1000000000000000000000"], ["--block-m", "1..1024"]),
    (["--seqlen", "65536", "--heads", "64"], ["26869760", "steps to simulate", "at most 8388608"]),
    # the API's window rule: -5 is no window size (it was taken as unbounded)
    (["--seqlen", "64", "--window-left", "-5"], ["--window-left -5", "each side must be an int in -1.."]),
    (["--varlen", "128,256", "--seqlen", "5000", "--batch", "7"], ["--varlen", "drop --seqlen, --batch"]),
    (["--seqlen", "64", "--hdim", "100"], ["--hdim 100", "multiples of 8 from 8 to 256, but for 104 and 112", "--block-m and --block-n"]),
])
def test_bad_flags(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    msg = capsys.readouterr().err
    assert e.value.code == 2, msg   # as argparse's own errors
    assert msg.startswith("dash-schedule: error: ") and msg.count("\n") == 1, msg
    for w in words:
        assert w in msg, (w, msg)
    assert "None" not in msg, msg   # a bad flag's message never shows an unset default
    if "--seqlen" in argv:   # named as typed ("--seqlen 0" was reported as --seqlen-q)
        assert "--seqlen-q" not in msg, msg


def test_a_group_too_big_for_the_sms_is_an_error_line_with_the_model_options_too(capsys):
    """The plan path refuses it with one line; the model's options (--assignment, --launch,
    --group-size) reach the simulator's deadlock, which was a traceback."""
    with pytest.raises(SystemExit) as e:
        main(["--seqlen", "256", "--block-m", "64", "--block-n", "64", "--heads", "1", "--sms", "2",
              "--schedules", "shift", "--assignment", "static"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("dash-schedule: error: shift on --sms 2 with the model's options: ")
    assert "pick 'descending' or 'ascending'" in err


def _figures(monkeypatch, argv):
    """The matplotlib figures `dash-schedule argv` draws (kept open), in drawing order."""
    from dash_plugin.schedules import gantt
    from dash_plugin.schedules.cli import parse_args, run

    figures = []
    monkeypatch.setattr(gantt.plt, "close", figures.append)
    run(parse_args(argv))
    return figures


def test_bubbles_are_shares_of_the_sms_the_header_names(tmp_path, monkeypatch, capsys):
    """shift's persistent grid has 64 programs on a 132-SM device: its bubbles count the 68 idle
    SMs as the other rows do (they read 0.0 %, over the grid's 64), and the picture says the same."""
    figures = _figures(monkeypatch, ["--seqlen", "1024", "--causal", "--schedules", "ascending,shift",
                                     "--png", str(tmp_path)])
    text = capsys.readouterr().out
    rows = _table(text)
    assert "SMs=132" in text and rows["ascending"] == (27.5, 1.0, 52.4)
    assert rows["shift"][0] == 27.0 and rows["shift"][2] == 51.5   # 1 - 1728 / (27 x 132)
    titles = [f.axes[0].get_title() for f in figures]
    assert titles[1].startswith("shift (causal, 16 heads, 132 SMs)  makespan 27, bubbles 51.5%"), titles
    assert len(figures[1].axes[0].get_yticks()) > 0 and figures[1].axes[0].get_ylim() == (131.5, -0.5)


@pytest.mark.parametrize("hdim, mask", [(128, ["--window-left", "512"]), (128, ["--window-right", "0"]),
                                        (128, ["--causal"]), (128, []), (256, ["--causal"]), (64, [])])
def test_default_tiles_are_the_hopper_kernels(hdim, mask, capsys):
    """The tiles come from the Hopper backend's own tile function: a window tiles like causal, and
    hdim 256 uses 64 x 48 (the CLI had FA3's table: 80 x 128 for windows, 64 x 80 at 256)."""
    from dash_plugin.kernels.hopper.tile_table import bwd_tiles
    main(["--seqlen", "512", "--hdim", str(hdim), "--sms", "8", "--schedules", "ascending", *mask])
    block_m, block_n = bwd_tiles(hdim, bool(mask))
    assert f" tiles {block_m}x{block_n} " in capsys.readouterr().out


def test_a_window_of_right_0_is_the_causal_mask(capsys):
    """--window-right 0 (no left limit) is the causal mask, as the API and the kernel read it: the
    same table as --causal, shift-symmetric included (it fell back to descending on 80 x 128 tiles)."""
    shape = ["--seqlen", "4096", "--heads", "4", "--schedules", "ascending,shift"]
    main(shape + ["--window-right", "0"])
    as_window = capsys.readouterr().out
    main(shape + ["--causal"])
    assert as_window == capsys.readouterr().out
    assert "mask=causal window=(-1,0)" in as_window and "shift-symmetric" in as_window


def test_png_titles_name_the_mask_the_kernel_runs(tmp_path, monkeypatch):
    for flags, mask in ((["--causal", "--window-left", "100"], "window"), (["--window-right", "0"], "causal"),
                        ([], "full")):
        figures = _figures(monkeypatch, SMALL + flags + ["--schedules", "ascending", "--png", str(tmp_path)])
        assert figures[0].axes[0].get_title().startswith(f"ascending ({mask}, 8 heads, 8 SMs)")


@pytest.mark.parametrize("make, words", [
    (lambda d: (d / "afile").write_text("x") and str(d / "afile"), ["afile: exists and is not a folder"]),
    (lambda d: "", ["--png ''", "a folder path"]),
    (lambda d: (d / "x" / "ascending.png").mkdir(parents=True) or str(d / "x"),
     ["ascending.png is a folder, where the picture of ascending goes"]),
    (lambda d: (d / "f").write_text("x") and str(d / "f" / "sub"), ["--png", "cannot create the folder"]),
])
def test_a_bad_png_path_is_refused_before_simulating(make, words, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(SMALL + ["--schedules", "ascending", "--png", make(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "simulating" not in err, err   # checked before the simulation
    for w in words:
        assert w in err, (w, err)


def test_a_schedule_named_twice_is_simulated_and_drawn_once(tmp_path, capsys):
    main(SMALL + ["--schedules", "ascending,shift,ascending", "--png", str(tmp_path)])
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.split()[0] in registry.names()] == [
        "ascending", "shift"]
    assert out.count("wrote ") == 2


def test_nothing_to_simulate_draws_without_a_warning(tmp_path):
    """Empty sequences: makespan 0 gave matplotlib's 'identical low and high xlims' warning."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["--varlen", "0,0", "--schedules", "ascending", "--png", str(tmp_path)]) == 0
    assert (tmp_path / "ascending.png").read_bytes()[:4] == b"\x89PNG"


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

    figures = _figures(monkeypatch, ["--seqlen", "256", "--block-m", "64", "--block-n", "64", "--heads", "16",
                                     "--sms", "8", "--schedules", "ascending", "--png", str(tmp_path)])
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
