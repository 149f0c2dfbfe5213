"""The launch plan (dash_plugin/schedules/plan.py): what it holds for each kernel mode, the launch
rules it decides (persistent grid, residency, skipped waits, debug waits), its cache, and that the
simulator draws the same plan the kernel runs."""
import dataclasses

import pytest
import torch

from dash_plugin.kernels.backends import DeviceProps
from dash_plugin.schedules import (AttentionShape, LaunchOptions, build_schedule, kernel_tables, launch_order,
                                   launch_plan, simulate, simulate_plan)
from dash_plugin.schedules.plan import ResidencyError


class Tiles:
    def __init__(self, block_m, block_n, group_size=None):
        self.block_m, self.block_n, self.group_size = block_m, block_n, group_size


H100 = DeviceProps(resident_programs=132)
GQA = dict(batch=3, heads_q=8, heads_kv=2)


def shape(sq=512, sk=512, causal=True, varlen=False, **kw):
    kw = dict(GQA, **kw)
    return AttentionShape(seqlens_q=sq if varlen else (sq,), seqlens_k=sk if varlen else (sk,), varlen=varlen,
                          causal=causal, window_left=-1, window_right=0 if causal else -1, **kw)


def test_ordered_plan_holds_the_tables_and_the_launch():
    plan = launch_plan(shape(), "descending", tiles=Tiles(64, 128), device=H100)
    t = kernel_tables("descending", seqlens_q=[512], seqlens_k=[512], block_m=64, block_n=128, causal=True,
                      window_left=-1, window_right=0)
    assert plan.tables is t and plan.mode == "ordered" and plan.schedule.name == "descending"
    assert (plan.block_m, plan.block_n, plan.group_size, plan.slots) == (64, 128, 1, 4)
    assert plan.semaphores == (3, 8, 8)               # (sequences, query heads, dQ tiles)
    assert not plan.persistent and not plan.skip_waits and plan.table_stride == 0
    assert plan.worker_order.tolist() == [[0, 1, 2, 3]]
    assert plan.grid(3) == ((4, 2, 3), 24)
    assert plan.work_items()[:5] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 3), (0, 0, 1, 0)]
    assert len(plan.work_items()) == 24


def test_launch_order_puts_contributors_in_rank_order():
    # tile 0: worker 2 (rank 0) then worker 0 (rank 1); tile 1: worker 1 (rank 0) then worker 2 (rank 1)
    q_tile = torch.tensor([[0], [1], [0]])
    rank = torch.tensor([[1], [0], [0]])
    order = launch_order(3, q_tile, rank)
    assert order.index(2) < order.index(0)
    q_tile = torch.tensor([[0, 1], [1, 0]])
    rank = torch.tensor([[0, 1], [0, 1]])   # cyclic: 0 waits on 1 for tile 1, 1 on 0 for tile 0
    assert sorted(launch_order(2, q_tile, rank)) == [0, 1]


def test_cyclic_shift_gets_a_persistent_grid_of_resident_programs():
    full = shape(1024, 1024, causal=False)
    plan = launch_plan(full, "shift", tiles=Tiles(64, 128), device=DeviceProps(resident_programs=10))
    assert plan.schedule.variants == ("shift-cyclic",) and plan.group_size == 8
    assert plan.persistent and plan.grid(3) == ((10,), 48)   # 8 workers x 2 KV heads x 3 sequences
    # the persistent launch order: a topological order of the rank chains, groups kept together
    t = plan.tables
    assert plan.worker_order[0].tolist() == launch_order(8, t.q_tile[0, :8], t.rank[0, :8])
    with pytest.raises(ResidencyError, match="groups of 8 programs.*holds 6"):
        launch_plan(full, "shift", tiles=Tiles(64, 128), device=DeviceProps(resident_programs=6))
    # programs that run one by one (the interpreter): no residency to check, the cyclic waits are skipped
    one_by_one = launch_plan(full, "shift", tiles=Tiles(64, 128), device=DeviceProps(3, concurrent=False))
    assert one_by_one.skip_waits and one_by_one.grid(3) == ((3,), 48)
    plain = launch_plan(full, "shift", tiles=Tiles(64, 128), device=H100,
                        options=LaunchOptions(persistent_cyclic=False))
    assert not plain.persistent and plain.grid(1) == ((8, 2, 1), 16)


def test_a_backend_may_choose_the_cyclic_group_size():
    """e.g. a backend whose scheduler spreads a group's CTAs over more launch slots than one per worker"""
    full = shape(1024, 1024, causal=False)
    plan = launch_plan(full, "shift", tiles=Tiles(64, 128, group_size=3), device=H100)
    assert plan.group_size == 3 and [w.group for w in plan.schedule.sequences[0].workers] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert plan.schedule is build_schedule("shift", seqlens_q=[1024], seqlens_k=[1024], block_m=64, block_n=128,
                                           group_size=3)


def test_unordered_modes_and_backends_without_tiles():
    for name, mode in (("atomic", "atomic"), ("split", "split")):
        plan = launch_plan(shape(sk=300), name, tiles=Tiles(64, 128), device=H100)
        assert (plan.mode, plan.tables, plan.semaphores, plan.slots) == (mode, None, None, 3)
        assert plan.grid(2) == ((3, 2, 2), 12) and plan.schedule.name == name
    ref = launch_plan(shape(), "shift", tiles=None, device=DeviceProps(1, concurrent=False))
    assert ref.schedule is None and ref.tables is None and ref.spec.name == "shift"


def test_varlen_rows_and_shape_from_tensors():
    cu = torch.tensor([0, 100, 100, 356], dtype=torch.int32)
    q, k = torch.zeros(356, 4, 32), torch.zeros(356, 2, 32)
    s = AttentionShape.of(q, k, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert s == AttentionShape(3, 4, 2, (100, 0, 256), (100, 0, 256), True, True, -1, 0)
    assert AttentionShape.of(torch.zeros(2, 7, 4, 32), torch.zeros(2, 9, 1, 32), window_left=3, window_right=2) \
        == AttentionShape(2, 4, 1, (7,), (9,), False, False, 3, 2)
    plan = launch_plan(s, "ascending", tiles=Tiles(16, 32), device=H100)
    assert plan.table_stride == 1 and plan.tables.num_workers.tolist() == [4, 0, 8]
    assert [item[:2] for item in plan.work_items()] == [(0, 0)] * 8 + [(2, 2)] * 16
    with pytest.raises(ValueError, match="must start at 0"):
        AttentionShape.of(q, k, cu_seqlens_q=cu + 1, cu_seqlens_k=cu)


def test_debug_waits_and_persistence_come_from_the_environment(monkeypatch):
    assert LaunchOptions.from_env() == LaunchOptions()
    monkeypatch.setenv("DASH_DEBUG_WAITS", "1")
    monkeypatch.setenv("DASH_DEBUG_WAIT_POLLS", "77")
    monkeypatch.setenv("DASH_PERSISTENT_CYCLIC", "0")
    assert LaunchOptions.from_env() == LaunchOptions(True, 77, False)
    plan = launch_plan(shape(), "ascending", tiles=Tiles(64, 128), device=H100)
    assert (plan.debug_waits, plan.max_polls) == (True, 77)
    split = launch_plan(shape(), "split", tiles=Tiles(64, 128), device=H100)
    assert not split.debug_waits            # nothing waits in the split mode
    monkeypatch.setenv("DASH_DEBUG_WAITS", "maybe")
    with pytest.raises(ValueError, match="DASH_DEBUG_WAITS='maybe'"):
        LaunchOptions.from_env()
    monkeypatch.setenv("DASH_DEBUG_WAITS", "on")
    monkeypatch.setenv("DASH_DEBUG_WAIT_POLLS", "0")
    with pytest.raises(ValueError, match="DASH_DEBUG_WAIT_POLLS='0'"):
        LaunchOptions.from_env()


def test_plans_are_cached_and_copy_their_tables_once_per_device():
    a = launch_plan(shape(), "spt", tiles=Tiles(64, 128), device=H100)
    assert launch_plan(shape(), "spt", tiles=Tiles(64, 128), device=H100) is a
    assert launch_plan(shape(), "spt", tiles=Tiles(64, 64), device=H100) is not a   # ranks follow the tiles
    on_cpu = a.device_tables(torch.device("cpu"))
    assert on_cpu is a.device_tables("cpu") and set(on_cpu) == {"order", "num_workers", "seg_kv", "seg_end",
                                                                  "q_tile", "rank"}
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in on_cpu.values())
    assert torch.equal(on_cpu["order"], a.worker_order.to(torch.int32))
    for name in ("num_workers", "seg_kv", "seg_end", "q_tile", "rank"):   # every table, each from its source
        assert torch.equal(on_cpu[name], getattr(a.tables, name).to(torch.int32)), name
    changed = dataclasses.replace(a, tables=dataclasses.replace(a.tables, rank=a.tables.rank + 1))
    assert torch.equal(changed.device_tables("cpu")["rank"], a.tables.rank + 1)   # a copy has its own cache


def test_the_simulator_draws_the_plan():
    """Acyclic: the kernel's launch is the model's head-major dynamic launch onto the resident
    programs. Cyclic: the persistent grid, item k on program k mod P."""
    s = shape(512, 512, batch=1, heads_q=8, heads_kv=8)
    sched = build_schedule("descending", seqlens_q=[512], seqlens_k=[512], block_m=64, block_n=64, causal=True)
    plan = launch_plan(s, "descending", tiles=Tiles(64, 64), device=DeviceProps(8))
    assert simulate_plan(plan).makespan == simulate(sched, num_heads=8, num_sms=8).makespan == 57.5
    sym = launch_plan(s, "shift", tiles=Tiles(64, 64), device=DeviceProps(8))
    assert sym.persistent and sym.grid(1) == ((8,), 32)
    res = simulate_plan(sym, record=True)
    assert res.makespan == 54.0 and res.num_sms == 8 and res.wait == 0
    assert {b.sm for b in res.blocks if b.unit == 9} == {9 % 8}
    with pytest.raises(ValueError, match="no schedule"):
        simulate_plan(launch_plan(s, "shift", tiles=None, device=DeviceProps(1, concurrent=False)))


def test_the_work_items_follow_the_plans_launch_order():
    """Where the launch order is not the identity (arrival launches a head's groups top group first),
    the kernel's work items take the workers in that order."""
    plan = launch_plan(shape(2048, 2048, batch=1, heads_q=2, heads_kv=2), "arrival", tiles=Tiles(64, 64),
                       device=DeviceProps(132))
    order = plan.worker_order[0].tolist()[:int(plan.tables.num_workers[0])]
    assert order != sorted(order)   # not the identity, or this test could not tell
    items = plan.work_items()
    assert [w for *_, w in items[:len(order)]] == order


@pytest.mark.parametrize("schedule", ("ascending", "descending", "spt", "arrival", "shift"))
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_the_order_does_not_depend_on_the_sm_count(schedule, causal):
    """The addition order of every dQ tile (the tables: Q tile, rank, workers, launch order) is the
    same for a GPU holding 132, 66 or 16 programs at once: the bits cannot depend on the SM count.
    Only the persistent grid's size may."""
    plans = [launch_plan(shape(2048, 2048, causal=causal), schedule, tiles=Tiles(64, 128),
                         device=DeviceProps(resident_programs=n)) for n in (132, 66, 16)]
    first = plans[0]
    assert first.tables is not None
    for plan in plans[1:]:
        assert plan.resident_programs != first.resident_programs
        for name in ("q_tile", "rank", "num_workers"):
            assert torch.equal(getattr(plan.tables, name), getattr(first.tables, name)), name
        assert torch.equal(plan.worker_order, first.worker_order)
        assert plan.work_items() == first.work_items()
