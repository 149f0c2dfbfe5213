"""The schedule registry: its entries, its checks, and the places that must agree with it (the
config switch, the docs tables)."""
import re
from pathlib import Path

import pytest

import dash_plugin
from dash_plugin.schedules import build_schedule, registry
from dash_plugin.schedules.builders import build_ascending

ROOT = Path(__file__).resolve().parent.parent


def test_builtin_entries():
    assert registry.names() == ("atomic", "ascending", "spt", "descending", "shift", "arrival", "split")
    assert registry.names(deterministic=False) == ("atomic",)
    modes = {s.name: s.kernel_mode for s in registry.specs()}
    assert modes == {"atomic": "atomic", "ascending": "ordered", "spt": "ordered", "descending": "ordered",
                     "shift": "ordered", "arrival": "ordered", "split": "split"}
    assert [s.name for s in registry.specs() if s.ordered] == ["ascending", "spt", "descending", "shift", "arrival"]
    assert [s.name for s in registry.specs() if s.reduction_free] == ["split"]
    assert {s.name: s.backends for s in registry.specs()} == {
        **{n: ("reference", "triton", "hopper")
           for n in ("atomic", "ascending", "spt", "descending", "shift", "arrival")},
        "split": ("reference", "triton")}
    assert dash_plugin.SCHEDULES == {"auto": registry.AUTO_DESCRIPTION,
                                     **{s.name: s.description for s in registry.specs()}}
    assert dash_plugin.DETERMINISTIC_SCHEDULES == registry.names(deterministic=True)


@pytest.mark.parametrize("spec, match", [
    (dict(name="shift"), "taken"),
    (dict(name="auto"), "reserved"),
    (dict(kernel_mode="fast"), "kernel_mode='fast'; allowed: atomic, ordered, split"),
    (dict(deterministic=False), "contradicts kernel_mode='ordered'"),
])
def test_register_refuses_bad_entries(spec, match):
    fields = dict(name="new", description="x", deterministic=True, kernel_mode=registry.ORDERED,
                  build=build_ascending)
    before = {s.name: s for s in registry.specs()}
    with pytest.raises(ValueError, match=match):
        registry.register(registry.ScheduleSpec(**dict(fields, **spec)))
    assert {s.name: s for s in registry.specs()} == before   # nothing added, nothing replaced


def test_check_call_is_the_one_check_of_a_concrete_schedule():
    assert registry.check_call("split", True, where="").name == "split"
    assert registry.check_call("atomic", False, where="").name == "atomic"
    with pytest.raises(ValueError, match="^op: schedule='auto'; a concrete schedule is needed"):
        registry.check_call("auto", True, where="op: ")
    with pytest.raises(ValueError, match="schedule='atomic' is not deterministic but deterministic=True"):
        registry.check_call("atomic", True, where="")
    with pytest.raises(ValueError, match="schedule must be one of atomic, ascending"):
        build_schedule("fast", seqlens_q=[8], seqlens_k=[8], block_m=4, block_n=4)


def _table(path: Path):
    """{name: (deterministic, description)} of a markdown table whose rows start with | `name` |."""
    rows = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\| `([\w-]+)` \| (\**(?:yes|no)\**) \| (?:(\w+) \| )?(.+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip("*") == "yes", m.group(3), m.group(4))
    return rows


def test_docs_tables_list_the_registry():
    readme = _table(ROOT / "README.md")
    assert readme.pop("auto") == (True, None, registry.AUTO_DESCRIPTION)
    assert readme == {s.name: (s.deterministic, None, s.description) for s in registry.specs()}
    design = _table(ROOT / "docs" / "DESIGN.md")
    assert design == {s.name: (s.deterministic, s.kernel_mode, s.description) for s in registry.specs()}
