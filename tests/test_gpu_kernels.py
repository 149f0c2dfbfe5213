"""GPU tests of the Triton attention kernels (marker `gpu`; skipped without CUDA).

- every feature x every schedule, bf16 and fp16, against the float64 oracle (tests/math_attention.py),
  each of out, dq, dk and dv within twice the error of plain PyTorch math in the same dtype (the
  FlashAttention papers' bar); lse against the oracle's;
- every deterministic schedule: 1,000 backward passes bitwise equal while another stream runs
  matrix products; `atomic` shown to differ (so the bitwise check can fail);
- schedules agree with each other; two concurrent backward passes on two streams, three threads
  at once, and CUDA graph replays give the bits of a plain call (semaphores are zeroed per call);
- int64 offsets: a varlen batch with more than 2**31 elements in q.
"""
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    from dash_plugin.kernels import attn_fwd

from dash_plugin import dispatch  # noqa: E402
from dash_plugin.schedules import registry  # noqa: E402
from tests.gpu_oracle import assert_same_sums, assert_within_bar, oracle_of_call  # noqa: E402

SCHEDULES = registry.names()
DETERMINISTIC = registry.names(deterministic=True)


def triton_backward(*args, **kw):
    return dispatch.attention_backward(*args, backend="triton", **kw)
N_DETERMINISM = int(os.environ.get("DASH_DETERMINISM_PASSES", "1000"))

# name -> (dense shape (B, Sq, Sk, Hq, Hkv, D), keywords); varlen handled apart
FEATURES = {
    "full": ((2, 384, 384, 4, 4, 64), {}),
    "causal": ((2, 384, 384, 4, 4, 128), {"causal": True}),
    # four KV tiles of 128: two symmetric pairs, so shift's two programs wait on each other
    "causal_pairs": ((2, 512, 512, 4, 2, 128), {"causal": True}),
    "causal_sq_lt_sk": ((2, 200, 456, 4, 2, 64), {"causal": True}),
    "causal_sq_gt_sk": ((2, 456, 200, 4, 2, 64), {"causal": True}),
    "window": ((2, 512, 512, 4, 2, 96), {"window_left": 100, "window_right": 30}),
    "softcap": ((2, 384, 384, 4, 1, 128), {"causal": True, "softcap": 20.0}),
    "dropout": ((2, 384, 384, 4, 2, 64), {"causal": True, "dropout_p": 0.2, "seed": 1234}),
    "hdim256": ((1, 256, 256, 2, 1, 256), {"causal": True}),
    "hdim32": ((2, 384, 384, 4, 4, 32), {}),
    # below the kernels' smallest tile width: padded with zeros that change no result
    "hdim8": ((2, 256, 256, 4, 2, 8), {"causal": True}),
    "hdim24": ((2, 300, 300, 4, 4, 24), {}),
}


def make(shape, dtype, seed=0):
    b, sq, sk, hq, hkv, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d), mk(b, sq, hq, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("feature", list(FEATURES) + ["varlen"])
def test_every_feature_every_schedule_matches_float64_oracle(feature, dtype):
    if feature == "varlen":
        lens_q, lens_k = [130, 1, 300, 64], [200, 17, 300, 0]
        hq, hkv, d = 4, 2, 64
        kw = {"causal": True}
        g = torch.Generator(device="cuda").manual_seed(3)
        q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, generator=g)
        do = torch.randn_like(q)
        cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
        kw.update(cu_seqlens_q=cu(lens_q).cuda(), cu_seqlens_k=cu(lens_k).cuda(),
                  max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    else:
        shape, kw = FEATURES[feature]
        q, k, v, do = make(shape, dtype)
        d = shape[-1]
    kw = dict(kw, softmax_scale=d ** -0.5)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    want = oracle_of_call(q, k, v, do, **kw)
    assert_within_bar("out", out, want.out, want.out_bar)
    packed_lse = lse.transpose(0, 1).flatten(1) if lse.dim() == 3 else lse   # dense (B, H, S) as (H, B * S)
    fin = torch.isfinite(want.lse)
    assert torch.equal(torch.isinf(packed_lse.cpu()), ~fin)
    assert (packed_lse.cpu().double()[fin] - want.lse[fin]).abs().max() < 1e-4   # fp32 lse: ~1e-6 off
    for schedule in SCHEDULES:
        grads = triton_backward(do, q, k, v, out, lse, schedule=schedule, deterministic=schedule != "atomic", **kw)
        for name, got, ref, bar in zip(("dq", "dk", "dv"), grads, want.grads, want.grad_bars):
            assert_within_bar(f"{schedule} {name}", got, ref, bar)


def _side_stream_matmuls(stream, n=8):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(stream):
        for _ in range(n):
            a = (a @ a).clamp_(-1, 1)
    return a


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("schedule", DETERMINISTIC)
def test_deterministic_schedules_bitwise_over_many_passes_with_busy_side_stream(schedule, causal):
    q, k, v, do = make((2, 1024, 1024, 8, 4, 128), torch.bfloat16, seed=11)
    kw = dict(softmax_scale=128 ** -0.5, causal=causal)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    first = triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
    side = torch.cuda.Stream()
    mismatches = busy_at_launch = 0
    side_done = None
    for _ in range(N_DETERMINISM):
        if side_done is None or side_done.query():   # keep the side stream busy: refill it once it drains
            _side_stream_matmuls(side)
            side_done = torch.cuda.Event()
            side_done.record(side)
        busy_at_launch += not side_done.query()      # checked just before the backward is enqueued
        again = triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
        mismatches += sum(not torch.equal(a, b) for a, b in zip(first, again))
    torch.cuda.synchronize()
    print(f"[determinism] {schedule} causal={causal}: {N_DETERMINISM} passes, {mismatches} mismatching tensors, "
          f"side stream busy at {busy_at_launch} launches")
    assert mismatches == 0
    # Each pass ends on the host (torch.equal), so the side work runs beside the next one only if the
    # stream still holds some: refilled whenever it drains, it does at nearly every launch.
    assert busy_at_launch >= 0.9 * N_DETERMINISM, busy_at_launch


def test_atomic_is_not_bitwise_reproducible():
    """Proves the bitwise check can fail: float atomics add in arrival order."""
    q, k, v, do = make((2, 2048, 2048, 8, 8, 128), torch.bfloat16, seed=5)
    kw = dict(softmax_scale=128 ** -0.5)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    first = triton_backward(do, q, k, v, out, lse, schedule="atomic", deterministic=False, **kw)[0]
    differing = 0
    for _ in range(50):
        dq = triton_backward(do, q, k, v, out, lse, schedule="atomic", deterministic=False, **kw)[0]
        differing += not torch.equal(dq, first)
    print(f"[determinism] atomic: {differing}/50 passes differ from the first")
    assert differing > 0


def test_arrival_over_several_groups_repeats_and_agrees_with_ascending():
    """A head of more than 64 KV tiles runs `arrival` as groups launched top group first (the
    plan's worker order, which this backend launches as it is): its waits cross groups, so the
    bits must repeat while a side stream holds SMs, and the sums agree with `ascending`'s."""
    q, k, v, do = make((1, 9000, 9000, 4, 2, 128), torch.bfloat16, seed=13)
    kw = dict(softmax_scale=128 ** -0.5, causal=True)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    first = triton_backward(do, q, k, v, out, lse, schedule="arrival", **kw)
    from dash_plugin.kernels import backends
    from dash_plugin.schedules.plan import AttentionShape, launch_plan
    spec, req = dispatch.request(q, k, "arrival", causal=True)
    triton = backends.choose("triton", req, spec.backends)
    plan = launch_plan(AttentionShape.of(q, k, causal=True), "arrival", tiles=triton.tiles(req),
                       device=triton.device_props(q.device))
    seq = plan.schedule.sequences[0]
    assert seq.variant == "arrival" and seq.group_size == 64 and seq.geometry.num_kv_tiles > 64
    side = torch.cuda.Stream()
    for i in range(50):
        if i % 10 == 0:
            _side_stream_matmuls(side)
        again = triton_backward(do, q, k, v, out, lse, schedule="arrival", **kw)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), f"pass {i}"
    base = triton_backward(do, q, k, v, out, lse, schedule="ascending", **kw)
    for name, a, b in zip(("dq", "dk", "dv"), first, base):
        assert_same_sums(f"{name} against ascending", a, b)


def test_schedules_agree_with_each_other():
    q, k, v, do = make((2, 1024, 1024, 8, 2, 128), torch.bfloat16, seed=9)
    for causal in (True, False):
        kw = dict(softmax_scale=128 ** -0.5, causal=causal)
        out, lse = attn_fwd.attention_forward(q, k, v, **kw)
        base = triton_backward(do, q, k, v, out, lse, schedule="ascending", **kw)
        for s in DETERMINISTIC:
            other = triton_backward(do, q, k, v, out, lse, schedule=s, **kw)
            for a, b in zip(base, other):
                assert_same_sums(f"{s} against ascending", b, a)


@pytest.mark.parametrize("case", ["causal", "window", "hdim32", "softcap", "dropout", "varlen"])
def test_forward_tma_loads_give_the_pointer_loads_bits(case, monkeypatch):
    """The forward's interior KV tiles come through TMA descriptors (default) or pointer loads
    (DASH_FWD_TMA=0); the values loaded are the same, so out and lse must be bit for bit equal."""
    if case == "varlen":
        lens = [300, 1, 700, 130]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(4)
        q, k, v = (torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        d = 128
    else:
        shape, kw = FEATURES[case]
        shape = (shape[0], 1024, 1024) + shape[3:]   # long enough for interior tiles
        q, k, v, _ = make(shape, torch.bfloat16, seed=6)
        d = shape[-1]
    kw = dict(kw, softmax_scale=d ** -0.5)
    monkeypatch.setenv("DASH_FWD_TMA", "1")
    assert attn_fwd._kv_descriptors(k, v, "cu_seqlens_q" in kw, 64, 128, False)[0] is not None, "TMA not taken"
    with_tma = attn_fwd.attention_forward(q, k, v, **kw)
    monkeypatch.setenv("DASH_FWD_TMA", "0")
    with_pointers = attn_fwd.attention_forward(q, k, v, **kw)
    for a, b in zip(with_tma, with_pointers):
        assert torch.equal(a, b)


def test_two_streams_and_cuda_graph_replay_give_plain_bits():
    q, k, v, do = make((2, 1024, 1024, 8, 8, 128), torch.bfloat16, seed=2)
    kw = dict(softmax_scale=128 ** -0.5, causal=True)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    for schedule in ("ascending", "shift"):
        plain = triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            r1 = triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
        with torch.cuda.stream(s2):
            r2 = triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
        torch.cuda.synchronize()
        for a, b, c in zip(plain, r1, r2):
            assert torch.equal(a, b) and torch.equal(a, c)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)  # warm-up/tables
            with torch.cuda.graph(graph):
                captured = triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
        torch.cuda.current_stream().wait_stream(s)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(plain, captured):
                assert torch.equal(a, b)


def test_two_threads_at_once_give_plain_bits():
    """Two Python threads, each on its own stream, run the whole autograd backward through the public
    API 50 times at once (the table cache, the placeholders and the config are shared or per-thread
    state): every result equals the single-thread bits."""
    import threading

    import dash_plugin

    q, k, v, do = make((2, 1024, 1024, 8, 2, 128), torch.bfloat16, seed=3)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def grads(schedule):
        out = dash_plugin.flash_attention(*leaves, causal=True, schedule=schedule)
        return torch.autograd.grad(out, leaves, do)

    plain = {s: grads(s) for s in ("descending", "split")}
    bad, errors = [], []

    def worker(schedule):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(50):
                    got = grads(schedule)
                    torch.cuda.current_stream().synchronize()
                    bad.extend(schedule for a, b in zip(plain[schedule], got) if not torch.equal(a, b))
        except Exception as exc:  # surfaced below, with the schedule
            errors.append((schedule, repr(exc)))

    threads = [threading.Thread(target=worker, args=(s,)) for s in ("descending", "split", "descending")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a backward thread did not finish within 300 s"
    assert not errors, errors
    assert not bad, f"{len(bad)} tensors differed from the single-thread bits: {sorted(set(bad))}"


def test_int64_offsets_beyond_2_pow_31_elements():
    """q holds 2**31 elements (varlen, 2048 sequences): offsets overflow int32 if not widened."""
    nseq, s, hq, d = 2048, 1024, 8, 128
    t = nseq * s
    assert t * hq * d >= 2 ** 31
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.arange(0, t + 1, s, device="cuda", dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s, softmax_scale=d ** -0.5,
              causal=True)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    do = torch.randn_like(q)
    dq, dk, dv = triton_backward(do, q, k, v, out, lse, schedule="split", **kw)
    last = slice(t - s, t)   # the last sequence lives past 2**31 elements
    # (no dropout here: the oracle would key its mask by sequence 0, and this is sequence 2047)
    want = oracle_of_call(*(x[last].unsqueeze(0) for x in (q, k, v, do)), softmax_scale=d ** -0.5, causal=True)
    assert_within_bar("out", out[last], want.out, want.out_bar)
    for name, got, ref, bar in zip(("dq", "dk", "dv"), (dq, dk, dv), want.grads, want.grad_bars):
        assert_within_bar(name, got[last], ref, bar)
