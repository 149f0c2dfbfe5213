"""Input checks for the public API and the ``dash::`` ops. Every error names the argument, the value and
what is allowed."""
import torch

from .schedules import registry

HEAD_DIM_MIN, HEAD_DIM_MAX = 32, 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t):
    return tuple(t.shape)


def check_tensors(q, k, v, varlen: bool):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not supported; allowed: float16, bfloat16, "
                            "float32 and float64 (the last two run on the reference path)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    want = 3 if varlen else 4
    layout = "(total_tokens, heads, head_dim) with cu_seqlens" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name} has shape {_shape(t)}; expected {want} dims {layout}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={_shape(k)}, v={_shape(v)}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got q={_shape(q)}, k={_shape(k)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head_dim, got q={_shape(q)}, k={_shape(k)}")
    if not HEAD_DIM_MIN <= d <= HEAD_DIM_MAX:
        raise ValueError(f"head_dim={d} (q.shape[-1]) is out of range; allowed: {HEAD_DIM_MIN}..{HEAD_DIM_MAX}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA/MQA; "
                         f"got q={_shape(q)}, k={_shape(k)}")


def check_cu_seqlens(name, cu, total, batch=None):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}.dtype={cu.dtype}; allowed: torch.int32")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} has shape {_shape(cu)}; expected (batch + 1,) with batch >= 1")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} has {cu.numel()} entries but cu_seqlens_q has {batch + 1}; both must be (batch + 1,)")
    values = cu.tolist()  # one small host copy: a broken cu_seqlens would read out of bounds
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}={values[:8]}{'...' if len(values) > 8 else ''} must start at 0 and never decrease")
    if values[-1] != total:
        raise ValueError(f"{name}[-1]={values[-1]} must equal the number of tokens ({total})")
    return max(b - a for a, b in zip(values, values[1:]))


def check_window(window, causal):
    if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(isinstance(w, int) for w in window)):
        raise ValueError(f"window={window!r} must be a pair of ints (left, right); -1 means unbounded")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window={tuple(window)}: each side must be >= 0, or -1 for unbounded")
    if causal and right > 0:
        raise ValueError(f"window={tuple(window)} with causal=True: causal allows no keys to the right "
                         "(window right must be 0 or -1)")
    return left, (0 if causal else right)


def check_scalars(softcap, dropout_p, softmax_scale):
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap={softcap!r} must be a number >= 0 (0 disables it)")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} must be in [0, 1)")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float)) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a positive number (or None for 1/sqrt(head_dim))")


def check_op_args(name, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right,
                  softcap, dropout_p, schedule, deterministic):
    """The checks of ``dash::fwd`` / ``dash::bwd`` (op ``name``), for callers that skip the API: no host
    sync (cu_seqlens contents are checked where they are read)."""
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k must be given together (varlen), or neither")
    check_tensors(q, k, v, varlen)
    if varlen:
        for arg, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
                raise ValueError(f"{name}: {arg} must be a 1-D int32 tensor of batch + 1 >= 2 offsets, got "
                                 f"dtype={cu.dtype}, shape={_shape(cu)}")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(f"{name}: cu_seqlens_q has {cu_seqlens_q.numel()} entries, cu_seqlens_k "
                             f"{cu_seqlens_k.numel()}; both must be (batch + 1,)")
    check_scalars(softcap, dropout_p, softmax_scale)
    if softmax_scale is None:
        raise ValueError(f"{name}: softmax_scale=None; the op needs the scale (the API fills in 1/sqrt(head_dim))")
    if window_left < -1 or window_right < -1:
        raise ValueError(f"{name}: window_left={window_left}, window_right={window_right}; each must be >= 0, "
                         "or -1 for unbounded")
    if causal and window_right > 0:
        raise ValueError(f"{name}: causal=True with window_right={window_right}; causal allows 0 or -1")
    registry.check_call(schedule, deterministic, where=f"{name}: ")
