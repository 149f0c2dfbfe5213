"""What an install pulls in: the CPU path runs without Triton, which is an extra (gpu, and dev for
the tests), not a requirement (about 1 GB that a CPU-only install never imports); and what a plain
(not editable) install carries: the training script dash-repro runs."""
import configparser
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON = 'triton>=3.6; platform_system == "Linux" and platform_machine == "x86_64"'


def _lines(value):
    return [line.strip() for line in value.splitlines() if line.strip()]


def test_triton_is_an_extra_not_a_requirement():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert not [r for r in _lines(cfg["options"]["install_requires"]) if r.startswith("triton")]
    extras = cfg["options.extras_require"]
    assert TRITON in _lines(extras["gpu"])
    assert TRITON in _lines(extras["dev"])   # make test installs .[dev]: the interpreter tests need it


def test_the_cpu_path_never_imports_triton():
    """Training a tiny Hugging Face model with attn_implementation="dash" on the CPU, with every
    import of triton failing: none of our code asks for it (an import it guards with try/except
    would be swallowed, so the finder records who asked)."""
    script = textwrap.dedent("""
        import os
        import sys
        import traceback

        import importlib.util
        ROOT = os.path.dirname(os.path.dirname(os.path.abspath(importlib.util.find_spec("dash_plugin").origin)))
        OURS = tuple(os.path.join(ROOT, d) + os.sep for d in ("dash_plugin", "kernels", "integrations"))
        asked = []

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    # the frame that imports: the innermost one outside the import machinery and this finder
                    importer = [f for f in traceback.extract_stack()[:-1]
                                if not f.filename.startswith("<frozen") and "importlib" not in f.filename][-1]
                    if os.path.abspath(importer.filename).startswith(OURS):
                        asked.append((name, f"{importer.filename}:{importer.lineno}"))
                    raise ImportError("triton is not installed")

        sys.meta_path.insert(0, NoTriton())
        import torch
        import transformers
        import dash_plugin

        q = torch.randn(1, 16, 2, 8, requires_grad=True)
        dash_plugin.flash_attention(q, q, q, causal=True).sum().backward()
        cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="dash")
        ids = torch.randint(0, 32, (2, 10))
        model(input_ids=ids, labels=ids).loss.backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()
        assert dash_plugin.last_resolved().concrete_backend == "reference"
        assert not [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
        assert not asked, asked
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_plain_install_carries_the_training_script_dash_repro_runs(tmp_path):
    """`pip install .` (not editable): dash-repro's default training script comes with the package
    (`dash_plugin.examples`), found from a directory outside any checkout."""
    for name in ("setuptools", "wheel"):   # pyproject's build requirements, used here without isolation
        pytest.importorskip(name)
    src = tmp_path / "src"   # a copy: an install builds in the source tree
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for folder in ("dash_plugin", "kernels", "integrations", "examples"):
        shutil.copytree(os.path.join(ROOT, folder), src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    code = "from dash_plugin.repro.cli import find_script; print(find_script())"
    env = {**{k: v for k, v in os.environ.items() if k != "DASH_REPRO_SCRIPT"}, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip()) == site / "dash_plugin" / "examples" / "train_accelerate.py"
