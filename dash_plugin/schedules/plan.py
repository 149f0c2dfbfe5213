"""The launch plan of one backward call: everything a kernel backend needs to run a schedule.

Built on the host from (problem shape, schedule, tile sizes, device properties), cached, and
testable on the CPU. The schedule decides the order; a backend only executes the plan, and the
DAG simulator and the Gantt pictures draw the same plan (`simulate.simulate(plan)`).
Contents and the launch rules: docs/DESIGN.md, "The launch plan"; the tables: docs/INTERNALS.md.
"""
from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from dash_plugin.kernels.varlen import seqlens_of

from . import registry
from .schedule import Schedule, build_cached, normalize_args
from .tables import KernelTables, tables_cached


@dataclass(frozen=True)
class AttentionShape:
    """The problem shape of one call, in schedule terms."""

    batch: int                    # sequences
    heads_q: int
    heads_kv: int
    seqlens_q: tuple[int, ...]    # per sequence; dense batches: one entry that every sequence shares
    seqlens_k: tuple[int, ...]
    varlen: bool
    causal: bool = False
    window_left: int = -1         # -1: unbounded
    window_right: int = -1        # -1: unbounded; causal means 0

    @classmethod
    def of(cls, q, k, *, cu_seqlens_q=None, cu_seqlens_k=None, causal=False, window_left=-1,
           window_right=-1) -> "AttentionShape":
        """From the call's tensors (layouts of docs/INTERNALS.md). Varlen: one host sync, for the
        lengths the tables are built from."""
        wl, wr = int(window_left), 0 if causal else int(window_right)
        if cu_seqlens_q is None:
            return cls(q.shape[0], q.shape[2], k.shape[2], (q.shape[1],), (k.shape[1],), False, bool(causal), wl, wr)
        lq = seqlens_of(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
        lk = seqlens_of(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
        return cls(len(lq), q.shape[1], k.shape[1], tuple(lq), tuple(lk), True, bool(causal), wl, wr)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seqlens_k)


_DEFAULT_POLLS = 1 << 22   # about a second or more of polling on an H100/H200


@dataclass(frozen=True)
class LaunchOptions:
    """The environment's say in a launch (ordered schedules only; read per call by `from_env`)."""

    debug_waits: bool = False     # DASH_DEBUG_WAITS=1: every wait gives up after max_polls polls
    max_polls: int = 0            # DASH_DEBUG_WAIT_POLLS
    persistent_cyclic: bool = True   # DASH_PERSISTENT_CYCLIC=0: one program per worker, for comparison

    @classmethod
    def from_env(cls) -> "LaunchOptions":
        # Read on every backward; the parse (and the frozen instance) only when the values change.
        return _options_of(os.environ.get("DASH_PERSISTENT_CYCLIC", "1"), os.environ.get("DASH_DEBUG_WAITS", "0"),
                           os.environ.get("DASH_DEBUG_WAIT_POLLS", str(_DEFAULT_POLLS)))


@lru_cache(maxsize=16)
def _options_of(persistent_raw: str, waits_raw: str, polls_raw: str) -> LaunchOptions:
    persistent = persistent_raw != "0"
    raw = waits_raw.strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return LaunchOptions(persistent_cyclic=persistent)
    if raw not in ("1", "true", "yes", "on"):
        raise ValueError(f"DASH_DEBUG_WAITS={raw!r}: use 1 (on) or 0 (off)")
    try:
        polls = int(polls_raw)
    except ValueError:
        polls = 0
    if polls < 1:
        raise ValueError(f"DASH_DEBUG_WAIT_POLLS={polls_raw!r}: must be a positive integer")
    return LaunchOptions(True, polls, persistent)


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """One backward launch. Work item = (launch slot, KV head, sequence), slot fastest; a slot runs
    worker `worker_order[row, slot]` (row: the sequence's table row) in the ordered mode and KV
    tile `slot` otherwise."""

    shape: AttentionShape
    spec: registry.ScheduleSpec
    block_m: int | None                 # tiles the ranks are built for (None: a backend without tiles)
    block_n: int | None
    schedule: Schedule | None           # visits and ranks per sequence
    tables: KernelTables | None         # their int32 form, ordered mode only
    worker_order: torch.Tensor | None   # (rows, W) int32: launch slot -> worker (`launch_order`)
    group_size: int                     # largest group whose waits may be cyclic (1: acyclic)
    slots: int                          # launch slots per (sequence, KV head)
    persistent: bool                    # a persistent grid: cyclic waits with every group co-resident
    resident_programs: int              # programs the device holds at once
    skip_waits: bool                    # cyclic waits where programs run one by one (the interpreter)
    semaphores: tuple[int, int, int] | None   # (sequences, query heads, dQ tiles) int32, zeroed per call
    debug_waits: bool
    max_polls: int
    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def mode(self) -> str:
        return self.spec.kernel_mode

    @property
    def table_stride(self) -> int:
        """Table rows per sequence: 1 (varlen: one row each) or 0 (dense: one shared row)."""
        return 1 if self.shape.varlen else 0

    def grid(self, sequences: int) -> tuple[tuple[int, ...], int]:
        """(grid, work items) of the KV-stationary launch over `sequences` consecutive sequences.
        One program per item, grid (slots, KV heads, sequences), dispatched in that order; or
        persistent: P = min(items, resident programs) programs, program p taking the items
        p, p + P, p + 2P, ... in increasing order (why that cannot deadlock: docs/DESIGN.md)."""
        items = self.slots * self.shape.heads_kv * sequences
        if self.persistent:
            return (min(items, self.resident_programs),), items
        return (self.slots, self.shape.heads_kv, sequences), items

    def work_items(self) -> list[tuple[int, int, int, int]]:
        """(sequence, table row, KV head, worker) in launch order, over the whole batch (split:
        its KV programs, then the Q-stationary dQ programs of its second launch)."""
        seqs = self.schedule.sequences
        out = []
        for b in range(self.shape.batch):
            row = b if self.shape.varlen else 0
            count = len(seqs[row].workers)
            order = self.worker_order[row, :count].tolist() if self.worker_order is not None else range(count)
            out.extend((b, row, hk, w) for hk in range(self.shape.heads_kv) for w in order)
        return out

    def device_tables(self, device) -> dict[str, torch.Tensor]:
        """The ordered mode's tables on `device` (int32, contiguous; copied once per device)."""
        key = str(device)
        if key not in self._on_device:
            t = self.tables
            tensors = dict(order=self.worker_order, num_workers=t.num_workers, seg_kv=t.seg_kv,
                           seg_end=t.seg_end, q_tile=t.q_tile, rank=t.rank)
            self._on_device[key] = {n: x.to(device=device, dtype=torch.int32).contiguous()
                                    for n, x in tensors.items()}
        return self._on_device[key]


def launch_order(num_workers: int, q_tile: torch.Tensor, rank: torch.Tensor) -> list:
    """Workers of one sequence in an order that launches every dQ tile's contributors in rank order.

    Edges "rank r of tile m before rank r+1 of tile m"; Kahn's algorithm, lowest worker first.
    A cyclic schedule (shift) has no such order: the cycle is broken at the lowest worker left,
    which keeps each group's workers together and groups in rank order.
    """
    by_tile = {}
    for w in range(num_workers):
        for m, r in zip(q_tile[w].tolist(), rank[w].tolist()):
            if m >= 0:
                by_tile.setdefault(m, {})[r] = w
    succ = [set() for _ in range(num_workers)]
    indeg = [0] * num_workers
    for ranks in by_tile.values():
        for r, w in ranks.items():
            nxt = ranks.get(r + 1)
            if nxt is not None and nxt != w and nxt not in succ[w]:
                succ[w].add(nxt)
                indeg[nxt] += 1
    ready = [w for w in range(num_workers) if indeg[w] == 0]
    heapq.heapify(ready)
    placed, order = [False] * num_workers, []
    while len(order) < num_workers:
        if not ready:   # cycle: take the lowest unplaced worker
            ready = [min(w for w in range(num_workers) if not placed[w])]
        w = heapq.heappop(ready)
        if placed[w]:
            continue
        placed[w] = True
        order.append(w)
        for n in succ[w]:
            indeg[n] -= 1
            if indeg[n] == 0 and not placed[n]:
                heapq.heappush(ready, n)
    return order


def _worker_order(tables: KernelTables) -> torch.Tensor:
    rows, w_max = tables.seg_kv.shape[0], tables.seg_kv.shape[1]
    order = torch.zeros((rows, max(w_max, 1)), dtype=torch.int32)
    for b in range(rows):
        nw = int(tables.num_workers[b])
        if nw:
            order[b, :nw] = torch.tensor(launch_order(nw, tables.q_tile[b, :nw], tables.rank[b, :nw]),
                                         dtype=torch.int32)
    return order


class ResidencyError(RuntimeError):
    """A schedule's cyclic waits need more programs resident at once than the device holds."""


@lru_cache(maxsize=256)
def _plan_cached(shape: AttentionShape, spec: registry.ScheduleSpec, block_m, block_n, group_size, resident: int,
                 concurrent: bool, options: LaunchOptions) -> LaunchPlan:
    unordered = dict(tables=None, worker_order=None, group_size=1, persistent=False, resident_programs=resident,
                     skip_waits=False, semaphores=None, debug_waits=False, max_polls=0)
    if block_m is None:   # the backend sums in its own fixed order (the reference): nothing to plan
        return LaunchPlan(shape, spec, None, None, schedule=None, slots=0, **unordered)
    normalized = normalize_args(spec.name, shape.seqlens_q, shape.seqlens_k, block_m, block_n, shape.causal,
                                shape.window_left, shape.window_right, group_size)
    schedule = build_cached(*normalized)
    if not spec.ordered:   # one program per KV tile
        return LaunchPlan(shape, spec, block_m, block_n, schedule, slots=-(-shape.max_seqlen_k // block_n),
                          **unordered)
    tables = tables_cached(*normalized)
    group = tables.group_size
    cyclic = group > 1
    if cyclic and concurrent and resident < group:
        raise ResidencyError(f"the schedule waits cyclically inside groups of {group} programs, but this GPU "
                             f"holds {resident} at once (under MPS: the SMs the process's active-thread percentage "
                             f"leaves): pick 'descending' or 'ascending'")
    return LaunchPlan(
        shape, spec, block_m, block_n, schedule, tables=tables, worker_order=_worker_order(tables),
        group_size=group, slots=max(tables.max_workers, 1), persistent=cyclic and options.persistent_cyclic,
        resident_programs=resident, skip_waits=cyclic and not concurrent,
        semaphores=(shape.batch, shape.heads_q, -(-shape.max_seqlen_q // block_m)),   # per dQ tile
        debug_waits=options.debug_waits, max_polls=options.max_polls)


def launch_plan(shape: AttentionShape, schedule: str, *, tiles, device, options: LaunchOptions | None = None
                ) -> LaunchPlan:
    """The plan of `schedule` (a registered, concrete name) for `shape`.

    `tiles`: the backend's tiles of its KV-stationary kernel (anything with block_m and block_n,
    and optionally group_size: the largest cyclic group it keeps co-resident; the ranks depend on
    them), or None for a backend that needs no plan (the reference).
    `device`: the backend's device properties (resident_programs, concurrent).
    `options`: the environment's debug and launch switches (default: read now, ordered schedules only).
    """
    spec = registry.get(schedule)
    if options is None:
        options = LaunchOptions.from_env() if spec.ordered else LaunchOptions()
    block_m, block_n = (None, None) if tiles is None else (tiles.block_m, tiles.block_n)
    group_size = getattr(tiles, "group_size", None)
    return _plan_cached(shape, spec, block_m, block_n, group_size, device.resident_programs, device.concurrent,
                        options)
