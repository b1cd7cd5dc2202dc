"""pytest setup: GPU tests (marker ``gpu``, declared in pyproject.toml) skip cleanly without CUDA.

The tests import the installed fp8amp (its compiled extension lives only in site-packages);
run them from outside the source tree, e.g. ``cd /tmp && python -m pytest /path/to/tests/python``.
"""

import collections

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Every run says why tests skipped, one line a reason with its count (``-rs`` lists them one
    line a test function)."""
    reasons = collections.Counter(
        report.longrepr[2].removeprefix("Skipped: ")
        for report in terminalreporter.stats.get("skipped", []) if isinstance(report.longrepr, tuple))
    if reasons:
        terminalreporter.section("skipped, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d}  {reason}")
