"""conversion_report, numerics_report and convert's policy options as users use them: shared and
aliased layers, options of the wrong kind, the reports' names against the model's own
(`named_modules`). CPU."""

import pytest
import torch
from torch import nn

import fp8amp


class Aliased(nn.Module):
    """Linears reachable under two names: their own in ``blocks`` and an alias set on the root
    (``self.proj = self.blocks[0]``, as models do for a layer they use apart)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        self.proj = self.blocks[0]
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        return self.head(self.proj(self.blocks(x)))


def test_an_aliased_linear_is_judged_and_reported_under_its_first_name():
    """A Linear also set as an attribute of the root was passed to module_filter_fn and reported
    under the alias ("proj"), not under the name named_modules / numerics_report give it
    ("blocks.0"): a filter on "blocks." kept the layer silently."""
    model = Aliased()
    seen = []
    fp8amp.convert(model, policy="all", module_filter_fn=lambda m, fqn: seen.append(fqn) or fqn != "head")
    first_names = [name for name, m in model.named_modules() if isinstance(m, fp8amp.Fp8Linear)]
    assert seen == ["blocks.0", "blocks.2", "head"]
    assert [d.name for d in fp8amp.conversion_report(model).decisions] == ["blocks.0", "blocks.2", "head"]
    assert first_names == ["blocks.0", "blocks.2"] and model.proj is model.blocks[0]

    model = fp8amp.convert(Aliased(), policy="all", module_filter_fn=lambda m, fqn: fqn.startswith("blocks."))
    assert type(model.blocks[0]) is fp8amp.Fp8Linear and model.proj is model.blocks[0]
    assert type(model.head) is nn.Linear
    with fp8amp.numerics_report(model) as report:
        model(torch.randn(4, 32)).sum().backward()
    assert {r.layer for r in report.rows} == {d.name for d in fp8amp.conversion_report(model).converted}
