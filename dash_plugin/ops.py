"""``torch.ops.dash.fwd`` / ``torch.ops.dash.bwd``: the custom ops behind the public API.

They are opaque to torch.compile (fake implementations give the shapes), so a compiled model
calls exactly the same kernels as an eager one. The backward-only knobs (schedule,
deterministic) are forward arguments: ``register_autograd`` only sees forward inputs.

Backend: the ``backend`` argument names one of kernels/backends.py (the API passes the one it
resolved); ``auto`` picks by the committed rule there: Triton for CUDA half-precision inputs, the
plain-PyTorch reference for everything else (CPU, fp32, fp64, or a CUDA machine without Triton).
"""
from typing import Optional

import torch

from dash_plugin import checks, dispatch
from dash_plugin.kernels import backends
from dash_plugin.kernels.reference import compute_dtype


def kernel_path(t: torch.Tensor) -> str:
    """Which backend ``auto`` runs for inputs of ``t``'s device and dtype: "triton" or "reference"."""
    return backends.choose("auto", backends.Request(t.device, t.dtype, t.shape[-1] if t.dim() else 1)).name


def _kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
            window_right, softcap, dropout_p, seed):
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                window_right=window_right, softcap=softcap, dropout_p=dropout_p, seed=seed)


def _lse_shape(q: torch.Tensor, varlen: bool):
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
             window_right, softcap, dropout_p, seed, schedule, deterministic, backend="auto"):
    """``dash::fwd`` after its checks (the API calls it directly: see `_plain_eager`)."""
    kw = _kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                 window_right, softcap, dropout_p, seed)
    return dispatch.attention_forward(q, k, v, schedule=schedule, backend=backend, **kw)


def _backward_of(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                 causal, window_left, window_right, softcap, dropout_p, seed, schedule, deterministic,
                 backend="auto"):
    """``dash::bwd`` after its checks."""
    kw = _kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                 window_right, softcap, dropout_p, seed)
    return dispatch.attention_backward(dout.contiguous(), q, k, v, out, lse, schedule=schedule,
                                       deterministic=deterministic, backend=backend, **kw)


@torch.library.custom_op("dash::fwd", mutates_args=())
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
             cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
             causal: bool, window_left: int, window_right: int, softcap: float, dropout_p: float, seed: int,
             schedule: str, deterministic: bool, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_op_args("dash::fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
                         window_right, softcap, dropout_p, schedule, deterministic)
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, dropout_p, seed, schedule, deterministic, backend)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                   window_left, window_right, softcap, dropout_p, seed, schedule, deterministic, backend="auto"):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=compute_dtype(q.dtype))


@torch.library.custom_op("dash::bwd", mutates_args=())
def attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
             max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
             window_right: int, softcap: float, dropout_p: float, seed: int, schedule: str,
             deterministic: bool, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_op_args("dash::bwd", q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
                         window_right, softcap, dropout_p, schedule, deterministic)
    for arg, t in (("dout", dout), ("out", out)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"dash::bwd: {arg} is {t.dtype} {tuple(t.shape)} on {t.device}; it must match q "
                             f"({q.dtype} {tuple(q.shape)} on {q.device})")
    want = _lse_shape(q, cu_seqlens_q is not None)
    if tuple(lse.shape) != want or lse.dtype != compute_dtype(q.dtype):
        raise ValueError(f"dash::bwd: lse is {lse.dtype} {tuple(lse.shape)}; expected {compute_dtype(q.dtype)} {want}")
    return _backward_of(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed, schedule,
                        deterministic, backend)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.args = rest
    ctx.mark_non_differentiable(lse)
    # lse never has a gradient; without this autograd would allocate and zero one (B, H, S) fp32
    # tensor per backward to pass as `dlse`.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    if dout is None:   # nothing flowed into out (lse takes no gradient)
        return (None,) * (5 + len(ctx.args))
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    # The forward checked these arguments, and autograd gives dout out's shape, dtype and device.
    # With create_graph=True the op stays: it refuses a second derivative (_no_second_derivative),
    # the plain body would not.
    plain = not torch.is_grad_enabled() and _plain_eager(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    bwd = _backward_of if plain else torch.ops.dash.bwd
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.args)
    return (dq, dk, dv, None, None) + (None,) * len(ctx.args)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_second_derivative(ctx, *grads):
    raise RuntimeError(
        "dash attention has no second derivative: torch.autograd.grad(..., create_graph=True) gives first-order "
        "gradients, but a backward through them (a gradient penalty, double backward, Hessian-vector products) is "
        "not supported. Run that part with attn_implementation='sdpa' or 'eager' (or torch SDPA directly).")


# Without it, a backward through the gradients fails in torch with "no autograd formula was
# registered", which names neither the cause nor a way out.
attn_bwd.register_autograd(_no_second_derivative, setup_context=lambda ctx, inputs, output: None)


def _plain_eager(*tensors) -> bool:
    """Nothing but eager PyTorch sees this call: no torch.compile or compiled autograd, no tensor
    subclass or Python mode (FakeTensor, DTensor, FlopCounterMode, selective checkpointing,
    ``with torch.device(...)``), no functorch transform, no profiler. Then the ops' Python bodies
    can be called directly: the dispatcher would run the same body, with grad mode as the caller
    has it, and adds about 20 us a call in its custom-op wrappers (scripts/host_overhead.py).
    Everything else goes through ``torch.ops.dash`` so that it sees the ops."""
    return (not torch.compiler.is_compiling()
            and all(t is None or type(t) is torch.Tensor for t in tensors)
            and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._are_functorch_transforms_active()
            and not torch._C._autograd._profiler_enabled())


def _forward_op(*tensors):
    """``dash::fwd``'s body for plain eager calls, else the op (`_plain_eager`)."""
    return _forward if _plain_eager(*tensors) else torch.ops.dash.fwd


class _Attention(torch.autograd.Function):
    """What the public API calls when gradients are needed: the same context and backward as the
    op's registered autograd (one place, above), without the custom-op autograd wrapper, which
    spends about 41 us per forward rebuilding our 17-argument schema (docs/benchmarks/NOTES.md).
    Inside ``forward`` grad mode is off; it runs ``dash::fwd``'s body, or the op itself where
    something besides eager PyTorch watches (`_plain_eager`). The non-tensor arguments come as
    one tuple: `apply` inspects each argument it is given, and 12 of them cost about 25 us a
    call more than one."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, args):
        out, lse = _forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k)(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
        _setup_context(ctx, (q, k, v, cu_seqlens_q, cu_seqlens_k, *args), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)[:5] + (None,)   # no gradient for the argument tuple


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    """``(out, lse)`` of ``dash::fwd``, differentiable; ``args`` as in the op's schema after
    cu_seqlens_k, checked by the caller (the API) as the op would. Without gradients it is the
    op's body (the Function's own cost is not free); under torch.compile it is the op itself:
    compile cannot trace a Function given one tensor twice (q, k and v of self-attention, or one
    cu_seqlens for both) and has no per-call cost to save."""
    if torch.compiler.is_compiling():
        return torch.ops.dash.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, args)
    return _forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k)(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
