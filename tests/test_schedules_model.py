"""Schedule model: geometry, validity of every builder over a grid of shapes, the DASH makespan
formulas, temporal order, SM-count independence, co-residency, GQA, varlen, windows, auto."""
import inspect
import dataclasses
import itertools

import pytest
import torch

from dash_plugin.schedules import (MAX_GROUP, registry, build_schedule, default_group_size,
                                   kernel_tables, make_geometry)
from dash_plugin.schedules.auto import choose_schedule, load_rules
from dash_plugin.schedules.simulate import SimulationDeadlock, simulate
from dash_plugin.schedules.validity import (ScheduleError, validate_schedule, check_waits,
                                            sequential_safe)

C, R = 1.0, 0.5


def sched(name, n, causal=False, bm=64, bn=64, **kw):
    """Square problem with n KV tiles of width bn."""
    return build_schedule(name, seqlens_q=[n * bn], seqlens_k=[n * bn], block_m=bm, block_n=bn,
                          causal=causal, **kw)


def order(s, q, b=0):
    """KV tiles adding into dQ tile q, by rank."""
    contrib = [(r, kv) for w in s.sequences[b].workers for kv, qq, r in w.steps if qq == q]
    return [kv for _r, kv in sorted(contrib)]


# ----------------------------------------------------------------------------- geometry

def _brute_range(j, sq, sk, bm, bn, wl, wr):
    shift = sk - sq
    rows = set()
    for i in range(sq):
        for c in range(j * bn, min((j + 1) * bn, sk)):
            if (wl < 0 or c >= i + shift - wl) and (wr < 0 or c <= i + shift + wr):
                rows.add(i // bm)
    return (min(rows), max(rows)) if rows else (0, -1)


@pytest.mark.parametrize("sq,sk", [(40, 40), (37, 53), (53, 37), (1, 20), (20, 1), (0, 9)])
@pytest.mark.parametrize("wl,wr", [(-1, -1), (-1, 0), (5, 0), (3, 7), (0, 0), (-1, 4), (9, -1)])
def test_geometry_matches_bruteforce(sq, sk, wl, wr):
    for bm, bn in [(4, 4), (4, 8), (5, 8), (8, 3)]:
        geo = make_geometry(sq, sk, bm, bn, wl, wr)
        assert geo.kv_range == tuple(_brute_range(j, sq, sk, bm, bn, wl, wr)
                                     for j in range(-(-sk // bn)))
        for i, (lo, hi) in enumerate(geo.q_range):  # contributor ranges agree with kv ranges
            assert [j for j, (a, b) in enumerate(geo.kv_range) if a <= i <= b] == list(range(lo, hi + 1))


# ----------------------------------------------------------------------------- validity grid

SHAPES = [(512, 512), (448, 448), (576, 576), (500, 700), (700, 500), (64, 64), (1, 1), (0, 128)]
TILES = [(64, 64), (64, 128), (80, 128), (128, 128), (64, 96), (128, 64)]
MASKS = [(False, -1, -1), (True, -1, 0), (True, 150, 0), (False, 100, 60), (False, -1, 40),
         (False, 200, -1), (False, 0, 0)]


@pytest.mark.parametrize("name", registry.names())
def test_every_builder_valid_over_grid(name):
    variants = set()
    for (sq, sk), (bm, bn), (causal, wl, wr) in itertools.product(SHAPES, TILES, MASKS):
        s = build_schedule(name, seqlens_q=[sq], seqlens_k=[sk], block_m=bm, block_n=bn,
                           causal=causal, window_left=wl, window_right=wr)
        validate_schedule(s)
        variants.update(s.variants)
        if s.ordered:
            # all workers co-resident: no deadlock inside any group
            simulate(s, num_sms=None)
        if name in ("ascending", "descending", "spt"):
            assert sequential_safe(s.sequences[0])
            simulate(s, num_sms=1)  # the interpreter's one-after-another order finishes
    if name == "shift":  # every documented variant was exercised
        assert any(v == "shift-cyclic" for v in variants)
        assert any(v == "shift-symmetric" for v in variants)
        for reason in ("odd number", "not a multiple", "seqlen_q", "window mask"):
            assert any(reason in v for v in variants), reason


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 9, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_and_even_tile_counts(n, causal):
    s = sched("shift", n, causal)
    validate_schedule(s)
    simulate(s, num_sms=None)
    v = s.variants[0]
    if causal:
        odd = f"descending (fallback: odd number of KV tiles ({n}))"
        assert v == ("shift-symmetric" if n % 2 == 0 else odd)
    else:
        assert v == "shift-cyclic"


def test_varlen_per_sequence_variants_and_tables():
    kw = dict(seqlens_q=[512, 448, 0, 300], seqlens_k=[512, 448, 64, 300], block_m=64, block_n=64,
              causal=True)
    s = build_schedule("shift", **kw)
    validate_schedule(s)
    assert s.variants[0] == "shift-symmetric"
    assert s.variants[1].startswith("descending (fallback: odd number")
    assert s.variants[2].startswith("descending (fallback: seqlen_q 0")
    assert s.variants[3].startswith("descending (fallback: odd number")  # 300/64 -> 5 tiles
    t = kernel_tables("shift", window_left=-1, window_right=-1, **kw)
    assert t.num_workers.tolist() == [4, 7, 1, 5]
    assert t.num_contrib[2].tolist() == [0] * t.num_contrib.shape[1]
    r = simulate(s, num_heads=2, num_sms=None)
    assert r.makespan > 0


def test_symmetric_shift_orders_match_notes():
    s = sched("shift", 4, True)
    assert [order(s, q) for q in range(4)] == [[0], [0, 1], [1, 0, 2], [1, 0, 2, 3]]
    s = sched("shift", 8, True)
    assert order(s, 3) == [0, 3, 2, 1]
    assert order(s, 4) == [1, 0, 3, 2, 4]
    assert order(s, 7) == [3, 2, 1, 0, 4, 5, 6, 7]
    assert [order(s, q) for q in range(3)] == [[0], [1, 0], [2, 1, 0]]


def test_cyclic_shift_ranks_equal_dash_formula():
    """rank of member l at dQ tile q: F + ((min(q - lo, K-1) - l) mod K), F = tiles of earlier groups."""
    for n, m_rows, g in [(4, 4, None), (3, 6, None), (8, 10, 3), (10, 12, 4), (6, 6, 6)]:
        s = build_schedule("shift", seqlens_q=[m_rows * 16], seqlens_k=[n * 16], block_m=16,
                           block_n=16, group_size=g)
        assert s.variants == ("shift-cyclic",)
        gs = g or n
        for w in s.sequences[0].workers:
            for kv, q, rank in w.steps:
                j0 = (kv // gs) * gs
                k = min(gs, n - j0)
                assert rank == j0 + (min(q, k - 1) - (kv - j0)) % k


def test_ascending_descending_spt_rank_rules():
    kw = dict(seqlens_q=[700], seqlens_k=[500], block_m=64, block_n=128, causal=False,
              window_left=150, window_right=100)
    for name in ("ascending", "descending", "spt"):
        s = build_schedule(name, **kw)
        geo = s.sequences[0].geometry
        for w in s.sequences[0].workers:
            kv = w.segments[0].kv
            lo, hi = geo.kv_range[kv]
            assert list(w.segments[0].q_tiles) == (list(range(lo, hi + 1)) if name != "descending"
                                                   else list(range(hi, lo - 1, -1)))
            for _kv, q, rank in w.steps:
                jlo, jhi = geo.q_range[q]
                assert rank == (jhi - kv if name == "spt" else kv - jlo)
    spt = build_schedule("spt", **kw)
    assert [w.segments[0].kv for w in spt.sequences[0].workers] == [3, 2, 1, 0]


# ----------------------------------------------------------------------------- formulas

@pytest.mark.parametrize("n", [4, 8, 16])
def test_full_formulas(n):
    assert simulate(sched("ascending", n)).makespan == n * (C + R) + (n - 1) * R
    assert simulate(sched("shift", n)).makespan == n * (C + R)
    assert simulate(sched("shift", n), num_sms=n, assignment="static").makespan == n * (C + R)


@pytest.mark.parametrize("n,m", [(4, 2), (8, 8), (16, 32), (8, 4)])
def test_causal_formulas(n, m):
    asc = simulate(sched("ascending", n, True), num_heads=m, num_sms=n).makespan
    desc = simulate(sched("descending", n, True), num_heads=m, num_sms=n).makespan
    sym = simulate(sched("shift", n, True), num_heads=m, num_sms=n).makespan
    assert asc == m * n * (C + R) + (n - 1) * R
    assert desc == m * (n + 1) * (C + R) / 2 + (n - 1) * R
    assert sym == m * (n + 1) * (C + R) / 2  # the work bound: no tail


def test_check_values_from_notes():
    assert simulate(sched("ascending", 8)).makespan == 15.5
    assert simulate(sched("shift", 8)).makespan == 12.0
    assert simulate(sched("ascending", 8, True), num_heads=8, num_sms=8).makespan == 99.5
    assert simulate(sched("descending", 8, True), num_heads=8, num_sms=8).makespan == 57.5
    assert simulate(sched("ascending", 16, True), num_heads=32, num_sms=16).makespan == 775.5
    assert simulate(sched("descending", 16, True), num_heads=32, num_sms=16).makespan == 415.5
    assert simulate(sched("shift", 8, True), num_sms=4).makespan == 13.5
    assert simulate(sched("shift", 16, True, bm=64, bn=128), num_sms=8).makespan == 51.0
    # where the descending formula stops holding (notes section 3)
    assert simulate(sched("descending", 8, True), num_heads=8, num_sms=8, r=1.5).makespan == 111.0
    assert simulate(sched("descending", 4, True), num_sms=4).makespan == 6.0
    assert simulate(sched("descending", 4, True), num_heads=2, num_sms=4).makespan == 9.0
    assert simulate(sched("ascending", 4, True), num_heads=2, num_sms=4).makespan == 13.5


def test_split_and_atomic_model():
    n = 8
    assert simulate(sched("atomic", n)).makespan == n * (C + R)
    # split: n KV programs and n Q programs of n compute stages each, no reductions
    assert simulate(sched("split", n), num_sms=n).makespan == 2 * n * C


def test_gqa_repeats_visits_per_query_head():
    s = sched("shift", 8)
    r = simulate(s, num_heads=8, num_kv_heads=2, num_sms=None)
    assert r.makespan == 4 * 8 * (C + R) and r.wait == 0
    r = simulate(sched("ascending", 8), num_heads=8, num_kv_heads=2, num_sms=None)
    assert r.makespan == 4 * 8 * (C + R) + 7 * R
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        simulate(s, num_heads=6, num_kv_heads=4)


# ----------------------------------------------------------------------------- temporal order

@pytest.mark.parametrize("kw", [
    dict(seqlens_q=[512], seqlens_k=[512], block_m=64, block_n=64),
    dict(seqlens_q=[1000], seqlens_k=[640], block_m=80, block_n=128),
    dict(seqlens_q=[333], seqlens_k=[333], block_m=32, block_n=64),
    dict(seqlens_q=[2048], seqlens_k=[2048], block_m=32, block_n=32, group_size=16),
    dict(seqlens_q=[512], seqlens_k=[512], block_m=64, block_n=64, causal=True),
    dict(seqlens_q=[2048], seqlens_k=[2048], block_m=64, block_n=128, causal=True),
    dict(seqlens_q=[1000], seqlens_k=[1000], block_m=50, block_n=100, causal=True),
    dict(seqlens_q=[4096], seqlens_k=[4096], block_m=32, block_n=32, causal=True, group_size=16),
])
def test_shift_ranks_are_arrival_order(kw):
    """Lock-step (each group's workers on their own SMs, equal stage costs): nobody ever waits.
    With several groups, a group runs once the one before it has left the SMs."""
    s = build_schedule("shift", **kw)
    seq = s.sequences[0]
    assert seq.variant.startswith("shift-")
    groups = len({w.group for w in seq.workers})
    assert (groups > 1) == ("group_size" in kw)
    longest = max(w.num_steps for w in seq.workers)
    for c, r in [(1.0, 0.5), (1.0, 1.0), (1.0, 0.0)]:
        res = simulate(s, num_sms=seq.group_size, c=c, r=r)
        assert res.wait == 0
        assert res.makespan == groups * longest * (c + r)
    if groups > 1:  # run concurrently, a later group waits behind the earlier one (README)
        assert simulate(s, num_sms=None).wait > 0


# ----------------------------------------------------------------------------- SM count, groups

def _executed_orders(res):
    blocks = sorted((b for b in res.blocks if b.kind == "r"), key=lambda b: (b.start, b.unit))
    orders = {}
    for b in blocks:
        orders.setdefault((b.head, b.q), []).append(b.kv)
    return orders


def test_sm_count_independence():
    # nothing in the builders' or the tables' signatures knows about the GPU
    for fn in (build_schedule, kernel_tables):
        params = set(inspect.signature(fn).parameters)
        assert not {p for p in params if "sm" in p.lower() or "device" in p.lower()}, params
    torch.manual_seed(0)
    for name, causal in [("shift", False), ("shift", True), ("descending", True), ("spt", True),
                         ("ascending", False)]:
        s = sched(name, 16, causal, bm=32, bn=64)
        partial = torch.randn(4, 64, 16, 8, dtype=torch.float32)  # (head, q tile, kv tile, d)
        orders, sums = [], []
        for sms, how, launch in [(78, "dynamic", "head-major"), (114, "dynamic", "group-major"),
                                 (132, "static", "head-major"), (20, "dynamic", "head-major"),
                                 (None, "dynamic", "group-major")]:
            res = simulate(s, num_heads=4, num_sms=sms, assignment=how, launch=launch,
                           record=True, r=0.7)
            o = _executed_orders(res)
            orders.append(o)
            dq = torch.zeros(4, 64, 8)
            for (h, q), kvs in sorted(o.items()):
                for kv in kvs:
                    dq[h, q] += partial[h, q, kv]
            sums.append(dq)
        assert all(o == orders[0] for o in orders)
        assert all(torch.equal(x, sums[0]) for x in sums)
        # the executed order is the rank order of the schedule
        assert all(orders[0][(h, q)] == order(s, q) for h in range(4) for q in range(32))


def test_group_must_be_coresident():
    s = sched("shift", 8)  # one cyclic group of 8 workers
    with pytest.raises(SimulationDeadlock, match="never finish"):
        simulate(s, num_sms=4)
    with pytest.raises(SimulationDeadlock):
        simulate(s, num_sms=1)
    with pytest.raises(ScheduleError, match="max_group 4"):
        check_waits(s.sequences[0], max_group=4)
    s4 = sched("shift", 8, group_size=4)  # two groups of 4: fits on 4 SMs
    check_waits(s4.sequences[0], max_group=4)
    assert simulate(s4, num_sms=4).makespan > 0
    assert simulate(s4, num_sms=4, assignment="static").makespan > 0
    # a persistent grid of P >= G programs may split a group across rounds and still finishes
    for p in (4, 5, 7):
        simulate(s4, num_heads=3, num_sms=p, assignment="static")
        simulate(s4, num_heads=3, num_sms=p, assignment="static", launch="group-major")
    assert not sequential_safe(s4.sequences[0])


@pytest.mark.parametrize("causal", [False, True])
def test_several_groups_per_head(causal):
    """N > 2*MAX_GROUP tiles: several groups per head. Valid and deadlock-free on 78 SMs in both
    launch orders; group-major launch (all heads' first groups first) hides the cross-group wait."""
    s = sched("shift", 2 * MAX_GROUP + 4 if not causal else 4 * MAX_GROUP + 8, causal, bm=8, bn=8)
    seq = s.sequences[0]
    assert len({w.group for w in seq.workers}) == 3 and seq.group_size <= MAX_GROUP
    validate_schedule(s)
    heads = 4
    hm = simulate(s, num_heads=heads, num_sms=78, launch="head-major")
    gm = simulate(s, num_heads=heads, num_sms=78, launch="group-major")
    assert gm.makespan < hm.makespan
    simulate(s, num_heads=heads, num_sms=78, assignment="static", launch="group-major")


def test_default_group_size():
    assert default_group_size(8) == 8
    assert default_group_size(MAX_GROUP) == MAX_GROUP
    assert default_group_size(MAX_GROUP + 1) == (MAX_GROUP + 2) // 2
    assert default_group_size(200) == 50
    assert MAX_GROUP <= 78  # H20: co-resident at one program per SM
    s = sched("shift", 130, bm=8, bn=8)
    assert s.sequences[0].group_size == 44  # 130 tiles -> 3 groups: 44, 44, 42
    sizes = [sum(w.group == g for w in s.sequences[0].workers) for g in range(3)]
    assert sizes == [44, 44, 42]
    validate_schedule(s)
    s = sched("shift", 160, True, bm=8, bn=8)  # 80 pairs -> 2 groups of 40
    assert s.sequences[0].group_size == 40
    validate_schedule(s)


def test_build_cache():
    a = sched("shift", 8)
    assert sched("shift", 8) is a
    assert build_schedule("shift", seqlens_q=(512,), seqlens_k=(512,), block_m=64, block_n=64) is a


@pytest.mark.parametrize("bad, exc, match", [
    (dict(name="bogus"), ValueError, "schedule must be one of"),
    (dict(block_m=-2), ValueError, "block_m must be >= 1, got -2"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(seqlens_k=[512, 512]), ValueError, "equal length"),
    (dict(seqlens_q=[]), ValueError, "non-empty"),
    (dict(group_size=True), TypeError, "group_size must be an int"),
])
def test_build_bad_input(bad, exc, match):
    kw = dict(name="shift", seqlens_q=[512], seqlens_k=[512], block_m=64, block_n=64)
    kw.update(bad)
    name = kw.pop("name")
    with pytest.raises(exc, match=match):
        build_schedule(name, **kw)


def test_simulate_bad_input():
    s = sched("ascending", 4)
    with pytest.raises(ValueError, match="assignment must be"):
        simulate(s, assignment="random")
    with pytest.raises(ValueError, match="num_sms must be >= 1"):
        simulate(s, num_sms=0)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        simulate(s, r=-1)
    with pytest.raises(ValueError, match="launch must be"):
        simulate(s, launch="random")


# ----------------------------------------------------------------------------- auto

def test_auto_rule():
    def pick(causal, d, sq, sk=None, wl=-1, wr=-1, varlen=False):
        return choose_schedule(causal=causal, head_dim=d, seqlen_q=sq, seqlen_k=sk or sq,
                               window_left=wl, window_right=wr, varlen=varlen)
    # The committed table: split won every point of the H200 quick benchmark (docs/benchmarks/).
    for args in [(True, 128, 16384), (True, 64, 2048), (False, 64, 2048), (False, 128, 8192), (False, 128, 16384),
                 (True, 64, 1024, 2048), (False, 64, 1024, None, 256, 0)]:
        assert pick(*args) == "split"
    assert pick(True, 64, 1024, varlen=True) == "split"
    for causal, d, sq, sk, wl, wr, v in itertools.product(
            [False, True], [32, 64, 128, 256], [1, 512, 4096, 65536], [512, 65536], [-1, 64],
            [-1, 0], [False, True]):
        s = choose_schedule(causal=causal, head_dim=d, seqlen_q=sq, seqlen_k=sk, window_left=wl,
                            window_right=wr, varlen=v)
        assert s in registry.names(deterministic=True)
    assert len(load_rules()) >= 4
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
        choose_schedule(causal=True, head_dim=0, seqlen_q=1, seqlen_k=1)
    with pytest.raises(ValueError, match="window_right 0 or -1, got 3"):
        choose_schedule(causal=True, head_dim=64, seqlen_q=1, seqlen_k=1, window_right=3)


# ----------------------------------------------------------------------------- random shapes

from hypothesis import example, given, settings, strategies as st  # noqa: E402


# The drawn examples are fixed (the hypothesis profile of conftest.py), and none of them builds an
# `arrival` or `shift` sequence (they fall back to `descending`), so these examples make sure the
# no-wait checks of both orders run: arrival with distinct first rows (one and two sequences),
# the cyclic shift and the causal symmetric shift in one group, and a shift of several groups.
@example(name="arrival", lens=[(512, 512)], bm=64, bn=64, mask=(True, -1, 0), g=None)
@example(name="arrival", lens=[(512, 512), (200, 200)], bm=32, bn=64, mask=(True, -1, 0), g=2)
@example(name="shift", lens=[(512, 512)], bm=64, bn=64, mask=(False, -1, -1), g=None)
@example(name="shift", lens=[(640, 640)], bm=64, bn=64, mask=(True, -1, 0), g=None)
@example(name="shift", lens=[(512, 512), (200, 200)], bm=32, bn=32, mask=(False, -1, -1), g=7)
@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from([s.name for s in registry.specs() if s.ordered]),
       lens=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700)), min_size=1, max_size=3),
       bm=st.sampled_from([16, 32, 48, 64, 80]), bn=st.sampled_from([16, 32, 64, 96, 128]),
       mask=st.sampled_from([(False, -1, -1), (True, -1, 0), (True, 64, 0), (False, 50, 90),
                             (False, -1, 0), (False, 0, -1)]),
       g=st.sampled_from([None, 1, 2, 3, 7]))
def test_random_shapes_valid(name, lens, bm, bn, mask, g):
    causal, wl, wr = mask
    kw = dict(seqlens_q=[a for a, _ in lens], seqlens_k=[b for _, b in lens], block_m=bm,
              block_n=bn, causal=causal, window_left=wl, window_right=wr, group_size=g)
    s = build_schedule(name, **kw)
    validate_schedule(s)
    res = simulate(s, num_heads=2, num_kv_heads=1, num_sms=None)
    if name == "shift":
        for seq in s.sequences:
            if seq.variant.startswith("shift-") and len({w.group for w in seq.workers}) == 1:
                one = build_schedule("shift", **dict(kw, seqlens_q=[seq.geometry.seqlen_q],
                                                     seqlens_k=[seq.geometry.seqlen_k]))
                assert simulate(one, num_sms=None).wait == 0  # arrival order inside a group
    elif name == "arrival":
        for seq in s.sequences:
            if seq.variant != "arrival":   # its fallback (descending): waits point backwards
                assert sequential_safe(seq)
                continue
            one = build_schedule("arrival", **dict(kw, seqlens_q=[seq.geometry.seqlen_q],
                                                   seqlens_k=[seq.geometry.seqlen_k]))
            # A head's adds in arrival order: nobody waits, unless two KV tiles reach their first
            # row at one step (more keys than queries, or Q tiles taller than KV tiles), where
            # the rank rule makes one of the pair wait for the other.
            geo = seq.geometry
            firsts = [geo.kv_range[j][0] for j in range(geo.num_kv_tiles) if geo.kv_range[j][1] >= geo.kv_range[j][0]]
            if len(set(firsts)) == len(firsts):
                assert simulate(one, num_sms=None).wait == 0
    else:
        assert all(sequential_safe(seq) for seq in s.sequences)
        simulate(s, num_sms=1)
    t = kernel_tables(name, **kw)
    assert t.num_workers.tolist() == [len(seq.workers) for seq in s.sequences]
    assert res.makespan >= 0


def _corrupt(schedule, edit):
    """`schedule` with its first sequence's first worker's first segment changed by edit(segment)."""
    seq = schedule.sequences[0]
    worker = seq.workers[0]
    segment = edit(worker.segments[0])
    worker = dataclasses.replace(worker, segments=(segment,) + worker.segments[1:])
    seq = dataclasses.replace(seq, workers=(worker,) + seq.workers[1:])
    return dataclasses.replace(schedule, sequences=(seq,) + schedule.sequences[1:])


@pytest.mark.parametrize("edit, message", [
    (lambda s: dataclasses.replace(s, q_tiles=s.q_tiles + s.q_tiles[:1], ranks=s.ranks + s.ranks[:1]),
     "visited twice"),
    (lambda s: dataclasses.replace(s, q_tiles=s.q_tiles[1:], ranks=s.ranks[1:]), "missing"),
    (lambda s: dataclasses.replace(s, ranks=(s.ranks[0] + 1,) + s.ranks[1:]), "not a permutation"),
    (lambda s: dataclasses.replace(s, kv=s.kv + 100), "KV tiles owned by segments"),
], ids=["duplicate visit", "missing visit", "duplicate rank", "foreign KV tile"])
def test_the_validity_checks_refuse_broken_schedules(edit, message):
    """The oracle of the builder and table tests (validate_schedule) must itself refuse what is wrong."""
    good = build_schedule("descending", seqlens_q=[256], seqlens_k=[256], block_m=64, block_n=64, causal=True)
    validate_schedule(good)
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(_corrupt(good, edit))
