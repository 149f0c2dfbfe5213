"""Kernel tables: layout per docs/INTERNALS.md, equal to the builder's schedule, cached, checked input."""
import pytest
import torch

from dash_plugin.schedules import KernelTables, build_schedule, kernel_tables, registry
from dash_plugin.schedules.validity import validate_schedule


def _kw(**over):
    kw = dict(seqlens_q=[512], seqlens_k=[512], block_m=64, block_n=128, causal=True,
              window_left=-1, window_right=-1)
    kw.update(over)
    return kw


def test_full_shift_4x4_matches_notes():
    t = kernel_tables("shift", **_kw(seqlens_q=[256], seqlens_k=[256], block_m=64, block_n=64,
                                     causal=False))
    assert t.num_workers.tolist() == [4]
    assert t.q_tile[0].tolist() == [[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2]]
    # dQ0 addition order kv0, kv3, kv2, kv1 (the DASH paper's 4x4 cyclic shift): rank of kv1/kv2/kv3 at q0
    ranks_q0 = {w: t.rank[0, w][t.q_tile[0, w] == 0].item() for w in range(4)}
    assert ranks_q0 == {0: 0, 1: 3, 2: 2, 3: 1}
    assert t.num_contrib.tolist() == [[4, 4, 4, 4]]
    assert t.seg_kv[0, :, 1].tolist() == [-1] * 4
    assert t.seg_end[0].tolist() == [[4, 4]] * 4


def test_causal_symmetric_shift_n8_matches_notes():
    t = kernel_tables("shift", **_kw(block_m=64, block_n=64))
    assert t.variants == ("shift-symmetric",)
    assert t.seg_kv[0].tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert t.q_tile[0, 0].tolist() == [3, 4, 5, 6, 7, 0, 1, 2, 7]
    assert t.q_tile[0, 3].tolist() == [6, 7, 3, 4, 5, 7, 6, 5, 4]
    assert t.seg_end[0].tolist() == [[8, 9], [7, 9], [6, 9], [5, 9]]
    # dQ4 order from the notes: kv0 rank 1, kv1 rank 0, kv2 rank 3, kv3 rank 2, kv4 rank 4
    got = {}
    for w in range(4):
        for s in range(t.seg_end[0, w, 1]):
            if t.q_tile[0, w, s] == 4:
                kv = t.seg_kv[0, w, 0 if s < t.seg_end[0, w, 0] else 1].item()
                got[kv] = t.rank[0, w, s].item()
    assert got == {0: 1, 1: 0, 2: 3, 3: 2, 4: 4}


@pytest.mark.parametrize("schedule", [s.name for s in registry.specs() if s.ordered])
def test_tables_equal_builder(schedule):
    kw = _kw(seqlens_q=[300, 0, 513, 128], seqlens_k=[300, 77, 700, 128], block_m=64,
             block_n=128, causal=False, window_left=100, window_right=20)
    t = kernel_tables(schedule, **kw)
    sched = build_schedule(schedule, **kw)
    validate_schedule(sched)
    assert isinstance(t, KernelTables)
    for x in (t.num_workers, t.seg_kv, t.seg_end, t.q_tile, t.rank, t.num_contrib):
        assert x.dtype == torch.int32 and x.device.type == "cpu"
    B, W, S = t.q_tile.shape
    assert B == 4 and t.seg_kv.shape == (B, W, 2) and t.rank.shape == (B, W, S)
    assert t.num_contrib.shape == (B, max(1, max(s.geometry.num_q_tiles for s in sched.sequences)))
    for b, seq in enumerate(sched.sequences):
        assert t.num_workers[b] == len(seq.workers)
        for w, worker in enumerate(seq.workers):
            steps = worker.steps
            n = len(steps)
            assert t.q_tile[b, w, :n].tolist() == [q for _k, q, _r in steps]
            assert t.rank[b, w, :n].tolist() == [r for _k, _q, r in steps]
            assert (t.q_tile[b, w, n:] == -1).all() and (t.rank[b, w, n:] == -1).all()
            assert t.seg_end[b, w, 1] == n
            segs = worker.segments   # which KV tile each segment owns, and where it ends
            assert t.seg_kv[b, w, :len(segs)].tolist() == [seg.kv for seg in segs]
            ends = [sum(len(x.q_tiles) for x in segs[:i + 1]) for i in range(len(segs))]
            assert t.seg_end[b, w, :len(segs)].tolist() == ends
        for w in range(len(seq.workers), W):
            assert t.seg_kv[b, w].tolist() == [-1, -1]
        for i, (lo, hi) in enumerate(seq.geometry.q_range):
            assert t.num_contrib[b, i] == max(0, hi - lo + 1)
    # sequence 1 has no queries: its KV tiles get zero-step workers, dK/dV = 0
    assert t.num_workers[1] == 1 and t.seg_end[1, 0].tolist() == [0, 0]
    assert t.num_contrib[1].tolist() == [0] * t.num_contrib.shape[1]


def test_tables_cached_and_lists_or_tuples():
    a = kernel_tables("descending", **_kw())
    b = kernel_tables("descending", **_kw(seqlens_q=(512,), seqlens_k=(512,)))
    assert a is b
    c = kernel_tables("descending", **_kw(seqlens_q=[640], seqlens_k=[640]))
    assert c is not a


@pytest.mark.parametrize("bad, match", [
    (dict(schedule="auto"), "schedule must be one of"),
    (dict(schedule="atomic"), "needs no tables"),
    (dict(schedule="split"), "needs no tables"),
    (dict(block_m=0), "block_m must be >= 1, got 0"),
    (dict(block_n=64.0), "block_n must be an int"),
    (dict(seqlens_q=[512, 3]), "equal length"),
    (dict(seqlens_q=[-1]), r"seqlens_q\[0\] must be >= 0"),
    (dict(seqlens_q=512), "must be lists"),
    (dict(window_right=5), "causal=True needs window_right"),
    (dict(group_size=0), "group_size must be >= 1"),
])
def test_bad_input(bad, match):
    kw = _kw()
    schedule = bad.pop("schedule", "shift")
    kw.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        kernel_tables(schedule, **kw)
