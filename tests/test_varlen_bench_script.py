"""scripts/gpu_varlen_bench.py's host-side pieces, on the CPU: the FLOPs it divides by count the
visible pairs of the mask exactly, the documents fill the token budget, and the interleaved
timing rounds keep failing columns apart."""
import sys

import pytest
import torch

from dash_plugin.kernels.reference import visible_mask
from tests.script_modules import load_script_with_siblings


@pytest.fixture(scope="module")
def bench():
    return load_script_with_siblings("gpu_varlen_bench")


@pytest.mark.parametrize("sq, sk", [(7, 7), (5, 9), (9, 5), (1, 4), (4, 1)])
@pytest.mark.parametrize("left, right", [(-1, -1), (-1, 0), (2, 0), (1, 3), (-1, 2), (0, 0)])
def test_visible_pairs_count_the_mask(bench, sq, sk, left, right):
    ok = visible_mask(torch.arange(sq), torch.arange(sk), sq, sk, left, right)   # bottom-right aligned
    assert bench.visible_pairs(sq, sk, left, right) == int(ok.sum())


def test_documents_fill_the_token_budget_within_their_range(bench):
    lens = bench.doc_lengths(256, 4096, seed=0)
    assert sum(lens) == bench.TOKENS and all(0 < n <= 4096 for n in lens)
    assert all(n >= 256 for n in lens[:-1])   # only the last one is cut
    assert lens == bench.doc_lengths(256, 4096, seed=0)


def test_rounds_interleave_and_a_failing_column_drops_out(bench, monkeypatch):
    hopper_bwd = sys.modules["gpu_hopper_bwd"]
    calls = []
    monkeypatch.setattr(hopper_bwd, "bench_ms", lambda fn: fn())

    def ok(name, ms):
        return lambda: calls.append(name) or ms

    def broken():
        calls.append("broken")
        raise RuntimeError("no kernel")
    times = hopper_bwd.time_rounds({"a": ok("a", 1.0), "broken": broken, "b": ok("b", 2.0)}, 3)
    assert times == {"a": [1.0, 1.0, 1.0], "broken": None, "b": [2.0, 2.0, 2.0]}
    assert calls == ["a", "broken", "b", "a", "b", "a", "b"]


def test_rounds_record_the_lowest_clock_of_each_when_asked(bench, monkeypatch):
    """gpu_hopper_bwd.time_rounds asks the clock monitor for the window of every round it timed."""
    hopper_bwd = sys.modules["gpu_hopper_bwd"]
    monkeypatch.setattr(hopper_bwd, "bench_ms", lambda fn: fn())

    class Clocks:
        def __init__(self):
            self.windows = []

        def window(self, t0, t1):
            self.windows.append((t0, t1))
            return None if len(self.windows) == 4 else {"sm_mhz_min": 1300 + 10 * len(self.windows)}

    def fails_later():
        fails_later.calls = getattr(fails_later, "calls", 0) + 1
        if fails_later.calls > 1:
            raise RuntimeError("no kernel")
        return 3.0
    lowest, monitor = {}, Clocks()
    times = hopper_bwd.time_rounds({"a": lambda: 1.0, "b": lambda: 2.0, "c": fails_later}, 2, monitor, lowest)
    assert times == {"a": [1.0, 1.0], "b": [2.0, 2.0], "c": None}
    # one window per timed round, in order; a round with no sample records None; a column
    # that failed keeps no clocks
    assert len(monitor.windows) == 5
    assert lowest == {"a": [1310, None], "b": [1320, 1350]}
