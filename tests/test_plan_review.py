"""Property checks of the launch plans, written from the definitions and not from the code's own
checker (validity.py) or its simulator: every visible (Q tile, KV tile) pair is visited exactly
once, each dQ tile's ranks are 0..k-1, the order does not depend on the device, and the launch
(Triton: in-order blocks or the persistent grid; Hopper: its launch slots, pairs and closed forms)
runs to completion with no more programs resident than the plan assumes.

Visibility is taken row by row (row r of a sequence sees the keys [r + s_k - s_q - wl,
r + s_k - s_q + wr], clipped), so the tile geometry is checked too. Shapes are drawn from fixed
seeds: odd lengths, ragged last tiles, s_q != s_k, one- and two-sided windows, packed batches with
empty sequences, GQA, several cyclic groups.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from dash_plugin.kernels.backends import DeviceProps, Request
from dash_plugin.kernels.hopper import HEAD_DIMS, batch_tables, closed_form_visits, tables_of
from dash_plugin.kernels.hopper.visit_tables import launch_slots, pair_launch
from dash_plugin.kernels.hopper_backend import BACKEND
from dash_plugin.schedules import registry
from dash_plugin.schedules.plan import AttentionShape, ResidencyError, launch_plan

ORDERED = [s.name for s in registry.specs() if s.ordered]
TILES = [(16, 32), (32, 16), (16, 16), (64, 128), (80, 128), (64, 96), (64, 48)]


# ----------------------------------------------------------------------------- the definitions

def visible_pairs(sq, sk, bm, bn, wl, wr):
    """(Q tile, KV tile) pairs with at least one visible score, row by row (bottom-right aligned)."""
    shift = sk - sq
    out = set()
    for r in range(sq):
        c0 = 0 if wl < 0 else max(0, r + shift - wl)
        c1 = sk - 1 if wr < 0 else min(sk - 1, r + shift + wr)
        if c0 <= c1:
            out.update((r // bm, j) for j in range(c0 // bn, c1 // bn + 1))
    return out


def table_workers(plan, row):
    """Per worker of a table row: [(kv, q, rank)] per step, read as the Triton kernel reads them."""
    t = plan.tables
    workers = []
    for w in range(int(t.num_workers[row])):
        steps, begin = [], 0
        for seg in range(2):
            kv, end = int(t.seg_kv[row, w, seg]), int(t.seg_end[row, w, seg])
            if kv >= 0:
                steps += [(kv, int(t.q_tile[row, w, i]), int(t.rank[row, w, i])) for i in range(begin, end)]
            begin = end
        workers.append(steps)
    return workers


def check_visits(steps, want, ordered=True):
    """`steps`: every (kv, q, rank) of a sequence. Each visible pair once, nothing else, and each dQ
    tile's ranks a permutation of 0..k-1 (k: its visible KV tiles)."""
    pairs = [(q, kv) for kv, q, _ in steps]
    assert len(pairs) == len(set(pairs)), "a pair visited twice"
    assert set(pairs) == want, f"missing {sorted(want - set(pairs))[:4]}, hidden {sorted(set(pairs) - want)[:4]}"
    if ordered:
        ranks = {}
        for _kv, q, r in steps:
            ranks.setdefault(q, []).append(r)
        for q, rs in ranks.items():
            assert sorted(rs) == list(range(len(rs))), f"dQ tile {q}: ranks {sorted(rs)}"


def runs_to_completion(programs, resident, persistent=False):
    """Whether programs [(semaphore key, rank) per add] finish when at most `resident` run at once:
    dispatched in order as slots free up, or a persistent grid of P = min(len, resident) programs,
    program p taking p, p + P, ... An add waits until its counter equals its rank, then bumps it.
    Greedy: every running program advances as far as it can, until nothing moves."""
    counters, pos = {}, {}

    def advance(i):
        prog, s = programs[i], pos.get(i, 0)
        while s < len(prog) and counters.get(prog[s][0], 0) == prog[s][1]:
            counters[prog[s][0]] = prog[s][1] + 1
            s += 1
        moved = s != pos.get(i, 0)
        pos[i] = s
        return moved, s == len(prog)

    if persistent:
        p_count = min(len(programs), resident)
        queues = [list(range(p, len(programs), p_count)) for p in range(p_count)]
        heads = [0] * p_count
        moved = True
        while moved:
            moved = False
            for p, queue in enumerate(queues):
                while heads[p] < len(queue):
                    step, finished = advance(queue[heads[p]])
                    moved |= step or finished
                    if not finished:
                        break
                    heads[p] += 1
        return all(h == len(q) for h, q in zip(heads, queues))
    running, nxt, moved = [], 0, True
    while moved:
        moved = False
        while len(running) < resident and nxt < len(programs):
            running.append(nxt)
            nxt += 1
        for i in list(running):
            step, finished = advance(i)
            moved |= step
            if finished:
                running.remove(i)
                moved = True
    return nxt == len(programs) and not running


def triton_programs(plan, gqa):
    """The Triton launch of `plan`: work items (slot fastest, KV head, sequence); an item runs its
    worker's segments in turn, each for every query head of its KV head (the kernel's loops)."""
    sh, t = plan.shape, plan.tables
    programs = []
    for b in range(sh.batch):
        row = b if sh.varlen else 0
        for hk in range(sh.heads_kv):
            for slot in range(plan.slots):
                prog = []
                if slot < int(t.num_workers[row]):
                    w, begin = int(plan.worker_order[row, slot]), 0
                    for seg in range(2):
                        kv, end = int(t.seg_kv[row, w, seg]), int(t.seg_end[row, w, seg])
                        for h in range(hk * gqa, (hk + 1) * gqa) if kv >= 0 else ():
                            prog += [((b, h, int(t.q_tile[row, w, i])), int(t.rank[row, w, i]))
                                     for i in range(begin, end)]
                        begin = end
                programs.append(prog)
    return programs


# ----------------------------------------------------------------------------- shapes

def random_masks(rng):
    return [(True, -1, 0), (False, -1, -1), (False, rng.randint(0, 300), -1), (False, -1, rng.randint(0, 300)),
            (False, rng.randint(0, 300), rng.randint(0, 300)), (True, rng.randint(0, 300), 0), (False, 0, 0)]


def random_lengths(rng, top):
    """(seqlens_q, seqlens_k, varlen): dense, or a packed batch with empty and one-token sequences."""
    if rng.random() < 0.4:
        sq = [rng.choice([0, 1, rng.randint(1, top)]) for _ in range(rng.randint(1, 4))]
        sk = [rng.choice([s, 0, rng.randint(1, top)]) for s in sq]
        return tuple(sq + [rng.randint(1, top)]), tuple(sk + [rng.randint(1, top)]), True
    sq = rng.randint(1, top)
    return (sq,), (rng.choice([sq, rng.randint(1, top)]),), False


def plans(seed, count, top):
    """(plan, GQA group) of every ordered schedule over random shapes, tiles and group sizes."""
    rng = random.Random(seed)
    for _ in range(count):
        bm, bn = rng.choice(TILES)
        sq, sk, varlen = random_lengths(rng, top)
        for causal, wl, wr in random_masks(rng):
            for schedule in ORDERED:
                gqa, hk = rng.choice([1, 2]), rng.choice([1, 2])
                shape = AttentionShape(len(sq), hk * gqa, hk, sq, sk, varlen, causal, wl, wr)
                tiles = SimpleNamespace(block_m=bm, block_n=bn, group_size=rng.choice([None, None, 1, 2, 3]))
                try:
                    yield launch_plan(shape, schedule, tiles=tiles, device=DeviceProps(78)), gqa
                except ResidencyError:   # a group larger than 78 programs: refused, nothing to run
                    pass


# ----------------------------------------------------------------------------- Triton plans

@pytest.mark.parametrize("seed", range(4))
def test_every_visible_pair_once_ranks_a_permutation_and_the_launch_finishes(seed):
    for plan, gqa in plans(seed, 15, 500):
        sh = plan.shape
        for b in range(sh.batch):
            want = visible_pairs(sh.seqlens_q[b], sh.seqlens_k[b], plan.block_m, plan.block_n,
                                 sh.window_left, sh.window_right)
            workers = table_workers(plan, b if sh.varlen else 0)
            check_visits([s for w in workers for s in w], want)
        programs = triton_programs(plan, gqa)
        for resident in {plan.group_size, 78}:   # the fewest the plan allows, and an H20
            assert runs_to_completion(programs, resident, plan.persistent), (plan.spec.name, sh, resident)
            assert runs_to_completion(programs, resident, persistent=False), (plan.spec.name, sh, resident)


@pytest.mark.parametrize("schedule, causal, bm, bn, seqlen", [
    ("shift", False, 16, 32, 70 * 32 + 5),    # two cyclic groups, ragged last tile
    ("shift", True, 16, 32, 140 * 32 - 7),    # symmetric pairs, two groups of pairs, ragged
    ("shift", True, 32, 32, 134 * 32),
    ("arrival", True, 16, 16, 150 * 16 + 3),  # three groups, top group first
    ("arrival", True, 32, 16, 130 * 16),      # Q tiles taller than KV tiles
])
def test_several_cyclic_groups_finish_with_the_residency_the_plan_asks(schedule, causal, bm, bn, seqlen):
    shape = AttentionShape(1, 4, 2, (seqlen,), (seqlen,), False, causal, -1, 0 if causal else -1)
    plan = launch_plan(shape, schedule, tiles=SimpleNamespace(block_m=bm, block_n=bn), device=DeviceProps(78))
    groups = {w.group for w in plan.schedule.sequences[0].workers}
    assert plan.group_size > 1 and len(groups) > 1 and "fallback" not in plan.schedule.variants[0]
    check_visits([s for w in table_workers(plan, 0) for s in w],
                 visible_pairs(seqlen, seqlen, bm, bn, -1, 0 if causal else -1))
    programs = triton_programs(plan, 2)
    assert runs_to_completion(programs, plan.group_size, persistent=True)
    assert runs_to_completion(programs, plan.group_size, persistent=False)


@pytest.mark.parametrize("schedule", ["atomic", "split"])
def test_unordered_schedules_visit_every_visible_pair_once(schedule):
    rng = random.Random(7)
    for _ in range(20):
        bm, bn = rng.choice(TILES)
        sq, sk, varlen = random_lengths(rng, 500)
        for causal, wl, wr in random_masks(rng):
            shape = AttentionShape(len(sq), 1, 1, sq, sk, varlen, causal, wl, wr)
            plan = launch_plan(shape, schedule, tiles=SimpleNamespace(block_m=bm, block_n=bn), device=DeviceProps(78))
            for b, seq in enumerate(plan.schedule.sequences):
                steps = [s for w in seq.workers if w.kind == "kv" for s in w.steps]
                check_visits(steps, visible_pairs(sq[b], sk[b], bm, bn, plan.shape.window_left,
                                                  plan.shape.window_right), ordered=False)


def test_the_order_is_the_same_for_every_device():
    """Tables and launch order built for 78, 114 and 132 SMs (and for programs run one by one)
    are identical, so every GPU adds each dQ tile in one order."""
    rng = random.Random(11)
    for _ in range(15):
        bm, bn = rng.choice(TILES)
        sq, sk, varlen = random_lengths(rng, 3000)
        for causal, wl, wr in random_masks(rng)[:3]:
            shape = AttentionShape(len(sq), 2, 1, sq, sk, varlen, causal, wl, wr)
            for schedule in ORDERED:
                built = [launch_plan(shape, schedule, tiles=SimpleNamespace(block_m=bm, block_n=bn),
                                     device=DeviceProps(sms, concurrent)) for sms, concurrent in
                         ((78, True), (114, True), (132, True), (132, False))]
                first = built[0]
                for other in built[1:]:
                    for name in ("num_workers", "seg_kv", "seg_end", "q_tile", "rank"):
                        assert torch.equal(getattr(other.tables, name), getattr(first.tables, name)), name
                    assert torch.equal(other.worker_order, first.worker_order)


def test_the_checks_catch_a_lost_a_doubled_and_a_misranked_partial():
    shape = AttentionShape(1, 1, 1, (300,), (300,), False, True, -1, 0)
    plan = launch_plan(shape, "descending", tiles=SimpleNamespace(block_m=32, block_n=64), device=DeviceProps(78))
    steps = [s for w in table_workers(plan, 0) for s in w]
    want = visible_pairs(300, 300, 32, 64, -1, 0)
    check_visits(steps, want)
    (kv, q, r), (kv2, q2, r2) = steps[0], next(s for s in steps if s[1] == steps[0][1] and s[0] != steps[0][0])
    for bad in (steps[1:], steps + [steps[0]], [(kv, q, r2) if s == (kv, q, r) else s for s in steps]):
        with pytest.raises(AssertionError):
            check_visits(bad, want)
    # a wait on a later-launched program of its own, when programs run one at a time
    assert not runs_to_completion([[(0, 1)], [(0, 0)]], resident=1)
    assert runs_to_completion([[(0, 1)], [(0, 0)]], resident=2)
    assert not runs_to_completion([[(0, 1)], [(1, 0)], [(0, 0)]], resident=2, persistent=True)


# ----------------------------------------------------------------------------- Hopper plans

def hopper_programs(tables, seqs, heads):
    """The Hopper launch: per sequence and query head one CTA per launch slot (a pair of KV tiles
    under the paired launch); each KV tile's visits and ranks from the closed form the kernel
    computes (packed batches: from each sequence's own lengths), or from the tables it reads."""
    programs = []
    for b, seq in enumerate(seqs):
        geo = seq.geometry

        def walk(kv):
            if tables.visit is not None:
                return closed_form_visits(tables.visit, geo, kv, kv_descending=tables.kv_descending,
                                          group_size=tables.group_size)
            k = int(tables.count[kv])
            return list(zip(tables.q_tile[kv, :k].tolist(), tables.rank[kv, :k].tolist()))
        n = geo.num_kv_tiles
        ctas = pair_launch(n) if tables.paired else [(kv,) for kv in launch_slots(tables, n)]
        for h in range(heads):
            programs += [[((b, h, q), r) for kv in kvs for q, r in walk(kv)] for kvs in ctas]
    return programs


def hopper_cases(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        d = rng.choice(HEAD_DIMS)
        top = rng.choice([3000, 12000])
        sq, sk, varlen = random_lengths(rng, top)
        causal, wl, wr = rng.choice([(True, -1, 0), (True, -1, 0), (False, -1, -1),
                                     (False, rng.randint(0, 3000), rng.randint(0, 3000)),
                                     (False, -1, rng.randint(0, 3000)), (True, rng.randint(0, 3000), 0)])
        for schedule in ("ascending", "spt", "descending", "arrival", "shift", "atomic"):
            yield d, sq, sk, varlen, causal, wl, wr, schedule


@pytest.mark.parametrize("seed", range(3))
def test_hopper_closed_forms_are_the_plan_and_its_launch_finishes(seed):
    """Every request the Hopper backend accepts (its `supports` rules, less the device checks):
    the order the kernel runs (closed form per sequence, or the tables) is the plan's, visit by
    visit and rank by rank, covers every visible pair once, and its launch finishes with the 64
    CTAs the backend counts on (RESIDENT_SLOTS)."""
    for d, sq, sk, varlen, causal, wl, wr, schedule in hopper_cases(seed, 40):
        spec = registry.get(schedule)
        req = Request(torch.device("cuda"), torch.bfloat16, d, schedule, spec.kernel_mode, varlen, max(sq), max(sk),
                      causal, wl, 0 if causal else wr)
        tiles = BACKEND.tiles(req)
        if varlen and (schedule == "shift" or (schedule == "arrival" and tiles.block_m > tiles.block_n)):
            continue   # runs on the Triton backend
        shape = AttentionShape(len(sq), 2, 2, sq, sk, varlen, causal, wl, wr)
        plan = launch_plan(shape, schedule, tiles=tiles, device=DeviceProps(132))
        seqs = plan.schedule.sequences
        tables = batch_tables(seqs) if varlen else tables_of(seqs[0])
        assert tables.visit is not None or not varlen
        for b, seq in enumerate(seqs):
            walks = {}
            for kv, visit in _steps_of(tables, seq):
                walks.setdefault(kv, []).append(visit)
            for s in (s for w in seq.workers for s in w.segments):   # the kernel's walk is the plan's
                walk = walks.get(s.kv, [])
                assert [q for q, _ in walk] == list(s.q_tiles), (schedule, d, sq[b], sk[b], s.kv)
                assert not spec.ordered or [r for _, r in walk] == list(s.ranks), (schedule, d, sq[b], sk[b], s.kv)
            check_visits([(kv, q, r) for kv, (q, r) in _steps_of(tables, seq)],
                         visible_pairs(sq[b], sk[b], tiles.block_m, tiles.block_n, wl, 0 if causal else wr),
                         ordered=spec.ordered)
        if spec.ordered:
            assert runs_to_completion(hopper_programs(tables, seqs, 2), 64), (schedule, d, sq, sk)


def _steps_of(tables, seq):
    """(kv, (q, rank)) of every visit of one sequence as the Hopper kernel runs it."""
    for kv in range(seq.geometry.num_kv_tiles):
        if tables.visit is not None:
            walk = closed_form_visits(tables.visit, seq.geometry, kv, kv_descending=tables.kv_descending,
                                      group_size=tables.group_size)
        else:
            k = int(tables.count[kv])
            walk = list(zip(tables.q_tile[kv, :k].tolist(), tables.rank[kv, :k].tolist()))
        for q, r in walk:
            yield kv, (q, r)
