"""GPU tests of the Hopper backend (kernels/hopper_backend.py; marker `gpu`; skipped without an
sm90 GPU and the `hopper` extra).

- every schedule it runs x mask x GQA x head dim against the float64 oracle, within twice the
  error of plain bf16 PyTorch math (the FlashAttention papers' bar);
- the orders FA4 also runs (ascending on full masks, spt on causal ones) give FA4's bits;
- 1,000 passes bitwise equal per ordered schedule while another process loads the GPU, and while
  a side stream occupies SMs at launch (the order never depends on how many SMs are free);
  `atomic` shown to differ; the same digests in a fresh process;
- the forward against the oracle, and bitwise equal over repeated calls;
- through the API: `auto` takes this backend where it runs the call and says why where it does
  not; a Hugging Face model through it matches fp32 eager.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

import dash_plugin
from dash_plugin import dispatch
from dash_plugin.kernels import hopper
from dash_plugin.schedules import registry

from tests.gpu_oracle import (HOPPER_SKIP, assert_call_matches_oracle, assert_same_sums, assert_within_bar,
                              oracle_and_bf16_math, rel)
from tests.hardening_helpers import gpu_load, count_mismatching_passes, hang_guard, sha256

pytestmark = [pytest.mark.gpu, HOPPER_SKIP]

SCHEDULES = tuple(s for s in registry.names() if "hopper" in registry.get(s).backends)
ORDERED = tuple(s for s in SCHEDULES if registry.get(s).ordered)
N_PASSES = int(os.environ.get("DASH_DETERMINISM_PASSES", "1000"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def problem(b, s, hq, hkv, d, causal, seed=0, **mask):
    """Inputs, and out/lse from the Hopper forward; `mask`: window_left/window_right/softcap."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (hq, hkv, hkv, hq))
    out, lse = hopper.attention_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, **mask)
    return dict(q=q, k=k, v=v, do=do, out=out, lse=lse, causal=causal, mask=mask)


def backward(p, schedule):
    return dispatch.attention_backward(p["do"], p["q"], p["k"], p["v"], p["out"], p["lse"],
                                       softmax_scale=p["q"].shape[-1] ** -0.5, causal=p["causal"],
                                       schedule=schedule, deterministic=schedule != "atomic", backend="hopper",
                                       **p["mask"])


SHAPES = {"mha": (2, 1000, 4, 4), "gqa4": (2, 1024, 8, 2)}


@pytest.fixture(scope="module", params=[(n, d, c) for n in SHAPES for d in (64, 96, 128) for c in (True, False)],
                ids=lambda x: f"{x[0]}-d{x[1]}-{'causal' if x[2] else 'full'}")
def checked_problem(request):
    name, d, causal = request.param
    b, s, hq, hkv = SHAPES[name]
    p = problem(b, s, hq, hkv, d, causal)
    oracle = oracle_and_bf16_math(p["q"], p["k"], p["v"], p["do"], causal=causal)
    return p, oracle.grads, oracle.grad_bars


@pytest.mark.parametrize("feature", ("causal", "full", "causal-window256", "band128x128", "full-softcap30"))
@pytest.mark.parametrize("gqa", (1, 4))
@pytest.mark.parametrize("head_dim", (64, 96, 128))
def test_forward_gives_fa4s_bits(feature, gqa, head_dim):
    """fwd_sm90 compiles and launches FA4's sm90 forward itself (FA4's launcher costs more host
    time than the kernel at short sequences); it must be the same kernel with the same tiles."""
    from flash_attn.cute.interface import _flash_attn_fwd
    mask = dict(FEATURES.get(feature, {"causal": feature == "causal"}))
    causal = mask.pop("causal")
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 1000, 8, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 1000, 8 // gqa, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    ours = hopper.attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, causal=causal, **mask)
    fa4_mask = hopper.fa4_mask(causal, mask.get("window_left", -1), mask.get("window_right", -1))
    theirs = _flash_attn_fwd(q, k, v, softmax_scale=head_dim ** -0.5, num_splits=1, return_lse=True,
                             softcap=mask.get("softcap", 0.0), causal=fa4_mask[0], window_size_left=fa4_mask[2],
                             window_size_right=fa4_mask[3])[:2]
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.fixture
def forward_grid(monkeypatch):
    """Runs a forward on the grid named ("one-tile", "persistent", "auto"), then back to auto."""
    from dash_plugin.kernels.hopper import fwd_sm90

    def run(grid, *args, **kwargs):
        monkeypatch.setattr(fwd_sm90, "GRID", grid)
        return hopper.attention_forward(*args, **kwargs)
    return run


@pytest.mark.parametrize("head_dim, causal", ((64, True), (128, True), (64, False)))
def test_persistent_forward_dealt_for_half_the_sms_gives_the_same_bits(monkeypatch, head_dim, causal):
    """The persistent grid's deal depends on the SM count (fwd_tile_order.work_table); the bits must
    not: a plan dealt for half the SMs runs half the CTAs (asserted) and gives the full grid's bits."""
    from dash_plugin.kernels.hopper import fwd_sm90
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(4, 2048, 8, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    call = dict(softmax_scale=head_dim ** -0.5, causal=causal)
    monkeypatch.setattr(fwd_sm90, "_plans", {})
    full = fwd_sm90.plan_of(q, k, v, causal=causal)
    whole = hopper.attention_forward(q, k, v, **call)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: sms // 2)
    monkeypatch.setattr(fwd_sm90, "_plans", {})
    half = fwd_sm90.plan_of(q, k, v, causal=causal)
    assert (full.ctas, half.ctas) == (sms, sms // 2)
    halved = hopper.attention_forward(q, k, v, **call)
    assert torch.equal(whole[0], halved[0]) and torch.equal(whole[1], halved[1])


@pytest.mark.parametrize("feature", ("causal", "full", "causal-window256", "band128x128", "full-softcap30",
                                     "dropout0.1", "dropout0.7"))
@pytest.mark.parametrize("gqa", (1, 4))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("lengths", ((2048, 2048), (700, 1300), (1300, 700)), ids=lambda x: f"{x[0]}x{x[1]}")
def test_persistent_forward_gives_the_one_tile_grids_bits(forward_grid, feature, gqa, head_dim, lengths):
    """The persistent grid (fwd_persistent.py) moves tiles between CTAs, not bits: 16 query heads
    x 2 sequences give 4-8 tiles per CTA (several tiles in a row through one CTA's buffers), fewer
    queries than keys and the reverse (rows that see no key)."""
    mask = dict(FEATURES.get(feature, {"causal": feature != "full"}))
    if feature.startswith("dropout"):
        mask.update(dropout_p=float(feature[len("dropout"):]), seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    q = torch.randn(2, lengths[0], 16, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, lengths[1], 16 // gqa, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    call = dict(softmax_scale=head_dim ** -0.5, **mask)
    one_tile = forward_grid("one-tile", q, k, v, **call)
    persistent = forward_grid("persistent", q, k, v, **call)
    assert torch.equal(one_tile[0], persistent[0]) and torch.equal(one_tile[1], persistent[1])
    assert one_tile[0].abs().sum() > 0


@pytest.mark.parametrize("dropout_p", (0.0, 0.1))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_persistent_forward_bitwise_equal_over_many_passes_under_another_process(forward_grid, dropout_p, head_dim):
    """1,000 forwards on the persistent grid, 6-8 tiles per CTA, while another process loads the
    GPU: one set of bits, FA4's grid's (at hdim 64 with tail-aligned Q tiles, 64 rows above the
    sequence)."""
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (torch.randn(4, 2048, 16, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    call = dict(softmax_scale=head_dim ** -0.5, causal=True, dropout_p=dropout_p, seed=5)
    reference = forward_grid("one-tile", q, k, v, **call)
    torch.cuda.synchronize()
    with gpu_load() as load, hang_guard(300):
        bad = count_mismatching_passes(lambda: forward_grid("persistent", q, k, v, **call), N_PASSES,
                                       reference=reference)
        assert load.alive(), f"load process died: {load.stderr()}"
    assert bad == 0


def test_auto_takes_the_persistent_forward_where_it_pays(monkeypatch, forward_grid):
    """`auto` picks the persistent grid for causal masks (1k and 16k) and FA4's grid for a full
    mask at hdim 128 16k (fwd_tile_order.persistent_pays), and each call repeats its bits (the
    work table is built once per shape and kept)."""
    from dash_plugin.kernels.hopper import fwd_sm90
    for seqlen, causal, persistent in ((1024, True, True), (16384, True, True), (16384, False, False)):
        q, k, v = (torch.randn(16384 // seqlen, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        monkeypatch.setattr(fwd_sm90, "GRID", "auto")   # the previous shape's last call left another grid set
        assert bool(fwd_sm90.plan_of(q, k, v, causal=causal).ctas) == persistent
        first = forward_grid("auto", q, k, v, softmax_scale=128 ** -0.5, causal=causal)
        again = forward_grid("auto", q, k, v, softmax_scale=128 ** -0.5, causal=causal)
        other = forward_grid("one-tile" if persistent else "persistent", q, k, v, softmax_scale=128 ** -0.5,
                             causal=causal)
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, again, other))


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """The forward's O and LSE come from NaN-filled buffers with NaN guard rows on both sides:
    `check()` says that every element was written and nothing beside the tensors."""
    from dash_plugin.kernels.hopper import fwd_sm90
    buffers, guard = [], 4096

    def empty(shape, dtype, device):
        n = math.prod(shape)
        buffer = torch.full((n + 2 * guard,), float("nan"), dtype=dtype, device=device)
        buffers.append(buffer)
        return buffer[guard:guard + n].view(shape)

    def check(outputs):
        assert all(not torch.isnan(t).any() for t in outputs), "an output element was not written"
        for buffer in buffers:
            assert torch.isnan(buffer[:guard]).all() and torch.isnan(buffer[-guard:]).all(), \
                "a write landed beside the outputs"
        buffers.clear()
    monkeypatch.setattr(fwd_sm90, "_empty", empty)
    return check


def tail_aligned_against_fa4_tiling(monkeypatch, forward_grid, check, grid, head_dim, gqa, mask, lengths_list):
    """Runs each (queries, keys) length with and without tail-aligned Q tiles; asserts equal bits,
    every output written and nothing beside; returns how many lengths moved their tiles."""
    from dash_plugin.kernels.hopper import fwd_sm90
    monkeypatch.setattr(fwd_sm90, "GRID", grid)   # plan_of reads it (forward_grid sets it for each call)
    plan_args = {name: mask[name] for name in ("causal", "window_left", "window_right", "dropout_p") if name in mask}
    moved = 0
    for lengths in lengths_list:
        g = torch.Generator(device="cuda").manual_seed(14)
        q = torch.randn(2, lengths[0], 16, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(2, lengths[1], 16 // gqa, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        results = {}
        for tail_align in (True, False):
            monkeypatch.setattr(fwd_sm90, "TAIL_ALIGN", tail_align)
            results[tail_align] = (fwd_sm90.plan_of(q, k, v, **plan_args).q_shift,
                                   forward_grid(grid, q, k, v, softmax_scale=head_dim ** -0.5, **mask))
            check(results[tail_align][1])
        (shift, tail), (no_shift, fa4_tiling) = results[True], results[False]
        assert no_shift == 0
        assert torch.equal(tail[0], fa4_tiling[0]) and torch.equal(tail[1], fa4_tiling[1]), (lengths, shift)
        moved += shift > 0
    return moved


def tail_mask(feature):
    """The forward's mask keywords for a FEATURES name or "dropout<p>" (causal, with that p)."""
    mask = dict(FEATURES.get(feature, {"causal": True}))
    if feature.startswith("dropout"):
        mask.update(dropout_p=float(feature[len("dropout"):]), seed=11)
    return mask


# (queries, keys): 1k (128 rows above the sequence at 192-row tiles), fewer queries than keys and
# the reverse (rows that see no key), 1000 (a shift of 152: no multiple of 16, so not with
# dropout), 272 and 784 x 1040 (shifts of 112 and 176: dropout's 16-row groups moved whole)
TAIL_LENGTHS = ((1024, 1024), (700, 1300), (1300, 700), (1000, 1000), (272, 272), (784, 1040))


@pytest.mark.parametrize("feature", ("causal", "causal-window256", "band128x128", "causal-softcap20", "dropout0.1",
                                     "dropout0.7"))
@pytest.mark.parametrize("gqa", (1, 4))
@pytest.mark.parametrize("grid", ("one-tile", "persistent"))
def test_tail_aligned_q_tiles_give_fa4_tilings_bits(monkeypatch, forward_grid, poisoned_outputs, feature, gqa, grid):
    """Q tiles aligned to the end of the sequence (fwd_tail_aligned.py) skip KV tiles masked whole
    for every row they hold, and change no bit of O or LSE, at hdim 64 on both grids; every
    output element is written (NaN-filled outputs) and nothing beside them (NaN guard rows: the
    top tile's rows above the sequence must not land before the first head). GQA with dropout
    runs unpacked heads (moved); without, packed rows (never moved)."""
    moved = tail_aligned_against_fa4_tiling(monkeypatch, forward_grid, poisoned_outputs, grid, 64, gqa,
                                            tail_mask(feature), TAIL_LENGTHS)
    unpacked = gqa == 1 or feature.startswith("dropout")
    assert moved >= 2 if unpacked else moved == 0, moved   # which lengths: tests/test_forward_tile_order.py


@pytest.mark.parametrize("feature", ("causal", "band128x128", "dropout0.1"))
@pytest.mark.parametrize("head_dim", (96, 256))
def test_tail_aligned_q_tiles_at_other_head_dims(monkeypatch, forward_grid, poisoned_outputs, feature, head_dim):
    """hdim 96 (192-row tiles, P through shared memory, so FA4's one-CTA-per-tile grid: the
    persistent grid needs P in registers) and 256 (128 x 80 tiles, O rescaled before its product):
    FA4's tiling's bits, with the tiles moved at some lengths."""
    moved = tail_aligned_against_fa4_tiling(monkeypatch, forward_grid, poisoned_outputs, "auto", head_dim, 1,
                                            tail_mask(feature), TAIL_LENGTHS)
    assert moved >= 1, moved


def test_forward_with_broadcast_kv_compiles_apart_and_gives_fa4s_bits():
    """K/V expanded over the batch (stride 0) compile with that stride static: such a kernel must
    never serve ordinary inputs, nor the reverse (fwd_sm90's key says which dims have stride 0)."""
    from flash_attn.cute.interface import _flash_attn_fwd
    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(3, 512, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k1, v1 = (torch.randn(1, 512, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    for k, v in ((k1.expand(3, -1, -1, -1), v1.expand(3, -1, -1, -1)),
                 (k1.expand(3, -1, -1, -1).contiguous(), v1.expand(3, -1, -1, -1).contiguous()),
                 (k1.expand(3, -1, -1, -1), v1.expand(3, -1, -1, -1))):
        ours = hopper.attention_forward(q, k, v, softmax_scale=128 ** -0.5, causal=True)
        theirs = _flash_attn_fwd(q, k, v, softmax_scale=128 ** -0.5, causal=True, num_splits=1, return_lse=True)[:2]
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_matches_float64_oracle(checked_problem, schedule):
    p, ref, base = checked_problem
    poison = [torch.full_like(p[n], float("nan")) for n in ("q", "k", "v")]
    del poison  # the allocator hands these NaN blocks to the backward's outputs: unwritten stays NaN
    grads = backward(p, schedule)
    for name, g, r, bar in zip(("dq", "dk", "dv"), grads, ref, base):
        assert_within_bar(name, g, r, bar)


# Sliding windows (causal and two-sided) and softcap: FA4's local mask and softcap score_mod
# inside our ordered kernel; ranks from the row's first visible KV tile.
FEATURES = {
    "causal-window256": dict(causal=True, window_left=256),
    "band128x128": dict(causal=False, window_left=128, window_right=128),
    "full-softcap30": dict(causal=False, softcap=30.0),
    "causal-softcap20": dict(causal=True, softcap=20.0),
}


@pytest.fixture(scope="module", params=[(f, d) for f in FEATURES for d in (64, 96, 128)],
                ids=lambda x: f"{x[0]}-d{x[1]}")
def feature_problem(request):
    name, d = request.param
    feature = dict(FEATURES[name])
    causal = feature.pop("causal")
    p = problem(2, 1000, 8, 2, d, causal, seed=4, **feature)
    oracle = oracle_and_bf16_math(p["q"], p["k"], p["v"], p["do"], causal=causal, **feature)
    return p, oracle


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_windows_and_softcap_match_float64_oracle(feature_problem, schedule):
    p, oracle = feature_problem
    assert_within_bar("out", p["out"], oracle.out, oracle.out_bar)
    grads = backward(p, schedule)
    for name, g, r, bar in zip(("dq", "dk", "dv"), grads, oracle.grads, oracle.grad_bars):
        assert_within_bar(name, g, r, bar)


@pytest.mark.parametrize("feature, schedule", [("causal-window256", "descending"), ("band128x128", "ascending"),
                                               ("full-softcap30", "shift")])
def test_windows_and_softcap_bitwise_equal_over_many_passes_under_another_process(feature, schedule):
    mask = dict(FEATURES[feature])
    p = problem(2, 2048, 8, 2, 128, mask.pop("causal"), seed=5, **mask)
    first = backward(p, schedule)
    torch.cuda.synchronize()
    with gpu_load() as load, hang_guard(300):
        bad = count_mismatching_passes(lambda: backward(p, schedule), N_PASSES, reference=first)
        assert load.alive(), f"load process died: {load.stderr()}"
    print(f"[hopper load] {feature} {schedule}: {N_PASSES} passes, {bad} mismatching")
    assert bad == 0


@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("gqa", (1, 4))
def test_the_order_fa4_also_runs_gives_fa4s_bits(causal, gqa):
    from flash_attn.cute.interface import _flash_attn_bwd
    p = problem(2, 1024, 8, 8 // gqa, 128, causal, seed=1)
    ours = backward(p, "spt" if causal else "ascending")
    theirs = _flash_attn_bwd(p["q"], p["k"], p["v"], p["out"], p["do"], p["lse"], softmax_scale=128 ** -0.5,
                             causal=causal, deterministic=True)[:3]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def computed_and_read(tables, do, q, k, v, out, lse, **kw):
    """The Hopper backward's gradients with the order computed (the closed form `tables.visit`)
    and with it read from the plan's tables (visit=None), for a bit-for-bit comparison."""
    import dataclasses
    from dash_plugin.kernels.hopper import bwd_sm90
    run = lambda t: bwd_sm90.attention_backward(  # noqa: E731
        do, q, k, v, out, lse, softmax_scale=q.shape[-1] ** -0.5, tables=t, deterministic=True, **kw)
    with hang_guard(120):
        computed, read = run(tables), run(dataclasses.replace(tables, visit=None))
        torch.cuda.synchronize()
    return computed, read


@pytest.mark.parametrize("schedule, causal, seqlen, head_dim, window", [
    ("descending", True, 2048, 128, (-1, -1)), ("descending", False, 2048, 64, (-1, -1)),
    ("shift", False, 2048, 64, (-1, -1)), ("shift", False, 8192, 128, (-1, -1)),
    ("shift", False, 16384, 64, (-1, -1)),
    ("ascending", True, 2048, 128, (300, 0)), ("spt", True, 2048, 128, (256, 0)),
    ("descending", False, 2048, 128, (128, 128)), ("descending", False, 2048, 64, (-1, 200)),
    ("ascending", False, 2048, 64, (300, -1)), ("arrival", True, 2048, 128, (-1, -1)),
    ("arrival", True, 8192, 64, (-1, -1)), ("arrival", True, 16384, 128, (-1, -1)),
    ("arrival", True, 12288, 64, (-1, -1)), ("shift", True, 2048, 128, (-1, -1)),
    ("shift", True, 8192, 64, (-1, -1)), ("shift", True, 32768, 128, (-1, -1))],
    ids=lambda x: x if isinstance(x, str) else str(x))
def test_computed_order_gives_the_bits_of_the_tables(schedule, causal, seqlen, head_dim, window):
    """The kernel computes the visit order and ranks (bwd_sm90._visit); reading the plan's tables
    instead must add every dQ tile in the same order, so the bits are equal. The shift cases
    include a whole-head group of 64 KV tiles (8k, hdim 128) and groups split evenly (16k), the
    arrival cases a whole-head group of 16 and of 64 KV tiles and heads of two groups launched top
    group first (128 KV tiles; 96, the bottom group half full); the windowed ones check the ranks
    counted from each row's first visible KV tile. The causal shift cases run the symmetric pairs
    (one group of 8 and of 32 pairs, two groups of 64)."""
    from tests.test_hopper_tables import plan_tables
    tables = plan_tables(schedule, seqlen=seqlen, head_dim=head_dim, causal=causal, window=window)
    assert tables.visit == {"spt": "ascending", "shift": "pairs" if causal else "shift"}.get(schedule, schedule)
    mask = dict(window_left=window[0], window_right=window[1])
    p = problem(1, seqlen, 4, 4, head_dim, causal, seed=3, **mask)
    computed, read = computed_and_read(tables, p["do"], p["q"], p["k"], p["v"], p["out"], p["lse"],
                                       causal=causal, **mask)
    assert all(torch.equal(a, b) for a, b in zip(computed, read))
    # Same sums in another order: FA4's own (ascending) adds agree to fp32 rounding of bf16 grads.
    ascending = backward(p, "ascending")
    for name, a, b in zip(("dq", "dk", "dv"), computed, ascending):
        assert_same_sums(f"{name} against ascending", a, b)


@pytest.fixture(scope="module")
def loaded_gpu():
    problems = {c: problem(2, 2048, 8, 2, 128, c, seed=2) for c in (True, False)}
    unloaded = {(c, s): backward(problems[c], s) for c in (True, False) for s in ORDERED}
    torch.cuda.synchronize()
    with gpu_load() as proc:
        yield problems, unloaded, proc


@pytest.mark.parametrize("schedule, causal", [(s, c) for s in ORDERED for c in (True, False) if c or s != "arrival"],
                         ids=lambda x: x if isinstance(x, str) else ("causal" if x else "full"))
def test_bitwise_equal_over_many_passes_under_another_process(loaded_gpu, schedule, causal):
    problems, unloaded, load = loaded_gpu
    with hang_guard(300):
        bad = count_mismatching_passes(lambda: backward(problems[causal], schedule), N_PASSES,
                                       reference=unloaded[(causal, schedule)])
    assert load.alive(), f"load process died: {load.stderr()}"
    print(f"[hopper load] {schedule} {'causal' if causal else 'full'}: {N_PASSES} passes, {bad} mismatching")
    assert bad == 0


def test_arrival_over_several_groups_is_bitwise_equal_under_another_process():
    """A head of 128 KV tiles runs `arrival` as two groups launched top group first: its waits
    cross groups, so 1,000 passes while another process loads the GPU must give one set of bits."""
    p = problem(1, 16384, 4, 4, 128, True, seed=6)
    first = backward(p, "arrival")
    torch.cuda.synchronize()
    with gpu_load() as load, hang_guard(600):
        bad = count_mismatching_passes(lambda: backward(p, "arrival"), N_PASSES, reference=first)
        assert load.alive(), f"load process died: {load.stderr()}"
    print(f"[hopper load] arrival causal 16k (two groups): {N_PASSES} passes, {bad} mismatching")
    assert bad == 0


def test_symmetric_shift_over_two_groups_repeats_and_sums_as_ascending_does():
    """32k tokens at hdim 128: 256 KV tiles, 128 pairs a head in two groups of 64 (the second
    group's adds wait on the first's). The call repeats its bits, and its sums agree with
    `ascending`'s (the same adds in another order) to the rounding of bf16 gradients."""
    from tests.test_hopper_tables import plan_tables
    tables = plan_tables("shift", seqlen=32768, head_dim=128, causal=True)
    assert tables.paired and tables.group_size == 64 and tables.count.shape[0] == 256
    p = problem(1, 32768, 2, 2, 128, True, seed=9)
    with hang_guard(300):
        first = backward(p, "shift")
        again = [backward(p, "shift") for _ in range(3)]
        ascending = backward(p, "ascending")
        torch.cuda.synchronize()
    assert all(torch.equal(a, b) for g in again for a, b in zip(first, g))
    for name, a, b in zip(("dq", "dk", "dv"), first, ascending):
        assert_same_sums(f"{name} against ascending", a, b)


# The first add to each dQ tile stores instead of adding (STORE_FIRST_DQ), so the accumulator is
# not zeroed where every tile gets an add. Cases: every tile added to; rows that see no key
# (causal with more queries than keys: their tiles get no add, so the accumulator is zeroed);
# more keys than queries; a window; GQA; dropout.
STORE_FIRST_CASES = {   # (mask and shapes, the ordered schedules run there)
    "full": (dict(sq=1000, sk=1000, causal=False), ("ascending", "shift")),
    "causal-gqa": (dict(sq=1024, sk=1024, causal=True, hkv=2), ("arrival",)),
    "causal-more-queries": (dict(sq=1000, sk=600, causal=True), ("descending", "spt")),
    "causal-more-keys": (dict(sq=600, sk=1000, causal=True), ("arrival",)),
    "window": (dict(sq=1000, sk=1000, causal=True, window=(256, -1)), ("descending",)),
    "dropout": (dict(sq=1000, sk=1000, causal=False, dropout_p=0.1), ("ascending",)),
}


@pytest.mark.parametrize("case,schedule", [(c, s) for c, (_, scheds) in STORE_FIRST_CASES.items() for s in scheds])
def test_first_add_storing_gives_the_bits_of_adding_into_zeros(monkeypatch, case, schedule):
    c = dict(STORE_FIRST_CASES[case][0])
    sq, sk, causal, hkv = c.pop("sq"), c.pop("sk"), c.pop("causal"), c.pop("hkv", 4)
    g = torch.Generator(device="cuda").manual_seed(11)
    q, do = (torch.randn(2, sq, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, sk, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))

    def grads():
        poison = torch.full((64 << 20,), float("nan"), device="cuda")
        del poison   # the accumulator is likely carved from these NaN bytes: an unwritten tile shows
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = dash_plugin.flash_attention(*leaves, causal=causal, backend="hopper", schedule=schedule,
                                          dropout_seed=5, **c)
        out.backward(do)
        return [t.grad for t in leaves]

    stored = grads()
    monkeypatch.setattr(hopper.bwd_sm90.OrderedBackwardSm90, "STORE_FIRST_DQ", False)
    added = grads()
    for name, a, b in zip(("dq", "dk", "dv"), stored, added):
        assert torch.isfinite(a).all(), f"{name}: NaN/inf"
        assert torch.equal(a, b), f"{name}: storing the first add changed the bits"
    if sq > sk:   # bottom-right causal: the first sq - sk rows see no key
        assert torch.equal(stored[0][:, :sq - sk], torch.zeros_like(stored[0][:, :sq - sk]))


def test_atomic_differs_between_passes():
    p = problem(2, 2048, 8, 2, 128, False, seed=2)
    assert count_mismatching_passes(lambda: backward(p, "atomic"), 50) > 0


@pytest.mark.parametrize("schedule, seqlen", [("descending", 4096), ("spt", 4096), ("arrival", 4096),
                                             ("arrival", 16384), ("shift", 4096), ("shift", 16384)],
                         ids=lambda x: str(x))
def test_same_bits_while_other_work_occupies_sms(schedule, seqlen):
    """Far more CTAs than SMs (16 heads x 32 KV tiles x 4 sequences, or x 128 KV tiles: arrival's
    groups launched top group first; shift's symmetric pairs, 16 or 64 CTAs a head) launched while
    matmuls hold SMs: the plan's order, not the free SMs, decides the bits."""
    p = problem(16384 // seqlen, seqlen, 16, 16, 128, True, seed=3)
    alone = backward(p, schedule)
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    busy_at_launch = 0
    with hang_guard(300):
        for _ in range(3):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(20):
                    a @ a
                side_done = torch.cuda.Event()
                side_done.record(side)
            busy_at_launch += not side_done.query()   # the matmuls still hold SMs as the backward is enqueued
            again = backward(p, schedule)
            torch.cuda.synchronize()
            assert all(torch.equal(x, y) for x, y in zip(alone, again))
    assert busy_at_launch == 3, "the side stream finished before the backward was launched: no overlap"


_DIGEST_SNIPPET = """
import sys, torch
sys.path.insert(0, {repo!r})
from tests.test_gpu_hopper import problem, backward
from tests.hardening_helpers import sha256
for causal, schedule in {pairs!r}:
    g = backward(problem(2, 1024, 8, 2, 128, causal, seed=5), schedule)
    print(causal, schedule, *(sha256(t) for t in g))
"""


def test_same_digests_in_a_fresh_process():
    pairs = [(True, "descending"), (True, "spt"), (True, "shift"), (False, "ascending"), (False, "shift")]
    here = [f"{c} {s} " + " ".join(sha256(t) for t in backward(problem(2, 1024, 8, 2, 128, c, seed=5), s))
            for c, s in pairs]
    run = subprocess.run([sys.executable, "-c", _DIGEST_SNIPPET.format(repo=REPO, pairs=pairs)],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:len(pairs)] == here


def test_auto_takes_this_backend_where_it_runs_and_says_why_where_not():
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    out = dash_plugin.flash_attention(q, k, v, causal=True)
    got = dash_plugin.last_resolved()
    assert (got.concrete_backend, got.concrete_schedule) == ("hopper", "arrival"), got.describe()
    assert_call_matches_oracle(q, k, v, out, causal=True)
    narrow = [t[..., :112].contiguous().detach() for t in (q, k, v)]   # head dim 112 runs on Triton
    dash_plugin.flash_attention(*narrow, causal=True)
    got = dash_plugin.last_resolved()
    assert got.concrete_backend == "triton" and "hopper: head_dim=112" in got.describe(), got.describe()
    with pytest.raises(ValueError, match="backend='hopper' cannot run this call: head_dim=112"):
        dash_plugin.flash_attention(*narrow, causal=True, backend="hopper")


@pytest.mark.parametrize("padded", (False, True), ids=("dense", "padded"))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_hugging_face_llama_through_this_backend_matches_fp32_eager(monkeypatch, tmp_path, head_dim, padded):
    """A padded batch reaches the kernel unpadded, as a packed (varlen) batch. The padding is on the
    left, so a binding that ignored it would let every real query of that row see the padded keys
    (on the right, the causal mask alone would hide them)."""
    import transformers

    import dash_plugin.integrations.transformers as dash_hf
    calls = []
    through = dash_hf._flash_attention

    def seen(q, k, v, **kwargs):
        calls.append("cu_seqlens_q" in kwargs and kwargs["cu_seqlens_q"] is not None)
        return through(q, k, v, **kwargs)

    monkeypatch.setattr(dash_hf, "_flash_attention", seen)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=4 * head_dim, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                   max_position_embeddings=512)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    ids = torch.randint(3, 128, (2, 256), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 256, dtype=torch.long)
    if padded:
        mask[0, :56] = 0

    def run(model, device, dtype, **kw):
        model = model.to(device, dtype)
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), **kw).logits
        logits = logits[mask.bool().to(device)]   # padding rows say nothing
        logits.float().square().mean().backward()
        return logits.float().cpu(), torch.cat([p.grad.float().flatten().cpu() for p in model.parameters()])

    load = lambda impl: transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=impl)  # noqa: E731
    want = run(load("eager"), "cpu", torch.float32)
    got = run(load("dash"), "cuda", torch.bfloat16, dash_backend="hopper")
    assert dash_plugin.last_resolved().concrete_backend == "hopper"
    assert calls and all(packed == padded for packed in calls), calls   # packed calls exactly when padded
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()).item() < 3e-2


@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("gqa", (1, 4))
@pytest.mark.parametrize("head_dim", (64, 96, 128))
def test_forward_matches_oracle_and_repeats_its_bits(causal, gqa, head_dim):
    g = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(2, 1000, 8, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 1000, 8 // gqa, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out, lse = hopper.attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, causal=causal)
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)   # the oracle computes grads too
    oracle = oracle_and_bf16_math(q, k, v, do, causal=causal)
    assert_within_bar("out", out, oracle.out, oracle.out_bar)
    assert rel(lse, oracle.lse) < 1e-5
    for _ in range(100):
        again = hopper.attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, causal=causal)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
