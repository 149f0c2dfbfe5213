"""GPU tests of the Hopper backend at head dims outside its tile table (marker `gpu`; skipped
without an sm90 GPU and the `hopper` extra). A multiple of 8 up to 256 runs at the tiles and FA4
configuration of the next table head dim up (64, 96, 128, 192, 256), its columns past the head
dim zero in shared memory: 8 (the smallest), 40 and 80 (Stable Diffusion's U-Net, Phi-2), 120
(hdim 128's tiles, 80-row Q tiles at full masks), 160 and 224 (dK/dV swapped: rows padded to 192
and 256). 104 and 112 run on the Triton backend, and say so.

- the forward against the float64 oracle, and FA4's bits (the same kernel through FA4's own
  launcher, whose Q tiles are not tail-aligned);
- every schedule's backward against the float64 oracle, MHA and GQA 4:1, causal and full;
- packed batches, windows, softcap; the computed orders give the bits of the plan's tables;
- 1,000 passes bitwise equal under another process's load (and at head dim 96, whose
  configuration 72-88 share);
- dropout: the forward's mask read out exactly, and out/dq/dk/dv against the oracle with it;
- `auto` runs these head dims here, not on the Triton backend.
"""
import pytest
import torch

import dash_plugin
from tests.gpu_oracle import HOPPER_SKIP, assert_call_matches_oracle, assert_within_bar
from tests.test_gpu_hopper import SCHEDULES, backward, problem
from tests.test_gpu_hopper_wide import (check_against, check_auto_runs_hopper, check_computed_order,
                                        check_dropout_against_oracle, check_dropout_forward_read_out,
                                        check_many_passes, check_packed_batch, check_windows_and_softcap,
                                        loaded_cases, problem_and_oracle)

pytestmark = [pytest.mark.gpu, HOPPER_SKIP]

OFF_TABLE = (8, 40, 80, 120, 160, 224)
MASKED = [(d, c) for d in OFF_TABLE for c in (True, False)]


def _mask_id(x):
    return f"d{x[0]}-{'causal' if x[1] else 'full'}"


@pytest.fixture(scope="module", params=MASKED, ids=_mask_id)
def mha_problem(request):
    return problem_and_oracle("mha", *request.param)


@pytest.fixture(scope="module", params=MASKED, ids=_mask_id)
def gqa_problem(request):
    return problem_and_oracle("gqa4", *request.param)


def test_forward_matches_float64_oracle(mha_problem):
    p, oracle = mha_problem
    assert_within_bar("out", p["out"], oracle.out, oracle.out_bar)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_backward_matches_float64_oracle(mha_problem, schedule):
    p, oracle = mha_problem
    check_against(oracle, backward(p, schedule))


@pytest.mark.parametrize("schedule", ("descending", "shift", "atomic"))
def test_gqa_matches_float64_oracle(gqa_problem, schedule):
    """Three orders: what GQA adds, the ordered dK/dV sums over query heads, does not depend on
    the Q-tile order."""
    p, oracle = gqa_problem
    assert_within_bar("out", p["out"], oracle.out, oracle.out_bar)
    check_against(oracle, backward(p, schedule))


@pytest.mark.parametrize("d", OFF_TABLE)
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_forward_gives_fa4s_bits(d, causal):
    """FA4's launcher tiles Q from the top. Ours aligns 192-row tiles (d <= 96) to the end of the
    1000 queries, and the top tile's O, stored per thread, must leave out the tile's columns past
    d (d = 8, 40): in O's layout they are the next head's first columns."""
    from flash_attn.cute.interface import _flash_attn_fwd
    p = problem(2, 1000, 8, 2, d, causal, seed=1)
    out, lse = _flash_attn_fwd(p["q"], p["k"], p["v"], softmax_scale=d ** -0.5, causal=causal, num_splits=1,
                               return_lse=True)[:2]
    assert torch.equal(lse, p["lse"])
    assert torch.equal(out, p["out"])


@pytest.mark.parametrize("mask", ({"window_left": 300, "window_right": 0}, {"window_left": 200, "window_right": 100},
                                  {"softcap": 30.0}), ids=("causal-window", "band", "softcap"))
@pytest.mark.parametrize("d", (40, 120, 160))
def test_windows_and_softcap_match_float64_oracle(d, mask):
    check_windows_and_softcap(d, mask)


@pytest.mark.parametrize("d, schedule", [(d, s) for d in (40, 80, 224) for s in ("descending", "spt")]
                         + [(40, "arrival"), (80, "arrival")])   # packed arrival: not at hdim 256's tiles
def test_packed_batch_matches_float64_oracle(d, schedule):
    check_packed_batch(d, schedule)


@pytest.mark.parametrize("schedule, causal, d", [("descending", True, 80), ("arrival", True, 40),
                                                 ("shift", False, 80), ("shift", False, 120),
                                                 ("descending", True, 160)])
def test_computed_order_gives_the_bits_of_the_tables(schedule, causal, d):
    check_computed_order(schedule, causal, d)


# Head dim 96 (in the table) shares its configuration with 72-88 and had no run under load before.
# 40/48 shift and arrival: what `auto` runs at head dims 33-48; 56 and 32 causal: at hdim 64's
# tiles with 64 and 32 padded columns, what it runs up to 64 (the causal symmetric shift, arrival).
PASS_CASES = [("descending", True, 80), ("spt", True, 40), ("shift", False, 80), ("ascending", False, 120),
              ("arrival", True, 120), ("descending", True, 224), ("descending", True, 96), ("shift", False, 96),
              ("shift", True, 40), ("shift", False, 48), ("arrival", True, 48), ("shift", True, 56),
              ("arrival", True, 32)]


@pytest.fixture(scope="module")
def loaded_gpu():
    yield from loaded_cases(PASS_CASES)


@pytest.mark.parametrize("schedule, causal, d", PASS_CASES, ids=lambda x: x if isinstance(x, str) else str(x))
def test_bitwise_equal_over_many_passes_under_another_process(loaded_gpu, schedule, causal, d):
    check_many_passes(loaded_gpu, schedule, causal, d)


@pytest.mark.parametrize("d", (40, 80))
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_dropout_forward_mask_read_out_exactly(d, causal):
    check_dropout_forward_read_out(d, causal)


@pytest.mark.parametrize("d", (40, 120, 160))
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_dropout_matches_float64_oracle_with_the_same_mask(d, causal):
    check_dropout_against_oracle(d, causal)


def test_auto_runs_these_head_dims_here():
    check_auto_runs_hopper(OFF_TABLE)


@pytest.mark.parametrize("d", (36, 104, 112))
def test_head_dims_it_does_not_run_go_to_triton_and_say_why(d):
    g = torch.Generator(device="cuda").manual_seed(16)
    q, k, v = (torch.randn(1, 256, 2, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    out = dash_plugin.flash_attention(q, k, v, causal=True)
    got = dash_plugin.last_resolved()
    assert got.concrete_backend == "triton"
    assert f"head_dim={d}" in got.describe(), got.describe()
    assert_call_matches_oracle(q, k, v, out, causal=True)
