"""The import graph goes one way: API -> config -> plan -> backend -> kernel (docs/DESIGN.md,
"Layers"). No module imports one of a layer above its own, at module level or inside a function."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> installed package (setup.cfg: kernels/ and integrations/ install under dash_plugin.*).
PACKAGES = {"dash_plugin": "dash_plugin", "kernels": "dash_plugin.kernels", "integrations": "dash_plugin.integrations"}
# Highest first. A module belongs to the layer of its longest listed prefix.
LAYERS = [
    ("api", ("dash_plugin", "dash_plugin.api", "dash_plugin.ops", "dash_plugin.integrations", "dash_plugin.bench",
             "dash_plugin.repro", "dash_plugin.schedules.cli", "dash_plugin.schedules.__main__")),
    ("config", ("dash_plugin.config", "dash_plugin.checks")),
    ("plan", ("dash_plugin.dispatch", "dash_plugin.schedules")),
    ("backend", ("dash_plugin.kernels.backends", "dash_plugin.kernels.reference_backend",
                 "dash_plugin.kernels.triton_backend", "dash_plugin.kernels.hopper_backend")),
    ("kernel", ("dash_plugin.kernels",)),
]


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def modules():
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            yield ".".join([package] + parts), is_pkg, path


def imports(name: str, is_pkg: bool, path: Path):
    """Every dash_plugin module `name` imports (absolute or relative, anywhere in the file)."""
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "dash_plugin")
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] != "dash_plugin":
                continue
            for alias in node.names:   # `from pkg import module` imports pkg.module
                sub = f"{target}.{alias.name}"
                yield sub if _is_module(sub) else target


def _is_module(name: str) -> bool:
    return any(name == m for m, _p, _f in modules())


def test_every_module_has_a_layer():
    assert all(layer_of(name) is not None for name, _p, _f in modules())


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for name, is_pkg, path in modules():
        for target in imports(name, is_pkg, path):
            if layer_of(target) < layer_of(name):
                upward.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(upward)


def test_the_checker_sees_upward_imports():
    """The check would notice the old ones: attn_bwd importing the schedule model, auto importing config."""
    assert layer_of("dash_plugin.kernels.attn_bwd") > layer_of("dash_plugin.schedules")
    assert layer_of("dash_plugin.schedules.auto") > layer_of("dash_plugin.config")
    assert layer_of("dash_plugin.kernels.triton_backend") < layer_of("dash_plugin.kernels.attn_bwd")
    found = list(imports("dash_plugin.kernels.attn_bwd", False, ROOT / "kernels" / "attn_bwd.py"))
    assert "dash_plugin.kernels._triton_common" in found
