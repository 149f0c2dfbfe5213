"""Input checks for the public API and the ``dash::`` ops. Every error names the argument, the value and
what is allowed."""
import math
import numbers

import torch

from .kernels.philox import dropout_threshold
from .kernels.varlen import seqlens_of
from .schedules import registry

# Every path takes head dims 1..256: the Triton kernels pad to their minimum (the padding never
# changes a result), the reference takes any.
HEAD_DIM_MIN, HEAD_DIM_MAX = 1, 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT64_MAX = 2 ** 63 - 1   # what the ops' int arguments carry


def _shape(t):
    return tuple(t.shape)


def _bound(value):
    return "2**63-1" if value == INT64_MAX else str(value)


def _is_int(value) -> bool:
    # A plain int first: the ABC check is slow, and every call checks several ints.
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def check_int(name, value, low, high=INT64_MAX):
    """An int in low..high (a symbolic int under torch.compile passes as it is)."""
    if isinstance(value, torch.SymInt):
        return value
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be an int in {low}..{_bound(high)}")
    return int(value)


def check_head_dim(head_dim):
    if not HEAD_DIM_MIN <= head_dim <= HEAD_DIM_MAX:
        raise ValueError(f"head_dim={head_dim} (q.shape[-1]) is out of range; allowed: {HEAD_DIM_MIN}..{HEAD_DIM_MAX}")


def check_tensors(q, k, v, varlen: bool):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise ValueError(f"{name} is a nested tensor; allowed: plain tensors. For a batch of sequences of "
                             "different lengths pass the packed (total_tokens, heads, head_dim) tensor with "
                             "cu_seqlens_q/k (a jagged nested tensor gives them as .values() and .offsets())")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device, which holds no data; allowed: devices with data "
                             "(cpu, cuda)")
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
    check_head_dim(d)
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA/MQA; "
                         f"got q={_shape(q)}, k={_shape(k)}")


def _check_cu_seqlens_layout(name, cu, batch=None):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}.dtype={cu.dtype}; allowed: torch.int32")
    if cu.device.type == "meta":   # its offsets are read: a meta tensor has none
        raise ValueError(f"{name} is on the meta device, which holds no data; allowed: devices with data "
                         "(cpu, cuda)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} has shape {_shape(cu)}; expected (batch + 1,) with batch >= 1")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} has {cu.numel()} entries but cu_seqlens_q has {batch + 1}; both must be (batch + 1,)")


def check_dense_lengths(q, k, max_seqlen_q, max_seqlen_k):
    """(max_seqlen_q, max_seqlen_k) of a dense call: its lengths; given ones must equal them."""
    for name, given, actual in (("max_seqlen_q", max_seqlen_q, q.shape[1]), ("max_seqlen_k", max_seqlen_k, k.shape[1])):
        if given is not None and check_int(name, given, 0) != actual:
            raise ValueError(f"{name}={given!r} is for packed (varlen) calls; this dense call's length is {actual} "
                             f"(leave it out, or pass {actual})")
    return q.shape[1], k.shape[1]


def check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """(max_seqlen_q, max_seqlen_k) of a varlen call: the given ones, checked against the longest
    sequences, or the longest ones. The offsets are read (one small host copy) and checked, except
    under torch.compile, where reading them would break the graph: there max_seqlen_q/k must be
    given, and the op checks the offsets when it runs (it reads them through the same check)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (varlen), or neither (dense)")
    _check_cu_seqlens_layout("cu_seqlens_q", cu_seqlens_q)
    _check_cu_seqlens_layout("cu_seqlens_k", cu_seqlens_k, batch=cu_seqlens_q.numel() - 1)
    given = {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k}
    for name, value in given.items():
        if value is not None:
            given[name] = check_int(name, value, 0)
    if torch.compiler.is_compiling():
        if None in given.values():
            raise ValueError("varlen: under torch.compile pass max_seqlen_q and max_seqlen_k; reading them from "
                             "cu_seqlens would break the graph (the op checks cu_seqlens when it runs)")
        return given["max_seqlen_q"], given["max_seqlen_k"]
    longest = {"max_seqlen_q": max(seqlens_of(cu_seqlens_q, q.shape[0], "cu_seqlens_q")),
               "max_seqlen_k": max(seqlens_of(cu_seqlens_k, k.shape[0], "cu_seqlens_k"))}
    for name, value in given.items():
        if value is not None and value < longest[name]:
            raise ValueError(f"{name}={value} is smaller than the longest sequence ({longest[name]})")
    return tuple(longest[name] if value is None else value for name, value in given.items())


def check_window(window, causal):
    if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(_is_int(w) for w in window)):
        raise ValueError(f"window={window!r} must be a pair of ints (left, right); -1 means unbounded")
    left, right = (int(w) for w in window)
    if not (-1 <= left <= INT64_MAX and -1 <= right <= INT64_MAX):
        raise ValueError(f"window={tuple(window)}: each side must be an int in -1..{_bound(INT64_MAX)} "
                         "(>= 0, or -1 for unbounded)")
    if causal and right > 0:
        raise ValueError(f"window={tuple(window)} with causal=True: causal allows no keys to the right "
                         "(window right must be 0 or -1)")
    return left, (0 if causal else right)


def unbounded_beyond(left, right, max_seqlen_q, max_seqlen_k):
    """(left, right) with a side at least S_q + S_k long written as -1 (unbounded): it sees the same
    keys, and the kernels' position arithmetic (i + right, j - left) stays far from int64's limit,
    where a side near 2**63 overflowed and gave wrong rows."""
    reach = max_seqlen_q + max_seqlen_k
    if isinstance(reach, torch.SymInt):   # under torch.compile: kept as given
        return left, right
    return (-1 if left >= reach else left), (-1 if right >= reach else right)


def check_bool(name, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


def _finite(value) -> bool:
    if type(value) is float or type(value) is int:   # the common case, without the slow ABC check
        return math.isfinite(value)
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


# The scores are computed in float32 (also for half inputs), as s * scale and, with a softcap,
# s * (scale / softcap): a scale or softcap outside these bounds, or a ratio above the upper one,
# becomes 0 or inf there, and a score times inf or over 0 is NaN (a zero score gives 0 * inf).
SCALAR_RANGE = (2.0 ** -126, 2.0 ** 126)
_RANGE_TEXT = "2**-126..2**126 (the scores are float32)"


def check_scalars(softcap, dropout_p, softmax_scale):
    if not _finite(softcap) or softcap < 0:
        raise ValueError(f"softcap={softcap!r} must be a finite number >= 0 (0 disables it)")
    if softcap and not SCALAR_RANGE[0] <= softcap <= SCALAR_RANGE[1]:
        raise ValueError(f"softcap={softcap!r} must be 0 (off) or in {_RANGE_TEXT}")
    if not _finite(dropout_p):   # not a real number: dropout_threshold would fail on the compare
        raise ValueError(f"dropout_p={dropout_p!r} must be in [0, 1)")
    dropout_threshold(dropout_p)   # the range and the mask's 2**-8 steps: refused here, not in a kernel launch
    if softmax_scale is None:
        return
    if not _finite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite number > 0 "
                         "(or None for 1/sqrt(head_dim))")
    if not SCALAR_RANGE[0] <= softmax_scale <= SCALAR_RANGE[1]:
        raise ValueError(f"softmax_scale={softmax_scale!r} must be in {_RANGE_TEXT}, or None for 1/sqrt(head_dim)")
    if softcap and softmax_scale / softcap > SCALAR_RANGE[1]:   # None gives a ratio <= 1 / softcap: in range
        raise ValueError(f"softmax_scale / softcap = {softmax_scale!r} / {softcap!r} must be at most 2**126 "
                         "(the scores are float32)")


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
