"""torch.library ops: opcheck, autograd, and torch.compile(fullgraph=True) training steps."""
import re

import pytest
import torch
from torch.library import opcheck

import dash_plugin


def _args(varlen=False, dropout=0.0):
    g = torch.Generator().manual_seed(0)
    if varlen:
        q, k, v = (torch.randn(24, h, 32, generator=g).requires_grad_() for h in (4, 2, 2))
        cu = torch.tensor([0, 10, 24], dtype=torch.int32)
        return (q, k, v, cu, cu, 14, 14, 0.2, True, -1, 0, 0.0, dropout, 11, "descending", True)
    q = torch.randn(2, 12, 4, 32, generator=g).requires_grad_()
    k, v = (torch.randn(2, 12, 2, 32, generator=g).requires_grad_() for _ in range(2))
    return (q, k, v, None, None, 12, 12, 0.2, True, 5, 0, 2.5, dropout, 11, "shift", True)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_opcheck_forward(varlen, dropout):
    opcheck(torch.ops.dash.fwd.default, _args(varlen, dropout))


def test_opcheck_float64_keeps_a_float64_lse():
    q, k, v, *rest = (t.detach().double().requires_grad_() if isinstance(t, torch.Tensor) else t for t in _args())
    out, lse = torch.ops.dash.fwd(q, k, v, *rest)
    assert lse.dtype == torch.float64
    opcheck(torch.ops.dash.fwd.default, (q, k, v, *rest))
    opcheck(torch.ops.dash.bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(),
                                         lse, *rest))


def test_opcheck_backward():
    q, k, v, *rest = _args()
    out, lse = torch.ops.dash.fwd(q, k, v, *rest)
    opcheck(torch.ops.dash.bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(),
                                         lse, *rest))


@pytest.mark.parametrize("varlen", [False, True])
def test_api_function_and_the_ops_registered_autograd_give_the_same_bits(varlen):
    """The API differentiates through its own autograd.Function (cheaper per call); the op's
    registered autograd must stay the same computation: same outputs and gradients, bit for bit."""
    from dash_plugin import ops

    q, k, v, *rest = _args(varlen, dropout=0.2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for forward in (ops.attention, torch.ops.dash.fwd):
        out, lse = forward(q, k, v, *rest)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        results.append((out, lse) + grads)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not results[0][1].requires_grad    # lse is not differentiable on either path
    with torch.no_grad():
        out, _ = ops.attention(q, k, v, *rest)
    assert out.grad_fn is None and torch.equal(out, results[0][0])


@pytest.mark.parametrize("change, message", [
    (dict(q=torch.randn(2, 12, 3, 32)), "multiple of key/value heads"),
    (dict(k=torch.randn(3, 12, 2, 32), v=torch.randn(3, 12, 2, 32)), "same batch size"),
    (dict(schedule="bogus"), "schedule='bogus'"),
    (dict(schedule="auto"), "the API resolves 'auto'"),
    (dict(schedule="atomic"), "not deterministic but deterministic=True"),
    (dict(dropout_p=1.5), "dropout_p=1.5"),
    (dict(softmax_scale=-0.2), "softmax_scale=-0.2"),
    (dict(softmax_scale=float("nan")), "softmax_scale=nan"),
    (dict(softmax_scale=float("inf")), "softmax_scale=inf"),
    (dict(softcap=float("nan")), "softcap=nan"),
    (dict(softcap=float("inf")), "softcap=inf"),
    (dict(window_left=-3), "window_left=-3"),
    (dict(window_right=4), "causal=True with window_right=4"),
    (dict(cu_seqlens_q=torch.tensor([0, 12], dtype=torch.int32)), "given together"),
])
def test_ops_refuse_bad_input_with_the_argument_named(change, message):
    """Callers of torch.ops.dash.* skip the API's checks: the ops check on their own (no host sync)."""
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
             "causal", "window_left", "window_right", "softcap", "dropout_p", "seed", "schedule", "deterministic")
    good = dict(zip(names, _args()))
    good.update(window_left=-1)
    args = tuple(dict(good, **change)[n] for n in names)
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.dash.fwd(*args)
    q, k, v, *rest = _args()
    out, lse = torch.ops.dash.fwd(q, k, v, *rest)
    with pytest.raises(ValueError, match="lse is"):
        torch.ops.dash.bwd(torch.randn_like(out), q, k, v, out, lse[:, :, :5], *rest)
    with pytest.raises(ValueError, match="dout is"):
        torch.ops.dash.bwd(torch.randn(2, 12, 4, 16), q, k, v, out, lse, *rest)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("cu, message", [
    ([0, 7, 4], "must start at 0 and never decrease"),
    ([0, 7, 50], r"\[-1\]=50 must equal the number of tokens \(12\)"),
    ([0, 5, 9], r"\[-1\]=9 must equal the number of tokens \(12\)"),
    ([2, 5, 12], "must start at 0"),
])
def test_ops_check_the_cu_seqlens_they_read(backend, which, cu, message):
    """Callers of torch.ops.dash.* skip the API: each op reads cu_seqlens once and refuses contents
    that would read or write outside the packed tensors (the reference forward returned
    uninitialised memory, its backward NaN gradients)."""
    # Triton on a GPU where there is one (its kernels take half precision there), else in its
    # CPU interpreter (tests/conftest.py)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 32, generator=g).to(device, dtype) for _ in range(3))
    good = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    cus = dict(cu_seqlens_q=good, cu_seqlens_k=good)
    rest = (12, 12, 0.2, True, -1, 0, 0.0, 0.0, 0, "ascending", True, backend)
    out, lse = torch.ops.dash.fwd(q, k, v, good, good, *rest)
    cus[which] = torch.tensor(cu, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=which + r".*" + message):
        torch.ops.dash.fwd(q, k, v, cus["cu_seqlens_q"], cus["cu_seqlens_k"], *rest)
    with pytest.raises(ValueError, match=which + r".*" + message):
        torch.ops.dash.bwd(torch.ones_like(out), q, k, v, out, lse, cus["cu_seqlens_q"], cus["cu_seqlens_k"], *rest)


def test_deterministic_false_with_a_deterministic_schedule_runs():
    """deterministic=False means 'not required': split may still run (and gives split's bits)."""
    q, k, v, *rest = _args()
    rest[-2:] = ["split", False]
    out, _ = torch.ops.dash.fwd(q, k, v, *rest)

    def grads_of(deterministic):
        call = dash_plugin.flash_attention(q, k, v, causal=True, schedule="split", deterministic=deterministic,
                                           softmax_scale=0.2, window=(5, 0), softcap=2.5)
        assert dash_plugin.last_resolved().concrete_schedule == "split"
        return torch.autograd.grad(call, (q, k, v), torch.ones_like(out))

    grads = grads_of(False)
    assert all(torch.isfinite(g).all() for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_of(True)))   # split's bits either way


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 32, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: dash_plugin.flash_attention(q, k, v, causal=True, softcap=2.0),
                                    (q, k, v), eps=1e-6, atol=1e-5)


def test_first_order_grads_with_create_graph_and_a_clear_refusal_of_the_second():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 6, 2, 32, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    plain = torch.autograd.grad(dash_plugin.flash_attention(q, k, v, causal=True).sum(), (q, k, v))
    graphed = torch.autograd.grad(dash_plugin.flash_attention(q, k, v, causal=True).sum(), (q, k, v),
                                  create_graph=True)
    assert all(torch.equal(a, b.detach()) for a, b in zip(plain, graphed))
    with pytest.raises(RuntimeError, match=r"dash attention has no second derivative.*attn_implementation='sdpa'"):
        sum(x.pow(2).sum() for x in graphed).backward()   # a gradient penalty


def test_compiled_training_step_matches_eager():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 3 * 64)

    def step(x):
        q, k, v = layer(x).view(2, 16, 3, 2, 32).unbind(2)
        return dash_plugin.flash_attention(q, k, v, causal=True, schedule="descending").square().mean()

    x = torch.randn(2, 16, 64)
    eager = step(x)
    eager_grads = torch.autograd.grad(eager, list(layer.parameters()))
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):  # the second call reuses the compiled graph
        loss = compiled(x)
        grads = torch.autograd.grad(loss, list(layer.parameters()))
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # ... and through our op: the graph Dynamo captures calls dash::fwd (not a traced-through reference)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(step, fullgraph=True, backend=record)(x)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert "dash.fwd" in targets, targets


def _compiled_matches_eager(step, inputs):
    """`step` returns the attention output itself: a loss reduced after it would be fused by
    Inductor into another summation order than eager's (bits that depend on the CPU's vector
    width), so the gradient flows in from a fixed tensor instead."""
    eager = step(*inputs)
    grad_out = torch.randn(eager.shape, generator=torch.Generator().manual_seed(1))
    eager_grads = torch.autograd.grad(eager, [t for t in inputs if t.requires_grad], grad_out)
    compiled = torch.compile(step, fullgraph=True)
    out = compiled(*inputs)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad_out)
    assert torch.equal(out, eager)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)


def test_compiled_varlen_matches_eager():
    """fullgraph=True with cu_seqlens: the API's cu_seqlens checks read the tensor (a graph break),
    so under compile they are left to the op, which checks what it reads when it runs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)

    def step(q, k, v, cu):
        return dash_plugin.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=14,
                                           max_seqlen_k=14, causal=True)

    _compiled_matches_eager(step, (q, k, v, cu))
    bad = torch.tensor([0, 10, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]=20 must equal the number of tokens \(24\)"):
        torch.compile(step, fullgraph=True)(q, k, v, bad)


def test_compiled_varlen_needs_max_seqlen():
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    x = torch.randn(24, 2, 16)

    def step(x, cu):
        return dash_plugin.flash_attention(x, x, x, cu_seqlens_q=cu, cu_seqlens_k=cu)

    with pytest.raises(Exception, match="under torch.compile pass max_seqlen_q and max_seqlen_k"):
        torch.compile(step, fullgraph=True)(x, cu)


def test_compiled_self_attention_with_one_tensor_for_q_k_v_matches_eager():
    x = torch.randn(2, 12, 2, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()

    def step(x):
        return dash_plugin.flash_attention(x, x, x, causal=True)

    _compiled_matches_eager(step, (x,))


def test_compiling_a_call_raises_no_warning_from_our_code(monkeypatch):
    """Dynamo traces the API at compile time; where it meets a functools cache it warns that it
    ignores it ("silent incorrectness is a potential risk"), an alarm a user of a determinism
    library should not see. The API builds its request and auto rule without the caches there."""
    import warnings
    import torch._dynamo.utils as dynamo_utils
    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set(), raising=False)   # warned once per process
    torch._dynamo.reset()
    x = torch.randn(1, 16, 2, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()

    def step(x):
        return dash_plugin.flash_attention(x, x, x, causal=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(step, fullgraph=True)(x)
    ours = [str(w.message) for w in caught if "dash_plugin" in str(w.message) or "lru_cache" in str(w.message)]
    assert ours == [], ours
    assert torch.equal(out, step(x))


def test_compiled_dropout_draws_a_fresh_seed_per_call_and_follows_a_given_one():
    """fullgraph compile with dropout: each call draws its own mask, reproducibly from
    torch.manual_seed; with dropout_seed the compiled call gives the eager bits (README)."""
    x = torch.randn(1, 16, 2, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    drawn = torch.compile(lambda x: dash_plugin.flash_attention(x, x, x, causal=True, dropout_p=0.5),
                          fullgraph=True)
    torch.manual_seed(0)
    first, second = drawn(x), drawn(x)
    torch.manual_seed(0)
    assert not torch.equal(first, second) and torch.equal(drawn(x), first)

    def seeded(x):
        return dash_plugin.flash_attention(x, x, x, causal=True, dropout_p=0.5, dropout_seed=123)
    assert torch.equal(torch.compile(seeded, fullgraph=True)(x), seeded(x))
