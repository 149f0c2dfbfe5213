"""The Hopper backend's plan, on the CPU: per-KV-tile visit lists and ranks taken from the
launch plan, the launch-order rule that keeps a non-persistent grid deadlock-free, the closed
form the kernel computes instead of reading tables, and the request filter."""
import pytest
import torch

from dash_plugin.kernels.backends import DeviceProps, Request
from dash_plugin.kernels.hopper import (RESIDENT_SLOTS, Unsupported, VisitTables, bwd_tiles,
                                        check_waits_follow_launch, cyclic_group_size,
                                        heads_per_l2_section, tables_of)
from dash_plugin.kernels.hopper_backend import BACKEND
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


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (True, False))
def test_closed_forms_equal_the_tables(d, causal):
    """The kernel walks ascending/spt without tables: Q tiles lo..hi ascending, rank = KV index
    (ascending launch) or last visible KV tile of the row minus it (spt). Same numbers as the plan."""
    for n in SEQLENS:
        _, geo = visible_pairs(n, d, causal)
        for schedule, descending in (("ascending", False), ("spt", True)):
            t = plan_tables(schedule, seqlen=n, head_dim=d, causal=causal)
            assert t.closed_form
            assert t.kv_descending == (descending and geo.num_kv_tiles > 1)  # one tile: no direction
            for kv in range(geo.num_kv_tiles):
                lo, hi = geo.kv_range[kv]
                assert t.q_tile[kv, :t.count[kv]].tolist() == list(range(lo, hi + 1))
                want = [geo.q_range[m][1] - kv if t.kv_descending else kv for m in range(lo, hi + 1)]
                assert t.rank[kv, :t.count[kv]].tolist() == want
        desc = plan_tables("descending", seqlen=n, head_dim=d, causal=causal)
        assert desc.closed_form == (max(desc.count.tolist()) <= 1) and not desc.kv_descending
        lo, hi = geo.kv_range[0]
        assert desc.q_tile[0, :desc.count[0]].tolist() == list(range(hi, lo - 1, -1))


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
    """A shift group's CTAs span (G-1) x swizzle + 1 launch slots: never more than RESIDENT_SLOTS,
    and the group depends on the shape only."""
    sw = heads_per_l2_section(seqlen, d, 2)
    g = cyclic_group_size(seqlen, d, 2)
    assert sw & (sw - 1) == 0 and g >= 1
    assert (g - 1) * sw + 1 <= RESIDENT_SLOTS
    t = plan_tables("shift", seqlen=seqlen, head_dim=d, causal=False)
    assert t.group_size <= g


def test_requests_the_backend_does_not_run_say_why():
    assert BACKEND.supports(request("descending", 1024, 128, True)) == "needs an sm90 (Hopper) GPU"
    with pytest.raises(ValueError, match="head_dim=32"):
        bwd_tiles(32, True)
    assert BACKEND.tiles(request("shift", 2048, 128, False)) == (80, 128, cyclic_group_size(2048, 128, 2))
    assert BACKEND.tiles(request("descending", 2048, 64, True)).group_size is None
