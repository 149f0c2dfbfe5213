"""Triton attention forward: FlashAttention-2 style online softmax with fp32 accumulation.

One program owns one Q tile (BLOCK_M rows) of one query head of one sequence and walks the
KV tiles its rows can see (the mask bounds the walk, so causal and sliding-window calls skip
invisible tiles). The running max is kept in the log2 domain (exp2 is the fast path on the
GPU); the log-sum-exp goes out in natural log, +inf for rows that see no key.

Semantics, layouts and the signature: docs/INTERNALS.md; the oracle: kernels/reference.py.
"""
import os

import torch
import triton
import triton.language as tl

try:   # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

from . import buffers, tile_config
from ._triton_common import (LOG2E, as4d, col_range, dropout_keep, interior_cols, interpreting, load_tile, problem,
                             q_tile_program, seq_chunks, stats_strides, strides4, tanh, visible)
from .philox import dropout_threshold, keep_scale


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, m0, rows, n_from, n_to,
               h, b, seed, drop_threshold, scale_log2, softcap, seqlen_q, seqlen_k, window_left, window_right,
               head_dim, K_DESC, V_DESC, desc_b, desc_row0, hk,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
               SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, TMA: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online softmax over the KV tiles [n_from, n_to). MASKED=False is the fast path for tiles
    that `interior_cols` proved whole and fully visible: no load masks, no score mask. With TMA
    those interior tiles come through the tensor-memory accelerator (host-made descriptors of
    K and V as (batch, row, head, dim)): the copy engine fetches them, which frees registers and
    address arithmetic for the software pipeline. Interior tiles never reach past a sequence, so
    both paths load the same values; edge tiles keep the masked pointer loads."""
    cols0 = tl.arange(0, BLOCK_N)
    for n0 in range(n_from, n_to, BLOCK_N):
        cols = n0 + cols0
        if TMA and not MASKED:
            k = K_DESC.load([desc_b, desc_row0 + n0, hk, 0]).reshape(BLOCK_N, BLOCK_D)
            v = V_DESC.load([desc_b, desc_row0 + n0, hk, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            k = load_tile(k_base, cols, stride_ks, seqlen_k, head_dim, MASKED, EVEN_D, BLOCK_D)
            v = load_tile(v_base, cols, stride_vs, seqlen_k, head_dim, MASKED, EVEN_D, BLOCK_D)
        qk = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            s = softcap * tanh(qk * (scale_log2 / 1.4426950408889634 / softcap)) * 1.4426950408889634
        else:
            s = qk * scale_log2
        if MASKED:
            ok = visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left, window_right,
                         HAS_WL, HAS_WR)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 there (no inf - inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = dropout_keep(seed, m0, n0, h, b, drop_threshold, BLOCK_M, BLOCK_N, False)
            p = tl.where(keep, p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, K_DESC, V_DESC,
    seq_base, seed, drop_threshold, scale_log2, softcap, inv_keep,
    window_left, window_right,
    seqlen_q_dense, seqlen_k_dense, group, head_dim,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    VARLEN: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, REVERSE_M: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m, h, b, q_start, seqlen_q, k_start, seqlen_k = q_tile_program(CU_Q, CU_K, seq_base, seqlen_q_dense,
                                                                       seqlen_k_dense, VARLEN)
    num_m = tl.cdiv(seqlen_q, BLOCK_M)
    if pid_m >= num_m:
        return
    # Causal/windowed tiles near the bottom see the most keys: launch them first.
    m_tile = num_m - 1 - pid_m if REVERSE_M else pid_m
    m0 = m_tile * BLOCK_M
    hk = h // group

    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim

    desc_b = 0 if VARLEN else b   # the descriptors see a packed varlen tensor as one sequence
    # int64 base offsets: B*S*H*D may exceed 2**31.
    q_base = Q + b.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qs + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vs + hk.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + q_start.to(tl.int64) * stride_os + h.to(tl.int64) * stride_oh

    rmask = rows < seqlen_q
    q = tl.load(q_base + rows.to(tl.int64)[:, None] * stride_qs + dims[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, hi = col_range(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, HAS_WL, HAS_WR)
    n_lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
    a, z = interior_cols(m0, n_lo, hi, seqlen_q, seqlen_k, window_left, window_right,
                         BLOCK_M, BLOCK_N, HAS_WL, HAS_WR)
    # Left edge (window), interior (no masks), right edge (causal diagonal, ragged end): the
    # same tiles in the same order as one masked walk over [n_lo, hi).
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, m0, rows, n_lo, a,
                               h, b, seed, drop_threshold, scale_log2, softcap, seqlen_q, seqlen_k,
                               window_left, window_right, head_dim, K_DESC, V_DESC, desc_b, k_start, hk,
                               True, EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, TMA, BLOCK_M, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, m0, rows, a, z,
                               h, b, seed, drop_threshold, scale_log2, softcap, seqlen_q, seqlen_k,
                               window_left, window_right, head_dim, K_DESC, V_DESC, desc_b, k_start, hk,
                               False, EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, TMA, BLOCK_M, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, m0, rows, z, hi,
                               h, b, seed, drop_threshold, scale_log2, softcap, seqlen_q, seqlen_k,
                               window_left, window_right, head_dim, K_DESC, V_DESC, desc_b, k_start, hk,
                               True, EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, TMA, BLOCK_M, BLOCK_N, BLOCK_D)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    scale_out = inv_keep / l_safe if DROPOUT else 1.0 / l_safe
    out = acc * scale_out[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(o_base + rows.to(tl.int64)[:, None] * stride_os + dims[None, :], out.to(O.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])
    lse_ptr = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + (q_start + rows).to(tl.int64) * stride_ls
    tl.store(lse_ptr, lse, mask=rmask)


def _check_common(q, k, v, softmax_scale, causal, window_left, window_right, softcap, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name}.dtype={t.dtype}: the Triton kernels take float16, bfloat16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if softmax_scale is None or not softmax_scale > 0:
        raise ValueError(f"softmax_scale={softmax_scale}: must be a positive float")
    if causal and window_right > 0:
        raise ValueError(f"causal=True with window_right={window_right}: causal means window_right=0")
    if softcap < 0:
        raise ValueError(f"softcap={softcap}: must be >= 0 (0 turns it off)")
    dropout_threshold(dropout_p)   # refuses a p the mask cannot take (out of [0, 1), or lost to its steps)


def mask_params(causal, window_left, window_right):
    """(window_left, window_right) with causal folded in (causal means window_right = 0)."""
    wr = 0 if causal else int(window_right)
    return int(window_left), wr


def _tma_wanted() -> bool:
    """DASH_FWD_TMA=0 turns the forward's TMA loads off (read per call); they give the same values."""
    raw = os.environ.get("DASH_FWD_TMA", "1").strip().lower()
    if raw not in ("0", "1"):
        raise ValueError(f"DASH_FWD_TMA={raw!r}: use 1 (on) or 0 (off)")
    return raw == "1"


def _kv_descriptors(k, v, varlen, block_n, block_d, interp):
    """TMA descriptors of K and V over (batch, row, head, dim) with a (1, BLOCK_N, 1, BLOCK_D)
    box, or (None, None) where the forward keeps pointer loads: the interpreter, Triton without
    descriptors, GPUs before Hopper, fp32, or layouts the copy engine cannot address (16-byte
    aligned base and strides, contiguous head dim)."""
    if interp or TensorDescriptor is None or not _tma_wanted():
        return None, None
    if k.dtype not in (torch.float16, torch.bfloat16) or torch.cuda.get_device_capability(k.device)[0] < 9:
        return None, None
    descs = []
    for t in (as4d(k, varlen), as4d(v, varlen)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            return None, None
        descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_n, 1, block_d]))
    return descs[0], descs[1]


def attention_forward(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                      softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                      dropout_p=0.0, seed=0):
    """(out, lse) as kernels/reference.py computes them; see docs/INTERNALS.md."""
    _check_common(q, k, v, softmax_scale, causal, window_left, window_right, softcap, dropout_p)
    pb = problem(q, k, v, cu_seqlens_q, cu_seqlens_k)
    wl, wr = mask_params(causal, window_left, window_right)
    interp = interpreting()
    cfg = tile_config.fwd_config(q.dtype, pb.head_dim, interpret=interp)
    block_d = tile_config.padded_head_dim(pb.head_dim)

    out = buffers.empty_like(q)
    if pb.varlen:
        lse = buffers.empty((pb.heads_q, q.shape[0]), torch.float32, q.device)
    else:
        lse = buffers.empty((pb.batch, pb.heads_q, pb.max_seqlen_q), torch.float32, q.device)
    if pb.max_seqlen_q == 0 or pb.batch == 0:
        return out.zero_(), lse.fill_(float("inf"))

    k_desc, v_desc = _kv_descriptors(k, v, pb.varlen, cfg.block_n, block_d, interp)
    use_tma = k_desc is not None
    for base, count in seq_chunks(pb.batch):
        _fwd_kernel[(triton.cdiv(pb.max_seqlen_q, cfg.block_m), pb.heads_q, count)](
            q, k, v, out, lse, pb.cu_q, pb.cu_k, k_desc if use_tma else k, v_desc if use_tma else v, base,
            int(seed), dropout_threshold(dropout_p), float(softmax_scale) * LOG2E, float(softcap),
            keep_scale(dropout_p),
            wl, wr,
            pb.max_seqlen_q, pb.max_seqlen_k, pb.group, pb.head_dim,
            *strides4(q, pb.varlen), *strides4(k, pb.varlen), *strides4(v, pb.varlen), *strides4(out, pb.varlen),
            *stats_strides(lse, pb.varlen),
            VARLEN=pb.varlen, HAS_WL=wl >= 0, HAS_WR=wr >= 0,
            SOFTCAP=softcap > 0, DROPOUT=dropout_p > 0, REVERSE_M=wr >= 0, EVEN_D=block_d == pb.head_dim,
            TMA=use_tma, BLOCK_D=block_d, **cfg.launch_args(),
        )
    return out, lse
