"""torch.compile and torch.export of converted models as users apply them (CPU, aot_eager where the
question is tracing): whole training steps compiled with graph breaks, state dicts across compiled
and uncompiled models, dynamic shapes, the order of compile and initialize."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8amp


class MLP(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.ln = nn.LayerNorm(h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def converted(level, recipe=None, seed=0):
    """A tiny MLP and its AdamW, converted to ``level`` ("fp8": convert with the optimizer)."""
    torch.manual_seed(seed)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if level == "fp8":
        return fp8amp.convert(model, policy="all", recipe=recipe, optimizer=optimizer), optimizer
    return fp8amp.initialize(model, optimizer, opt_level=level, policy="all", recipe=recipe)


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm()).item()


def train_step(model, optimizer, x):
    loss = model(x).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("level, recipe", [("O1", None), ("O2", None), ("O2", "blockwise"), ("fp8", None)])
def test_a_compiled_train_step_with_backward_inside_trains_as_eager(level, recipe):
    """torch.compile of the whole step (fullgraph=False): loss.backward() breaks the graph and runs
    eagerly under Dynamo's frame hook, which then compiled the FP8 gradients' __torch_dispatch__
    frames and crashed on a half-built ScaledTensor ("'ScaledTensor' object has no attribute '_data'")."""
    torch._dynamo.reset()
    eager, eager_opt = converted(level, recipe)
    model, opt = converted(level, recipe)
    step = torch.compile(train_step, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 16, 32, generator=g)
        expected, got = train_step(eager, eager_opt, x), step(model, opt, x)
        assert abs(got.item() - expected.item()) <= 1e-3 * expected.item()
    assert rel(model(x), eager(x)) < 0.1
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert type(p) is type(q) and p.grad is None, name


@pytest.mark.parametrize("how", ["convert", "initialize"])
def test_convert_of_a_compiled_linear_is_refused_before_anything_changes(how):
    """torch.compile(nn.Linear) binds its forward to that Linear: convert replaced the wrapper's
    _orig_mod by an Fp8Linear that no forward ran (the model computed in high precision, and at O2
    the optimizer stepped masters that got no gradient)."""
    linear = nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(linear.parameters())
    compiled = torch.compile(linear, backend="aot_eager")
    with pytest.raises(ValueError, match="torch.compile"):
        if how == "convert":
            fp8amp.convert(compiled, policy="all")
        else:
            fp8amp.initialize(compiled, optimizer, opt_level="O2", policy="all")
    assert type(compiled._orig_mod) is nn.Linear and type(linear.weight) is nn.Parameter
    # What works: convert first, compile what convert returns.
    model = torch.compile(fp8amp.convert(linear, policy="all"), backend="aot_eager")
    x = torch.randn(16, 32)
    assert torch.equal(model(x), model._orig_mod(x)) and not torch.equal(model(x), F.linear(x, linear.weight, linear.bias))


def test_conversion_report_reads_through_torch_compile():
    """conversion_report(torch.compile(model)) was None ("never went through convert"); convert of
    the wrapper reported on the wrapper only, and unconvert of the wrapper left the model's report."""
    model, _ = converted("fp8")
    compiled = torch.compile(model, backend="aot_eager")
    assert fp8amp.conversion_report(compiled) is fp8amp.conversion_report(model) is not None
    fp8amp.unconvert(compiled)
    assert fp8amp.conversion_report(model) is None and type(model.fc1) is nn.Linear
    fp8amp.convert(compiled, policy="all")
    assert fp8amp.conversion_report(model) is fp8amp.conversion_report(compiled)
    assert len(fp8amp.conversion_report(model).converted) == 2


def test_unconvert_of_a_compiled_fp8_linear_is_refused_before_anything_changes():
    """torch.compile(Fp8Linear)'s forward is bound to the Fp8Linear: unconvert put an nn.Linear in
    the wrapper's _orig_mod that no forward ran (the model went on computing in FP8)."""
    layer = fp8amp.convert(nn.Linear(32, 32), policy="all")
    compiled = torch.compile(layer, backend="aot_eager")
    with pytest.raises(ValueError, match="torch.compile"):
        fp8amp.unconvert(compiled)
    assert compiled._orig_mod is layer and fp8amp.conversion_report(layer) is not None
    assert type(torch.compile(fp8amp.unconvert(layer), backend="aot_eager")._orig_mod) is nn.Linear
