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


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_a_compiled_models_state_dict_loads_into_the_uncompiled_model_and_back(level):
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    torch._dynamo.reset()
    model, opt = converted(level)
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        train_step(compiled, opt, torch.randn(4, 16, 32))
    state = compiled.state_dict()
    assert all(k.startswith("_orig_mod.") for k in state)
    x = torch.randn(4, 16, 32)
    model.eval()
    expected = compiled(x)
    plain, _ = converted(level, seed=1)
    consume_prefix_in_state_dict_if_present(state, "_orig_mod.")
    plain.load_state_dict(state)
    assert torch.equal(plain.eval()(x), expected)
    again, _ = converted(level, seed=2)
    again = torch.compile(again, backend="aot_eager")
    again._orig_mod.load_state_dict(plain.state_dict())
    assert torch.equal(again.eval()(x), expected)


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_initialize_after_compile_trains_as_initialize_before(level):
    """The order users get wrong works: the compiled wrapper recompiles for the converted layers."""
    torch._dynamo.reset()
    reference, ref_opt = converted(level)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(4, 16, 32))  # compiled while plain
    if level == "fp8":
        fp8amp.convert(compiled, policy="all", optimizer=opt)
    else:
        compiled, opt = fp8amp.initialize(compiled, opt, opt_level=level, policy="all")
    for _ in range(3):
        x = torch.randn(4, 16, 32)
        assert torch.equal(train_step(compiled, opt, x), train_step(reference, ref_opt, x))
    assert type(model.fc1.weight) is type(reference.fc1.weight)


@pytest.mark.parametrize("recipe", [None, "blockwise"])
def test_exported_trained_o2_model_equals_eager(recipe):
    model, opt = converted("O2", recipe)
    for _ in range(2):
        train_step(model, opt, torch.randn(4, 16, 32))
    model.eval()
    program = torch.export.export(model, (torch.randn(4, 16, 32),)).module()
    x = torch.randn(4, 16, 32) * 3
    with torch.no_grad():
        assert torch.equal(program(x), model(x))


def test_a_converted_gpt_compiles_without_graph_breaks():
    from fp8amp.testing import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_head=2, d_model=32))
    gpt, _ = fp8amp.initialize(gpt, torch.optim.AdamW(gpt.parameters()), opt_level="O2", policy="all")
    idx = torch.randint(0, 64, (2, 32))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(gpt)(idx, idx)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_dynamic_batch_and_sequence_compile_a_bounded_number_of_graphs():
    """mark_dynamic on batch and sequence: token counts off the multiple of 16 add one graph (the
    padded branch), not one a shape."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model, opt = converted("O2")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    for b, t in [(2, 16), (3, 16), (4, 24), (5, 7), (6, 48), (2, 100), (3, 5), (7, 33)]:
        x = torch.randn(b, t, 32)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(x, 1)
        train_step(compiled, opt, x)
    assert counter.frame_count <= 3
