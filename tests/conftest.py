import os

import torch

# Without CUDA the Triton kernels run under the interpreter; the variable must be set before
# anything imports triton, so it is set here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

try:   # property tests draw the same examples on every run: CI must not pass or fail by luck
    from hypothesis import settings as _hypothesis_settings
except ImportError:   # the dev extra brings it; without it those modules are not collected anyway
    pass
else:
    _hypothesis_settings.register_profile("dash", derandomize=True, database=None)
    _hypothesis_settings.load_profile("dash")


def pytest_collection_modifyitems(config, items):
    # GPU tests run on the GPU machine; elsewhere they are reported as skipped, never silently dropped.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
