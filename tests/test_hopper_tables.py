"""The Hopper backend's plan, on the CPU: per-KV-tile visit lists and ranks taken from the
launch plan, the launch-order rule that keeps a non-persistent grid deadlock-free, the closed
form the kernel computes instead of reading tables, and the request filter."""
import dataclasses

import pytest
import torch

from dash_plugin.kernels.backends import DeviceProps, Request
from dash_plugin.kernels.hopper import (HEAD_DIMS, RESIDENT_SLOTS, Unsupported, VisitTables, batch_tables, bwd_tiles,
                                        check_waits_follow_launch, closed_form_visits, tables_of,
                                        visits_every_q_tile)
from dash_plugin.kernels.hopper.masks import fa4_mask
from dash_plugin.kernels.hopper_backend import BACKEND, HopperTiles
from dash_plugin.schedules import make_geometry, registry
from dash_plugin.schedules.plan import AttentionShape, launch_plan


def request(schedule, n, d, causal, window=(-1, -1), seqlen_k=None, **kw):
    left, right = window
    return Request(torch.device("cuda"), torch.bfloat16, d, schedule, registry.get(schedule).kernel_mode, False,
                   n, n if seqlen_k is None else seqlen_k, causal, left, 0 if causal else right, **kw)


def plan_tables(schedule, *, seqlen, head_dim, causal, window=(-1, -1)):
    """What the Hopper backend runs: the launch plan at its tiles, as per-KV-tile tables."""
    left, right = window
    shape = AttentionShape(1, 1, 1, (seqlen,), (seqlen,), False, causal, left, 0 if causal else right)
    plan = launch_plan(shape, schedule, tiles=BACKEND.tiles(request(schedule, seqlen, head_dim, causal, window)),
                       device=DeviceProps(132))
    tables = tables_of(plan.schedule.sequences[0])
    check_waits_follow_launch(tables)
    return tables

SEQLENS = (128, 640, 1000, 2048, 8192)


def cases():
    for d in HEAD_DIMS:
        for causal in (True, False):
            for s in ("ascending", "spt", "descending", "atomic", "arrival", "shift"):
                for n in SEQLENS:
                    yield d, causal, s, n


def visible_pairs(n, d, causal, window=(-1, -1)):
    left, right = window
    bm, bn = bwd_tiles(d, causal or left >= 0 or right >= 0)
    geo = make_geometry(n, n, bm, bn, left, 0 if causal else right)
    return {(q, kv) for kv in range(geo.num_kv_tiles) for q in range(geo.kv_range[kv][0], geo.kv_range[kv][1] + 1)}, geo


@pytest.mark.parametrize("d, causal, schedule, n", list(cases()))
def test_tables_cover_every_visible_pair_once_with_valid_ranks(d, causal, schedule, n):
    t = plan_tables(schedule, seqlen=n, head_dim=d, causal=causal)
    want, geo = visible_pairs(n, d, causal)
    counts, q_tiles, ranks = t.count.tolist(), t.q_tile.tolist(), t.rank.tolist()
    seen = [(q_tiles[kv][i], kv) for kv in range(len(counts)) for i in range(counts[kv])]
    assert len(seen) == len(set(seen)) and set(seen) == want
    per_tile = {}
    for kv in range(len(counts)):
        for i in range(counts[kv]):
            per_tile.setdefault(q_tiles[kv][i], []).append(ranks[kv][i])
        assert all(x == -1 for x in q_tiles[kv][counts[kv]:])  # padding
    for q, r in per_tile.items():
        want_ranks = [-1] * len(r) if schedule == "atomic" else list(range(len(r)))  # atomic: no order
        assert sorted(r) == want_ranks, f"dQ tile {q}: ranks {r}"
    check_waits_follow_launch(t)


# The closed form each schedule runs with (a single Q tile per KV tile reads the same either way).
EXPECTED_VISIT = {"ascending": "ascending", "spt": "ascending", "atomic": "ascending",
                  "descending": "descending", "shift": "shift", "arrival": "arrival"}


WINDOWS = ((-1, -1), (256, -1), (300, 0), (1000, 0), (128, 128), (-1, 200))


def window_cases():
    for d in (64, 128):
        for window in WINDOWS[1:]:
            for causal in (False, True) if window[1] == 0 else (False,):
                for s in ("ascending", "spt", "descending", "atomic", "shift", "arrival"):
                    for n in (640, 2048, 4096):
                        yield d, causal, s, n, window


@pytest.mark.parametrize("d, causal, schedule, n, window",
                         [c + ((-1, -1),) for c in cases()] + [(64, False, "shift", 16384, (-1, -1))]
                         + list(window_cases()))
def test_every_schedule_runs_in_closed_form_and_it_equals_the_tables(d, causal, schedule, n, window):
    """The kernel computes each visit and rank (bwd_sm90._visit) instead of reading the tables;
    closed_form_visits is that arithmetic in Python, so it must give the plan's tables exactly,
    visit by visit and rank by rank, with and without sliding windows."""
    t = plan_tables(schedule, seqlen=n, head_dim=d, causal=causal, window=window)
    _, geo = visible_pairs(n, d, causal, window)
    expected = EXPECTED_VISIT[schedule] if "fallback" not in t.variant else t.variant.split()[0]
    single = max(t.count.tolist()) <= 1
    if single and expected in ("descending", "arrival"):   # one row per KV tile: the same walk either way
        expected = "ascending"
    if expected == "arrival" and geo.num_kv_tiles == 1:   # nobody to arrive before: ascending's ranks
        expected = "ascending"
    firsts = [geo.kv_range[kv][0] for kv in range(geo.num_kv_tiles)]
    if t.paired:   # the causal symmetric shift
        expected = "pairs"
    if expected == "arrival" and any(firsts.count(m) > 1 for m in set(firsts) if m > 0):
        # Q tiles taller than KV tiles (hdim 256): two KV tiles reach a row past the first Q tile
        # at one step and add in KV order, which the kernel's arithmetic does not give: tables
        expected = None
    assert t.visit == expected
    if expected is None:
        return
    bm, bn = bwd_tiles(d, causal)
    if schedule == "shift" and not causal and n >= 1000 and window == (-1, -1) and bm <= bn:   # else more KV than Q
        assert t.variant == "shift-cyclic"
    for kv in range(geo.num_kv_tiles):
        got = closed_form_visits(t.visit, geo, kv, kv_descending=t.kv_descending, group_size=t.group_size)
        k = int(t.count[kv])
        assert [m for m, _ in got] == t.q_tile[kv, :k].tolist()
        if schedule != "atomic":
            assert [r for _, r in got] == t.rank[kv, :k].tolist()
    if schedule == "descending" and not single and window == (-1, -1):   # the order really is reversed
        lo, hi = geo.kv_range[0]
        assert t.q_tile[0, :t.count[0]].tolist() == list(range(hi, lo - 1, -1))


def test_tables_that_match_no_closed_form_are_read():
    """An order the arithmetic does not give (here: every KV tile visiting its rows
    odd-first) leaves `visit` None, so the kernel reads the tables."""
    from dash_plugin.schedules import make_geometry
    from dash_plugin.schedules.builders import ordered_sequence
    geo = make_geometry(2048, 2048, 64, 128, -1, 0)
    visits = [(j, [(j, sorted(range(lo, hi + 1), key=lambda m: (m % 2 == 0, m)))])
              for j, (lo, hi) in enumerate(geo.kv_range)]
    t = tables_of(ordered_sequence(geo, visits, "odd rows first"))
    check_waits_follow_launch(t)
    assert t.visit is None


def test_a_wait_on_a_later_launch_outside_the_group_is_refused():
    t = plan_tables("ascending", seqlen=1024, head_dim=128, causal=False)
    flipped = VisitTables(t.count, t.q_tile, t.rank, not t.kv_descending, 1, "ascending ranks, descending launch")
    with pytest.raises(Unsupported, match="launched before it"):
        check_waits_follow_launch(flipped)


@pytest.mark.parametrize("seqlen, d", [(1024, 128), (2048, 64), (8192, 96), (16384, 128), (32768, 128)])
def test_causal_symmetric_shift_runs_in_pairs_from_the_plans_lists(seqlen, d):
    """CTA p runs KV tile p, then N-1-p, each KV tile from its own row of the tables (the
    kernel reads them), and the ranks are the plan's."""
    shape = AttentionShape(1, 1, 1, (seqlen,), (seqlen,), False, True, -1, 0)
    seq = launch_plan(shape, "shift", tiles=BACKEND.tiles(request("shift", seqlen, d, True)),
                      device=DeviceProps(132)).schedule.sequences[0]
    t = tables_of(seq)
    check_waits_follow_launch(t)
    n = t.count.shape[0]
    assert seq.variant == "shift-symmetric" and t.paired and t.visit == "pairs" and n % 2 == 0
    assert t.group_size == min(n // 2, RESIDENT_SLOTS)
    for p, w in enumerate(seq.workers):
        assert [s.kv for s in w.segments] == [p, n - 1 - p]
        for s in w.segments:
            k = int(t.count[s.kv])
            assert t.q_tile[s.kv, :k].tolist() == list(s.q_tiles) and t.rank[s.kv, :k].tolist() == list(s.ranks)


def test_a_pair_whose_first_tile_waits_for_its_own_second_is_refused():
    """Inside a pair CTA the second KV tile runs after the first, so ranks that make the first
    tile's add wait for the second tile's (of the same CTA, or through a chain of other CTAs of
    the group) would hang."""
    t = plan_tables("shift", seqlen=1024, head_dim=128, causal=True)
    n = t.count.shape[0]
    q_tile, rank = t.q_tile.clone(), t.rank.clone()
    # dQ tile M-1 is the first tile's (p = 0) and its own second tile's (KV n-1): swap their ranks
    last = int(t.q_tile[n - 1, 0])
    i = t.q_tile[0].tolist().index(last)
    rank[0, i], rank[n - 1, 0] = int(t.rank[n - 1, 0]), int(t.rank[0, i])
    bad = dataclasses.replace(t, rank=rank)
    with pytest.raises(Unsupported, match="may not have reached"):
        check_waits_follow_launch(bad)


def test_packed_batches_do_not_take_the_paired_launch():
    shape = AttentionShape(2, 1, 1, (1024, 2048), (1024, 2048), True, True, -1, 0)
    plan = launch_plan(shape, "shift", tiles=BACKEND.tiles(request("shift", 2048, 128, True)), device=DeviceProps(132))
    with pytest.raises(Unsupported, match="does not take the paired launch"):
        batch_tables(plan.schedule.sequences)


@pytest.mark.parametrize("seqlen", (512, 1024, 4096, 16384, 131072))
@pytest.mark.parametrize("d", (64, 128))
def test_cyclic_groups_fit_the_resident_window(seqlen, d):
    """The shift kernel launches heads one after another, so a group of G KV tiles spans G
    launch slots: the plan's groups are the whole head up to RESIDENT_SLOTS KV tiles, and beyond
    the fewest equal groups that fit (sizes from the shape alone; that no SM count enters the
    tables: tests/test_launch_plan.py::test_the_order_does_not_depend_on_the_sm_count)."""
    t = plan_tables("shift", seqlen=seqlen, head_dim=d, causal=False)
    n = t.count.shape[0]
    assert t.group_size <= RESIDENT_SLOTS
    groups = -(-n // RESIDENT_SLOTS)              # the fewest equal groups that fit
    assert t.group_size == -(-n // groups)        # n itself where the head fits


def test_a_group_larger_than_the_resident_window_is_refused():
    shape = AttentionShape(1, 1, 1, (16384,), (16384,), False, False, -1, -1)
    plan = launch_plan(shape, "shift", tiles=HopperTiles(80, 128, 128), device=DeviceProps(132))
    with pytest.raises(Unsupported, match="at most 64 co-resident"):
        tables_of(plan.schedule.sequences[0])


def test_requests_the_backend_does_not_run_say_why(monkeypatch):
    from dash_plugin.kernels import hopper_backend
    monkeypatch.setattr(hopper_backend, "_is_sm90", lambda device: False)   # as on any other GPU (or none)
    assert BACKEND.supports(request("descending", 1024, 128, True)) == "needs an sm90 (Hopper) GPU"
    for d in (4, 36, 104, 264):
        with pytest.raises(ValueError, match=f"head_dim={d}: the Hopper kernels run multiples of 8 from 8 to 256"):
            bwd_tiles(d, True)
    assert BACKEND.tiles(request("shift", 2048, 128, False)) == (80, 128, None)   # the plan's default groups
    assert BACKEND.tiles(request("descending", 2048, 64, True)).group_size is None


def test_head_dims_off_the_table_run_at_the_next_ones_tiles(monkeypatch):
    """A multiple of 8 up to 256 takes the tiles of the next table head dim up (FA4's sm90
    configuration ranges), but for 104 and 112 (FA4's dQ conversion does not cover their rows at
    hdim 128's tiles), which the backend refuses by name."""
    from dash_plugin.kernels import hopper, hopper_backend
    for d in range(8, 257, 8):
        if d in (104, 112):
            continue
        row = next(t for t in HEAD_DIMS if t >= d)
        for masked, dropout in ((True, False), (False, False), (False, True)):
            assert bwd_tiles(d, masked, dropout) == bwd_tiles(row, masked, dropout), (d, masked, dropout)
    assert bwd_tiles(120, False) == (80, 128) and bwd_tiles(80, False) == (64, 128)
    monkeypatch.setattr(hopper_backend, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hopper, "available", lambda: True)
    assert BACKEND.supports(request("descending", 1024, 80, True)) is True
    assert BACKEND.tiles(request("descending", 1024, 80, True))[:2] == (64, 128)
    for d in (36, 112, 264):
        assert BACKEND.supports(request("descending", 1024, d, True)) == (
            f"head_dim={d}: the Hopper kernels run multiples of 8 from 8 to 256, but for 104 and 112")


@pytest.mark.parametrize("causal, left, right, want", [
    (False, -1, -1, (False, False, None, None)),       # full
    (True, -1, -1, (True, False, None, None)),         # causal
    (True, -1, 0, (True, False, None, None)),          # causal, right given as ours spells it
    (True, 256, -1, (False, True, 256, 0)),            # causal sliding window
    (False, 128, 128, (False, True, 128, 128)),        # two-sided window
    (False, -1, 200, (False, True, None, 200)),        # right side only
    (False, -1, 0, (True, False, None, None)),         # causal spelled as a window
    (False, 300, -1, (False, True, 300, None)),        # left side only, no causal limit
])
def test_windows_in_fa4s_terms(causal, left, right, want):
    assert fa4_mask(causal, left, right) == want


def test_full_masks_at_hdim128_take_the_masked_tiles_with_dropout_only():
    assert BACKEND.tiles(request("ascending", 2048, 128, False))[:2] == bwd_tiles(128, False) == (80, 128)
    assert BACKEND.tiles(request("ascending", 2048, 128, False, dropout=True))[:2] == (64, 128)
    assert bwd_tiles(128, False, dropout=True) == bwd_tiles(128, True)
    for d in HEAD_DIMS:   # masked tiles and the other head dims do not change with dropout
        assert bwd_tiles(d, True, dropout=True) == bwd_tiles(d, True)
        if d != 128:
            assert bwd_tiles(d, False, dropout=True) == bwd_tiles(d, False)


def test_windows_and_softcap_run_here_softcap_with_dropout_does_not(monkeypatch):
    from dash_plugin.kernels import hopper, hopper_backend
    monkeypatch.setattr(hopper_backend, "_is_sm90", lambda device: True)   # as on an H100
    monkeypatch.setattr(hopper, "available", lambda: True)
    window = request("descending", 2048, 128, True, window=(256, 0))
    assert BACKEND.supports(window) is True
    assert BACKEND.tiles(window)[:2] == bwd_tiles(128, True) == (64, 128)   # windows tile like causal
    assert BACKEND.tiles(request("ascending", 2048, 128, False, window=(128, 128)))[:2] == (64, 128)
    assert BACKEND.supports(request("ascending", 2048, 64, False, softcap=True)) is True
    assert BACKEND.supports(request("ascending", 2048, 64, False, softcap=True, dropout=True)) == \
        "softcap with dropout runs on the Triton backend"
    assert BACKEND.supports(request("shift", 2048, 64, True)) is True   # the symmetric pairs
    assert BACKEND.supports(request("shift", 2048, 64, True, window=(256, 0))) is True   # descending fallback
    assert BACKEND.supports(request("shift", 2048, 64, False, window=(-1, 0))) is True   # causal spelled as a window
    assert BACKEND.tiles(request("ascending", 2048, 128, False, window=(-1, 0)))[:2] == (64, 128)


def test_forward_compile_key_separates_what_the_compiler_bakes_in():
    """fwd_sm90 reuses a compiled forward for every call with its key: the key must change with
    everything compiled in (stride-0 dims included: K/V expanded over the batch) and stay the same
    across what is passed at run time (sizes, the scale, window sizes, the seed)."""
    from dash_plugin.kernels.hopper.fwd_key import forward_key

    def key(q, k, v=None, **over):
        mask = dict(causal=True, local=False, window_size_left=None, window_size_right=None, softcap=0.0,
                    dropout_p=0.0)
        return forward_key(q, k, k if v is None else v, **{**mask, **over})
    q = torch.empty(2, 64, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 64, 2, 128, dtype=torch.bfloat16)
    base = key(q, k)
    assert key(torch.empty(3, 512, 8, 128, dtype=torch.bfloat16), torch.empty(3, 512, 2, 128, dtype=torch.bfloat16)) == base
    assert key(q, k, local=True, causal=False, window_size_left=100, window_size_right=0) == \
        key(q, k, local=True, causal=False, window_size_left=7, window_size_right=3)   # sizes: run time
    assert key(q, k, dropout_p=0.1) == key(q, k, dropout_p=0.5)   # p: run time, up to one half
    assert key(q, k, dropout_p=0.6) == key(q, k, dropout_p=0.9)
    broadcast = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16).expand(2, -1, -1, -1)
    different = [key(q.half(), k.half()), key(torch.empty(2, 64, 8, 64), torch.empty(2, 64, 2, 64)),
                 key(q, torch.empty(2, 64, 8, 128, dtype=torch.bfloat16)), key(q, k, causal=False),
                 key(q, k, causal=False, local=True, window_size_left=5, window_size_right=None),
                 key(q, k, causal=False, local=True, window_size_left=None, window_size_right=5),
                 key(q, k, softcap=30.0), key(q, k, softcap=20.0), key(q, k, dropout_p=0.1),
                 key(q, k, dropout_p=0.6),
                 key(q, broadcast), key(q, k, broadcast)]
    assert len({base, *different}) == len(different) + 1


# ----------------------------------------------------------------------------- packed batches

def packed_plan(schedule, lengths, d, causal, window=(-1, -1)):
    """The launch plan of a packed batch of (queries, keys) per sequence at the Hopper tiles."""
    left, right = window
    right = 0 if causal else right
    sq, sk = tuple(a for a, _ in lengths), tuple(b for _, b in lengths)
    shape = AttentionShape(len(lengths), 1, 1, sq, sk, True, causal, left, right)
    req = Request(torch.device("cuda"), torch.bfloat16, d, schedule, registry.get(schedule).kernel_mode, True,
                  max(sq), max(sk), causal, left, right)
    return launch_plan(shape, schedule, tiles=BACKEND.tiles(req), device=DeviceProps(132))


def random_lengths(seed, n=12):
    """Ragged (queries, keys) per sequence: equal and unequal, empty, one token, several tiles."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = int(torch.randint(0, 3000, (1,), generator=g))
        out.append((a, a) if torch.rand(1, generator=g) < 0.6 else (a, int(torch.randint(0, 3000, (1,), generator=g))))
    return out + [(0, 0), (1, 1), (1, 700)]


PACKED_MASKS = {"causal": (True, (-1, -1)), "full": (False, (-1, -1)), "causal-window": (True, (300, -1)),
                "band": (False, (200, 100))}


@pytest.mark.parametrize("mask", PACKED_MASKS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("schedule, visit", [("ascending", "ascending"), ("spt", "ascending"),
                                             ("descending", "descending"), ("atomic", "ascending")])
def test_packed_batches_of_the_acyclic_orders_run_one_computed_order(schedule, visit, d, mask):
    """A packed batch runs one compiled kernel whose order each sequence computes from its own
    lengths: for the orders the backend runs on packed batches, every sequence of any mix of
    lengths follows it, and every wait points to an earlier-launched KV tile."""
    causal, window = PACKED_MASKS[mask]
    for seed in range(4):
        plan = packed_plan(schedule, random_lengths(seed), d, causal, window)
        tables = batch_tables(plan.schedule.sequences)
        check_waits_follow_launch(tables)
        assert tables.visit == visit and tables.group_size == 1
        assert tables.kv_descending == (schedule == "spt")


@pytest.mark.parametrize("d", [d for d in HEAD_DIMS if bwd_tiles(d, True)[0] <= bwd_tiles(d, True)[1]])
@pytest.mark.parametrize("groups", (1, 3))
def test_packed_batches_of_arrival_run_one_computed_order(d, groups):
    """arrival on a packed batch: every sequence (more queries than keys or fewer, up to one
    group of KV tiles or up to three) follows the closed form under the batch's launch rule,
    with the longest sequence's group as the compiled one, and every wait points to a tile
    launched earlier or to one of its own group."""
    whole = groups * RESIDENT_SLOTS * bwd_tiles(d, True)[1]
    for seed in range(4):
        lengths = [(min(a * groups, whole), min(b * groups, whole)) for a, b in random_lengths(seed)]
        plan = packed_plan("arrival", lengths + [(whole, whole)], d, True)
        tables = batch_tables(plan.schedule.sequences)
        check_waits_follow_launch(tables)
        assert tables.visit == "arrival" and not tables.kv_descending
        assert tables.group_size == RESIDENT_SLOTS and tables.top_group_first == (groups > 1)


def test_packed_arrival_with_kv_tiles_narrower_than_q_tiles_runs_on_triton(monkeypatch):
    """hdim 256 (64-row Q tiles, 48-key KV tiles): two KV tiles reach a row at one step, an arrival
    order the kernel does not compute, and a packed batch cannot read tables."""
    from dash_plugin.kernels import hopper, hopper_backend
    monkeypatch.setattr(hopper_backend, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hopper, "available", lambda: True)
    plan = packed_plan("arrival", [(1000, 1000), (2000, 2000)], 256, True)
    with pytest.raises(Unsupported):
        batch_tables(plan.schedule.sequences)
    req = Request(torch.device("cuda"), torch.bfloat16, 256, "arrival", "ordered", True, 2000, 2000, True, -1, 0)
    assert BACKEND.supports(req).startswith("schedule='arrival' with varlen at head_dim=256")
    assert BACKEND.supports(Request(torch.device("cuda"), torch.bfloat16, 256, "arrival", "ordered", False, 2000,
                                    2000, True, -1, 0)) is True   # dense: the kernel reads the tables


@pytest.mark.parametrize("d", (128, 192))
def test_a_packed_batch_takes_the_closed_form_its_sequences_share(d):
    """A sequence of few queries and many keys (one Q tile per KV tile) walks ascending and
    descending alike; when it has the most KV tiles it must not decide the batch's order."""
    plan = packed_plan("descending", [(44, 2933), (2000, 2000)], d, True)
    tables = batch_tables(plan.schedule.sequences)
    assert tables.visit == "descending"
    check_waits_follow_launch(tables)


@pytest.mark.parametrize("sq, sk", [(1000, 2048), (128, 4096), (2048, 1000), (700, 300), (300, 700),
                                    (16384, 16384), (9000, 9000), (3000, 9000), (2000, 20000), (128, 20000)])
def test_arrival_with_unequal_lengths_is_the_computed_order(sq, sk):
    """Where keys outnumber queries several KV tiles reach the first row together: they add
    after the others, by (group launched first, KV tile), and the kernel's closed form says so,
    with one group or several (over 64 KV tiles; tied tiles in one group or spread over three)."""
    shape = AttentionShape(1, 1, 1, (sq,), (sk,), False, True, -1, 0)
    seq = launch_plan(shape, "arrival", tiles=BACKEND.tiles(request("arrival", sq, 128, True, seqlen_k=sk)),
                      device=DeviceProps(132)).schedule.sequences[0]
    assert seq.variant == "arrival"
    for w in seq.workers:
        got = closed_form_visits("arrival", seq.geometry, w.segments[0].kv, group_size=seq.group_size)
        assert got == list(zip(w.segments[0].q_tiles, w.segments[0].ranks))
    tables = tables_of(seq)
    assert tables.visit is not None and tables.top_group_first == (seq.geometry.num_kv_tiles > RESIDENT_SLOTS)
    check_waits_follow_launch(tables)


def test_a_packed_batch_whose_sequences_take_different_orders_is_refused():
    # full-mask shift: a sequence of one Q tile falls back to ascending, a square one does not
    plan = packed_plan("shift", [(1000, 1000), (64, 4096)], 128, False)
    assert [s.variant.split(" ")[0] for s in plan.schedule.sequences] == ["shift-cyclic", "ascending"]
    with pytest.raises(Unsupported, match="1000 keys .'shift-cyclic'. does not follow the ascending order"):
        batch_tables(plan.schedule.sequences)


def test_packed_batches_and_unequal_lengths_run_here(monkeypatch):
    from dash_plugin.kernels import hopper, hopper_backend
    monkeypatch.setattr(hopper_backend, "_is_sm90", lambda device: True)   # as on an H100
    monkeypatch.setattr(hopper, "available", lambda: True)

    def packed(schedule, causal=True, **kw):
        return Request(torch.device("cuda"), torch.bfloat16, 128, schedule, registry.get(schedule).kernel_mode, True,
                       4096, 4096, causal, -1, 0 if causal else -1, **kw)
    for schedule in ("ascending", "spt", "descending", "atomic", "arrival"):
        assert BACKEND.supports(packed(schedule)) is True
    long = Request(torch.device("cuda"), torch.bfloat16, 128, "arrival", "ordered", True, 20000, 20000, True, -1, 0)
    assert BACKEND.supports(long) is True   # over one group of KV tiles: groups launched top group first
    assert BACKEND.supports(packed("shift", causal=False)).startswith("schedule='shift' with varlen")
    assert BACKEND.supports(packed("descending", dropout=True)) is True
    assert BACKEND.supports(packed("descending", dropout=True, softcap=True)) == \
        "softcap with dropout runs on the Triton backend"
    unequal = Request(torch.device("cuda"), torch.bfloat16, 128, "arrival", "ordered", False, 1024, 4096, True, -1, 0)
    assert BACKEND.supports(unequal) is True


@pytest.mark.parametrize("kw, want", [
    (dict(causal=True, head_dim=128, varlen=True), "arrival"),
    (dict(causal=True, head_dim=128, varlen=True, seqlen_q=16384, seqlen_k=16384), "descending"),
    (dict(causal=True, head_dim=64, varlen=True), "spt"),
    (dict(causal=False, head_dim=128, varlen=True), "ascending"),
    (dict(causal=True, head_dim=128, seqlen_q=1024), "ascending"),   # fewer queries than keys
    (dict(causal=True, head_dim=128, window_left=1024), "spt"),
    (dict(causal=False, head_dim=64, window_left=512, window_right=512), "spt"),
    (dict(causal=True, head_dim=128), "arrival"),
    (dict(causal=True, head_dim=192), "arrival"),
    (dict(causal=False, head_dim=192, seqlen_q=2048, seqlen_k=2048), "shift"),
    (dict(causal=False, head_dim=128, seqlen_q=1024, seqlen_k=1024), "shift"),
    (dict(causal=False, head_dim=128, seqlen_q=2048, seqlen_k=2048), "shift"),
    (dict(causal=False, head_dim=128, seqlen_q=8192, seqlen_k=8192), "ascending"),
    (dict(causal=False, head_dim=192, seqlen_q=1024, seqlen_k=1024), "shift"),
    (dict(causal=False, head_dim=64, seqlen_q=2048, seqlen_k=2048), "shift"),
    (dict(causal=False, head_dim=64), "ascending"),
    (dict(causal=False, head_dim=192), "ascending"),
    (dict(causal=False, head_dim=64, seqlen_q=16384, seqlen_k=16384), "descending"),
    (dict(causal=False, head_dim=128, seqlen_q=16384, seqlen_k=16384), "descending"),
    (dict(causal=False, head_dim=160, seqlen_q=1024, seqlen_k=16384), "descending"),
    (dict(causal=False, head_dim=256, seqlen_q=16384, seqlen_k=16384), "ascending"),
    (dict(causal=True, head_dim=256), "spt"),
    (dict(causal=True, head_dim=256, varlen=True), "spt"),   # packed arrival does not run at hdim 256
    (dict(causal=False, head_dim=256, seqlen_q=2048, seqlen_k=2048), "ascending"),
    # head dims off the tile table take the rules of the tiles they run at
    (dict(causal=True, head_dim=224), "spt"),
    (dict(causal=True, head_dim=160, seqlen_q=2048, seqlen_k=2048), "arrival"),
    (dict(causal=False, head_dim=160, seqlen_q=2048, seqlen_k=2048), "shift"),
    (dict(causal=True, head_dim=40, seqlen_q=1024, seqlen_k=1024), "arrival"),
    # 33-48: hdim 64's tiles, rules of their own (48 padded columns)
    (dict(causal=True, head_dim=40, seqlen_q=8192, seqlen_k=8192), "arrival"),
    (dict(causal=True, head_dim=48, seqlen_q=16384, seqlen_k=16384), "shift"),
    (dict(causal=False, head_dim=40, seqlen_q=16384, seqlen_k=16384), "shift"),
    (dict(causal=True, head_dim=40, varlen=True), "spt"),
    # 49-56: 8 padded columns, the causal symmetric shift beyond 4k
    (dict(causal=True, head_dim=56, seqlen_q=16384, seqlen_k=16384), "shift"),
    (dict(causal=True, head_dim=56, seqlen_q=8192, seqlen_k=8192), "shift"),
    (dict(causal=True, head_dim=56, seqlen_q=4096, seqlen_k=4096), "arrival"),
    (dict(causal=True, head_dim=64, seqlen_q=8192, seqlen_k=8192), "spt"),
    (dict(causal=True, head_dim=32, seqlen_q=8192, seqlen_k=8192), "spt"),
    (dict(causal=True, head_dim=64, seqlen_q=1024, seqlen_k=1024), "arrival"),
    (dict(causal=True, head_dim=80, seqlen_q=2048, seqlen_k=2048), "arrival"),
    (dict(causal=False, head_dim=120, seqlen_q=2048, seqlen_k=2048), "shift"),
])
def test_auto_on_this_backend_picks_an_order_it_runs(monkeypatch, kw, want):
    """`auto` resolves per backend: on this one it must name an order the backend runs for the
    call, or the call would pass to Triton although the Hopper kernel covers it."""
    from dash_plugin.kernels import hopper, hopper_backend
    from dash_plugin.schedules import auto
    monkeypatch.setattr(hopper_backend, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hopper, "available", lambda: True)
    args = {"seqlen_q": 4096, "seqlen_k": 4096, **kw}
    got = auto.choose_schedule(**args, backend="hopper")
    assert got == want
    left, right = args.get("window_left", -1), args.get("window_right", -1)
    causal = args["causal"]
    req = Request(torch.device("cuda"), torch.bfloat16, args["head_dim"], got, registry.get(got).kernel_mode,
                  args.get("varlen", False), args["seqlen_q"], args["seqlen_k"], causal, left, 0 if causal else right)
    assert BACKEND.supports(req) is True


def test_which_calls_may_leave_a_query_row_without_keys():
    from dash_plugin.kernels.hopper.masks import may_have_empty_rows
    assert may_have_empty_rows(True, [2048], [1024])              # causal, more queries than keys
    assert not may_have_empty_rows(True, [1024], [2048])
    assert not may_have_empty_rows(True, [2048], [2048])
    assert not may_have_empty_rows(False, [2048], [1024])         # full mask: every row sees every key
    assert may_have_empty_rows(True, [10, 700, 0], [10, 300, 0])  # packed: any one sequence


@pytest.mark.parametrize("schedule, sq, sk, causal, window, want", [
    ("shift", 1000, 1000, False, (-1, -1), True),
    ("arrival", 1000, 1000, True, (-1, -1), True),
    ("descending", 600, 1000, True, (-1, -1), True),      # more keys: every row sees some
    ("descending", 1000, 600, True, (-1, -1), False),     # the first 400 rows see no key
    ("spt", 2048, 64, True, (-1, -1), False),
    ("descending", 1000, 1000, True, (256, -1), True),    # a window keeps the diagonal
])
def test_which_dense_calls_give_every_dq_tile_an_add(schedule, sq, sk, causal, window, want):
    """Where every dQ tile gets an add, the backward stores each tile's first add instead of
    zeroing the accumulator first; a tile with no add must then be zeroed."""
    left, right = window
    shape = AttentionShape(1, 1, 1, (sq,), (sk,), False, causal, left, 0 if causal else right)
    tiles = BACKEND.tiles(request(schedule, sq, 128, causal, window, seqlen_k=sk))
    tables = tables_of(launch_plan(shape, schedule, tiles=tiles, device=DeviceProps(132)).schedule.sequences[0])
    q_tiles = -(-sq // tiles.block_m)
    assert visits_every_q_tile(tables, q_tiles) is want
    if want:   # and one tile more than the sequence has is not covered
        assert visits_every_q_tile(tables, q_tiles + 1) is False
