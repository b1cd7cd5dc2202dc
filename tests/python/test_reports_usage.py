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


def two_linears():
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))


@pytest.mark.parametrize("call", ["convert", "initialize"])
@pytest.mark.parametrize("module_filter_fn", [lambda fqn: True, lambda module, fqn, extra: True,
                                              lambda *, module, fqn: True])
def test_a_module_filter_of_the_wrong_signature_is_named(call, module_filter_fn):
    """A filter taking other arguments than (module, name) failed with Python's "<lambda>() takes
    1 positional argument but 2 were given", naming neither module_filter_fn nor what it takes."""
    model = two_linears()
    with pytest.raises(TypeError, match=rf"{call}: module_filter_fn must take \(module, fqn\)"):
        if call == "convert":
            fp8amp.convert(model, module_filter_fn=module_filter_fn)
        else:
            fp8amp.initialize(model, None, "O1", module_filter_fn=module_filter_fn)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]  # nothing changed


@pytest.mark.parametrize("answer", [torch.tensor([True, False]), torch.ones(2).numpy()])
def test_a_module_filter_answer_that_is_no_truth_value_is_named(answer):
    """A filter returning a tensor or array of several values raised torch's / numpy's "Boolean
    value of Tensor with more than one value is ambiguous", naming neither the filter nor the layer."""
    model = two_linears()
    with pytest.raises(TypeError, match=r"module_filter_fn \(of fp8amp.convert / fp8amp.initialize\) must return a bool; for '0' it returned"):
        fp8amp.convert(model, module_filter_fn=lambda module, fqn: answer)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]


def test_module_filters_that_work():
    """Any callable of (module, name) whose answer has a truth value: defaults, *args, a
    torch.tensor(False), a bound method; its own error propagates as it is, before any change."""
    assert [type(m) for m in fp8amp.convert(two_linears(), module_filter_fn=lambda *args: args[1] == "1")] == [
        nn.Linear, fp8amp.Fp8Linear]
    assert [type(m) for m in fp8amp.convert(two_linears(), module_filter_fn=lambda m, fqn, x=1: torch.tensor(False))] \
        == [nn.Linear, nn.Linear]
    names = {"0"}
    assert [type(m) for m in fp8amp.convert(two_linears(), module_filter_fn=lambda m, fqn: fqn in names)] == [
        fp8amp.Fp8Linear, nn.Linear]
    model = two_linears()
    with pytest.raises(ZeroDivisionError):
        fp8amp.convert(model, module_filter_fn=lambda m, fqn: 1 / 0)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(policy="none"), ValueError, "policy must be one of 'auto', 'layers', 'all'; got 'none'"),
    (dict(tokens=0), ValueError, "tokens must be >= 1, got 0"),
    (dict(tokens=8.0), TypeError, "tokens must be an int, got float"),
    (dict(compiled="yes"), TypeError, "compiled must be True"),
])
def test_initialize_names_itself_in_its_policy_errors(kwargs, error, words):
    """initialize's policy, tokens and compiled errors said "convert: ...", a function the caller
    never called."""
    model = two_linears()
    with pytest.raises(error, match="^initialize: " + words.replace("(", r"\(")):
        fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2", **kwargs)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]


def test_a_compiled_model_is_filtered_and_reported_under_its_own_names():
    """convert(torch.compile(model)) passed module_filter_fn and reported names with the wrapper's
    "_orig_mod." prefix, which the model itself (where the report is kept) has no module of: a
    filter on the model's own names ("blocks.") converted nothing, silently."""
    model = Aliased()
    compiled = torch.compile(model, backend="eager")
    seen = []
    fp8amp.convert(compiled, policy="all", module_filter_fn=lambda m, fqn: seen.append(fqn) or fqn.startswith("blocks."))
    assert seen == ["blocks.0", "blocks.2", "head"]
    report = fp8amp.conversion_report(model)
    assert report is fp8amp.conversion_report(compiled)
    assert [(d.name, d.converted) for d in report.decisions] == [("blocks.0", True), ("blocks.2", True), ("head", False)]
    assert all(isinstance(model.get_submodule(d.name), fp8amp.Fp8Linear) for d in report.converted)
    with fp8amp.numerics_report(model) as numerics:  # eager: the model itself
        model(torch.randn(4, 32)).sum().backward()
    assert {r.layer for r in numerics.rows} == {d.name for d in report.converted}
    torch.testing.assert_close(compiled(torch.ones(2, 32)), model(torch.ones(2, 32)))


def test_a_model_that_is_one_linear_is_named_in_both_reports():
    """convert(nn.Linear) returns the Fp8Linear itself, whose name is "": conversion_report prints
    it as <model>, numerics_report's table printed an empty layer cell."""
    layer = fp8amp.convert(nn.Linear(32, 32), policy="all")
    assert "  <model> (32->32 +bias" in str(fp8amp.conversion_report(layer))
    with fp8amp.numerics_report(layer) as report:
        layer(torch.randn(4, 32))
    assert [r.layer for r in report.rows] == ["", ""]  # the name named_modules gives it
    assert "| <model> | input |" in str(report) and "| <model> | weight |" in str(report)


@pytest.mark.parametrize("n", [-1, 2.5, True, "3"])
def test_worst_refuses_a_count_that_is_no_non_negative_int(n):
    # worst(-1) sliced as Python does: every row but one, where a count was meant.
    model = fp8amp.convert(nn.Linear(32, 32))
    with fp8amp.numerics_report(model) as report:
        model(torch.randn(4, 32)).sum().backward()
    assert len(report.worst(0)) == 0 and len(report.worst(100)) == len(report.rows)
    with pytest.raises(ValueError, match=r"NumericsReport\.worst: n must be a non-negative int"):
        report.worst(n)
