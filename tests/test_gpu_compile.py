"""torch.compile on the GPU backends (marker `gpu`): the compiled graph calls the same kernels as
eager, so out and every gradient must be the same bits, dense and packed, with dropout (a given
seed), on the Triton and the Hopper backend. The CPU tests (tests/test_ops.py) check the same on
the reference backend. The attention output is returned itself and the gradient flows in from a
fixed tensor: a loss reduced after it would be fused by Inductor into another summation order."""
import warnings

import pytest
import torch

import dash_plugin
from tests.gpu_oracle import HOPPER_SKIP

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BACKENDS = [pytest.param("triton", id="triton"), pytest.param("hopper", id="hopper", marks=HOPPER_SKIP)]


def _inputs(*shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for s in shapes]


def _compiled_gives_eager_bits(step, tensors, *extra):
    """Asserts the bits, and that tracing our code raised no warning (Dynamo warns where it meets a
    functools cache: see tests/test_ops.py); returns the backend the eager call ran on."""
    import torch._dynamo.utils as dynamo_utils
    torch._dynamo.reset()
    eager = step(*tensors, *extra)
    ran_on = dash_plugin.last_resolved().concrete_backend
    grad_out = torch.randn(eager.shape, device="cuda", dtype=eager.dtype,
                           generator=torch.Generator(device="cuda").manual_seed(1))
    want = torch.autograd.grad(eager, tensors, grad_out)
    compiled = torch.compile(step, fullgraph=True)
    dynamo_utils.warn_once_cache = set()   # Dynamo warns once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):   # the second call reuses the graph
            out = compiled(*tensors, *extra)
            got = torch.autograd.grad(out, tensors, grad_out)
            assert torch.equal(out, eager)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    ours = [str(w.message) for w in caught if "dash_plugin" in str(w.message) or "lru_cache" in str(w.message)]
    assert ours == [], ours
    return ran_on


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_compiled_dense_call_gives_the_eager_bits(backend, dropout_p):
    q, k, v = _inputs((2, 1000, 8, 128), (2, 1000, 2, 128), (2, 1000, 2, 128))

    def step(q, k, v):
        return dash_plugin.flash_attention(q, k, v, causal=True, dropout_p=dropout_p, dropout_seed=7, backend=backend)

    assert _compiled_gives_eager_bits(step, (q, k, v)) == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_packed_call_gives_the_eager_bits(backend):
    q, k, v = _inputs((3000, 8, 64), (3000, 8, 64), (3000, 8, 64), seed=2)
    cu = torch.tensor([0, 700, 3000], device="cuda", dtype=torch.int32)

    def step(q, k, v, cu):
        return dash_plugin.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2300,
                                           max_seqlen_k=2300, causal=True, window=(256, 0), backend=backend)

    assert _compiled_gives_eager_bits(step, (q, k, v), cu) == backend


def test_a_second_derivative_is_refused_by_name_on_the_gpu():
    q, k, v = _inputs((1, 256, 4, 64), (1, 256, 4, 64), (1, 256, 4, 64), seed=3)
    out = dash_plugin.flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), create_graph=True)
    plain = torch.autograd.grad(dash_plugin.flash_attention(q, k, v, causal=True), (q, k, v), torch.ones_like(out))
    assert all(torch.equal(a.detach(), b) for a, b in zip(grads, plain))
    with pytest.raises(RuntimeError, match="dash attention has no second derivative"):
        sum(g.float().pow(2).sum() for g in grads).backward()
