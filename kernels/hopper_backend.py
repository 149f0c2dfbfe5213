"""The Hopper backend: the warp-specialised sm90 backward of kernels/hopper, run from a launch
plan, and the sm90 forward (docs/hopper-backend.md).

It covers dense and packed (varlen) batches, equal or unequal query/key lengths (masks
bottom-right aligned), causal, full and sliding-window masks, softcap, the head dims
`hopper.head_dim_refusal` lets through (multiples of 8 up to 256 but for two, at the tiles of
64, 96, 128, 192 or 256, the next one up) in fp16/bf16, and dropout (not with softcap); packed
batches run every order but `shift`, each sequence's from its own lengths. The causal `shift`
runs its symmetric pairs, one CTA per pair of KV tiles.
`supports` names what else is missing, and the `auto` rule then takes the Triton backend.
"""
from __future__ import annotations

import weakref
from functools import lru_cache
from typing import NamedTuple

import torch

from . import hopper
from .backends import DeviceProps


_sm90: dict[str, bool] = {}


@torch.compiler.assume_constant_result   # as hopper.available: a constant of torch.compile's graph
def _is_sm90(device: str) -> bool:
    if device not in _sm90:
        _sm90[device] = torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9
    return _sm90[device]


@lru_cache(maxsize=None)   # asked on every backward; a device's SM count does not change
def _device_props(device: str) -> DeviceProps:
    # One CTA per SM (the kernel's shared memory allows no second), dispatched in launch order.
    return DeviceProps(torch.cuda.get_device_properties(device).multi_processor_count, concurrent=True)


class HopperTiles(NamedTuple):
    block_m: int
    block_n: int
    group_size: int | None   # the largest group this grid keeps co-resident (shift, arrival); None: the plan's default


class HopperBackend:
    name = "hopper"

    def __init__(self):
        self._tables = weakref.WeakKeyDictionary()   # plan -> its per-KV-tile tables

    def supports(self, r) -> bool | str:
        if r.device_type != "cuda" or not _is_sm90(str(r.device)):
            return "needs an sm90 (Hopper) GPU"
        if not hopper.available():
            return "flash-attn-4 and nvidia-cutlass-dsl are not installed (pip install 'dash_plugin[hopper]')"
        if r.kernel_mode not in (None, "ordered", "atomic"):
            return f"kernel mode {r.kernel_mode!r} runs on the Triton backend"
        if r.dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {r.dtype} (this backend: float16, bfloat16)"
        refusal = hopper.head_dim_refusal(r.head_dim)
        if refusal:
            return refusal
        # Packed arrival: its closed form needs KV tiles at least as tall as Q tiles.
        packed_arrival = r.varlen and r.schedule == "arrival"
        tiles = self.tiles(r) if packed_arrival else None
        for missing, what in ((r.seqlen_q == 0 or r.seqlen_k == 0, "an empty sequence"),
                              (r.softcap and r.dropout, "softcap with dropout"),
                              (r.varlen and r.schedule == "shift",
                               "schedule='shift' with varlen (a sequence with fewer queries than keys would "
                               "take another order)"),
                              (packed_arrival and tiles.block_m > tiles.block_n,
                               f"schedule='arrival' with varlen at head_dim={r.head_dim} (KV tiles narrower than "
                               "Q tiles reach a row together, an order the kernel does not compute)")):
            if missing:
                return f"{what} runs on the Triton backend"
        return True

    def tiles(self, r) -> HopperTiles:
        causal, local, _, _ = hopper.fa4_mask(r.causal, r.window_left, r.window_right)
        block_m, block_n = hopper.bwd_tiles(r.head_dim, causal or local, r.dropout)   # windows tile like causal
        # Groups: the plan's defaults (shift: a whole head up to 64 KV tiles, split evenly beyond;
        # arrival: groups of 64, the top one first), which the head-by-head launch keeps
        # co-resident (hopper.RESIDENT_SLOTS).
        return HopperTiles(block_m, block_n, None)

    def device_props(self, device) -> DeviceProps:
        return _device_props(str(device))

    def forward(self, q, k, v, *, softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                dropout_p=0.0, seed=0, cu_seqlens_q=None, cu_seqlens_k=None, **_unused):
        return hopper.attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                        window_left=window_left, window_right=window_right, softcap=softcap,
                                        dropout_p=dropout_p, seed=seed, cu_seqlens_q=cu_seqlens_q,
                                        cu_seqlens_k=cu_seqlens_k)

    def backward(self, plan, dout, q, k, v, out, lse, *, softmax_scale, causal=False, window_left=-1,
                 window_right=-1, softcap=0.0, dropout_p=0.0, seed=0, cu_seqlens_q=None, cu_seqlens_k=None,
                 **_unused):
        varlen = cu_seqlens_q is not None
        if q.numel() == 0 or k.numel() == 0:   # nothing to launch; no query sees a key
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        tables = self._tables.get(plan)
        if tables is None:
            seqs = plan.schedule.sequences
            # A packed batch: one computed order for all sequences, each from its own lengths.
            tables = hopper.batch_tables(seqs) if varlen else hopper.tables_of(seqs[0])
            hopper.check_waits_follow_launch(tables)
            self._tables[plan] = tables
        return hopper.attention_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                         tables=tables, deterministic=plan.spec.deterministic,
                                         window_left=window_left, window_right=window_right, softcap=softcap,
                                         dropout_p=dropout_p, seed=seed, cu_seqlens_q=cu_seqlens_q,
                                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=plan.shape.max_seqlen_q,
                                         max_seqlen_k=plan.shape.max_seqlen_k)


BACKEND = HopperBackend()
