"""Load a file of scripts/ as a module, so CPU tests can call its functions (scripts/ is not a
package)."""
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a fresh module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_script_with_siblings(name: str):
    """scripts/<name>.py as a fresh module, with scripts/ importable while it loads (it imports
    another script beside it, e.g. gpu_hopper_bwd)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return load_script(name)
    finally:
        sys.path.remove(str(SCRIPTS))
