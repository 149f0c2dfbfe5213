"""The Triton backend: the kernels of attn_fwd.py and attn_bwd.py, the backward launched from a
launch plan (dash_plugin/schedules/plan.py), which holds every decision about order and grid.

Runs on CUDA in float16/bfloat16, and on the CPU under TRITON_INTERPRET=1 (float16/float32:
bfloat16 dots are wrong in the interpreter), where programs run one after another.
"""
import functools

import torch
import triton

from . import attn_bwd, attn_fwd, buffers, tile_config
from ._triton_common import LOG2E, interpreting, placeholder, problem, seq_chunks, stats_strides, strides4
from .attn_fwd import _check_common, mask_params
from .backends import DeviceProps, StuckWaitError
from .philox import dropout_threshold, keep_scale

# The registry's kernel modes (dash_plugin/schedules/registry.py) and the kernel's named modes.
_MODES = {"atomic": attn_bwd.ATOMIC.value, "ordered": attn_bwd.ORDERED.value, "split": attn_bwd.SPLIT.value}
_CUDA_DTYPES = (torch.float16, torch.bfloat16)
_INTERPRETER_DTYPES = (torch.float16, torch.float32)


class TritonBackend:
    name = "triton"

    def supports(self, request):
        if request.kernel_mode is not None and request.kernel_mode not in _MODES:
            return f"kernel mode {request.kernel_mode!r} is not implemented (only {', '.join(_MODES)})"
        if not 1 <= request.head_dim <= 256:
            return f"head_dim={request.head_dim}: the Triton kernels take 1..256"
        if request.device_type == "cuda":
            dtypes = _CUDA_DTYPES
        elif request.device_type == "cpu" and interpreting():
            dtypes = _INTERPRETER_DTYPES
        else:
            return f"device {request.device_type!r}: Triton runs on CUDA, or on the CPU under TRITON_INTERPRET=1"
        if request.dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            return f"dtype {request.dtype} on {request.device_type}: the Triton backend takes {names} there"
        return True

    def tiles(self, request):
        kernel = "split_kv" if request.kernel_mode == "split" else "ordered"
        return tile_config.bwd_config(request.dtype, request.head_dim, interpret=interpreting(), kernel=kernel)

    def device_props(self, device) -> DeviceProps:
        return _device_props(str(device), interpreting())

    def forward(self, q, k, v, **kw):
        return attn_fwd.attention_forward(q, k, v, **kw)

    def backward(self, plan, dout, q, k, v, out, lse, **kw):
        return _backward(plan, dout, q, k, v, out, lse, **kw)


@functools.lru_cache(maxsize=None)
def _device_props(device: str, interp: bool) -> DeviceProps:
    """Resident programs: one per SM (under MPS, CUDA reports the SMs the process's active-thread
    percentage leaves). Every config in the tile table fits one program per SM, so
    all of them are resident together; more per SM would have to be proved from the compiled
    kernel's registers and shared memory, and a wrong guess deadlocks. The interpreter runs
    programs one by one (no cyclic waits there) and gets 3, so that work items wrap around the
    persistent grid in the CPU tests."""
    if interp:
        return DeviceProps(resident_programs=3, concurrent=False)
    return DeviceProps(torch.cuda.get_device_properties(device).multi_processor_count, concurrent=True)


def _raise_if_stuck(err, schedule, group):
    flag, m_tile, rank, seen, n_tile, h, b = err[:7].tolist()
    if flag:
        raise StuckWaitError(
            f"schedule={schedule!r}: a backward program gave up waiting (DASH_DEBUG_WAITS=1): dQ tile {m_tile} "
            f"of query head {h}, sequence {b}, waited for rank {rank} but the counter stayed at {seen}; the waiting "
            f"program owns KV tile {n_tile} of KV head {h // group}. Its dQ adds are incomplete: the gradients "
            f"of this call are wrong.")


def _backward(plan, dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0,
              dropout_p=0.0, seed=0):
    """(dq, dk, dv) of `plan` (built for this call's shape and for `tiles()`); docs/INTERNALS.md."""
    _check_common(q, k, v, softmax_scale, causal, window_left, window_right, softcap, dropout_p)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    pb = problem(q, k, v, cu_seqlens_q, cu_seqlens_k, lengths=(plan.shape.seqlens_q, plan.shape.seqlens_k))
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    wl, wr = mask_params(causal, window_left, window_right)
    interp = interpreting()
    mode = _MODES[plan.mode]
    cfg = tile_config.bwd_config(q.dtype, pb.head_dim, interpret=interp,
                                 kernel="split_kv" if plan.mode == "split" else "ordered")
    if (cfg.block_m, cfg.block_n) != (plan.block_m, plan.block_n):
        raise ValueError(f"the plan was built for {plan.block_m}x{plan.block_n} tiles, this kernel runs "
                         f"{cfg.block_m}x{cfg.block_n}")
    block_d = tile_config.padded_head_dim(pb.head_dim)
    varlen = pb.varlen

    dk = buffers.empty_like(k)
    dv = buffers.empty_like(v)
    if pb.batch == 0 or pb.max_seqlen_q == 0 or pb.max_seqlen_k == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()

    delta = buffers.empty_like(lse)
    grid_m = triton.cdiv(pb.max_seqlen_q, cfg.block_m)
    for base, count in seq_chunks(pb.batch):
        attn_bwd._bwd_preprocess[(grid_m, pb.heads_q, count)](
            out, dout, delta, pb.cu_q, base, pb.max_seqlen_q, pb.head_dim,
            *strides4(out, varlen), *strides4(dout, varlen), *stats_strides(delta, varlen),
            VARLEN=varlen, BLOCK_M=cfg.block_m, BLOCK_D=block_d)

    common = (seed, dropout_threshold(dropout_p), float(softmax_scale), float(softmax_scale) * LOG2E,
              float(softcap), keep_scale(dropout_p), wl, wr)
    flags = dict(VARLEN=varlen, EVEN_D=block_d == pb.head_dim, HAS_WL=wl >= 0, HAS_WR=wr >= 0,
                 SOFTCAP=softcap > 0, DROPOUT=dropout_p > 0, BLOCK_D=block_d)
    lse_strides = stats_strides(lse, varlen)
    assert stats_strides(delta, varlen) == lse_strides

    if plan.mode == "split":
        dq = buffers.empty_like(q)
        dqa = dq                      # the KV kernel does not touch it in split mode
    else:
        # fp32 accumulator, zeroed on the caller's stream for every call.
        dqa = torch.zeros(q.shape, device=q.device, dtype=torch.float32)

    err = torch.zeros(8, device=q.device, dtype=torch.int32) if plan.debug_waits else None
    if plan.mode == "ordered":
        tabs = plan.device_tables(q.device)
        # Counters zeroed per call (docs/DESIGN.md, rule 6).
        sem = torch.zeros(plan.semaphores, device=q.device, dtype=torch.int32)
        t_args = (tabs["order"], tabs["num_workers"], tabs["seg_kv"], tabs["seg_end"], tabs["q_tile"], tabs["rank"])
        t_dims = (plan.table_stride, plan.slots, plan.tables.max_steps)
    else:
        sem = placeholder(q.device)   # never read or written outside the ordered mode
        t_args = (sem,) * 6
        t_dims = (0, 1, 1)

    # Waits never cross sequences, so each launch of a chunk of sequences is self-contained.
    for base, count in seq_chunks(pb.batch):
        grid, num_items = plan.grid(count)
        attn_bwd._bwd_kv_kernel[grid](
            q, k, v, dout, dk, dv, dqa, lse, delta, pb.cu_q, pb.cu_k, sem, err if plan.debug_waits else sem,
            *t_args, base, *common[:-2], wl, wr, plan.max_polls, pb.max_seqlen_q, pb.max_seqlen_k, pb.group,
            pb.head_dim, pb.heads_q, grid_m,
            *strides4(q, varlen), *strides4(k, varlen), *strides4(v, varlen), *strides4(dout, varlen),
            *strides4(dk, varlen), *strides4(dv, varlen), *strides4(dqa, varlen), *lse_strides,
            *t_dims, num_items, PERSISTENT=plan.persistent, MODE=mode, NO_WAIT=plan.skip_waits,
            DEBUG_WAITS=plan.debug_waits, **flags, **cfg.launch_args())
    if plan.debug_waits:
        _raise_if_stuck(err, plan.spec.name, pb.group)   # a host sync, only in this debug mode

    if plan.mode == "split":
        dq_cfg = tile_config.bwd_config(q.dtype, pb.head_dim, interpret=interp, kernel="split_dq")
        for base, count in seq_chunks(pb.batch):
            attn_bwd._bwd_dq_kernel[(triton.cdiv(pb.max_seqlen_q, dq_cfg.block_m), pb.heads_q, count)](
                q, k, v, dout, dq, lse, delta, pb.cu_q, pb.cu_k,
                base, *common, pb.max_seqlen_q, pb.max_seqlen_k, pb.group, pb.head_dim,
                *strides4(q, varlen), *strides4(k, varlen), *strides4(v, varlen), *strides4(dout, varlen),
                *strides4(dq, varlen), *lse_strides, **flags, **dq_cfg.launch_args())
        return dq, dk, dv
    # postprocess: one rounding of the fp32 accumulator to the input dtype.
    return dqa.to(q.dtype), dk, dv


BACKEND = TritonBackend()
