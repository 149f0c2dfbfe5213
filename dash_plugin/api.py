"""The public entry point: ``dash_plugin.flash_attention``."""
import math

import torch

from . import checks, config, dispatch, ops
from .schedules.builders import is_fallback
from .schedules.registry import AUTO


def _plan_fallback(backend: str, asked: str, schedule: str, q_meta, k_meta, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, causal, window_left, window_right, softcap, dropout_p) -> str:
    """The fallback order the backward's launch plan runs where `schedule` does not apply to the
    call's shape, or where `auto` (`asked`) traded its table's cyclic pick for it ("" where neither,
    and for unordered schedules and backends without plans). Asked by last_resolved(), so calls
    nobody asks about build nothing here; the inputs are stand-ins of the call's shape, dtype and
    device (stride 0: no memory)."""
    q, k = (torch.empty((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in (q_meta, k_meta))
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k, causal=causal, window_left=window_left, window_right=window_right,
              softcap=softcap, dropout_p=dropout_p)
    notes = [v for v in dispatch.plan_variants(q, k, schedule=schedule, backend=backend, **kw) if is_fallback(v)]
    if asked == AUTO:
        notes.insert(0, dispatch.auto_trade_note(backend, schedule, q, **kw))
    return "; ".join(n for n in notes if n)


def _draw_seed() -> int:
    # From the default CPU generator: torch.manual_seed(s) fixes it, and no device sync is needed.
    return int(torch.randint(0, 2 ** 62, (1,)).item())


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, dropout_p=0.0,
                    dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    schedule=None, deterministic=None, backend=None, model_config=None, return_lse=False):
    """Attention with a deterministic backward, in the flash-attn layout.

    Dense: ``q (B, S_q, H_q, D)``, ``k, v (B, S_k, H_kv, D)``. Varlen: ``q (T_q, H_q, D)``,
    ``k, v (T_k, H_kv, D)`` with int32 ``cu_seqlens_q/k`` of shape ``(B + 1,)``. ``H_q`` must be a
    multiple of ``H_kv`` (GQA/MQA; K/V are never expanded). Causal masks are bottom-right aligned
    when ``S_q != S_k``; ``window=(left, right)`` limits keys to ``[i - left, i + right]`` around
    the diagonal (-1: unbounded); ``softcap > 0`` applies ``softcap * tanh(s / softcap)``.

    ``schedule`` / ``deterministic`` / ``backend`` override the config switch (see
    ``dash_plugin.config``); ``model_config`` lets a Hugging Face config's ``dash_attention`` entry
    take part.
    Dropout draws its seed from torch's default generator unless ``dropout_seed`` is given; its
    mask takes ``dropout_p`` in steps of 2**-8 (``dash_plugin.effective_dropout_p`` gives the p a
    call gets, whose exact inverse keep rate scales the kept values).

    Returns ``out`` (like ``q``), or ``(out, lse)`` with ``return_lse=True``; ``lse`` is fp32
    (fp64 for fp64 inputs) ``(B, H_q, S_q)``, varlen ``(H_q, T_q)``.

    Varlen under ``torch.compile``: pass ``max_seqlen_q`` and ``max_seqlen_k`` (reading them from
    ``cu_seqlens`` would break the graph); the op checks ``cu_seqlens`` when it runs.
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    checks.check_tensors(q, k, v, varlen)
    checks.check_bool("causal", causal)
    checks.check_bool("return_lse", return_lse)
    left, right = checks.check_window(window, causal)
    checks.check_scalars(softcap, dropout_p, softmax_scale)
    if dropout_seed is not None:
        dropout_seed = checks.check_int("dropout_seed", dropout_seed, 0)
    if varlen:
        max_seqlen_q, max_seqlen_k = checks.check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    else:
        max_seqlen_q, max_seqlen_k = checks.check_dense_lengths(q, k, max_seqlen_q, max_seqlen_k)
    left, right = checks.unbounded_beyond(left, right, max_seqlen_q, max_seqlen_k)

    resolved = config.resolve_config(schedule=schedule, deterministic=deterministic, backend=backend,
                                     model_config=model_config)
    try:
        runs_on, concrete, passed_over = dispatch.resolve(
            resolved.backend, resolved.schedule, q, k, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, causal=causal, window_left=left, window_right=right, softcap=softcap,
            dropout_p=dropout_p)
    except ValueError as exc:   # a backend or schedule the caller did not pass: say where it came from
        set_by = [f"{field}={value!r} from {source}" for field, value, source in
                  (("backend", resolved.backend, resolved.backend_source),
                   ("schedule", resolved.schedule, resolved.schedule_source))
                  if source not in ("call argument", "default")]
        if not set_by:
            raise
        raise ValueError(f"{exc} ({'; '.join(set_by)})") from None
    chosen = runs_on.name
    # (function, arguments) run only if last_resolved() is asked: one flat tuple on the call's path
    plan = None if torch.compiler.is_compiling() else (
        _plan_fallback, chosen, resolved.schedule, concrete, (q.shape, q.dtype, q.device),
        (k.shape, k.dtype, k.device), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, left, right,
        float(softcap), float(dropout_p))
    config._remember(resolved, plan, concrete_schedule=concrete, concrete_backend=chosen,
                     backend_passed_over=passed_over)

    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    seed = 0
    if dropout_p > 0:
        seed = _draw_seed() if dropout_seed is None else dropout_seed
    # Kernels need the head dim contiguous; other strides they take as they are.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = ops.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                             bool(causal), left, right, float(softcap), float(dropout_p), seed, concrete,
                             resolved.deterministic, chosen)
    return (out, lse) if return_lse else out
