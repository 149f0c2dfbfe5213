"""Adding a schedule touches the registry and a builder only (docs/DESIGN.md, "Adding a schedule").

The toy schedule below is registered here, in the test, and nowhere else: each KV tile visits its
even Q tiles, then its odd ones; dQ adds in KV order (singleton groups). With nothing else changed,
it passes the validity checks, `dash-schedule` draws it, the config switch and the ops accept it,
and the reference and the Triton kernels (in the interpreter) run it to the right gradients.
"""
import os

import pytest
import torch

import dash_plugin
from dash_plugin.schedules import (SequenceSchedule, build_schedule, kernel_tables, ordered_sequence, registry,
                                   sequential_safe, validate_schedule)
from dash_plugin.schedules.cli import main as dash_schedule
from tests.math_attention import math_attention

TOY = "toy-evens-first"


def build_toy(geo, group_size=None) -> SequenceSchedule:
    visits = []
    for j, (lo, hi) in enumerate(geo.kv_range):
        tiles = list(range(lo, hi + 1))
        visits.append((j, [(j, tiles[0::2] + tiles[1::2])]))   # group j: a wait never points forward
    return ordered_sequence(geo, visits, "toy")


@pytest.fixture
def toy():
    spec = registry.register(registry.ScheduleSpec(TOY, "even Q tiles first, then odd ones; dQ adds in KV order",
                                                   True, registry.ORDERED, build_toy))
    yield spec
    registry.unregister(TOY)


def test_toy_is_valid_and_tabled(toy):
    for sq, sk, causal in [(512, 512, True), (448, 640, False), (100, 333, True), (0, 64, False)]:
        s = build_schedule(TOY, seqlens_q=[sq], seqlens_k=[sk], block_m=64, block_n=64, causal=causal)
        validate_schedule(s)
        assert sequential_safe(s.sequences[0]) and s.variants == ("toy",)
    t = kernel_tables(TOY, seqlens_q=[256], seqlens_k=[256], block_m=64, block_n=128, causal=False,
                      window_left=-1, window_right=-1)
    assert t.q_tile[0].tolist() == [[0, 2, 1, 3], [0, 2, 1, 3]]
    assert t.rank[0].tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]   # KV order into every dQ tile


def test_dash_schedule_draws_the_toy(toy, tmp_path, capsys):
    out = tmp_path / "png"
    assert dash_schedule(["--seqlen", "512", "--block-m", "64", "--block-n", "64", "--heads", "2", "--sms", "4",
                          "--causal", "--schedules", f"{TOY},ascending", "--png", str(out)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    toy_row = next(r for r in rows if r and r[0] == TOY)
    assert float(toy_row[1]) > 0 and toy_row[-1] == "toy"
    assert (out / f"{TOY}.png").read_bytes()[:4] == b"\x89PNG"


def _problem():
    g = torch.Generator().manual_seed(3)
    # 96 rows: 6 Q tiles and 3 KV tiles at the interpreter's 16x32 backward tiles
    q = torch.randn(1, 96, 2, 32, generator=g)
    k, v = torch.randn(1, 96, 1, 32, generator=g), torch.randn(1, 96, 1, 32, generator=g)
    return q, k, v, torch.randn(1, 96, 2, 32, generator=g)


def _grads(q, k, v, do, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = dash_plugin.flash_attention(q, k, v, causal=True, **kw)
    return torch.autograd.grad(out, (q, k, v), do)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backends_run_the_toy(toy, backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter runs on machines without CUDA (tests/conftest.py)")
    q, k, v, do = _problem()
    grads = _grads(q, k, v, do, schedule=TOY, backend=backend)
    resolved = dash_plugin.last_resolved()
    assert (resolved.schedule, resolved.concrete_backend) == (TOY, backend)
    q64, k64, v64 = (t[0].double().requires_grad_() for t in (q, k, v))
    out64, _ = math_attention(q64, k64, v64, causal=True)
    exact = [g.unsqueeze(0) for g in torch.autograd.grad(out64, (q64, k64, v64), do[0].double())]
    for name, got, want in zip(("dq", "dk", "dv"), grads, exact):
        assert _rel(got, want) < 1e-5, name
    ascending = _grads(q, k, v, do, schedule="ascending", backend=backend)
    if backend == "reference":   # one fixed order of its own, whatever the schedule
        assert all(torch.equal(a, b) for a, b in zip(grads, ascending))
    else:
        # dQ adds in KV order, as ascending's; dK sums the Q tiles in the toy's visit order
        assert torch.equal(grads[0], ascending[0])
        assert not torch.equal(grads[1], ascending[1])
