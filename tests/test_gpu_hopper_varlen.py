"""GPU tests of the Hopper backend on packed (varlen) batches and unequal query/key lengths
(marker `gpu`; skipped without an sm90 GPU and the `hopper` extra).

- forward and every order the backend runs on packed batches (ragged lengths, an empty
  sequence, sequences with more queries than keys and the reverse) against the float64 oracle,
  within twice the error of plain bf16 PyTorch math; the same for dense batches of unequal
  lengths (bottom-right masks, rows that see no key);
- the forward gives FA4's varlen bits, and the order FA4 also runs (spt on causal masks,
  ascending on full ones) gives FA4's varlen deterministic bits;
- a sequence's gradients do not depend on what it was packed with: each one's bits equal the
  same sequence run alone;
- 1,000 passes bitwise equal while another process loads the GPU;
- through the API: `auto` runs packed batches here and says why where it does not.
"""
import os

import pytest
import torch

import dash_plugin
from dash_plugin import dispatch
from dash_plugin.kernels import hopper
from dash_plugin.schedules import auto
from tests.gpu_oracle import (HOPPER_SKIP, assert_call_matches_oracle, assert_same_sums, assert_within_bar,
                              packed_oracle_and_bf16_math)
from tests.hardening_helpers import count_mismatching_passes, gpu_load, hang_guard

pytestmark = [pytest.mark.gpu, HOPPER_SKIP]

PACKED = ("ascending", "spt", "descending", "arrival", "atomic")   # the orders packed batches run here
N_PASSES = int(os.environ.get("DASH_DETERMINISM_PASSES", "1000"))
# Per sequence (queries, keys): ragged, one empty, more queries than keys and the reverse.
LENGTHS = ((1000, 1000), (129, 129), (0, 0), (2048, 2048), (700, 300), (256, 1100), (1, 1))


def packed(lengths, hq, hkv, d, causal, seed=0, **mask):
    """Packed inputs of `lengths`, and out/lse from the Hopper forward."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu = [torch.tensor([0] + [sum(x[i] for x in lengths[:b + 1]) for b in range(len(lengths))],
                       dtype=torch.int32, device="cuda") for i in (0, 1)]
    tq, tk = int(cu[0][-1]), int(cu[1][-1])
    q, k, v, do = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for t, h in ((tq, hq), (tk, hkv), (tk, hkv), (tq, hq)))
    kw = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max(x[0] for x in lengths),
              max_seqlen_k=max(x[1] for x in lengths))
    out, lse = hopper.attention_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal,
                                        cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], **mask)
    return dict(q=q, k=k, v=v, do=do, out=out, lse=lse, causal=causal, mask=mask, kw=kw)


def sequence_alone(p, b):
    """Sequence `b` of packed problem `p` as a packed batch of its own (out/lse from its own
    forward), with its query rows and key rows in `p`."""
    cq, ck = (p["kw"][n].tolist() for n in ("cu_seqlens_q", "cu_seqlens_k"))
    rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
    sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
    cu = [torch.tensor([0, n], dtype=torch.int32, device="cuda") for n in (sq, sk)]
    solo = dict(q=p["q"][rows], k=p["k"][keys], v=p["v"][keys], do=p["do"][rows], causal=p["causal"], mask=p["mask"],
                kw=dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=sq, max_seqlen_k=sk))
    solo["out"], solo["lse"] = hopper.attention_forward(
        solo["q"], solo["k"], solo["v"], softmax_scale=p["q"].shape[-1] ** -0.5, causal=p["causal"],
        cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], **p["mask"])
    return solo, rows, keys


def backward(p, schedule):
    return dispatch.attention_backward(p["do"], p["q"], p["k"], p["v"], p["out"], p["lse"],
                                       softmax_scale=p["q"].shape[-1] ** -0.5, causal=p["causal"],
                                       schedule=schedule, deterministic=schedule != "atomic", backend="hopper",
                                       **p["mask"], **p["kw"])


MASKS = {"causal": dict(causal=True), "full": dict(causal=False),
         "causal-window200": dict(causal=True, window_left=200),
         "band128x64": dict(causal=False, window_left=128, window_right=64)}


@pytest.fixture(scope="module", params=[(m, d, g) for m in MASKS for d, g in ((64, 1), (128, 4))],
                ids=lambda x: f"{x[0]}-d{x[1]}-gqa{x[2]}")
def packed_problem(request):
    name, d, gqa = request.param
    mask = dict(MASKS[name])
    causal = mask.pop("causal")
    p = packed(LENGTHS, 8, 8 // gqa, d, causal, seed=1, **mask)
    right = mask.pop("window_right", -1)
    oracle = packed_oracle_and_bf16_math(p["q"], p["k"], p["v"], p["do"], p["kw"]["cu_seqlens_q"],
                                         p["kw"]["cu_seqlens_k"], causal=causal, window_right=right, **mask)
    return p, oracle


def test_packed_forward_matches_float64_oracle(packed_problem):
    p, oracle = packed_problem
    assert torch.isfinite(p["out"]).all()
    assert_within_bar("out", p["out"], oracle.out, oracle.out_bar)
    # A row that sees no key (the sequence of 700 queries and 300 keys under a causal mask or a
    # window): lse +inf, our convention (FA4's kernel writes -inf), and out 0.
    assert not torch.isneginf(p["lse"]).any()
    no_key = torch.isinf(p["lse"])   # (H, T)
    assert no_key.any() == (p["causal"] or bool(p["mask"]))
    assert (p["out"].transpose(0, 1)[no_key] == 0).all()


@pytest.mark.parametrize("schedule", PACKED)
def test_packed_backward_matches_float64_oracle(packed_problem, schedule):
    p, oracle = packed_problem
    poison = [torch.full_like(p[n], float("nan")) for n in ("q", "k", "v")]
    del poison  # the allocator hands these NaN blocks to the backward's outputs: unwritten stays NaN
    grads = backward(p, schedule)
    for name, g, r, bar in zip(("dq", "dk", "dv"), grads, oracle.grads, oracle.grad_bars):
        assert_within_bar(name, g, r, bar)


@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("gqa", (1, 4))
def test_packed_forward_and_the_order_fa4_also_runs_give_fa4s_bits(causal, gqa):
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    lengths = tuple((n, n) for n in (1000, 129, 2048, 640))
    p = packed(lengths, 8, 8 // gqa, 128, causal, seed=2)
    kw = p["kw"]
    out, lse = _flash_attn_fwd(p["q"], p["k"], p["v"], softmax_scale=128 ** -0.5, causal=causal, return_lse=True,
                               **kw)[:2]
    assert torch.equal(out, p["out"]) and torch.equal(lse, p["lse"])
    ours = backward(p, "spt" if causal else "ascending")
    theirs = _flash_attn_bwd(p["q"], p["k"], p["v"], p["out"], p["do"], p["lse"], softmax_scale=128 ** -0.5,
                             causal=causal, deterministic=True, **kw)[:3]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("schedule", ("descending", "spt", "ascending", "arrival"))
@pytest.mark.parametrize("gqa", (1, 4))
def test_a_sequence_gives_the_same_bits_whatever_it_is_packed_with(schedule, gqa):
    """The order of every dQ add is a function of the sequence's own lengths, so a sequence's
    gradients (and output) are the bits it gets when it runs alone."""
    lengths = ((1000, 1000), (2048, 2048), (333, 333), (1500, 1500))
    p = packed(lengths, 8, 8 // gqa, 128, True, seed=3)
    grads = backward(p, schedule)
    for b in range(len(lengths)):
        solo, rows, _ = sequence_alone(p, b)
        assert torch.equal(solo["out"], p["out"][rows]), f"sequence {b}: out"
        for name, x, y in zip(("dq", "dk", "dv"), backward(solo, schedule), grads):
            assert torch.equal(x, y[rows]), f"sequence {b}: {name}"


@pytest.mark.parametrize("schedule, causal, gqa", [("descending", True, 1), ("spt", True, 4),
                                                    ("ascending", False, 4), ("arrival", True, 1)],
                         ids=lambda x: x if isinstance(x, str) else str(x))
def test_packed_bitwise_equal_over_many_passes_under_another_process(schedule, causal, gqa):
    p = packed(((1000, 1000), (3000, 3000), (129, 129), (2048, 2048), (0, 0), (4000, 4000)), 16, 16 // gqa, 128,
               causal, seed=4)
    first = backward(p, schedule)
    torch.cuda.synchronize()
    with gpu_load() as load, hang_guard(300):
        bad = count_mismatching_passes(lambda: backward(p, schedule), N_PASSES, reference=first)
        assert load.alive(), f"load process died: {load.stderr()}"
    print(f"[hopper varlen load] {schedule} {'causal' if causal else 'full'} gqa{gqa}: {N_PASSES} passes, "
          f"{bad} mismatching")
    assert bad == 0


# Dense batches of unequal lengths: the masks align bottom-right; with more queries than keys the
# first rows see no key under a causal mask.
UNEQUAL = ((2, 700, 1500), (2, 1500, 700), (1, 64, 2048))


@pytest.mark.parametrize("b, sq, sk", UNEQUAL, ids=lambda x: str(x))
@pytest.mark.parametrize("mask", ("causal", "full", "causal-window200"))
def test_unequal_lengths_match_float64_oracle(b, sq, sk, mask):
    spec = dict(MASKS[mask])
    causal = spec.pop("causal")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, do = (torch.randn(b, sq, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(b, sk, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out, lse = hopper.attention_forward(q, k, v, softmax_scale=128 ** -0.5, causal=causal, **spec)
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    cu = [torch.arange(b + 1, device="cuda", dtype=torch.int32) * n for n in (sq, sk)]
    oracle = packed_oracle_and_bf16_math(flat(q), flat(k), flat(v), flat(do), *cu, causal=causal, **spec)
    assert not torch.isneginf(lse).any() and torch.isfinite(out).all()
    assert_within_bar("out", out, oracle.out, oracle.out_bar)
    for schedule in ("ascending", "spt", "descending") + (("arrival",) if causal else ("shift",)):
        grads = dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=128 ** -0.5, causal=causal,
                                            schedule=schedule, deterministic=schedule != "atomic", backend="hopper",
                                            **spec)
        for name, x, r, bar in zip(("dq", "dk", "dv"), grads, oracle.grads, oracle.grad_bars):
            assert_within_bar(f"{schedule} {name}", x, r, bar)


@pytest.mark.parametrize("sq, sk", [(1000, 2048), (2048, 1000), (3000, 12000), (12000, 12000)])
def test_arrival_with_unequal_lengths_computes_the_bits_of_its_tables(sq, sk):
    """Where keys outnumber queries several KV tiles reach the first row together and add last;
    the kernel's arithmetic must give the plan's order, so reading the tables gives the same bits.
    Over 64 KV tiles a head runs as groups launched top group first, and the tied tiles of
    (3000, 12000) lie in both of its groups."""
    from dash_plugin.kernels.backends import DeviceProps, Request
    from dash_plugin.kernels.hopper import tables_of
    from tests.test_gpu_hopper import computed_and_read
    from dash_plugin.kernels.hopper_backend import BACKEND
    from dash_plugin.schedules.plan import AttentionShape, launch_plan
    req = Request(torch.device("cuda"), torch.bfloat16, 128, "arrival", "ordered", False, sq, sk, True, -1, 0)
    plan = launch_plan(AttentionShape(1, 4, 4, (sq,), (sk,), False, True, -1, 0), "arrival",
                       tiles=BACKEND.tiles(req), device=DeviceProps(132))
    tables = tables_of(plan.schedule.sequences[0])
    assert tables.visit == "arrival"
    g = torch.Generator(device="cuda").manual_seed(7)
    q, do = (torch.randn(1, sq, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, sk, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out, lse = hopper.attention_forward(q, k, v, softmax_scale=128 ** -0.5, causal=True)
    computed, read = computed_and_read(tables, do, q, k, v, out, lse, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(computed, read))


def test_packed_arrival_over_several_groups_gives_each_sequence_its_own_bits():
    """Sequences of 71 and 94 KV tiles run `arrival` as groups launched top group first, counted
    from each sequence's own KV tiles: the packed gradients agree with FA4's ascending adds to
    rounding, and each sequence's bits are those it gets packed alone."""
    lengths = ((1000, 1000), (9000, 9000), (3000, 12000))
    p = packed(lengths, 4, 4, 128, True, seed=8)
    with hang_guard(300):
        grads = backward(p, "arrival")
        ascending = backward(p, "ascending")
    for name, a, b in zip(("dq", "dk", "dv"), grads, ascending):
        assert_same_sums(f"{name} against ascending", a, b)
    for b in range(len(lengths)):
        solo, rows, keys = sequence_alone(p, b)
        with hang_guard(300):
            alone = backward(solo, "arrival")
        for name, x, y, part in zip(("dq", "dk", "dv"), alone, grads, (rows, keys, keys)):
            assert torch.equal(x, y[part]), f"sequence {b}: {name}"


def test_auto_runs_packed_batches_here_and_says_why_where_not():
    g = torch.Generator(device="cuda").manual_seed(6)
    cu = torch.tensor([0, 1000, 4096], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    out = dash_plugin.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    got = dash_plugin.last_resolved()
    table = auto.choose_schedule(causal=True, head_dim=128, seqlen_q=3096, seqlen_k=3096, varlen=True,
                                 backend="hopper")
    assert (got.concrete_backend, got.concrete_schedule) == ("hopper", table), got.describe()
    assert_call_matches_oracle(q, k, v, out, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    dash_plugin.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, dropout_p=0.1, softcap=30.0)
    got = dash_plugin.last_resolved()
    assert got.concrete_backend == "triton"
    assert "hopper: softcap with dropout runs on the Triton backend" in got.describe()
    dash_plugin.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, dropout_p=0.1)
    assert dash_plugin.last_resolved().concrete_backend == "hopper"   # dropout on packed batches runs here
    with pytest.raises(ValueError, match="backend='hopper' cannot run this call: schedule='shift' with varlen"):
        dash_plugin.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="hopper", schedule="shift")
