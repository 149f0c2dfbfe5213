"""A/B in one process: the ordered dQ writer freeing the shared dQ buffer once the bulk add
has read it (the kernel as it is) against freeing it only after the add has landed in global
memory (the writer before commit 'frees the shared dQ buffer as soon as ...'). Same inputs, the
two kernels alternated ABABAB, each timed best-of-3 x 20 calls with CUDA events.

    python scripts/gpu_dq_release_ab.py OUT.json
"""
import json
import statistics
import sys

import torch

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from flash_attn.cute import barrier
from flash_attn.cute.named_barrier import NamedBarrierBwd
from quack import copy_utils

from dash_plugin import dispatch
from dash_plugin.kernels.hopper import bwd_sm90
from scripts.gpu_hopper_dropout import timed


@cute.jit
def _free_after_landing(self, sdQaccum, gdQ, counters, m_block, rank, lane, step, visits):
    """The writer before the change: every add frees the buffer at the top of the next one."""
    chunks = self.num_wg_dQ
    handshake = self.num_threads_per_warp_group + cute.arch.WARP_SIZE
    for c in cutlass.range_constexpr(chunks):
        if const_expr(not self.deterministic):
            cute.arch.cp_async_bulk_wait_group(chunks - 1 - c, read=True)
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQEmptyWG0) + c, number_of_threads=handshake)
    if const_expr(self.deterministic):
        barrier.wait_eq(counters[(m_block, None)].iterator, lane, 0, rank)
    for c in cutlass.range_constexpr(chunks):
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQFullWG0) + c, number_of_threads=handshake)
        with cute.arch.elect_one():
            copy_utils.cpasync_reduce_bulk_add_f32(
                sdQaccum[None, c].iterator, gdQ[(None, c), m_block].iterator, self.tma_copy_bytes["dQ"])
        cute.arch.cp_async_bulk_commit_group()
    if const_expr(self.deterministic):
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        barrier.arrive_inc(counters[(m_block, None)].iterator, lane, 0, 1)


VARIANTS = {"free after read (now)": bwd_sm90.OrderedBackwardSm90._add_dq_tile,
            "free after landing (before)": _free_after_landing}
POINTS = [(128, True, 1024), (128, True, 8192), (128, True, 16384), (128, False, 8192), (64, False, 2048)]


def main(path):
    rows = []
    caches = {name: {} for name in VARIANTS}   # bwd_sm90's compile cache, one per variant
    for hd, causal, s in POINTS:
        b, h = 16384 // s, 2048 // hd
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        from dash_plugin.kernels import hopper
        out, lse = hopper.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal)
        for schedule in ("descending", "ascending"):
            times = {name: [] for name in VARIANTS}
            grads = {}
            for _round in range(3):
                for name, fn in VARIANTS.items():
                    bwd_sm90.OrderedBackwardSm90._add_dq_tile = fn
                    bwd_sm90._compiled = caches[name]
                    run = lambda: dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=hd ** -0.5,  # noqa: E731
                                                              causal=causal, schedule=schedule, backend="hopper")
                    grads[name] = run()
                    times[name].append(timed(run))
            a, b_ = (statistics.median(t) for t in times.values())
            same = all(torch.equal(x, y) for x, y in zip(*grads.values()))
            row = dict(point=f"hd{hd} {'causal' if causal else 'full'} {s}", schedule=schedule,
                       ms={n: t for n, t in times.items()}, now_over_before=b_ / a, same_bits=same)
            rows.append(row)
            print(row["point"], schedule, f"now/before speed {b_ / a:.3f}", "same bits" if same else "BITS DIFFER",
                  {n: [round(x, 3) for x in t] for n, t in times.items()}, flush=True)
    bwd_sm90.OrderedBackwardSm90._add_dq_tile = VARIANTS["free after read (now)"]
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
