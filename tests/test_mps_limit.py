"""A limit on the SMs a process may hold (MPS's active-thread percentage): the backends plan for
the SMs the process holds, a cyclic order whose group cannot be co-resident is refused instead of
waiting for ever, and `auto` takes an order without cyclic waits there."""
import types

import pytest
import torch

from dash_plugin import dispatch
from dash_plugin.kernels import backends, hopper_backend
from dash_plugin.kernels.backends import DeviceProps, mps_limited
from dash_plugin.schedules import AttentionShape, MAX_GROUP, launch_plan, registry
from dash_plugin.schedules.plan import ResidencyError

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("percentage, want", [
    (None, 132), ("100", 132), ("50", 66), ("40", 52), ("48.5", 64), (" 25 ", 33), ("0.5", 1),
    ("0", 132), ("150", 132), ("-5", 132), ("abc", 132), ("nan", 132), ("", 132)])
def test_sms_a_process_holds_under_an_active_thread_percentage(percentage, want):
    assert mps_limited(132, percentage) == want


@pytest.fixture
def limited_gpu(monkeypatch):
    """A 132-SM CUDA device seen from a process whose environment sets a 40 % MPS limit."""
    monkeypatch.setenv(backends.MPS_PERCENTAGE, "40")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(backends, "_resident", {})
    hopper_backend._device_props.cache_clear()
    yield
    hopper_backend._device_props.cache_clear()


def test_the_backends_plan_for_the_sms_the_process_holds(limited_gpu):
    from dash_plugin.kernels import triton_backend
    assert backends.resident_sms("cuda:0") == 52
    assert hopper_backend._device_props("cuda:0") == DeviceProps(52, concurrent=True)
    assert triton_backend._device_props.__wrapped__("cuda:0", False) == DeviceProps(52, concurrent=True)


def test_a_cyclic_group_the_process_cannot_hold_is_refused_not_left_waiting():
    causal_8k = AttentionShape(1, 16, 16, (8192,), (8192,), False, True, -1, 0)
    tiles = types.SimpleNamespace(block_m=128, block_n=128, group_size=None)   # 64 KV tiles, one group
    with pytest.raises(ResidencyError, match="groups of 64 programs.*holds 52 at once.*MPS"):
        launch_plan(causal_8k, "arrival", tiles=tiles, device=DeviceProps(52))
    assert launch_plan(causal_8k, "descending", tiles=tiles, device=DeviceProps(52)).group_size == 1
    assert launch_plan(causal_8k, "arrival", tiles=tiles, device=DeviceProps(132)).group_size == 64


@pytest.mark.parametrize("resident, concurrent, device, picks", [
    (52, True, CUDA, {("arrival", True): "descending", ("shift", True): "descending",
                      ("shift", False): "ascending", ("spt", True): "spt", ("descending", False): "descending"}),
    (MAX_GROUP, True, CUDA, {("arrival", True): "arrival", ("shift", False): "shift"}),
    (3, False, CUDA, {("shift", False): "shift"}),                      # one by one: nothing to hold
    (52, True, torch.device("cpu"), {("arrival", True): "arrival"}),   # not a GPU
])
def test_auto_takes_an_order_without_cyclic_waits_where_groups_cannot_be_held(monkeypatch, resident, concurrent,
                                                                             device, picks):
    backend = types.SimpleNamespace(device_props=lambda device: DeviceProps(resident, concurrent))
    monkeypatch.setattr(backends, "get", lambda name: backend)
    for (pick, causal), want in picks.items():
        assert dispatch._held_at_once("hopper", device, pick, causal) == want


def test_the_orders_that_may_wait_cyclically_are_the_ones_named():
    """`auto`'s check reads the registry's list: every built-in order whose plan has groups of
    more than one program at some shape is in it, and no other."""
    tiles = types.SimpleNamespace(block_m=128, block_n=128, group_size=None)
    for name in registry.names():
        groups = {launch_plan(AttentionShape(1, 2, 2, (s,), (s,), False, causal, -1, 0 if causal else -1), name,
                              tiles=tiles, device=DeviceProps(132)).group_size
                  for causal in (True, False) for s in (1024, 8192)}
        assert (max(groups) > 1) == (name in registry.MAY_WAIT_CYCLICALLY), (name, groups)


@pytest.mark.parametrize("resident, want", [(52, "descending"), (132, "arrival")])
def test_a_call_resolves_to_the_order_the_process_can_hold(monkeypatch, resident, want):
    """Through dispatch.resolve, as the API calls it: hdim 128 causal 4k, where `auto` takes
    `arrival` (one group of 32 KV tiles) on a GPU it holds whole."""
    from dash_plugin.kernels import hopper
    monkeypatch.setattr(hopper_backend, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hopper, "available", lambda: True)
    monkeypatch.setattr(hopper_backend, "_device_props", lambda device: DeviceProps(resident))
    q = types.SimpleNamespace(device=CUDA, dtype=torch.bfloat16, shape=(1, 4096, 16, 128))
    runs_on, concrete, _ = dispatch.resolve("auto", "auto", q, q, max_seqlen_q=4096, max_seqlen_k=4096, causal=True)
    assert (runs_on.name, concrete) == ("hopper", want)
