"""The Hopper forward, launched directly: FA4's sm90 forward kernel (or our dropout subclass of
it), compiled once per configuration and called through TVM-FFI with the torch tensors.

Why not FA4's launcher (`_flash_attn_fwd`): it re-derives tiles, flags and a 60-field compile key
on every call, for every architecture and feature it serves. On the GPU machine's host a call of
FA4's `flash_attn_func` costs 100-190 us (scripts/gpu_host_cost.py), as long as the kernel itself
at 1k tokens, so short sequences measured the host, not the GPU. Here the configuration depends
on the key of fwd_key.py alone: it is derived when that key is first seen, and a call is the
inputs' layout check, two allocations, a dict lookup and the launch. Packed (varlen) batches run the
same kernel with FA4's varlen tile scheduler.

The kernel, its tiles (`_tile_size_fwd_sm90`) and its flags are FA4's sm90 choices for a dense
batch, so the output has FA4's bits (tests/test_gpu_hopper.py checks it). Dropout uses our
subclass (dropout_sm90.DropoutForwardSm90) with GQA heads unpacked, so accumulator rows are
query positions.

Imported only when the Hopper backend runs: it needs CUDA, `flash-attn-4` and the CuTe DSL.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch

import cutlass.cute as cute
from flash_attn.cute import interface as fa4
from flash_attn.cute import utils as fa4_utils
from flash_attn.cute.cute_dsl_utils import maybe_contiguous, to_cute_aux_tensor, to_cute_tensor, torch2cute_dtype_map
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

from .. import buffers
from ..varlen import seqlens_of
from . import dropout_sm90, fwd_persistent, fwd_tail_aligned, fwd_tile_order
from .fwd_key import forward_key
from .masks import fa4_mask, may_have_empty_rows

_compiled: dict = {}

# Which grid runs the forward (the bits are the same on both): "auto", the persistent grid
# (fwd_persistent.py) where it fits and its tiles are short enough to pay
# (fwd_tile_order.persistent_pays), else FA4's one CTA per tile; "one-tile"; "persistent", wherever
# it fits. Tests and scripts/gpu_fwd_persistent.py set it.
GRID = "auto"
GRIDS = ("auto", "one-tile", "persistent")
# Q tiles aligned to the end of the sequence where that cuts KV steps (fwd_tail_aligned.py; same
# bits either way). Tests and scripts turn it off to compare.
TAIL_ALIGN = True


@dataclass(frozen=True)
class Plan:
    """How a dense call runs: CTAs of the persistent grid (0: FA4's one CTA per tile), its work
    table (on the device) and the rows the Q tiles move up (0: FA4's tiling)."""
    ctas: int = 0
    work: Optional[torch.Tensor] = None
    q_shift: int = 0


def _plan(q, k, key, local: bool, varlen: bool, window_size_left, window_size_right) -> Plan:
    if GRID not in GRIDS:
        raise ValueError(f"fwd_sm90.GRID={GRID!r}: expected one of {GRIDS}")
    if varlen:
        return Plan()
    windows = (window_size_left, window_size_right) if local else (None, None)
    shape = (tuple(q.shape), tuple(k.shape), key, windows, GRID, TAIL_ALIGN, q.device)
    plan = _plans.get(shape)
    if plan is None:   # first call of this shape: deal the tiles, put the table on the device
        if len(_plans) >= 256:   # shapes seen once in a while (padded batches of many lengths) come back planned again
            _plans.clear()
        ctas, table, q_shift = _dense_plan(q.shape, k.shape, q.element_size(), key, windows, GRID, TAIL_ALIGN,
                                           _sm_count(q.device))
        work = torch.tensor(table, dtype=torch.int32, device=q.device) if ctas else None
        plan = _plans[shape] = Plan(ctas, work, q_shift)
    return plan


_plans: dict = {}   # the only cache of the deal: it runs on a first call of a shape


def plan_of(q, k, v, *, causal: bool, window_left: int = -1, window_right: int = -1, dropout_p: float = 0.0) -> Plan:
    """The plan a dense call with these inputs runs on now (GRID, TAIL_ALIGN), for tests and
    scripts/gpu_fwd_persistent.py."""
    causal, local, left, right = fa4_mask(causal, window_left, window_right)
    key = forward_key(q, k, v, causal=causal, local=local, window_size_left=left, window_size_right=right,
                      softcap=0.0, dropout_p=dropout_p)
    return _plan(q, k, key, local, False, left, right)


def _dense_plan(q_shape, k_shape, element_bytes, key, windows, grid: str, tail_align: bool, sms: int):
    """(CTAs or 0, work table or None, q_shift) for a dense shape."""
    _dtype, head_dim, group, causal, local, _left_open, _right_open, _softcap, dropout, *_ = key
    cfg = _fa4_config(key)
    packed = group > 1 and not dropout   # GQA heads packed into the rows (FA4's pack_gqa)
    batch, seqlen_q, heads, _ = q_shape
    tiles = fwd_tile_order.ForwardTiles(
        batch, k_shape[2] if packed else heads, seqlen_q, k_shape[1], head_dim, cfg.m_block_size,
        cfg.n_block_size, causal, *windows, rows_per_query=group if packed else 1, element_bytes=element_bytes)
    if tail_align:   # dropout's mask is drawn in 16-row groups, which a shift must keep whole
        tiles = replace(tiles, q_shift=fwd_tile_order.tail_shift(tiles, multiple=16 if dropout else 1))
    persistent = grid != "one-tile" and fwd_persistent.fits(head_dim, cfg.mma_pv_is_rs, varlen=False) and (
        grid == "persistent" or fwd_tile_order.persistent_pays(tiles))
    if not persistent:
        return 0, None, tiles.q_shift
    return sms, fwd_tile_order.work_table(tiles, sms), tiles.q_shift


def _fa4_config(key):
    """FA4's sm90 forward config (tiles, P in registers or not) for a compile key."""
    _dtype, head_dim, _group, causal, local, *_ = key
    return fa4._tile_size_fwd_sm90(head_dim, head_dim, causal, local)


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    if not torch.cuda.is_available():   # compiling without a GPU (scripts/sass_counts.py): an H100's
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _compile(key, q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, window_size_left,
             window_size_right, aux, plan: Plan):
    dtype, head_dim, group, causal, local, _left_open, _right_open, softcap, dropout, above_half, *_layout = key
    cfg = _fa4_config(key)
    kernel_cls = dropout_sm90.DropoutForwardSm90 if dropout else FlashAttentionForwardSm90
    if plan.ctas:
        kernel_cls = fwd_persistent.kernel_class(kernel_cls)
    if plan.q_shift:
        kernel_cls = fwd_tail_aligned.kernel_class(kernel_cls)
    dropout_kwargs = dict(threshold_above_half=above_half) if dropout else {}
    kernel = kernel_cls(
        torch2cute_dtype_map[dtype], head_dim, head_dim, group, is_causal=causal, is_local=local,
        pack_gqa=group > 1 and not dropout, tile_m=cfg.m_block_size, tile_n=cfg.n_block_size,
        num_stages=2, num_threads=384, Q_in_regs=False, intra_wg_overlap=cfg.intra_wg_overlap,
        mma_pv_is_rs=cfg.mma_pv_is_rs, mask_mod=None,
        score_mod=fa4_utils.create_softcap_scoremod(softcap) if softcap else None,
        has_aux_tensors=dropout, q_subtile_factor=1, paged_kv_non_tma=False, **dropout_kwargs)
    cu = [None if t is None else to_cute_tensor(t, assumed_align=4, leading_dim=0)
          for t in (cu_seqlens_q, cu_seqlens_k)]
    with fwd_persistent.persistent_grid(plan.ctas) if plan.ctas else contextlib.nullcontext():
        return cute.compile(
            kernel, *(to_cute_tensor(t) for t in (q, k, v, out)), to_cute_tensor(lse, assumed_align=4),
            softmax_scale, *cu, None, None, None, window_size_left, window_size_right, None, None,
            fa4_utils.AuxData([to_cute_aux_tensor(t) for t in aux] if aux else None, None),
            None if plan.work is None else to_cute_tensor(plan.work, assumed_align=4, leading_dim=0), None,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")


def _empty(shape, dtype, device):
    """The outputs' allocation (tests put NaN-filled buffers with guard rows here, to see that
    every element is written and nothing outside)."""
    return buffers.empty(shape, dtype, device)


def attention_forward(q, k, v, *, softmax_scale: float, causal: bool, window_left: int = -1,
                      window_right: int = -1, softcap: float = 0.0, dropout_p: float = 0.0, seed: int = 0,
                      cu_seqlens_q=None, cu_seqlens_k=None):
    """(out, lse) of dense (B, S, H, D) fp16/bf16 inputs, lse (B, H, S_q), or of packed ones
    (T, H, D) with int32 `cu_seqlens_q/k`, lse (H, T_q); fp32, natural log, of the undropped
    scores. Causal masks and windows are bottom-right aligned when a sequence's lengths differ;
    a row that sees no key gets out 0 and lse +inf. Windows and softcap as in masks.py; dropout
    with the mask of kernels/philox.py (not with softcap; a packed batch keys it by sequence
    index and positions inside the sequence, as every backend does)."""
    causal, local, window_size_left, window_size_right = fa4_mask(causal, window_left, window_right)
    dropout_sm90.refuse_softcap(dropout_p, softcap)
    dropout = dropout_p > 0
    varlen = cu_seqlens_q is not None
    q, k, v = (maybe_contiguous(t).detach() for t in (q, k, v))   # DLPack exports no autograd tensors
    out = _empty(q.shape, q.dtype, q.device)
    if varlen:
        total_q, heads, head_dim = q.shape
        lse = _empty((heads, total_q), torch.float32, q.device)
        # checked on the host (kept on the tensors: the caller's check read them already)
        lengths = (seqlens_of(cu_seqlens_q, total_q, "cu_seqlens_q"),
                   seqlens_of(cu_seqlens_k, k.shape[0], "cu_seqlens_k"))
        cu_seqlens_q, cu_seqlens_k = (t.contiguous() for t in (cu_seqlens_q, cu_seqlens_k))   # int32: checked
    else:
        batch, seqlen_q, heads, head_dim = q.shape
        lse = _empty((batch, heads, seqlen_q), torch.float32, q.device)
        lengths = [seqlen_q], [k.shape[1]]
    if q.numel() == 0 or k.numel() == 0:   # nothing to launch; no key is visible: softmax of nothing
        return out.zero_(), lse.fill_(float("inf"))
    aux = [dropout_sm90.params_tensor(seed, dropout_p, q.device)] if dropout else []
    key = forward_key(q, k, v, causal=causal, local=local, window_size_left=window_size_left,
                      window_size_right=window_size_right, softcap=softcap, dropout_p=dropout_p, varlen=varlen)
    plan = _plan(q, k, key, local, varlen, window_size_left, window_size_right)
    if plan.q_shift:   # the top tile's O is stored per thread, a column pair a word (fwd_tail_aligned.py)
        aux.append(out.view(torch.int32))
    # the compiled kernel depends on whether the Q tiles move, not by how much (it reads the length)
    compiled_as = (key, plan.ctas, bool(plan.q_shift))
    kernel = _compiled.get(compiled_as)
    if kernel is None:
        kernel = _compiled[compiled_as] = _compile(key, q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                                                   window_size_left, window_size_right, aux, plan)
    kernel(q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, None, None, None, window_size_left,
           window_size_right, None, None, fa4_utils.AuxData(aux or None, None), plan.work, None)
    if may_have_empty_rows(causal or local, *lengths):
        # FA4 writes -inf for a row that sees no key; ours is +inf (docs/INTERNALS.md), which the
        # backward reads as P = 0 as well.
        lse.masked_fill_(lse == float("-inf"), float("inf"))
    return out, lse
