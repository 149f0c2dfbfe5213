"""dash-bench: FLOP formulas, the shape list, the determinism check, the report writers and the
auto table on synthetic results, and the tiny CPU run end to end."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from dash_plugin.bench import autotable, cli, peers, protocol, report, runner
from dash_plugin.bench.protocol import Point


# ---------------------------------------------------------------------------- protocol
def test_flop_formulas_hand_computed():
    # 4 * 32 * 16 * 512^2 * 128 = 68,719,476,736
    assert protocol.fwd_flops(32, 16, 512, 128, causal=False) == 68_719_476_736
    assert protocol.fwd_flops(32, 16, 512, 128, causal=True) == 34_359_738_368
    assert protocol.bwd_flops(32, 16, 512, 128, causal=False) == 171_798_691_840
    # 4 * 1 * 8 * 16384^2 * 256 = 2^2 * 2^3 * 2^28 * 2^8 = 2^41
    assert protocol.fwd_flops(1, 8, 16384, 256, causal=False) == 2 ** 41
    assert protocol.bwd_flops(1, 8, 16384, 256, causal=True) == 2.5 * 2 ** 40


def test_protocol_points_shapes():
    points = protocol.protocol_points()
    assert len(points) == 24
    assert sorted({(p.batch, p.seqlen) for p in points}) == [
        (1, 16384), (2, 8192), (4, 4096), (8, 2048), (16, 1024), (32, 512)]
    assert {(p.hdim, p.heads_q, p.heads_kv) for p in points} == {(64, 32, 32), (128, 16, 16)}
    assert all(p.dtype == "bfloat16" for p in points)
    # 16k tokens, model dim 2048: every full point does 4 * 16384 * 2048 * S forward FLOPs
    for p in points:
        assert p.fwd_flops == 4 * 16384 * 2048 * p.seqlen / (2 if p.causal else 1)
    assert points[0].key == "hdim64-causal-s512"
    # head dims that do not divide the model dim: the nearest whole number of heads, FLOPs from them
    odd = {p.hdim: p for p in protocol.protocol_points(hdims=(80, 40, 160)) if p.seqlen == 1024 and p.causal}
    assert {d: p.heads_q for d, p in odd.items()} == {80: 26, 40: 51, 160: 13}
    assert odd[80].fwd_flops == protocol.fwd_flops(16, 26, 1024, 80, causal=True)
    with pytest.raises(ValueError, match="hdim must be positive, got 0"):
        protocol.heads_for(0)
    gqa = protocol.protocol_points(hdims=(256,), gqa=True)
    assert {(p.hdim, p.heads_q, p.heads_kv) for p in gqa} == {(256, 8, 8), (128, 16, 4)}
    assert "hdim128-gqa4-full-s16384" in {p.key for p in gqa}
    assert [p.key for p in protocol.quick_points()] == [
        "hdim64-causal-s2048", "hdim64-full-s2048", "hdim128-causal-s2048", "hdim128-full-s2048",
        "hdim128-causal-s8192", "hdim128-full-s8192"]


def test_protocol_rejects_bad_input():
    with pytest.raises(ValueError, match="seqlen must divide 16384"):
        protocol.protocol_points(seqlens=(3000,))
    with pytest.raises(ValueError, match="mask must be one of"):
        protocol.protocol_points(masks=("sliding",))
    with pytest.raises(ValueError, match="heads_q"):
        Point(batch=1, seqlen=8, heads_q=6, heads_kv=4, hdim=64, causal=False)


def test_select_impls():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [i.name for i in peers.select_impls("dash-s*,sdpa-cudnn", cpu)] == [
        "sdpa-cudnn", "dash-spt", "dash-shift", "dash-split"]
    names = [i.name for i in peers.select_impls(None, cuda)]
    assert "sdpa-math" not in names and {"flex", "sdpa-det", "dash-auto", "fa4-det"} <= set(names)
    assert [i.name for i in peers.select_impls(None, cpu, tiny=True)][:2] == ["sdpa-math", "dash-auto"]
    with pytest.raises(ValueError, match="'dash-fast' matches no implementation"):
        peers.select_impls("dash-fast", cpu)


# ---------------------------------------------------------------------------- the determinism check
class _NoisyIdentity(torch.autograd.Function):
    """Identity whose backward adds fresh noise: a deliberately nondeterministic gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + 1e-3 * torch.rand_like(grad)


def _fake_impl(name, transform=None, fail=None):
    def build(point, device):
        def fn(q, k, v):
            if fail is not None:
                raise fail
            q = transform(q) if transform else q
            return F.scaled_dot_product_attention(q, k, v, is_causal=point.causal)
        return fn
    return peers.Impl(name=name, family="test", description=name, layout="bhsd", build=build, devices=("cpu",))


_SMALL = Point(batch=1, seqlen=64, heads_q=2, heads_kv=2, hdim=32, causal=True, dtype="float32")
_FAST = runner.Settings(repeats=6, warmup_ms=0.0, rep_ms=1.0)


def test_determinism_check_detects_nondeterministic_fake():
    inputs = runner.make_inputs(_SMALL, torch.device("cpu"), seed=1)
    good, ref = runner.run_cell(_fake_impl("plain"), _SMALL, inputs, torch.device("cpu"), _FAST, None)
    noisy, _ = runner.run_cell(_fake_impl("noisy", _NoisyIdentity.apply), _SMALL, inputs, torch.device("cpu"),
                               _FAST, ref)
    assert good["status"] == "ok" and good["deterministic"] is True and good["det_mismatches"] == 0
    assert noisy["status"] == "ok" and noisy["deterministic"] is False
    assert noisy["det_mismatches"] == 5 and noisy["det_runs"] == 6
    # the noise shows in dq only, and the error against the first implementation is measured
    assert 0 < noisy["max_rel_err"] < 1e-2 and good["max_rel_err"] == 0.0 and noisy["err_ref"] == "plain"
    assert good["bwd_tflops"] > 0 and good["fwd_ms"] > 0


def test_forward_is_timed_before_and_after_the_backward_and_the_faster_kept(monkeypatch):
    timings = iter([5.0, 7.0, 3.0])   # forward, backward, forward again
    monkeypatch.setattr(runner, "bench_ms", lambda fn, device, **kw: next(timings))
    inputs = runner.make_inputs(_SMALL, torch.device("cpu"), seed=1)
    cell, _ = runner.run_cell(_fake_impl("plain"), _SMALL, inputs, torch.device("cpu"), _FAST, None)
    assert cell["fwd_ms_runs"] == [5.0, 3.0] and cell["fwd_ms"] == 3.0 and cell["bwd_ms"] == 7.0
    assert cell["fwd_tflops"] == _SMALL.fwd_flops / 3e-3 / 1e12


def test_failing_implementations_get_error_cells_and_the_run_goes_on():
    impls = [_fake_impl("refuses", fail=RuntimeError("No available kernel. Aborting execution.")),
             _fake_impl("breaks", fail=KeyError("boom")), _fake_impl("plain")]
    points = [_SMALL, Point(batch=2, seqlen=32, heads_q=2, heads_kv=2, hdim=32, causal=False, dtype="float32")]
    res = runner.run_benchmark(points, impls, torch.device("cpu"), _FAST, log=lambda s: None)
    status = {(c["point"], c["impl"]): c["status"] for c in res["cells"]}
    assert status == {(p.key, n): s for p in points
                      for n, s in (("refuses", "refused"), ("breaks", "error"), ("plain", "ok"))}
    assert res["complete"] is True and "KeyError" in res["cells"][1]["error"]
    # the reference of a point is the first implementation that ran there, not a failed one
    assert res["cells"][2]["err_ref"] == "plain"


def test_time_budget_skips_cells_cleanly():
    res = runner.run_benchmark([_SMALL], [_fake_impl("plain")], torch.device("cpu"), _FAST,
                               max_minutes=0.0, log=lambda s: None)
    assert [c["status"] for c in res["cells"]] == ["skipped"]
    assert res["complete"] is False and "time budget" in res["stop_reason"]


# ---------------------------------------------------------------------------- reports on synthetic results
def _synthetic_results():
    pts = [protocol.protocol_point(128, 16384, True), protocol.protocol_point(64, 2048, False),
           protocol.protocol_point(64, 8192, False)]
    keys = [p.key for p in pts]
    bwd = {  # impl -> backward TFLOP/s at the three points
        "sdpa-cudnn": (500.0, 400.0, 440.0), "flex": (370.0, 300.0, 330.0), "dash-atomic": (520.0, 420.0, 450.0),
        "dash-ascending": (400.0, 300.0, 420.0), "dash-descending": (480.0, 310.0, 400.0),
        "dash-shift": (440.0, 360.0, 430.0), "dash-split": (300.0, 200.0, 250.0), "dash-auto": (480.0, 360.0, 430.0),
    }
    cells = []
    for impl, values in bwd.items():
        for key, p, v in zip(keys, pts, values):
            cells.append({"point": key, "impl": impl, "status": "ok", "bwd_tflops": v,
                          "fwd_tflops": 600.0 if impl == "sdpa-cudnn" else 540.0,
                          "bwd_ms": p.bwd_flops / v / 1e9, "deterministic": impl not in ("sdpa-cudnn", "dash-atomic"),
                          "det_runs": 6, "det_mismatches": 0 if impl not in ("sdpa-cudnn", "dash-atomic") else 3,
                          "bwd_extra_bytes": 64 * 2 ** 20 if impl != "dash-split" else 200 * 2 ** 20,
                          "max_rel_err": 0.004})
    cells.append({"point": keys[0], "impl": "sdpa-cudnn-det", "status": "refused",
                  "error": "RuntimeError: No available kernel. Aborting execution."})
    names = list(bwd) + ["sdpa-cudnn-det"]
    return {"format": runner.FORMAT, "env": {"gpu": "NVIDIA H200", "sm_count": 132, "capability": "9.0",
                                             "torch": "2.11.0", "triton": "3.6.0", "device": "cuda",
                                             "date": "2026-11-22T00:00:00+00:00"},
            "config": {"repeats": 6, "warmup_ms": 25, "rep_ms": 100, "mode": "full"},
            "implementations": [{"name": n, "description": n, "claims_deterministic": None} for n in names],
            "unavailable": {"fa4": "flash_attn.cute does not import"},
            "points": [p.to_dict() for p in pts], "cells": cells, "complete": True, "elapsed_s": 1.0}


def test_targets_on_synthetic_results():
    # The issues' goals: >= 1.0x cuDNN (hdim 64/128, S >= 2k), >= 1.3x Flex and >= 0.97x atomic at every
    # point, >= 1.2x / >= 1.1x DASH effects, forward >= 1.0x FA4 and cuDNN.
    rows = {r["title"]: r for r in report.evaluate_targets(_synthetic_results())}
    cudnn = rows["det backward (auto) vs SDPA cuDNN non-det backward, hdim 64/128, S>=2k"]
    assert cudnn["points"] == 3 and cudnn["value"] == pytest.approx(360 / 400) and cudnn["verdict"] == "not met"
    assert "at hdim64-full-s2048" in cudnn["detail"]
    flex = rows["det backward (auto) vs FlexAttention backward"]
    assert flex["value"] == pytest.approx(360 / 300) and flex["verdict"] == "not met"
    assert "worst of 3 points, at hdim64-full-s2048" in flex["detail"]
    atomic = rows["det backward (auto) vs our atomic backward"]
    assert atomic["value"] == pytest.approx(360 / 420) and atomic["verdict"] == "not met"
    causal = rows["DASH: best of descending/shift vs ascending, causal hdim128 S=16k"]
    assert causal["value"] == pytest.approx(480 / 400) and causal["verdict"] == "met"
    assert "dash-descending" in causal["detail"]
    full = rows["DASH: shift vs ascending, full hdim64 S=2k"]
    assert full["value"] == pytest.approx(1.2) and full["verdict"] == "met"
    fwd = rows["forward vs SDPA cuDNN forward, hdim 64/128"]
    assert fwd["value"] == pytest.approx(0.9) and fwd["verdict"] == "not met"
    assert rows["forward vs FA4 forward, hdim 64/128"]["verdict"] == "not measured"   # no fa4 cells
    mem = rows["extra backward memory, det (auto) vs our atomic (worst point)"]
    assert mem["value"] == pytest.approx(1.0) and mem["verdict"] == "met"


def test_targets_are_not_judged_from_cpu_timings():
    results = _synthetic_results()
    results["env"]["device"] = "cpu"
    rows = report.evaluate_targets(results)
    assert {r["verdict"] for r in rows} == {"not judged (CPU timings; the goals are for the GPU)"}
    assert rows[0]["value"] == pytest.approx(360 / 400)   # the ratio itself is still shown
    assert "| not judged (CPU timings; the goals are for the GPU) |" in report.render_markdown(results)


def test_protocol_line_says_two_forward_timings_only_for_runs_that_made_them():
    results = _synthetic_results()
    phrase = "forward: the faster of two medians"
    assert phrase not in report.render_markdown(results)   # a run from before the change
    results["cells"][0]["fwd_ms_runs"] = [1.0, 1.1]
    assert phrase in report.render_markdown(results)


def test_target_verdicts_not_met_and_nondeterministic_auto():
    res = _synthetic_results()
    for c in res["cells"]:
        if c["impl"] == "dash-shift" and c["point"] == "hdim64-full-s2048":
            c["bwd_tflops"] = 310.0                      # shift barely beats ascending (1.03x)
        if c["impl"] == "dash-auto" and c["point"] == "hdim128-causal-s16384":
            c["bwd_tflops"] = 520.0                      # fast enough to beat cuDNN ...
            c["deterministic"], c["det_mismatches"] = False, 2   # ... but not bitwise deterministic
    rows = {r["title"]: r for r in report.evaluate_targets(res)}
    full = rows["DASH: shift vs ascending, full hdim64 S=2k"]
    assert full["value"] == pytest.approx(310 / 300) and full["verdict"] == "not met"
    # fast but not bitwise deterministic: never "met" (a backward target; the forward one is unaffected)
    cudnn = rows["det backward (auto) vs SDPA cuDNN non-det backward, hdim 64/128, S>=2k"]
    assert cudnn["value"] == pytest.approx(360 / 400)
    assert cudnn["verdict"] == "not met" and "NOT bitwise deterministic at hdim128-causal-s16384" in cudnn["detail"]
    assert "NOT bitwise" not in rows["forward vs SDPA cuDNN forward, hdim 64/128"]["detail"]
    for c in res["cells"]:
        if c["impl"] == "dash-auto" and c["point"] == "hdim128-causal-s16384":
            c["max_rel_err"] = 0.3                       # fast and wrong
    flex = {r["title"]: r for r in report.evaluate_targets(res)}["det backward (auto) vs FlexAttention backward"]
    assert flex["verdict"] == "not met" and "WRONG results (error > 0.05) at hdim128-causal-s16384" in flex["detail"]
    assert "| 520.0 nd WRONG |" in report.render_markdown(res)
    res["cells"] = [c for c in res["cells"] if c["impl"] != "flex"]
    assert {r["title"]: r for r in report.evaluate_targets(res)}[
        "det backward (auto) vs FlexAttention backward"]["verdict"] == "not measured"


def test_report_writers_on_synthetic_results(tmp_path):
    res = _synthetic_results()
    paths = report.write_reports(res, str(tmp_path), command="dash-bench --test")
    assert report.read_json(paths["json"]) == res
    md = open(paths["md"]).read()
    assert "NVIDIA H200 (132 SMs, sm 9.0)" in md and "`dash-bench --test`" in md
    header = "| row | mask | seqlen | B x Hq/Hkv | sdpa-cudnn | flex | dash-atomic | dash-ascending |"
    assert header in md
    # backward table row: cuDNN and atomic checked non-deterministic, the refused cell named
    assert ("| hdim128 | causal | 16384 | 1 x 16 | 500.0 nd | 370.0 | 520.0 nd | 400.0 | 480.0 | 440.0 | "
            "300.0 | 480.0 | refused |") in md
    assert "| hdim64 | full | 2048 | 8 x 32 | **no** (3/5) | yes |" in md        # determinism table
    assert "| hdim64 | full | 8192 | 2 x 32 | 64.0 | 64.0 | 64.0 | 64.0 | 64.0 | 64.0 | 200.0 |" in md
    assert ("| DASH: shift vs ascending, full hdim64 S=2k | 1.20x | >= 1.10x | met | at hdim64-full-s2048 |"
            in md)
    assert "| fa4 | not run: flash_attn.cute does not import | |" in md
    assert "- sdpa-cudnn-det at hdim128-causal-s16384: RuntimeError: No available kernel." in md
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_source_digest_names_the_code_that_ran(tmp_path, capsys):
    """Results record a digest of the sources (a device's copied tree may carry stale git
    metadata): the same files give the same digest, any edit or new file another; the report
    prints it and `dash-bench --source-digest` prints the installed tree's."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not code")
    first = runner.source_digest([str(pkg)])
    assert runner.source_digest([str(pkg)]) == first and len(first) == 16
    (pkg / "notes.txt").write_text("other")              # not a source: same digest
    assert runner.source_digest([str(pkg)]) == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    edited = runner.source_digest([str(pkg)])
    (pkg / "sub" / "c.py").write_text("")
    assert len({first, edited, runner.source_digest([str(pkg)])}) == 3
    assert runner.environment(torch.device("cpu"))["source_digest"] == runner.source_digest()
    res = _synthetic_results()
    res["env"]["source_digest"] = "0123abcd4567ef89"
    md = report.render_markdown(res, command="dash-bench --test")
    assert "dash_plugin commit" in md and "source digest 0123abcd4567ef89" in md
    assert cli.main(["--source-digest"]) == 0
    assert capsys.readouterr().out.strip() == runner.source_digest()


def test_auto_table_from_synthetic_results(tmp_path):
    res = _synthetic_results()
    autotable.write_auto_table(res, str(tmp_path / "auto.json"))
    table = json.load(open(tmp_path / "auto.json"))
    assert table == autotable.derive_auto_table(res)
    assert table["format"] == "dash-auto-table/1" and table["source"]["gpu"] == "NVIDIA H200"
    summary = [(r["head_dim"], r["mask"], r["seqlen_min"], r["seqlen_max"], r["schedule"]) for r in table["rules"]]
    # hdim64 full: shift wins at 2k (360) and at 8k (430 vs ascending 420): one merged rule
    # hdim128 causal: descending (480) wins at its only measured seqlen (split, 300, is a candidate too)
    assert summary == [(128, "causal", 0, None, "descending"), (64, "full", 0, None, "shift")]
    assert table["rules"][1]["measured"]["8192"] == {"ascending": 420.0, "descending": 400.0, "shift": 430.0,
                                                     "split": 250.0}
    # ascending wins at 8k once shift is slower there: two rules split at sqrt(2048 * 8192) = 4096
    for c in res["cells"]:
        if c["impl"] == "dash-shift" and c["point"] == "hdim64-full-s8192":
            c["bwd_tflops"] = 410.0
    table = autotable.derive_auto_table(res)
    assert [(r["seqlen_min"], r["seqlen_max"], r["schedule"]) for r in table["rules"] if r["mask"] == "full"] == [
        (0, 4096, "shift"), (4096, None, "ascending")]
    assert autotable.lookup(table, head_dim=64, causal=False, seqlen=1000) == "shift"
    assert autotable.lookup(table, head_dim=80, causal=False, seqlen=16384) == "ascending"
    assert autotable.lookup(table, head_dim=128, causal=True, seqlen=512) == "descending"


def test_auto_table_py_is_read_by_the_schedule_model(tmp_path, monkeypatch):
    """The .py output is a drop-in auto_table.py: dash_plugin.schedules.auto loads it and picks the winners."""
    import importlib.util
    from dash_plugin.schedules import auto

    res = _synthetic_results()
    for c in res["cells"]:
        if c["impl"] == "dash-shift" and c["point"] == "hdim64-full-s8192":
            c["bwd_tflops"] = 410.0
    rules = autotable.write_auto_table(res, str(tmp_path / "auto_table.py"), results_path="r.json")
    spec = importlib.util.spec_from_file_location("generated_auto_table", tmp_path / "auto_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.RULES == rules
    measured = [(r["mask"], r.get("head_dim_max"), r.get("seqlen_max"), r["schedule"]) for r in rules
                if "measured" in r["source"]]
    assert measured == [("causal", None, None, "descending"), ("full", None, 4095, "shift"),
                        ("full", None, None, "ascending")]
    # the structural rules of the current table (window, varlen, unequal lengths) come first, unchanged
    kept = [r for r in rules if "measured" not in r["source"]]
    assert kept and all(r["mask"] == "window" or "varlen" in r or "equal_lengths" in r for r in kept)
    assert rules[:len(kept)] == kept

    monkeypatch.setattr(auto, "auto_table", module)
    auto.load_rules.cache_clear()
    try:
        pick = lambda causal, d, s: auto.choose_schedule(causal=causal, head_dim=d, seqlen_q=s, seqlen_k=s)
        assert pick(False, 64, 2048) == "shift" and pick(False, 64, 4095) == "shift"
        assert pick(False, 64, 8192) == "ascending" and pick(False, 256, 4096) == "ascending"
        assert pick(True, 128, 16384) == "descending" and pick(True, 64, 512) == "descending"
    finally:
        auto.load_rules.cache_clear()


def test_auto_table_gives_each_measured_seqlen_its_own_winner_when_they_are_one_apart():
    """The boundary between two rules is the seqlens' geometric mean, but past the lower one: at 1000
    and 1001 it rounded down to 1000, and 1000 got its neighbour's rule."""
    res = _synthetic_results()
    for p in res["points"]:
        if p["key"] == "hdim64-full-s8192":
            p["seqlen"] = 2049
    for c in res["cells"]:
        if c["impl"] == "dash-shift" and c["point"] == "hdim64-full-s8192":
            c["bwd_tflops"] = 410.0   # ascending (420) wins the second point
    table = autotable.derive_auto_table(res)
    assert autotable.lookup(table, head_dim=64, causal=False, seqlen=2048) == "shift"
    assert autotable.lookup(table, head_dim=64, causal=False, seqlen=2049) == "ascending"


def test_auto_table_names_the_candidates_a_point_did_not_measure():
    """The synthetic run has no spt and no arrival column; a run with only one Triton column (as the
    Hopper-era runs whose dash-<schedule> columns ran Hopper kernels) leaves out all but that one."""
    res = _synthetic_results()
    assert autotable.unmeasured_candidates(res) == {key: ["spt", "arrival"] for key in (
        "hdim128-causal-s16384", "hdim64-full-s2048", "hdim64-full-s8192")}
    res["cells"] = [c for c in res["cells"] if c["impl"] in ("dash-shift", "sdpa-math")]
    assert autotable.unmeasured_candidates(res)["hdim64-full-s8192"] == [
        "ascending", "spt", "descending", "arrival", "split"]


def test_auto_table_ignores_nondeterministic_cells():
    res = _synthetic_results()
    for c in res["cells"]:
        if c["impl"] == "dash-descending":
            c["deterministic"] = False
    rules = autotable.derive_auto_table(res)["rules"]
    assert [r["schedule"] for r in rules if r["mask"] == "causal"] == ["shift"]
    for c in res["cells"]:
        if c["impl"].startswith("dash-"):
            c["status"] = "error"
    with pytest.raises(ValueError, match="cannot derive an auto table"):
        autotable.write_auto_table(res, "unused.py")


def test_auto_table_counts_dash_auto_as_the_schedule_it_ran():
    """A run that leaves out dash-split (dash-auto already runs it) still offers split: the auto cell
    measured it. Only for a schedule without its own column, and only if the cell was deterministic."""
    res = _synthetic_results()
    res["cells"] = [c for c in res["cells"] if c["impl"] != "dash-split"]
    auto_cell = next(c for c in res["cells"] if c["impl"] == "dash-auto" and c["point"] == "hdim128-causal-s16384")
    auto_cell.update(schedule_resolved="split", bwd_tflops=999.0, deterministic=True)
    rules = autotable.derive_auto_table(res)["rules"]
    causal = [r for r in rules if r["mask"] == "causal"]
    assert [r["schedule"] for r in causal] == ["split"] and causal[0]["measured"]["16384"]["split"] == 999.0
    auto_cell["deterministic"] = False
    assert [r["schedule"] for r in autotable.derive_auto_table(res)["rules"] if r["mask"] == "causal"] == [
        "descending"]


# ---------------------------------------------------------------------------- CLI
def test_cli_tiny_cpu_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["--device", "cpu", "--tiny", "--impls", "sdpa-math,dash-auto,dash-shift", "--repeats", "3",
                   "--rep-ms", "5", "--warmup-ms", "0", "--out", str(out),
                   "--write-auto-table", str(tmp_path / "auto.json"), "--auto-table-backend", "reference"])
    assert rc == 0
    res = report.read_json(str(out / "results.json"))
    assert [p["key"] for p in res["points"]] == ["hdim64-causal-s128", "hdim64-causal-s256",
                                                  "hdim64-full-s128", "hdim64-full-s256"]
    assert len(res["cells"]) == 12 and res["complete"] is True
    for c in res["cells"]:
        assert c["status"] == "ok", c
        assert c["deterministic"] is True and c["det_runs"] == 3
        assert c["bwd_tflops"] > 0 and c["fwd_tflops"] > 0 and c["bwd_extra_bytes"] is None
        # fp32 on the CPU: ours agrees with SDPA math, the point's reference
        assert c["err_ref"] == "sdpa-math" and c["max_rel_err"] < 1e-4
        if c["impl"].startswith("dash-"):   # what our call really ran is recorded
            assert c["kernel"] == "reference"
            assert c["schedule_resolved"] in peers.DETERMINISTIC_SCHEDULES
    md = (out / "results.md").read_text()
    assert "| hdim64 | full | 256 | 1 x 2 | yes | yes | yes |" in md
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    # The table's choices come from CPU timings, so which schedule wins is not fixed: check that
    # every rule picks the winner of the figures it records, and that the rules cover both masks.
    table = json.load(open(tmp_path / "auto.json"))
    auto_ran = {c["schedule_resolved"] for c in res["cells"] if c["impl"] == "dash-auto"}
    for mask in ("causal", "full"):
        rules = [r for r in table["rules"] if r["mask"] == mask]
        assert rules[0]["seqlen_min"] == 0 and rules[-1]["seqlen_max"] is None
        assert {r["head_dim"] for r in rules} == {64} and sum(len(r["measured"]) for r in rules) == 2
        for rule in rules:
            for figures in rule["measured"].values():
                assert set(figures) == {"shift"} | auto_ran
                best = max(figures.values())
                assert rule["schedule"] == next(s for s in autotable.CANDIDATES if figures.get(s) == best)
    captured = capsys.readouterr()
    log = captured.out
    assert "[4/4] hdim64-full-s256" in log and "dash-shift: fwd" in log
    # Two columns measure at most two of the candidates: the table says so (it picked among them only).
    missing = autotable.unmeasured_candidates(res, "reference")
    assert set(missing) == {p["key"] for p in res["points"]}
    assert all(set(autotable.CANDIDATES) - set(m) == {"shift"} | auto_ran for m in missing.values())
    assert f"warning: the table picks among fewer than the {len(autotable.CANDIDATES)} candidates at 4 point(s)" \
        in captured.err
    # GPU goals are not judged from CPU timings
    assert "-> not met" not in log and "-> met" not in log
    assert log.count("-> not judged (CPU timings; the goals are for the GPU)") == len(report.TARGETS)

    # the reports rebuild from the JSON alone
    rebuilt = tmp_path / "rebuilt"
    assert cli.main(["--from-json", str(out / "results.json"), "--out", str(rebuilt)]) == 0
    assert (rebuilt / "results.md").read_text() == md    # the measuring command is kept, too


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where CUDA is absent")
def test_cli_without_cuda_exits_with_a_clear_message(capsys):
    assert cli.main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert cli.main(["--device", "cpu"]) == 2
    assert "add --tiny" in capsys.readouterr().err


def test_cli_rejects_unknown_impl(capsys, tmp_path):
    assert cli.main(["--device", "cpu", "--tiny", "--impls", "nope", "--out", str(tmp_path)]) == 2
    assert "'nope' matches no implementation" in capsys.readouterr().err


def test_extra_memory_subtracts_baseline_and_returned_tensors(monkeypatch):
    """The GPU arithmetic, with the allocator statistics faked: peak - before - returned bytes."""
    stats = {"allocated": 1000, "peak": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: stats.update(peak=0))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats["peak"])

    def backward():   # a 4096-byte workspace on top of three 256-byte gradients
        stats["peak"] = 1000 + 4096 + 3 * 256
        return tuple(torch.zeros(64) for _ in range(3))

    grads, extra = runner.measure_extra_memory(backward, torch.device("cuda"))
    assert extra == 4096 and len(grads) == 3
    assert runner.measure_extra_memory(lambda: torch.zeros(4), torch.device("cpu"))[1] is None


def test_watchdog_reports_a_hung_cell(monkeypatch):
    import time as _time
    exits, reports = [], []
    monkeypatch.setattr(runner, "_exit_after_hang", lambda: exits.append(True))

    calls = []

    def slow(q):
        if not calls:        # the first call stands for a kernel that never returns
            _time.sleep(3.0)
        calls.append(1)
        return q
    impls = [_fake_impl("plain"), _fake_impl("stuck", slow), _fake_impl("after")]
    runner.run_benchmark([_SMALL], impls, torch.device("cpu"), _FAST, log=lambda s: None,
                         cell_timeout_s=1.5, on_hang=reports.append)
    assert exits == [True] and len(reports) == 1
    hung = reports[0]
    assert [(c["impl"], c["status"]) for c in hung["cells"]] == [("plain", "ok"), ("stuck", "hung"),
                                                                 ("after", "skipped")]
    assert hung["complete"] is False and "stuck at hdim32-causal-s64" in hung["stop_reason"]
    assert "hung" in report.render_markdown(hung)


def _split_runs(whole, folder) -> list[str]:
    """`whole` written as two runs of disjoint points, folder/part<n>/results.json, as
    `dash-bench --out part<n>` would leave them."""
    parts = []
    for n, keys in enumerate((["hdim128-causal-s16384"], ["hdim64-full-s2048", "hdim64-full-s8192"])):
        part = dict(whole, points=[p for p in whole["points"] if p["key"] in keys],
                    cells=[c for c in whole["cells"] if c["point"] in keys],
                    config=dict(whole["config"], command=f"dash-bench part{n}"))
        (folder / f"part{n}").mkdir()
        report.write_json(part, str(folder / f"part{n}" / "results.json"))
        parts.append(str(folder / f"part{n}" / "results.json"))
    return parts


def test_merge_split_runs(tmp_path):
    """A full protocol split over several commands: the reports and the targets cover every point."""
    whole = _synthetic_results()
    parts = _split_runs(whole, tmp_path)
    assert cli.main(["--from-json", ",".join(parts), "--out", str(tmp_path / "all")]) == 0
    merged = report.read_json(str(tmp_path / "all" / "results.json"))
    assert [p["key"] for p in merged["points"]] == [p["key"] for p in whole["points"]]
    assert report.evaluate_targets(merged) == report.evaluate_targets(whole)
    assert "Merged from 2 runs" in (tmp_path / "all" / "results.md").read_text()
    with pytest.raises(ValueError, match="is in both"):
        report.merge_results([whole, whole], ["a", "b"])
    other = dict(whole, env=dict(whole["env"], gpu="NVIDIA H100"))
    with pytest.raises(ValueError, match="different devices"):
        report.merge_results([whole, other], ["a", "b"])


def test_from_json_never_writes_over_its_inputs(tmp_path, monkeypatch, capsys):
    """--out left out is ./dash-bench-out, as --help says (it was the first input's folder, and
    the merge replaced that run's results.json); an --out or --write-auto-table that names an
    input is refused."""
    parts = _split_runs(_synthetic_results(), tmp_path)
    before = [open(p, "rb").read() for p in parts]
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--from-json", ",".join(parts)]) == 0
    assert [open(p, "rb").read() for p in parts] == before
    assert len(report.read_json("dash-bench-out/results.json")["points"]) == 3
    capsys.readouterr()
    for flags, named in ((["--out", os.path.dirname(parts[1])], "--out " + os.path.dirname(parts[1])),
                         (["--write-auto-table", parts[0]], "--write-auto-table " + parts[0])):
        assert cli.main(["--from-json", ",".join(parts), *flags]) == 2
        err = capsys.readouterr().err
        assert f"dash-bench: {named} would overwrite " in err and "which --from-json reads" in err, err
    assert [open(p, "rb").read() for p in parts] == before


def _cell(results, impl, point="hdim64-full-s2048"):
    return next(c for c in results["cells"] if c["impl"] == impl and c["point"] == point)


@pytest.mark.parametrize("tamper, message", [
    (lambda r: r.update(cells=5), "cells = 5 is not a list"),
    (lambda r: r.update(cells=None), "cells = None is not a list"),
    (lambda r: r.update(points={}), "points = {} is not a list"),
    (lambda r: r["cells"][0].pop("point"), "cells[0] has no 'point'"),
    (lambda r: r["cells"].__setitem__(0, "x"), "cells[0] is str 'x', not an object"),
    (lambda r: r["points"][0].pop("key"), "points[0] has no 'key'"),
    (lambda r: r["implementations"][0].pop("name"), "implementations[0] has no 'name'"),
    (lambda r: r.pop("env"), "the file has no 'env'"),
    (lambda r: r.update(env=None), "env = None is not an object"),
    (lambda r: r.update(config=[]), "config = [] is not an object"),
    (lambda r: r["config"].update(dropout_p="abc"), "config.dropout_p = 'abc' is not a number in [0, 1)"),
    (lambda r: r["cells"][0].update(bwd_tflops="fast"), "cells[0].bwd_tflops = 'fast' is not a finite number >= 0"),
    (lambda r: r["cells"][0].update(bwd_tflops=-1.0), "cells[0].bwd_tflops = -1.0 is not a finite number >= 0"),
    (lambda r: r["cells"][0].update(bwd_tflops=float("nan")), "cells[0].bwd_tflops = nan is not a finite"),
    (lambda r: r["cells"][0].update(fwd_tflops=float("inf")), "cells[0].fwd_tflops = inf is not a finite"),
    (lambda r: r["cells"][0].update(bwd_ms=-2.0), "cells[0].bwd_ms = -2.0 is not a finite number >= 0"),
    (lambda r: r["cells"][0].update(deterministic=False) or r["cells"][0].pop("det_mismatches"),
     "cells[0] (sdpa-cudnn at hdim128-causal-s16384) has no 'det_mismatches'"),
    (lambda r: r["cells"][0].update(plan_variants=5), "cells[0].plan_variants = 5 is not a list of strings"),
    (lambda r: r.update(format="dash-bench/999"), "format 'dash-bench/999' is not 'dash-bench/1'"),
    (lambda r: r.update(format=None), "format None is not 'dash-bench/1'"),
    # a cell given twice: the last one won silently, and a verdict could flip
    (lambda r: r["cells"].append(dict(_cell(r, "dash-auto"), bwd_tflops=9999.0)),
     "cells[25] gives dash-auto at hdim64-full-s2048 a second time"),
    (lambda r: r["cells"].append(dict(r["cells"][0], point="nope")), "cells[25] is at point 'nope', which is not"),
    (lambda r: r["cells"].append(dict(r["cells"][0], impl="ghost")), "implementation 'ghost', which is not"),
    (lambda r: r["points"].append(r["points"][0]), "point 'hdim128-causal-s16384' is listed twice"),
    (lambda r: r["cells"][0].update(dropout_error=5), "cells[0].dropout_error = 5 is not"),   # was a TypeError
])
def test_from_json_refuses_a_broken_or_tampered_file(tamper, message, tmp_path, capsys):
    """One line naming the file and what is wrong, exit 2; never a traceback or a quietly wrong report."""
    res = _synthetic_results()
    tamper(res)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))   # NaN and Infinity as Python's json writes and reads them
    assert cli.main(["--from-json", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"dash-bench: {path}: {err.split(': ', 2)[2]}" and message in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_every_committed_results_file_passes_the_check():
    import pathlib
    files = sorted((pathlib.Path(__file__).resolve().parent.parent / "docs" / "benchmarks").rglob("results.json"))
    assert files
    for f in files:
        report.read_json(str(f))


def test_a_zero_denominator_is_not_measurable():
    """bwd_tflops 0.0 is legal JSON: the ratio over it is not measurable (it raised ZeroDivisionError)."""
    title = "det backward (auto) vs our atomic backward"
    res = _synthetic_results()
    _cell(res, "dash-atomic").update(bwd_tflops=0.0)
    row = {r["title"]: r for r in report.evaluate_targets(res)}[title]
    assert row["value"] == pytest.approx(480 / 520) and row["points"] == 2   # the two other points
    assert "; not measurable where dash-atomic reads 0 (hdim64-full-s2048)" in row["detail"]
    for c in res["cells"]:
        if c["impl"] == "dash-atomic":
            c["bwd_tflops"] = 0.0
    row = {r["title"]: r for r in report.evaluate_targets(res)}[title]
    assert (row["value"], row["verdict"]) == (None, "not measured")
    assert row["detail"].startswith("not measurable where dash-atomic reads 0 (hdim128-causal-s16384, ")
    assert f"| {title} | - | >= 0.97x | not measured | not measurable" in report.render_markdown(res)


def test_a_value_given_twice_is_refused(capsys):
    """--hdims 64,64 gave each point twice (the report keeps one cell per point and column)."""
    for argv, message in ((["--hdims", "64,64"], "--hdims '64,64': 64 given twice; list each once"),
                          (["--seqlens", "512,1024,512"], "--seqlens '512,1024,512': 512 given twice; list each once"),
                          (["--masks", "causal,causal"], "--masks 'causal,causal': causal given twice; list each once"),
                          (["--hdims", "abc"], "--hdims must be a comma list of integers, got 'abc'")):
        assert cli.main(argv) == 2   # refused before the CUDA check
        assert capsys.readouterr().err == f"dash-bench: {message}\n"


@pytest.mark.parametrize("argv, message", [
    # 0 was refused by the protocol without the flag's name; 100000 was not refused before the run
    (["--hdims", "0"], "--hdims '0': 0 not allowed; allowed: 1..256 (the head dims the API takes)"),
    (["--hdims", "64,100000"], "--hdims '64,100000': 100000 not allowed; allowed: 1..256 (the head dims the API "
                               "takes)"),
    (["--hdims", "257,-8"], "--hdims '257,-8': 257, -8 not allowed; allowed: 1..256"),
    (["--seqlens", "0"], "--seqlens '0': 0 not allowed; allowed: the divisors of 16384 (every point is batch x "
                         "seqlen = 16384 tokens)"),
    (["--seqlens=-512,3000,2048"], "--seqlens '-512,3000,2048': -512, 3000 not allowed; allowed: the divisors of "
                                   "16384"),
    (["--hdims", "0,0"], "--hdims '0,0': 0 not allowed;"),   # each bad value named once
    # --quick runs its own points: the flags were dropped without a word
    (["--quick", "--hdims", "999"], "--quick runs its own points: drop --hdims / --seqlens"),
    (["--quick", "--seqlens", "2048"], "--quick runs its own points: drop --hdims / --seqlens"),
])
def test_a_bad_list_value_is_refused_naming_flag_value_and_allowed(argv, message, capsys):
    assert cli.main(["--device", "cpu", *argv]) == 2   # refused before anything else is asked
    err = capsys.readouterr().err
    assert err.startswith(f"dash-bench: {message}") and err.count("\n") == 1, err


def test_list_values_at_the_bounds_are_taken():
    """Head dims the API takes but the Hopper kernel does not (100) fall back to Triton: not refused."""
    points = cli._points(cli.build_parser().parse_args(["--hdims", "1,100,256", "--seqlens", "1,16384"]))
    assert sorted({(p.hdim, p.seqlen) for p in points}) == [(d, s) for d in (1, 100, 256) for s in (1, 16384)]
    from dash_plugin import checks
    assert checks.HEAD_DIM_MAX == 256   # the bound the messages above name


def test_out_says_which_earlier_report_files_it_replaces(tmp_path, capsys):
    """Replacing an earlier report in --out is by design (a rerun updates its folder), but it is said,
    in one line, before the first file is written."""
    source = tmp_path / "in" / "results.json"
    source.parent.mkdir()
    report.write_json(_synthetic_results(), str(source))
    out = tmp_path / "out"
    assert cli.main(["--from-json", str(source), "--out", str(out)]) == 0
    assert "replacing" not in capsys.readouterr().out   # nothing there yet
    assert cli.main(["--from-json", str(source), "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "replacing" in line]
    assert lines == [f"replacing the earlier report in {out}: results.json, results.md, results.png"]
    # a run says it before it measures (its JSON so far replaces results.json after the first point)
    (out / "results.json").unlink()
    (out / "results.png").unlink()
    assert cli.main(["--device", "cpu", "--tiny", "--impls", "sdpa-math", "--masks", "full", "--repeats", "2",
                     "--rep-ms", "1", "--warmup-ms", "0", "--out", str(out)]) == 0
    log = capsys.readouterr().out
    assert log.index(f"replacing the earlier report in {out}: results.md\n") < log.index("[1/2]"), log


def test_cli_gqa_only_selects_the_gqa_row_alone():
    from dash_plugin.bench import cli
    args = cli.build_parser().parse_args(["--gqa-only", "--seqlens", "2048,4096"])
    points = cli._points(args)
    assert [(p.hdim, p.heads_q, p.heads_kv, p.seqlen) for p in points] == \
        [(128, 16, 4, 2048), (128, 16, 4, 4096)] * 2
    with pytest.raises(ValueError, match="--gqa-only"):
        cli._points(cli.build_parser().parse_args(["--gqa-only", "--hdims", "64"]))


# ---------------------------------------------------------------------------- --dropout
@pytest.mark.parametrize("text, value", [("0.1", 0.1), ("0", 0.0), ("0.5", 0.5), ("2e-3", 2e-3)])
def test_cli_dropout_flag_parses(text, value):
    assert cli.build_parser().parse_args(["--dropout", text]).dropout == value
    assert cli.build_parser().parse_args([]).dropout == 0.0


@pytest.mark.parametrize("argv", [["--dropout", "-0.1"], ["--dropout=-0.1"], ["--dropout", "1.0"],
                                  ["--dropout", "abc"], ["--dropout", "nan"], ["--dropout", "inf"],
                                  ["--dropout", "1.5"], ["--dropout", "1e-3"], ["--dropout", "0.999"]])
def test_cli_dropout_flag_rejects_bad_values_naming_flag_value_and_range(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    value = argv[-1].split("=")[-1]
    assert "--dropout" in err and repr(value) in err and "above 2**-9 and below 1 - 2**-9" in err, err
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        runner.Settings(dropout_p=1.0)


def test_which_implementations_have_dropout():
    impls = {i.name: i for i in peers.all_impls()}
    without = {n for n, i in impls.items() if i.build_dropout is None}
    assert {"fa4", "fa4-det", "sdpa-cudnn", "sdpa-cudnn-det", "flex"} == without
    assert impls["sdpa-flash"].build_dropout is not None and impls["sdpa-flash"].layout == "bhsd"
    assert all(i.build_dropout is not None for n, i in impls.items() if n.startswith("dash-"))
    assert "FA4" in impls["fa4"].no_dropout and "cuDNN" in impls["sdpa-cudnn"].no_dropout
    assert impls["fa4"].describe()["dropout"] is False and impls["dash-auto"].describe()["dropout"] is True


def _fake_dropout_impl(name, fail=None):
    impl = _fake_impl(name)

    def build_dropout(point, device, dropout_p, seed):
        gen = torch.Generator().manual_seed(seed)

        def fn(q, k, v):
            if fail is not None:
                raise fail
            out = F.scaled_dot_product_attention(q, k, v, is_causal=point.causal)
            keep = (torch.rand(out.shape, generator=gen) >= dropout_p).to(out.dtype)
            return out * keep / (1 - dropout_p)
        return fn
    impl.build_dropout = build_dropout
    return impl


def test_run_cell_times_with_and_without_dropout_and_marks_peers_without_it():
    cpu = torch.device("cpu")
    settings = runner.Settings(repeats=3, warmup_ms=0.0, rep_ms=1.0, dropout_p=0.25)
    inputs = runner.make_inputs(_SMALL, cpu, seed=1)
    ok, _ = runner.run_cell(_fake_dropout_impl("drops"), _SMALL, inputs, cpu, settings, None)
    assert ok["status"] == "ok" and ok["dropout_status"] == "ok"
    assert ok["dropout_on_ms"] > 0 and ok["dropout_off_ms"] > 0
    assert ok["dropout_cost"] == pytest.approx(ok["dropout_on_ms"] / ok["dropout_off_ms"])
    none, _ = runner.run_cell(_fake_impl("plain"), _SMALL, inputs, cpu, settings, None)
    assert none["status"] == "ok" and none["dropout_status"] == "no dropout"
    assert not any(k in none for k in ("dropout_on_ms", "dropout_off_ms", "dropout_cost"))
    # a failing dropout call costs only the dropout figures, never the cell's others
    broken, _ = runner.run_cell(_fake_dropout_impl("broken", fail=RuntimeError("boom")), _SMALL, inputs, cpu,
                                settings, None)
    assert broken["status"] == "ok" and broken["bwd_ms"] > 0
    assert broken["dropout_status"] == "error" and "boom" in broken["dropout_error"]
    # without --dropout nothing of this is measured
    plain, _ = runner.run_cell(_fake_dropout_impl("drops"), _SMALL, inputs, cpu, _FAST, None)
    assert not any(k.startswith("dropout") for k in plain)


def test_cli_tiny_cpu_run_with_dropout(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["--device", "cpu", "--tiny", "--masks", "causal", "--impls", "sdpa-math,dash-auto",
                   "--dropout", "0.1", "--repeats", "2", "--rep-ms", "2", "--warmup-ms", "0", "--out", str(out)])
    assert rc == 0
    res = report.read_json(str(out / "results.json"))
    assert res["config"]["dropout_p"] == 0.1 and len(res["cells"]) == 4
    for c in res["cells"]:
        assert c["status"] == "ok" and c["dropout_status"] == "ok", c
        for key in ("dropout_on_ms", "dropout_off_ms", "dropout_cost"):
            assert isinstance(c[key], float) and c[key] > 0 and c[key] != float("inf"), (key, c)
        if c["impl"] == "dash-auto":   # a fixed seed: the dropout passes repeat their bits
            assert c["dropout_deterministic"] is True and c["dropout_det_runs"] == 2
    section = res["dropout"]
    assert section["dropout_p"] == 0.1 and section["seed"] == 0
    assert [(r["impl"], r["status"]) for r in section["cells"]] == [("sdpa-math", "ok"), ("dash-auto", "ok")] * 2
    assert all(r["cost"] > 0 and r["with_ms"] > 0 and r["without_ms"] > 0 for r in section["cells"])
    assert [t["title"] for t in section["targets"]] == [t.title for t in report.DROPOUT_TARGETS]
    md = (out / "results.md").read_text()
    assert "## Dropout (p = 0.1): forward + backward with dropout / without" in md
    assert "| row | mask | seqlen | B x Hq/Hkv | sdpa-math | dash-auto |" in md
    row = next(line for line in md.splitlines() if line.startswith("| hdim64 | causal | 128 | 2 x 2 |")
               and "ms)" in line)
    assert row.count("x (") == 2
    log = capsys.readouterr().out
    assert "dropout fwd+bwd" in log
    assert log.count("-> not judged (CPU timings; the goals are for the GPU)") == (
        len(report.TARGETS) + len(report.DROPOUT_TARGETS))
    rebuilt = tmp_path / "rebuilt"
    assert cli.main(["--from-json", str(out / "results.json"), "--out", str(rebuilt)]) == 0
    assert (rebuilt / "results.md").read_text() == md
    assert report.read_json(str(rebuilt / "results.json"))["dropout"] == section


def _synthetic_dropout_results():
    """_synthetic_results with --dropout 0.1: our columns (deterministic ones and atomic), SDPA flash
    with dropout, FA4 and cuDNN without."""
    res = _synthetic_results()
    res["config"]["dropout_p"] = 0.1
    res["config"]["seed"] = 0
    res["cells"] = [c for c in res["cells"] if c["impl"] != "sdpa-cudnn-det"]
    keys = [p["key"] for p in res["points"]]    # hdim128-causal-s16384, hdim64-full-s2048, hdim64-full-s8192
    cost = {"dash-auto": (1.05, 1.12, 1.10), "dash-ascending": (1.06, 1.10, 1.10),
            "dash-descending": (1.07, 1.15, 1.10), "dash-shift": (1.04, 1.10, 1.10), "dash-split": (1.03, 1.1, 1.1),
            "dash-atomic": (1.50, 1.50, 1.50), "sdpa-flash": (1.20, 1.25, 1.30)}
    for c in res["cells"]:
        if c["impl"] in cost:
            figure = cost[c["impl"]][keys.index(c["point"])]
            c.update(dropout_status="ok", dropout_off_ms=10.0, dropout_on_ms=10.0 * figure, dropout_cost=figure)
            if c["impl"].startswith("dash-"):
                c.update(dropout_deterministic=True, dropout_det_runs=6, dropout_det_mismatches=0)
        else:
            c.update(dropout_status="no dropout", dropout_note=f"no dropout ({c['impl']})")
    for key in keys:
        res["cells"].append({"point": key, "impl": "sdpa-flash", "status": "ok", "bwd_tflops": 300.0,
                             "fwd_tflops": 400.0, "deterministic": False, "det_runs": 6, "det_mismatches": 2,
                             "max_rel_err": 0.004,
                             "dropout_status": "ok", "dropout_off_ms": 10.0,
                             "dropout_on_ms": 10.0 * cost["sdpa-flash"][keys.index(key)],
                             "dropout_cost": cost["sdpa-flash"][keys.index(key)]})
        res["cells"].append({"point": key, "impl": "fa4", "status": "ok", "bwd_tflops": 600.0, "fwd_tflops": 600.0,
                             "deterministic": False, "det_runs": 6, "det_mismatches": 1, "max_rel_err": 0.004,
                             "dropout_status": "no dropout",
                             "dropout_note": "no dropout (FA4 has none)"})
    names = ["sdpa-cudnn", "sdpa-flash", "flex", "fa4", "dash-atomic", "dash-ascending", "dash-descending",
             "dash-shift", "dash-split", "dash-auto"]
    res["implementations"] = [{"name": n, "description": n, "family": n.split("-")[0],
                               "claims_deterministic": n in ("flex",) or (n.startswith("dash-") and n != "dash-atomic")}
                              for n in names]
    res["unavailable"] = {}
    return res


def test_dropout_targets_and_report_on_synthetic_results(tmp_path):
    res = _synthetic_dropout_results()
    rows = {r["title"]: r for r in report.evaluate_targets(res)}
    assert len(rows) == len(report.TARGETS) + len(report.DROPOUT_TARGETS)
    absolute, vs_flash = (rows[t.title] for t in report.DROPOUT_TARGETS)
    # hdim128 S >= 2k is one point here: the worst deterministic column of ours (atomic is not judged)
    assert absolute["value"] == pytest.approx(1.07) and absolute["verdict"] == "met" and absolute["op"] == "<="
    assert "dash-descending at hdim128-causal-s16384" in absolute["detail"]
    assert "(implementation, point) pairs (5 implementations)" in absolute["detail"]
    # below SDPA flash's cost at every point: worst ours / flash is 1.15 / 1.25 (hdim64 full 2k)
    assert vs_flash["value"] == pytest.approx(1.15 / 1.25) and vs_flash["verdict"] == "met"
    assert vs_flash["op"] == "<" and "dash-descending at hdim64-full-s2048" in vs_flash["detail"]
    md = report.render_markdown(res)
    assert ("| dropout cost (fwd+bwd with / without), our deterministic impls, hdim128, S>=2k | 1.070x | <= 1.08x "
            "| met |") in md
    section = md[md.index("## Dropout (p = 0.1)"):md.index("## Implementations")]
    line = next(row for row in section.splitlines() if row.startswith("| hdim128 | causal | 16384 |"))
    texts = [t.strip() for t in line.strip("|").split("|")][4:]
    by_impl = dict(zip(report.impl_names(res), texts))
    assert by_impl["fa4"] == "no dropout" and by_impl["sdpa-cudnn"] == "no dropout" and by_impl["flex"] == "no dropout"
    assert by_impl["sdpa-flash"] == "1.200x (12 / 10 ms)" and by_impl["dash-auto"] == "1.050x (10.5 / 10 ms)"
    # JSON: the dropout section, with a status and never a figure for those without dropout
    paths = report.write_reports(res, str(tmp_path))
    summary = report.read_json(paths["json"])["dropout"]
    fa4 = [r for r in summary["cells"] if r["impl"] == "fa4"]
    assert fa4 and all(r["status"] == "no dropout" and "cost" not in r for r in fa4)

    # over the goal, and a deterministic column whose fixed-seed dropout passes differ: not met
    for c in res["cells"]:
        if c["impl"] == "dash-split" and c["point"] == "hdim128-causal-s16384":
            c.update(dropout_cost=1.09)
        if c["impl"] == "dash-auto" and c["point"] == "hdim64-full-s8192":
            c.update(dropout_deterministic=False, dropout_det_mismatches=2)
        if c["impl"] == "dash-shift" and c["point"] == "hdim64-full-s8192":
            c.update(dropout_cost=1.30)
    rows = {r["title"]: r for r in report.evaluate_targets(res)}
    absolute, vs_flash = (rows[t.title] for t in report.DROPOUT_TARGETS)
    assert absolute["value"] == pytest.approx(1.09) and absolute["verdict"] == "not met"
    assert vs_flash["value"] == pytest.approx(1.0) and vs_flash["verdict"] == "not met"   # equal is not below
    assert "NOT bitwise deterministic at dash-auto@hdim64-full-s8192" in vs_flash["detail"]
    assert " nd |" in report.render_markdown(res)
    # the goals are GPU goals
    res["env"]["device"] = "cpu"
    assert {r["verdict"] for r in report.evaluate_targets(res)} == {report.NOT_JUDGED}
    # runs with different dropout probabilities do not merge
    other = dict(res, config=dict(res["config"], dropout_p=0.3))
    with pytest.raises(ValueError, match="different --dropout"):
        report.merge_results([res, other], ["a", "b"])


def test_random_inputs_have_the_points_shape_and_repeat():
    from dash_plugin.bench.protocol import random_inputs
    a = random_inputs(64, 1024, 2, device="cpu")
    b = random_inputs(64, 1024, 2, device="cpu")
    assert [t.shape for t in a] == [torch.Size([16, 1024, 32, 64])] * 2
    assert all(t.dtype == torch.bfloat16 for t in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])


def test_a_column_that_ran_a_fallback_order_is_marked_and_left_out_of_the_targets():
    """dash-shift at a point where shift does not apply runs the fallback its plan names: the cell says
    so (`fb`, and the list above the tables), and the shift target does not count it as shift's figure."""
    res = _synthetic_results()
    target = "DASH: shift vs ascending, full hdim64 S=2k"
    assert {r["title"]: r for r in report.evaluate_targets(res)}[target]["verdict"] == "met"
    for c in res["cells"]:
        if c["impl"] == "dash-shift" and c["point"] == "hdim64-full-s2048":
            c["plan_variants"] = ["descending (fallback: block_n 48 not a multiple of block_m 64)"]
    md = report.render_markdown(res)
    assert " fb |" in md
    assert "dash-shift at hdim64-full-s2048 -> descending (fallback: block_n 48 not a multiple of block_m 64)" in md
    assert {r["title"]: r for r in report.evaluate_targets(res)}[target]["verdict"] == "not measured"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors reach Triton in its interpreter only")
def test_call_info_records_the_orders_the_backward_plan_holds():
    """Under the Triton interpreter: `arrival` on a full mask runs descending (its plan's fallback),
    on a causal one arrival itself; the cell records which."""
    from types import SimpleNamespace

    import dash_plugin
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, 1, 32, generator=g) for _ in range(3))
    for causal, want in ((False, ["descending (fallback: not a causal mask)"]), (True, ["arrival"])):
        dash_plugin.flash_attention(q, k, v, causal=causal, schedule="arrival", backend="triton")
        info = peers._dash_call_info(q, k, SimpleNamespace(causal=causal))
        assert (info["schedule_resolved"], info["kernel"], info["plan_variants"]) == ("arrival", "triton", want)
        assert bool(report.ran_a_fallback(info)) is not causal


def test_the_auto_table_counts_only_the_triton_backends_cells():
    """auto_table.py serves calls that run on Triton: on an sm90 machine the dash-<schedule> columns
    run the Hopper kernels (kernel "hopper") and must not decide it; dash-triton-<schedule> columns do."""
    import copy
    res = _synthetic_results()
    for c in res["cells"]:
        if c["impl"].startswith("dash-"):
            c["kernel"] = "hopper"
    with pytest.raises(ValueError, match="no deterministic dash schedule ran successfully on the triton backend"):
        autotable.write_auto_table(res, "unused.json")
    triton = []
    for c in res["cells"]:
        if c["impl"] == "dash-ascending":
            t = copy.deepcopy(c)
            t.update(impl="dash-triton-ascending", kernel="triton", bwd_tflops=123.0)
            triton.append(t)
    res["cells"] += triton
    rules = autotable.derive_auto_table(res)["rules"]
    assert rules and {r["schedule"] for r in rules} == {"ascending"}
    assert all(set(m) == {"ascending"} and set(m.values()) == {123.0} for r in rules for m in r["measured"].values())
    assert autotable.derive_auto_table(res, "hopper")["rules"]   # the Hopper cells, when asked for


def test_the_documented_targets_are_the_ones_the_report_judges():
    """docs/benchmarks/README.md's targets table: one row per target of report.TARGETS, with its goal."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "README.md").read_text()
    block = text[text.index("- **Targets**"):text.index("With `--dropout P` two more rows")]
    documented = sorted(re.findall(r"\| ([≥≤]) (\d+\.\d\d) \|$", block, re.M))
    judged = sorted(("≥" if t.higher_is_better else "≤", f"{t.goal:.2f}") for t in report.TARGETS)
    assert documented == judged


@pytest.mark.parametrize("argv, message", [
    (["--masks", "bogus"], "--masks 'bogus': allowed: causal, full"),
    (["--max-minutes", "-1"], "--max-minutes -1.0: must be > 0"),
    (["--cell-timeout", "-5"], "--cell-timeout -5.0: must be >= 0 seconds"),
    (["--seed", "-5"], "--seed -5: must be an int in 0..2**63-1"),
    # past torch.manual_seed's 2**64-1: it failed at the first point, with --out already made
    (["--seed", str(2 ** 70)], f"--seed {2 ** 70}: must be an int in 0..2**63-1 (it is also the dropout seed"),
    (["--seed", str(2 ** 63)], f"--seed {2 ** 63}: must be an int in 0..2**63-1"),   # the API's dropout_seed
    (["--hdims", "x"], "--tiny runs its own points: drop --hdims / --seqlens"),
    (["--from-json", "/nonexistent/results.json"], "--from-json /nonexistent/results.json: No such file"),
    (["--from-json", ","], "--from-json ',' is empty: give a comma list of results files"),
    (["--from-json", ""], "--from-json '' is empty: give a comma list of results files"),
    (["--write-auto-table", ""], "--write-auto-table '': give a file path"),
    (["--write-auto-table", "{tmp}"], "--write-auto-table {tmp}: is a folder; give a file path"),
    (["--impls", ","], "--impls ',' names no implementation; give a comma list of names or patterns"),
    (["--rep-ms", "nan"], "rep_ms one > 0, got 2.0, nan"),   # NaN passed the range check
    (["--warmup-ms", "inf"], "warmup_ms must be a finite number >= 0"),
])
def test_bad_flags_are_named_with_what_is_allowed(argv, message, capsys, tmp_path):
    """Values argparse lets through are refused before anything runs (exit 2, one line, no traceback)."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    message = message.replace("{tmp}", str(tmp_path))
    rc = cli.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_the_largest_seed_is_taken(tmp_path):
    """2**63-1 is the API's largest dropout_seed; the inputs' generator takes it plus the point's number."""
    cli._check_flags(cli.build_parser().parse_args(["--seed", str(2 ** 63 - 1), "--out", str(tmp_path)]))
    runner.make_inputs(_SMALL, torch.device("cpu"), seed=2 ** 63 - 1 + 100)
    from dash_plugin import flash_attention
    q = torch.randn(1, 16, 1, 8)
    flash_attention(q, q, q, dropout_p=0.5, dropout_seed=2 ** 63 - 1)


def test_an_out_path_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    assert cli.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "f")]) == 2
    assert "--out" in capsys.readouterr().err and (tmp_path / "f").read_text() == ""


def test_from_json_reports_a_merged_run_whose_parts_name_no_command(tmp_path):
    """merged_from entries may leave out command and date (the check allows it): the report says so
    instead of raising KeyError."""
    res = _synthetic_results()
    res["merged_from"] = [{"date": "2026-11-26"}, {}]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))
    assert cli.main(["--from-json", str(path), "--out", str(tmp_path / "out")]) == 0
    assert "`None` (2026-11-26); `None` (None)" in (tmp_path / "out" / "results.md").read_text()
