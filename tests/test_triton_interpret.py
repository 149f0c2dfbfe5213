"""The Triton kernels on the CPU under TRITON_INTERPRET=1, against the float64 reference.

The interpreter runs programs one after another (grid axis 0 outermost), so ordered schedules
wait only on earlier programs: ascending, descending and spt run with their waits (the host
launches each dQ tile's contributors in rank order); the cyclic shift runs with waits skipped
(NO_WAIT), which checks its visit lists and arithmetic but not its waiting. bf16 `tl.dot` is
wrong in the interpreter, so fp32 and fp16 only. Shapes are tiny (tiles are 32x16 forward,
16x32 backward here, so they still span several tiles).
"""
import os

import pytest
import torch

triton = pytest.importorskip("triton")

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA before anything imports triton.
# There these tests must run: a failed import or compiled (non-interpreted) kernels are errors, not skips.
# On a GPU machine the kernels are tested compiled, by tests/test_gpu_kernels.py.
if os.environ.get("TRITON_INTERPRET") != "1":
    if torch.cuda.is_available():
        pytest.skip("GPU machine: the compiled kernels are tested by test_gpu_kernels.py", allow_module_level=True)
    raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")

from dash_plugin import dispatch  # noqa: E402
from dash_plugin.kernels import attn_fwd, reference  # noqa: E402
from dash_plugin.kernels.triton_backend import BACKEND as TRITON  # noqa: E402
from dash_plugin.schedules import registry  # noqa: E402

assert type(attn_fwd._fwd_kernel).__name__.startswith("Interpreted"), "triton was imported before TRITON_INTERPRET=1"

SCHEDULES = registry.names()


def triton_backward(*args, **kw):
    return dispatch.attention_backward(*args, backend="triton", **kw)

# name -> ((B, Sq, Sk, Hq, Hkv, D), keywords, schedules to run)
CASES = {
    "full_gqa_d48": ((2, 40, 56, 4, 2, 48), {}, ("atomic", "ascending", "split")),
    "causal": ((1, 64, 64, 2, 1, 32), {"causal": True}, SCHEDULES),
    "causal_sq_gt_sk": ((1, 70, 40, 2, 2, 32), {"causal": True}, ("ascending", "spt", "split")),
    "causal_sq_lt_sk": ((1, 40, 70, 2, 2, 32), {"causal": True}, ("descending", "atomic")),
    "window": ((1, 64, 64, 2, 1, 32), {"window_left": 9, "window_right": 4}, ("ascending", "descending", "split")),
    "softcap_mqa": ((1, 48, 48, 4, 1, 64), {"causal": True, "softcap": 3.0}, ("spt", "split")),
    "dropout": ((1, 48, 48, 2, 2, 32), {"causal": True, "dropout_p": 0.25, "seed": 2024}, ("ascending", "split")),
    "full_shift_cyclic": ((1, 96, 96, 1, 1, 32), {}, ("shift",)),
    # Windows wider than the tiles and ragged lengths: interior (unmasked) tiles between masked
    # edges on both sides, in the forward, the KV walk and the dQ walk.
    "wide_window_ragged": ((1, 150, 130, 2, 1, 32), {"window_left": 45, "window_right": 21},
                           ("ascending", "atomic", "split")),
    "causal_ragged_d40": ((2, 100, 117, 2, 2, 40), {"causal": True}, ("descending", "split")),
}


def _inputs(shape, dtype, seed=0):
    b, sq, sk, hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    do = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    return q, k, v, do


def _rel(a, b):
    assert torch.isfinite(a).all(), "NaN/inf in kernel output"
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


TOL = {torch.float32: 1e-5, torch.float16: 4e-3}


def _check(q, k, v, do, kw, schedules, dtype):
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    d64 = [t.double() for t in (q, k, v, do)]
    o64, lse64 = reference.attention_forward(*d64[:3], **kw)
    assert _rel(out, o64) < TOL[dtype]
    fin = torch.isfinite(lse64)
    assert torch.equal(torch.isinf(lse), ~fin), "rows without visible keys must give lse=+inf"
    assert (lse.double()[fin] - lse64[fin]).abs().max() < 1e-4
    assert torch.all(out[~fin.transpose(-1, -2)] == 0) if not fin.all() else True
    g64 = reference.attention_backward(d64[3], *d64[:3], o64, lse64, **kw)
    for schedule in schedules:
        grads = triton_backward(do, q, k, v, out, lse, schedule=schedule,
                                            deterministic=schedule != "atomic", **kw)
        for name, a, b in zip(("dq", "dk", "dv"), grads, g64):
            assert a.dtype == q.dtype and a.shape == b.shape
            assert _rel(a, b) < TOL[dtype], f"{schedule} {name}: {_rel(a, b):.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_reference_fp32(case):
    shape, kw, schedules = CASES[case]
    q, k, v, do = _inputs(shape, torch.float32)
    _check(q, k, v, do, dict(kw, softmax_scale=shape[-1] ** -0.5), schedules, torch.float32)


def test_fp16_causal_gqa_all_features_at_once():
    shape = (1, 48, 64, 4, 2, 48)
    kw = dict(causal=True, softcap=4.0, dropout_p=0.1, seed=7, softmax_scale=0.2)
    q, k, v, do = _inputs(shape, torch.float16, seed=1)
    _check(q, k, v, do, kw, ("ascending", "atomic"), torch.float16)


def test_varlen_matches_reference_including_empty_sequences():
    lens_q, lens_k = [20, 0, 37, 5], [33, 9, 37, 0]
    hq, hkv, d = 2, 1, 32
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens_q), hq, d, generator=g)
    k = torch.randn(sum(lens_k), hkv, d, generator=g)
    v = torch.randn(sum(lens_k), hkv, d, generator=g)
    do = torch.randn_like(q)
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    kw = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q),
              max_seqlen_k=max(lens_k), softmax_scale=d ** -0.5, causal=True, dropout_p=0.2, seed=3)
    _check(q, k, v, do, kw, ("ascending", "split"), torch.float32)


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "dense"])
def test_batches_beyond_the_grid_limit_launch_in_chunks(monkeypatch, varlen):
    """CUDA allows 65535 blocks on the sequence axis; more sequences go out in several launches. With
    the limit lowered to 2, five sequences take three launches and give the one-launch bits."""
    from dash_plugin.kernels import _triton_common

    g = torch.Generator().manual_seed(8)
    lens = [7, 1, 20, 0, 13] if varlen else [16] * 5
    q = torch.randn(sum(lens), 2, 32, generator=g)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    kw = dict(softmax_scale=0.2, causal=True, dropout_p=0.1, seed=5)
    if varlen:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    else:
        q, k, v, do = (t.view(5, 16, 2, 32) for t in (q, k, v, do))

    def run():
        out, lse = attn_fwd.attention_forward(q, k, v, **kw)
        grads = [triton_backward(do, q, k, v, out, lse, schedule=s, **kw)
                 for s in ("split", "ascending", "descending")]
        return [out, lse] + [t for g3 in grads for t in g3]

    one_launch = run()
    monkeypatch.setattr(_triton_common, "MAX_GRID_SEQS", 2)
    assert _triton_common.seq_chunks(5) == [(0, 2), (2, 2), (4, 1)]
    chunked = run()
    assert all(torch.equal(a, b) for a, b in zip(one_launch, chunked))
    ref, _ = reference.attention_forward(q.double(), k.double(), v.double(),
                                         **{n: x for n, x in kw.items() if not n.startswith("max_")})
    assert _rel(chunked[0], ref) < 1e-5


def test_dropout_mask_is_the_reference_mask():
    """Same seed gives the reference's output; another seed gives a different one."""
    shape = (1, 32, 32, 1, 1, 32)
    q, k, v, _ = _inputs(shape, torch.float32)
    kw = dict(softmax_scale=0.3, dropout_p=0.5, seed=11)
    out, _ = attn_fwd.attention_forward(q, k, v, **kw)
    ref, _ = reference.attention_forward(q.double(), k.double(), v.double(), **kw)
    assert _rel(out, ref) < 1e-5
    other, _ = attn_fwd.attention_forward(q, k, v, **dict(kw, seed=12))
    assert _rel(other, ref) > 1e-2


def test_ordered_schedules_give_identical_bits_in_the_interpreter_runs():
    """Sequential execution: an ordered schedule's dQ is a fixed sum; two calls agree bit for bit."""
    q, k, v, do = _inputs((1, 64, 64, 2, 1, 32), torch.float32)
    kw = dict(softmax_scale=0.17, causal=True)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    a = triton_backward(do, q, k, v, out, lse, schedule="descending", **kw)
    b = triton_backward(do, q, k, v, out, lse, schedule="descending", **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="auto"), "schedule='auto'"),
    (dict(schedule="atomic", deterministic=True), "deterministic=True"),
    (dict(softcap=-1.0), "softcap=-1.0"),
    (dict(dropout_p=1.0), "dropout_p=1.0"),
    (dict(causal=True, window_right=3), "window_right=3"),
])
def test_bad_arguments_are_named(kwargs, match):
    """(deterministic=False with an ordered schedule is allowed: it means 'not required'.)"""
    q, k, v, do = _inputs((1, 16, 16, 1, 1, 32), torch.float32)
    base = dict(softmax_scale=0.2)
    with pytest.raises(ValueError, match=match):
        triton_backward(do, q, k, v, q, torch.zeros(1, 1, 16), **dict(base, **kwargs))


@pytest.mark.parametrize("causal", [False, True])
def test_persistent_grid_computes_what_one_program_per_worker_computes(monkeypatch, causal):
    """The cyclic shift's persistent launch (here 3 programs, so work items wrap round the grid
    several times across workers, KV heads and sequences) visits the same tiles: dK/dV (summed in
    registers in visit order) are bitwise those of one program per worker, and all three
    gradients match the reference. dQ is not compared bitwise: the interpreter skips cyclic waits,
    so its dQ adds land in execution order, which the grid changes (the GPU tests check the bits)."""
    q, k, v, do = _inputs((3, 128, 128, 4, 2, 32), torch.float32, seed=5)   # 4 KV tiles: causal pairs them
    kw = dict(softmax_scale=32 ** -0.5, causal=causal)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("DASH_PERSISTENT_CYCLIC", flag)
        runs[flag] = triton_backward(do, q, k, v, out, lse, schedule="shift", **kw)
    assert TRITON.device_props(q.device).resident_programs == 3
    assert torch.equal(runs["1"][1], runs["0"][1]) and torch.equal(runs["1"][2], runs["0"][2])
    g64 = reference.attention_backward(*(t.double() for t in (do, q, k, v, out)), lse.double(), **kw)
    for a, b in zip(runs["1"], g64):
        assert _rel(a, b) < TOL[torch.float32]


@pytest.mark.parametrize("raw, want", [("1", True), ("0", False), (" 0 ", False)])
def test_fwd_tma_switch_reads_the_environment(monkeypatch, raw, want):
    monkeypatch.setenv("DASH_FWD_TMA", raw)
    assert attn_fwd._tma_wanted() is want


def test_fwd_tma_switch_names_a_bad_value(monkeypatch):
    monkeypatch.setenv("DASH_FWD_TMA", "yes please")
    with pytest.raises(ValueError, match="DASH_FWD_TMA='yes please'"):
        attn_fwd._tma_wanted()


def test_interpreter_forward_keeps_pointer_loads():
    """The interpreter runs the pointer loads (TMA is a Hopper copy engine): no descriptors there."""
    k = torch.randn(1, 64, 2, 32)
    assert attn_fwd._kv_descriptors(k, k, False, 16, 32, True) == (None, None)


@pytest.mark.parametrize("head_dim, schedule", [(1, "ascending"), (8, "split"), (24, "descending"), (200, "split")])
def test_head_dims_below_and_between_the_padded_sizes(head_dim, schedule):
    """Every head dim 1..256 runs (Hugging Face's tiny test models use 4, 8, 16): the kernels pad
    to a power of two of at least 16 and the padding changes nothing. The results equal those of
    inputs zero-padded by hand, bit for bit, and agree with the float64 reference."""
    from dash_plugin import flash_attention
    from dash_plugin.kernels.tile_config import padded_head_dim

    padded = padded_head_dim(head_dim)
    g = torch.Generator().manual_seed(head_dim)
    q, k, v, do = (torch.randn(1, 40, h, head_dim, generator=g) for h in (2, 1, 1, 2))
    kw = dict(causal=True, softmax_scale=head_dim ** -0.5, schedule=schedule)

    def run(q, k, v, do, backend):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = flash_attention(q, k, v, backend=backend, **kw)
        return (out,) + torch.autograd.grad(out, (q, k, v), do)

    got = run(q, k, v, do, "triton")
    pad = lambda t: torch.nn.functional.pad(t, (0, padded - head_dim))  # noqa: E731
    by_hand = run(pad(q), pad(k), pad(v), pad(do), "triton")
    want = run(q.double(), k.double(), v.double(), do.double(), "reference")
    for a, b, c in zip(got, by_hand, want):
        assert torch.equal(a, b[..., :head_dim])
        assert _rel(a, c) < 1e-5


@pytest.mark.parametrize("schedule", ("split", "descending"))
def test_one_head_sliced_from_a_call_gives_that_heads_gradients(schedule):
    """Inputs that are one head of a larger call: views, with lse a slice whose size-1 head
    dimension keeps its parent's stride (contiguous all the same). The backward reads delta with
    lse's strides, so the buffers made for it must keep them; the head's gradients are the full
    call's, bit for bit (heads never mix)."""
    q, k, v, do = _inputs((1, 40, 40, 3, 3, 32), torch.float32)
    kw = dict(softmax_scale=32 ** -0.5, causal=True)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    whole = triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
    head = lambda t: t[:, :, 1:2]  # noqa: E731
    one_lse = lse[:, 1:2]
    assert one_lse.is_contiguous() and one_lse.stride() != (40, 40, 1)
    alone = triton_backward(*(head(t) for t in (do, q, k, v, out)), one_lse, schedule=schedule, **kw)
    for name, a, w in zip(("dq", "dk", "dv"), alone, whole):
        assert torch.equal(a, head(w)), name
