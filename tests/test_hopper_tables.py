"""The Hopper backend's plan, on the CPU: per-KV-tile visit lists and ranks taken from the
launch plan, the launch-order rule that keeps a non-persistent grid deadlock-free, the closed
form the kernel computes instead of reading tables, and the request filter."""
import pytest
import torch

from dash_plugin.kernels.backends import DeviceProps, Request
from dash_plugin.kernels.hopper import (RESIDENT_SLOTS, Unsupported, VisitTables, bwd_tiles,
                                        check_waits_follow_launch, closed_form_visits, tables_of)
from dash_plugin.kernels.hopper_backend import BACKEND, HopperTiles
from dash_plugin.schedules import make_geometry, registry
from dash_plugin.schedules.plan import AttentionShape, launch_plan


def request(schedule, n, d, causal, **kw):
    return Request(torch.device("cuda"), torch.bfloat16, d, schedule, registry.get(schedule).kernel_mode, False,
                   n, n, causal, -1, 0 if causal else -1, **kw)


def plan_tables(schedule, *, seqlen, head_dim, causal):
    """What the Hopper backend runs: the launch plan at its tiles, as per-KV-tile tables."""
    shape = AttentionShape(1, 1, 1, (seqlen,), (seqlen,), False, causal, -1, 0 if causal else -1)
    plan = launch_plan(shape, schedule, tiles=BACKEND.tiles(request(schedule, seqlen, head_dim, causal)),
                       device=DeviceProps(132))
    tables = tables_of(plan.schedule.sequences[0])
    check_waits_follow_launch(tables)
    return tables

SEQLENS = (128, 640, 1000, 2048, 8192)


def cases():
    for d in (64, 96, 128):
        for causal in (True, False):
            for s in ("ascending", "spt", "descending", "atomic") + (() if causal else ("shift",)):
                for n in SEQLENS:
                    yield d, causal, s, n


def visible_pairs(n, d, causal):
    bm, bn = bwd_tiles(d, causal)
    geo = make_geometry(n, n, bm, bn, -1, 0 if causal else -1)
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
                  "descending": "descending", "shift": "shift"}


@pytest.mark.parametrize("d, causal, schedule, n", list(cases()) + [(64, False, "shift", 16384)])
def test_every_schedule_runs_in_closed_form_and_it_equals_the_tables(d, causal, schedule, n):
    """The kernel computes each visit and rank (bwd_sm90._visit) instead of reading the tables;
    closed_form_visits is that arithmetic in Python, so it must give the plan's tables exactly,
    visit by visit and rank by rank."""
    t = plan_tables(schedule, seqlen=n, head_dim=d, causal=causal)
    _, geo = visible_pairs(n, d, causal)
    single = max(t.count.tolist()) <= 1
    ascending_after_all = (single and schedule == "descending") or "fallback" in t.variant
    assert t.visit == ("ascending" if ascending_after_all else EXPECTED_VISIT[schedule])
    if schedule == "shift" and n >= 1000:
        assert t.variant == "shift-cyclic"
    for kv in range(geo.num_kv_tiles):
        got = closed_form_visits(t.visit, geo, kv, kv_descending=t.kv_descending, group_size=t.group_size)
        k = int(t.count[kv])
        assert [m for m, _ in got] == t.q_tile[kv, :k].tolist()
        if schedule != "atomic":
            assert [r for _, r in got] == t.rank[kv, :k].tolist()
    if schedule == "descending" and not single:   # the order really is reversed
        lo, hi = geo.kv_range[0]
        assert t.q_tile[0, :t.count[0]].tolist() == list(range(hi, lo - 1, -1))


def test_tables_that_match_no_closed_form_are_read():
    """Ranks the arithmetic does not give (here: a sliding window, where a dQ tile's first add
    is not KV tile 0's) leave `visit` None, so the kernel reads them."""
    from dash_plugin.schedules import make_geometry
    from dash_plugin.schedules.builders import build_descending
    geo = make_geometry(2048, 2048, 64, 128, 256, 0)
    t = tables_of(build_descending(geo))
    assert t.visit is None


def test_a_wait_on_a_later_launch_outside_the_group_is_refused():
    t = plan_tables("ascending", seqlen=1024, head_dim=128, causal=False)
    flipped = VisitTables(t.count, t.q_tile, t.rank, not t.kv_descending, 1, "ascending ranks, descending launch")
    with pytest.raises(Unsupported, match="launched before it"):
        check_waits_follow_launch(flipped)


def test_causal_symmetric_shift_is_not_for_this_grid():
    with pytest.raises(Unsupported, match="pairs two KV tiles"):
        plan_tables("shift", seqlen=1024, head_dim=128, causal=True)


@pytest.mark.parametrize("seqlen", (512, 1024, 4096, 16384, 131072))
@pytest.mark.parametrize("d", (64, 128))
def test_cyclic_groups_fit_the_resident_window(seqlen, d):
    """The shift kernel launches heads one after another, so a group of G KV tiles spans G
    launch slots: the plan's groups are the whole head up to RESIDENT_SLOTS KV tiles, split
    evenly beyond, and depend on the shape only."""
    t = plan_tables("shift", seqlen=seqlen, head_dim=d, causal=False)
    n = t.count.shape[0]
    assert t.group_size <= RESIDENT_SLOTS
    assert t.group_size == n if n <= RESIDENT_SLOTS else t.group_size > RESIDENT_SLOTS // 2


def test_a_group_larger_than_the_resident_window_is_refused():
    shape = AttentionShape(1, 1, 1, (16384,), (16384,), False, False, -1, -1)
    plan = launch_plan(shape, "shift", tiles=HopperTiles(80, 128, 128), device=DeviceProps(132))
    with pytest.raises(Unsupported, match="at most 64 co-resident"):
        tables_of(plan.schedule.sequences[0])


def test_requests_the_backend_does_not_run_say_why():
    assert BACKEND.supports(request("descending", 1024, 128, True)) == "needs an sm90 (Hopper) GPU"
    with pytest.raises(ValueError, match="head_dim=32"):
        bwd_tiles(32, True)
    assert BACKEND.tiles(request("shift", 2048, 128, False)) == (80, 128, None)   # the plan's default groups
    assert BACKEND.tiles(request("descending", 2048, 64, True)).group_size is None
