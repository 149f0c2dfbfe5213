"""The GPU tests' comparison helpers (tests/gpu_oracle.py) on the CPU: each must accept what it
claims to accept and catch what it claims to catch, or the GPU tests built on them prove nothing."""
import pytest
import torch

from tests.gpu_oracle import assert_same_sums, assert_within_bar, same_sums_excess


def partial_sums(dtype, contributions=64, seed=0):
    """fp32 partials of 64 contributors to a (256, 64) tile, like the dQ partials of 64 KV tiles,
    and the sum of all of them, in one order and in another, each rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(contributions, 256, 64, generator=g) / contributions ** 0.5

    def add(order):
        acc = torch.zeros(256, 64)
        for i in order:
            acc = acc + parts[i]
        return acc.to(dtype)

    forward, reverse = list(range(contributions)), list(reversed(range(contributions)))
    shuffled = torch.randperm(contributions, generator=g).tolist()
    return parts, add, forward, reverse, shuffled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_same_sums_in_other_orders_pass(dtype):
    _, add, forward, reverse, shuffled = partial_sums(dtype)
    a = add(forward)
    for other in (reverse, shuffled):
        b = add(other)
        assert not torch.equal(a, b)   # the orders do round differently somewhere
        assert same_sums_excess(a, b) <= 1
        assert_same_sums("dq", a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_lost_or_doubled_contribution_is_caught(dtype):
    parts, add, forward, _, shuffled = partial_sums(dtype)
    a = add(forward)
    lost = add(shuffled[1:])
    doubled = add(shuffled + shuffled[:1])
    for wrong in (lost, doubled):
        assert same_sums_excess(a, wrong) > 5
        with pytest.raises(AssertionError, match="dq: differs by"):
            assert_same_sums("dq", a, wrong)
    # one element of one contribution lost still shows
    one = a.clone()
    one[17, 5] = (one[17, 5].float() - parts[3, 17, 5]).to(dtype)
    assert same_sums_excess(a, one) > 5


def test_same_sums_refuses_mismatched_tensors():
    a = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):
        same_sums_excess(a, a.half())
    with pytest.raises(AssertionError):
        same_sums_excess(a, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="NaN"):
        same_sums_excess(a, torch.full((4,), float("nan"), dtype=torch.bfloat16))


def test_within_bar_holds_its_bar_and_refuses_a_non_bar():
    want = torch.randn(100, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rounded = want.to(torch.bfloat16)              # bf16 rounding alone: rel error about 1.5e-3
    err = ((rounded.double() - want).norm() / want.norm()).item()
    assert 5e-4 < err < 3e-3
    assert_within_bar("out", rounded, want, bar=err / 2)       # exactly at twice the bar
    with pytest.raises(AssertionError, match="out: error"):
        assert_within_bar("out", rounded, want, bar=err / 2.01)
    with pytest.raises(AssertionError, match="no bar"):
        assert_within_bar("out", rounded, want, bar=0.0)
    with pytest.raises(AssertionError, match="NaN"):
        assert_within_bar("out", torch.full((100,), float("nan")), want, bar=1e-3)
    # the result takes the oracle's shape (dense (B, S, H, D) against packed (B * S, H, D))
    assert_within_bar("out", rounded.view(2, 50), want, bar=err / 2)
