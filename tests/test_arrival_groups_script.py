"""scripts/gpu_arrival_groups.py's host side, on the CPU: the tables it times for each group size
are `arrival` launched in groups of that size, top group first (groups of one: `spt`'s launch),
with every wait on a tile launched earlier or in its own group."""
import pytest

from dash_plugin.kernels.backends import DeviceProps
from dash_plugin.kernels.hopper.visit_tables import launch_slots
from tests.script_modules import load_script_with_siblings


@pytest.fixture(scope="module")
def script():
    return load_script_with_siblings("gpu_arrival_groups")


@pytest.mark.parametrize("d, s", [(128, 8192), (128, 16384), (192, 8192)])
@pytest.mark.parametrize("group", [64, 32, 16, 1])
def test_tables_run_arrival_in_the_asked_groups(script, monkeypatch, d, s, group):
    monkeypatch.setattr(script.BACKEND, "device_props", lambda device: DeviceProps(132))
    tables = script.group_tables(1, s, 16, 16, d, group)   # checks the waits against the launch itself
    n = tables.count.shape[0]
    assert tables.variant == "arrival"
    if group == 1:   # arrival in groups of one is spt: ascending visits, KV tiles launched from the last down
        assert tables.kv_descending and tables.visit == "ascending"
        return
    assert tables.group_size == min(group, n) and tables.top_group_first == (n > group)
    assert tables.visit == "arrival"
    slots = launch_slots(tables, n)
    assert sorted(slots) == list(range(n)) and slots[:group] == list(range(max(n - group, 0), n))[:group]


@pytest.mark.parametrize("group", [64, 32, 4])
def test_shift_tables_run_the_pairs_in_the_asked_groups(script, monkeypatch, group):
    monkeypatch.setattr(script.BACKEND, "device_props", lambda device: DeviceProps(132))
    tables = script.group_tables(1, 16384, 16, 16, 128, group, "shift")   # 128 KV tiles, 64 pairs
    assert tables.variant == "shift-symmetric" and tables.paired and tables.visit == "pairs"
    assert tables.group_size == group
