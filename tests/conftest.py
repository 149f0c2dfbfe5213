import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GPU tests run on the GPU machine; elsewhere they are reported as skipped, never silently dropped.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
