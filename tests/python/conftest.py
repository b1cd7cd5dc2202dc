"""pytest setup: GPU tests (marker ``gpu``, declared in pyproject.toml) skip cleanly without CUDA.

The tests import the installed fp8amp (its compiled extension lives only in site-packages);
run them from outside the source tree, e.g. ``cd /tmp && python -m pytest /path/to/tests/python``.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
