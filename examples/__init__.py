"""Runnable examples (run them as scripts: `python examples/train_accelerate.py --help`).

Installed as `dash_plugin.examples` too, so that `dash-repro` finds its training script in an
install that is not an editable checkout."""
