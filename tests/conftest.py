"""Skip ``cuda``-marked tests on machines without a CUDA GPU."""

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
