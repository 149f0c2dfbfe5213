"""DAG simulator of the deterministic backward (the DASH paper's model, arXiv 2601.21824).

Nodes per stage of a worker: compute C (cost c) then, for ordered schedules, the reduction R
(cost r) into the dQ tile, which may start only when the previous rank of that dQ tile has
finished (the semaphore). Program order: a worker's next compute starts when its reduction ends
(one stage = c + r, no overlap, as in the paper's model). Workers are launched in order onto SMs:
- "dynamic": the first free SM takes the next worker (non-persistent grid);
- "static": worker k runs on SM k mod num_sms, in launch order (persistent grid).
GQA: a worker repeats its steps for each query head of its group; dQ semaphores are per query
head. Ranks come from the Schedule, the same ones the kernel tables carry.

Two entry points: `simulate_plan(plan)` draws what the kernel runs (the launch plan's order,
grid and persistence); `simulate(schedule, ...)` is the model with free choices (SM count,
assignment, a head-major or group-major launch), for what-if studies. `num_sms=None` gives
every worker its own SM (all co-resident: lock-step when all stages cost the same).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .plan import LaunchPlan
from .schedule import Schedule


class SimulationDeadlock(RuntimeError):
    pass


@dataclass
class Block:
    sm: int
    start: float
    end: float
    kind: str      # "c" compute, "r" reduction
    unit: int      # launch index of the worker
    head: int      # query head
    q: int
    kv: int


@dataclass
class SimResult:
    makespan: float
    num_sms: int           # SMs of the model (a persistent grid may use fewer: the rest stay idle)
    busy: float            # sum of compute and reduction time
    wait: float            # sum of time spent spinning on a semaphore
    blocks: list[Block] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Share of SM time (makespan x SMs) not spent computing or reducing."""
        total = self.makespan * self.num_sms
        return 0.0 if total == 0 else 1.0 - self.busy / total


def model_launch(schedule: Schedule, num_kv_heads: int, order: str = "head-major"):
    """(sequence, table row, KV head, worker) in launch order, for the model (workers in the
    builder's order; the kernel's own order is `LaunchPlan.work_items`).

    "head-major": worker fastest, then KV head, then sequence (grid (W, H_kv, B)).
    "group-major": the workers of one group fastest, then KV head, then group, then sequence:
    all heads' first groups launch before any second group, so when a head has several groups
    (N > MAX_GROUP) the later group usually starts after the earlier one is done."""
    if order not in ("head-major", "group-major"):
        raise ValueError(f"launch must be 'head-major' or 'group-major', got {order!r}")
    out = []
    for b, seq in enumerate(schedule.sequences):
        if order == "head-major":
            out.extend((b, b, hk, w) for hk in range(num_kv_heads) for w in range(len(seq.workers)))
        else:
            groups: dict[int, list[int]] = {}
            for w, worker in enumerate(seq.workers):
                groups.setdefault(worker.group, []).append(w)
            out.extend((b, b, hk, w) for members in groups.values() for hk in range(num_kv_heads)
                       for w in members)
    return out


def _units(schedule: Schedule, num_heads: int, num_kv_heads: int, items):
    """Workers in launch order with their stages (head, kv, q, rank, reduce)."""
    group = num_heads // num_kv_heads
    reduce = not schedule.spec.reduction_free
    units = []
    for b, row, hk, w in items:
        worker = schedule.sequences[row].workers[w]
        stages = []
        for hq in range(hk * group, (hk + 1) * group):
            for kv, q, rank in worker.steps:
                stages.append((hq, kv, q, rank, reduce and worker.kind == "kv"))
        units.append((b, stages))
    return units


def simulate(schedule: Schedule, *, num_heads: int = 1, num_kv_heads: int | None = None,
             num_sms: int | None = None, c: float = 1.0, r: float = 0.5,
             assignment: str = "dynamic", launch: str = "head-major",
             record: bool = False) -> SimResult:
    """The model: `schedule`'s workers launched head-major or group-major onto `num_sms` SMs."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
                         f"({num_kv_heads})")
    units = _units(schedule, num_heads, num_kv_heads, model_launch(schedule, num_kv_heads, launch))
    n_sm = max(1, len(units)) if num_sms is None else num_sms
    if n_sm < 1:
        raise ValueError(f"num_sms must be >= 1, got {num_sms}")
    return _run(schedule, units, n_sm, c, r, assignment, record)


def simulate_plan(plan: LaunchPlan, *, c: float = 1.0, r: float = 0.5, record: bool = False) -> SimResult:
    """What the kernel runs: the plan's work items in its launch order, on its persistent grid
    (item k on program k mod P) or, without one, onto its device's resident programs as they
    free up. (The kernel launches at most 65535 sequences at a time; the model runs one launch.)"""
    if plan.schedule is None:
        raise ValueError(f"the plan of {plan.spec.name!r} has no schedule: its backend sums in its own order")
    units = _units(plan.schedule, plan.shape.heads_q, plan.shape.heads_kv, plan.work_items())
    if not plan.persistent:
        return _run(plan.schedule, units, plan.resident_programs, c, r, "dynamic", record)
    result = _run(plan.schedule, units, plan.grid(plan.shape.batch)[0][0], c, r, "static", record)
    # A grid smaller than the device leaves SMs idle: count them, so that the bubbles of a
    # persistent plan and of a non-persistent one are shares of the same SMs.
    result.num_sms = plan.resident_programs
    return result


def _run(schedule: Schedule, units, n_sm: int, c: float, r: float, assignment: str, record: bool) -> SimResult:
    if assignment not in ("dynamic", "static"):
        raise ValueError(f"assignment must be 'dynamic' or 'static', got {assignment!r}")
    if c < 0 or r < 0:
        raise ValueError(f"costs must be >= 0, got c={c}, r={r}")
    ordered = schedule.ordered

    heap: list = []
    seq_no = 0

    def push(t, kind, *payload):
        nonlocal seq_no
        heapq.heappush(heap, (t, seq_no, kind, payload))
        seq_no += 1

    sem: dict = {}
    waiting: dict = {}
    unit_sm = [-1] * len(units)
    done = [False] * len(units)
    blocks: list[Block] = []
    busy = wait = 0.0
    makespan = 0.0
    next_unit = 0
    static_queues = [list(range(s, len(units), n_sm)) for s in range(n_sm)]

    def start(kind, u, i, t):
        """Start the compute ("c") or reduction ("r") node of step i of unit u at time t."""
        nonlocal busy
        cost = c if kind == "c" else r
        push(t + cost, kind, u, i)
        busy += cost
        if record:
            hq, kv, q, _rank, _red = units[u][1][i]
            blocks.append(Block(unit_sm[u], t, t + cost, kind, u, hq, q, kv))

    def start_unit_on(sm, t):
        nonlocal next_unit, makespan
        while True:
            if assignment == "dynamic":
                if next_unit >= len(units):
                    return
                u = next_unit
                next_unit += 1
            else:
                if not static_queues[sm]:
                    return
                u = static_queues[sm].pop(0)
            unit_sm[u] = sm
            if units[u][1]:
                start("c", u, 0, t)
                return
            done[u] = True  # a worker with no steps ends at once
            makespan = max(makespan, t)

    def advance(u, i, t):
        nonlocal makespan
        if i + 1 < len(units[u][1]):
            start("c", u, i + 1, t)
        else:
            done[u] = True
            makespan = max(makespan, t)
            start_unit_on(unit_sm[u], t)

    for sm in range(n_sm):
        start_unit_on(sm, 0.0)
    while heap:
        t, _s, kind, (u, i) = heapq.heappop(heap)
        b = units[u][0]
        hq, _kv, q, rank, red = units[u][1][i]
        if kind == "c":
            if not red:
                advance(u, i, t)
            elif not ordered:
                start("r", u, i, t)
            else:
                key = (b, hq, q)
                if sem.get(key, 0) == rank:
                    start("r", u, i, t)
                else:
                    waiting[(key, rank)] = (u, i, t)
        else:  # a reduction finished
            if ordered:
                key = (b, hq, q)
                sem[key] = sem.get(key, 0) + 1
                w = waiting.pop((key, sem[key]), None)
                if w is not None:
                    wait += t - w[2]
                    start("r", w[0], w[1], t)
            advance(u, i, t)
    if not all(done):
        stuck = [k for k, d in enumerate(done) if not d]
        raise SimulationDeadlock(
            f"{schedule.name}: {len(stuck)} workers never finish (first: launch index {stuck[0]}); "
            f"{len(waiting)} reductions wait on ranks that cannot come (SMs: {n_sm}, "
            f"assignment={assignment})")
    return SimResult(makespan, n_sm, busy, wait, blocks)
