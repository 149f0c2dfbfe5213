"""GPU tests of the Hopper backend at head dims 192 and 256 (marker `gpu`; skipped without an sm90
GPU and the `hopper` extra). Their tiles are FA4's: 64 x 96 (hdim 192) and 64 x 48 (hdim 256)
in the backward, with S not transposed (SdP_swapAB off), so the dropout step draws the mask in
the forward's orientation there.

- every schedule x causal/full x MHA/GQA 4:1 against the float64 oracle, within twice the error
  of plain bf16 PyTorch math; windows and softcap for two orders; packed batches;
- the forward, and the orders FA4 also runs (spt causal, ascending full), give FA4's bits;
- the computed orders give the bits of the same kernel reading the plan's tables (hdim 256
  `arrival` reads its tables: two KV tiles reach a row at one step there);
- 1,000 passes bitwise equal under another process's load;
- dropout: the forward's and the backward's masks read out exactly (tests/test_gpu_dropout.py's
  read-outs), and out/dq/dk/dv against the float64 oracle with the same mask.
"""
import os

import pytest
import torch

import dash_plugin
from dash_plugin.kernels import hopper
from dash_plugin.kernels.philox import keep_scale
from tests.gpu_oracle import (HOPPER_SKIP, assert_call_matches_oracle, assert_within_bar, keep_mask,
                              oracle_and_bf16_math, packed_oracle_and_bf16_math)
from tests.hardening_helpers import count_mismatching_passes, gpu_load, hang_guard
from tests.test_gpu_dropout import check_counts, forward_readout, identity, step, visible
from tests.test_gpu_hopper import ORDERED, SCHEDULES, backward, computed_and_read, problem
from tests.test_gpu_hopper_varlen import backward as packed_backward, packed

pytestmark = [pytest.mark.gpu, HOPPER_SKIP]

WIDE = (192, 256)
N_PASSES = int(os.environ.get("DASH_DETERMINISM_PASSES", "1000"))
SHAPES = {"mha": (2, 1000, 4, 4), "gqa4": (2, 1024, 8, 2)}   # (B, S, H_q, H_kv)


def check_against(oracle, got, names=("dq", "dk", "dv"), bars=None, want=None):
    for name, g, r, bar in zip(names, got, want or oracle.grads, bars or oracle.grad_bars):
        assert_within_bar(name, g, r, bar)


@pytest.fixture(scope="module", params=[(n, d, c) for n in SHAPES for d in WIDE for c in (True, False)],
                ids=lambda x: f"{x[0]}-d{x[1]}-{'causal' if x[2] else 'full'}")
def wide_problem(request):
    return problem_and_oracle(*request.param)


def problem_and_oracle(shape, d, causal):
    """A SHAPES problem run through the Hopper forward, and its float64 oracle."""
    p = problem(*SHAPES[shape], d, causal)
    return p, oracle_and_bf16_math(p["q"], p["k"], p["v"], p["do"], causal=causal)


def test_forward_matches_float64_oracle(wide_problem):
    p, oracle = wide_problem
    assert_within_bar("out", p["out"], oracle.out, oracle.out_bar)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_backward_matches_float64_oracle(wide_problem, schedule):
    p, oracle = wide_problem
    check_against(oracle, backward(p, schedule))


@pytest.mark.parametrize("mask", ({"window_left": 300, "window_right": 0}, {"window_left": 200, "window_right": 100},
                                  {"softcap": 30.0}), ids=("causal-window", "band", "softcap"))
@pytest.mark.parametrize("d", WIDE)
def test_windows_and_softcap_match_float64_oracle(d, mask):
    check_windows_and_softcap(d, mask)


def check_windows_and_softcap(d, mask):
    """Forward and two orders' backward against the float64 oracle under a window or softcap."""
    causal = mask.get("window_right") == 0
    p = problem(2, 1000, 4, 4, d, causal, seed=4, **mask)
    right = -1 if causal else mask.get("window_right", -1)
    oracle = oracle_and_bf16_math(p["q"], p["k"], p["v"], p["do"], causal=causal,
                                  window_left=mask.get("window_left", -1), window_right=right,
                                  softcap=mask.get("softcap", 0.0))
    assert_within_bar("out", p["out"], oracle.out, oracle.out_bar)
    for schedule in ("descending", "ascending"):
        check_against(oracle, backward(p, schedule))


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("gqa", (1, 4))
def test_forward_and_the_order_fa4_also_runs_give_fa4s_bits(d, causal, gqa):
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    p = problem(2, 1024, 8, 8 // gqa, d, causal, seed=1)
    out, lse = _flash_attn_fwd(p["q"], p["k"], p["v"], softmax_scale=d ** -0.5, causal=causal, num_splits=1,
                               return_lse=True)[:2]
    assert torch.equal(out, p["out"]) and torch.equal(lse, p["lse"])
    ours = backward(p, "spt" if causal else "ascending")
    theirs = _flash_attn_bwd(p["q"], p["k"], p["v"], p["out"], p["do"], p["lse"], softmax_scale=d ** -0.5,
                             causal=causal, deterministic=True)[:3]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("schedule, causal, d", [("descending", True, 192), ("descending", True, 256),
                                                 ("arrival", True, 192), ("shift", False, 192),
                                                 ("shift", False, 256), ("descending", False, 256)])
def test_computed_order_gives_the_bits_of_the_tables(schedule, causal, d):
    """As tests/test_gpu_hopper.py's test of that name, at the wide tiles (hdim 256 shift: more KV
    tiles than Q tiles, so the plan's fallback order, computed the same way)."""
    check_computed_order(schedule, causal, d)


def check_computed_order(schedule, causal, d):
    from tests.test_hopper_tables import plan_tables
    tables = plan_tables(schedule, seqlen=2048, head_dim=d, causal=causal, window=(-1, -1))
    assert tables.visit is not None, tables.variant
    p = problem(1, 2048, 4, 4, d, causal, seed=3)
    computed, read = computed_and_read(tables, p["do"], p["q"], p["k"], p["v"], p["out"], p["lse"], causal=causal)
    assert all(torch.equal(a, b) for a, b in zip(computed, read))


def test_hdim256_arrival_reads_its_tables_and_matches_the_oracle():
    from tests.test_hopper_tables import plan_tables
    assert plan_tables("arrival", seqlen=2048, head_dim=256, causal=True, window=(-1, -1)).visit is None
    p = problem(1, 2048, 4, 4, 256, True, seed=5)
    oracle = oracle_and_bf16_math(p["q"], p["k"], p["v"], p["do"], causal=True)
    with hang_guard(120):
        check_against(oracle, backward(p, "arrival"))


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("schedule", ("descending", "spt", "ascending"))
def test_packed_batch_matches_float64_oracle(d, schedule):
    check_packed_batch(d, schedule)


def check_packed_batch(d, schedule):
    lengths = ((1000, 1000), (129, 129), (0, 0), (700, 300), (256, 1100))
    p = packed(lengths, 8, 2, d, True, seed=6)
    kw = p["kw"]
    oracle = packed_oracle_and_bf16_math(p["q"], p["k"], p["v"], p["do"], kw["cu_seqlens_q"], kw["cu_seqlens_k"],
                                         causal=True)
    assert_within_bar("out", p["out"], oracle.out, oracle.out_bar)
    check_against(oracle, packed_backward(p, schedule))


# Causal shift is left out: at these tiles (block_n not a multiple of block_m) it falls back to
# descending, the same kernel as descending's case.
PASS_CASES = [(s, c, d) for s in ORDERED for c in (True, False) for d in WIDE
              if not (c and s == "shift") and (c or s != "arrival")]


def loaded_cases(cases):
    """Inputs per case (schedule, causal, head dim), each case's first pass taken before the load
    starts, and the load (a generator for a module fixture)."""
    problems = {case: problem(2, 2048, 8, 2, case[2], case[1], seed=2) for case in cases}
    unloaded = {case: backward(problems[case], case[0]) for case in cases}
    torch.cuda.synchronize()
    with gpu_load() as proc:
        yield problems, unloaded, proc


def check_many_passes(loaded, schedule, causal, d):
    problems, unloaded, load = loaded
    case = (schedule, causal, d)
    with hang_guard(300):
        bad = count_mismatching_passes(lambda: backward(problems[case], schedule), N_PASSES, reference=unloaded[case])
    assert load.alive(), f"load process died: {load.stderr()}"
    print(f"[hopper load] hdim{d} {schedule} {'causal' if causal else 'full'}: {N_PASSES} passes, {bad} mismatching")
    assert bad == 0


@pytest.fixture(scope="module")
def loaded_gpu():
    yield from loaded_cases(PASS_CASES)


@pytest.mark.parametrize("schedule, causal, d", PASS_CASES, ids=lambda x: x if isinstance(x, str) else str(x))
def test_bitwise_equal_over_many_passes_under_another_process(loaded_gpu, schedule, causal, d):
    check_many_passes(loaded_gpu, schedule, causal, d)


# Dropout: the read-outs of tests/test_gpu_dropout.py (q = k = 0; V or dO the identity).
@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_dropout_forward_mask_read_out_exactly(d, causal):
    check_dropout_forward_read_out(d, causal)


def check_dropout_forward_read_out(d, causal):
    p, batch, hq = 0.3, 2, 4
    got = forward_readout("hopper", batch=batch, hq=hq, hkv=2, seqlen_q=d, d=d, causal=causal, p=p, seed=11)
    vis = visible(d, d, causal)
    counts = (keep_mask(11, p, batch, hq, d, d) & vis).long()
    check_counts(got, counts, keep_scale(p) / vis.sum(-1, keepdim=True).clamp_min(1).double(), "hopper forward")


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("schedule, causal", [("descending", True), ("arrival", True), ("ascending", False),
                                              ("shift", False)])
def test_dropout_backward_mask_read_out_exactly_through_dv(d, schedule, causal):
    p, batch, hq, hkv = 0.3, 2, 4, 2
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.zeros(batch, d, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(batch, d, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, d, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    _, _, _, dv = step(q, k, v, identity(batch, d, hq, d), backend="hopper", schedule=schedule, causal=causal,
                       dropout_p=p, seed=12)
    assert dash_plugin.last_resolved().concrete_backend == "hopper"
    vis = visible(d, d, causal)
    keep = keep_mask(12, p, batch, hq, d, d) & vis
    counts = keep.view(batch, hkv, hq // hkv, d, d).sum(2)
    check_counts(dv.permute(0, 2, 3, 1).double().cpu(), counts,
                 keep_scale(p) / vis.sum(-1, keepdim=True).clamp_min(1).double(), f"hopper {schedule} dV")


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_dropout_matches_float64_oracle_with_the_same_mask(d, causal):
    check_dropout_against_oracle(d, causal)


def check_dropout_against_oracle(d, causal):
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v, do = (torch.randn(2, 1000, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2, 8))
    oracle = oracle_and_bf16_math(q, k, v, do, causal=causal, dropout_p=0.1, seed=14)
    for schedule in ("descending", "ascending"):
        got = step(q, k, v, do, backend="hopper", schedule=schedule, causal=causal, dropout_p=0.1, seed=14)
        check_against(oracle, got, ("out", "dq", "dk", "dv"), [oracle.out_bar, *oracle.grad_bars],
                      [oracle.out, *oracle.grads])


def test_auto_runs_wide_heads_here():
    check_auto_runs_hopper(WIDE)
    assert hopper.HEAD_DIMS == (64, 96, 128, 192, 256)


def check_auto_runs_hopper(head_dims):
    g = torch.Generator(device="cuda").manual_seed(15)
    for d in head_dims:
        q, k, v = (torch.randn(2, 2048, 4, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
                   for _ in range(3))
        out = dash_plugin.flash_attention(q, k, v, causal=True)
        got = dash_plugin.last_resolved()
        assert got.concrete_backend == "hopper", got.describe()
        assert_call_matches_oracle(q, k, v, out, causal=True)
