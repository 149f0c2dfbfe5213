"""Fewer SMs than a cyclic group (under MPS, CUDA reports the SMs the process's active-thread
percentage leaves): a cyclic order whose group cannot be co-resident is refused instead of
waiting for ever, and `auto` takes an order without cyclic waits there."""
import types

import pytest
import torch

from dash_plugin import dispatch
from dash_plugin.kernels import backends, hopper_backend
from dash_plugin.kernels.backends import DeviceProps
from dash_plugin.schedules import AttentionShape, MAX_GROUP, launch_plan, registry
from dash_plugin.schedules.plan import ResidencyError

CUDA = torch.device("cuda", 0)


def test_the_backends_plan_for_the_sms_cuda_reports(monkeypatch):
    """Under MPS, CUDA reports the SMs the active-thread percentage leaves as the device's SM count
    (at 40 %, about two fifths of an H100's 132); both backends take it as it is, with the variable
    set or not (reading it again would apply the limit twice)."""
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40")
    from dash_plugin.kernels import triton_backend
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=54))
    hopper_backend._device_props.cache_clear()
    try:
        assert hopper_backend._device_props("cuda:0") == DeviceProps(54, concurrent=True)
    finally:
        hopper_backend._device_props.cache_clear()
    assert triton_backend._device_props.__wrapped__("cuda:0", False) == DeviceProps(54, concurrent=True)


def test_a_cyclic_group_the_process_cannot_hold_is_refused_not_left_waiting():
    causal_8k = AttentionShape(1, 16, 16, (8192,), (8192,), False, True, -1, 0)
    tiles = types.SimpleNamespace(block_m=128, block_n=128, group_size=None)   # 64 KV tiles, one group
    with pytest.raises(ResidencyError, match="groups of 64 programs.*holds 54 at once.*MPS"):
        launch_plan(causal_8k, "arrival", tiles=tiles, device=DeviceProps(54))
    assert launch_plan(causal_8k, "descending", tiles=tiles, device=DeviceProps(54)).group_size == 1
    assert launch_plan(causal_8k, "arrival", tiles=tiles, device=DeviceProps(132)).group_size == 64


@pytest.mark.parametrize("resident, concurrent, device, picks", [
    (54, True, CUDA, {("arrival", True): "descending", ("shift", True): "descending",
                      ("shift", False): "ascending", ("spt", True): "spt", ("descending", False): "descending"}),
    (MAX_GROUP, True, CUDA, {("arrival", True): "arrival", ("shift", False): "shift"}),
    (3, False, CUDA, {("shift", False): "shift"}),                      # one by one: nothing to hold
    (54, True, torch.device("cpu"), {("arrival", True): "arrival"}),   # not a GPU
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


@pytest.mark.parametrize("resident, want", [(54, "descending"), (132, "arrival")])
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


def test_a_backend_that_does_not_import_is_passed_over_as_before(monkeypatch):
    """The check asks the backend for its device; one that does not import has none, and `auto`
    passes it over as it did before the check (it raised AttributeError once)."""
    real_get = backends.get
    monkeypatch.setattr(backends, "get", lambda name: backends._Unavailable(name, "does not import (test)")
                        if name == "hopper" else real_get(name))
    q = types.SimpleNamespace(device=CUDA, dtype=torch.bfloat16, shape=(1, 4096, 16, 128))
    for causal in (True, False):
        runs_on, _, passed_over = dispatch.resolve("auto", "auto", q, q, max_seqlen_q=4096, max_seqlen_k=4096,
                                                   causal=causal)
        assert runs_on.name != "hopper" and passed_over == ("hopper: does not import (test)",)


@pytest.mark.parametrize("resident, ran, want", [
    (54, "descending", "descending instead of the table's arrival, whose cyclic groups need up to 64 programs at "
                       "once where this device holds 54 (under MPS, the process's share)"),
    (132, "arrival", ""),
])
def test_describe_says_why_auto_ran_another_order(monkeypatch, resident, ran, want):
    """last_resolved().describe() names the trade: 'auto -> descending' alone would read as the
    table's choice."""
    monkeypatch.setattr(hopper_backend, "_device_props", lambda device: DeviceProps(resident))
    q = types.SimpleNamespace(device=CUDA, dtype=torch.bfloat16, shape=(1, 4096, 16, 128))
    assert dispatch.auto_trade_note("hopper", ran, q, max_seqlen_q=4096, max_seqlen_k=4096, causal=True) == want


def test_a_named_order_is_no_trade(monkeypatch):
    """The API asks for the note only where the call asked for `auto`; a named `descending` that
    the table would not pick is the caller's choice."""
    from dash_plugin import api
    seen = []
    monkeypatch.setattr(dispatch, "auto_trade_note", lambda *a, **kw: seen.append(a) or "traded")
    monkeypatch.setattr(dispatch, "plan_variants", lambda *a, **kw: ())
    meta = ((1, 64, 2, 16), torch.float32, torch.device("cpu"))
    args = (meta, meta, None, None, 64, 64, True, -1, 0, 0.0, 0.0)
    assert api._plan_fallback("reference", "descending", "descending", *args) == ""
    assert api._plan_fallback("reference", "auto", "descending", *args) == "traded" and len(seen) == 1
