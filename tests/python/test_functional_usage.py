"""torch.func and autograd's less common entry points over converted models, as users call them:
functional_call with the model's own tensors and with replacements, autograd.grad of some inputs
only, backward twice with retain_graph, module hooks (full backward, forward with kwargs),
parametrizations and activation checkpointing; each against the unconverted model under plain
torch (FP8 tolerances) or a clear error (CPU, FP8 compute, O1 and O2, tensorwise and blockwise)."""

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import fp8amp

LEVELS = ["fp8", "O1", "O2"]
RECIPES = ["tensorwise", "blockwise"]


def _mlp(width: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width), nn.GELU(),
                         nn.Linear(width, width))


def _pair(level: str, recipe: str):
    """The plain model and the same model converted (blockwise needs multiples of 128)."""
    width = 128 if recipe == "blockwise" else 32
    ref, (model, optimizer) = _mlp(width), _convert(_mlp(width), level, recipe)
    assert all(isinstance(model[i], fp8amp.Fp8Linear) for i in (0, 2, 4))
    return ref, model, optimizer, torch.randn(16, width, generator=torch.Generator().manual_seed(1))


def _convert(model, level, recipe="tensorwise"):
    if level == "fp8":
        return fp8amp.convert(model, policy="all", recipe=recipe), None
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level, policy="all",
                             recipe=recipe)


def _real(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize(torch.float32) if hasattr(t, "dequantize") and type(t) not in (torch.Tensor, nn.Parameter) \
        else t.detach().float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _real(a), _real(b)
    return ((a - b).norm() / b.norm()).item()


def _grads(model):
    return [None if p.grad is None else _real(p.grad) for p in model.parameters()]


def _close_grads(got, want, tol=0.2):
    assert [g is None for g in got] == [w is None for w in want]
    for g, w in zip(got, want):
        if w is not None:
            assert torch.equal(g, w) or _rel(g, w) < tol  # (equal: the zeros of an unused input)


def _scaling(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "scaling" in k}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_layer_called_with_nn_linears_keyword_input(level, recipe):
    """nn.Linear.forward names its argument `input`; Fp8Linear's was `x`, so layer(input=x) (and a
    forward pre-hook with_kwargs passing it on) raised "unexpected keyword argument 'input'"."""
    ref, model, _, x = _pair(level, recipe)
    assert _rel(model[0](input=x), ref[0](input=x)) < 0.1
    for m in (ref, model):
        m[2].register_forward_pre_hook(lambda mod, args, kwargs: ((), {"input": args[0] * 2}), with_kwargs=True)
    assert _rel(model(x), ref(x)) < 0.1


def test_a_conv1d_keeps_its_keyword_x():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conv = transformers.pytorch_utils.Conv1D(32, 32)
    layer = fp8amp.Fp8Conv1D.from_conv1d(transformers.pytorch_utils.Conv1D(32, 32))
    with torch.no_grad():
        layer.weight.copy_(conv.weight)
        layer.bias.copy_(conv.bias)
    x = torch.randn(16, 32)
    assert _rel(layer(x=x), conv(x=x)) < 0.1


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_functional_call_with_own_tensors_and_replacements(level, recipe):
    ref, model, _, x = _pair(level, recipe)
    assert torch.equal(functional_call(model, dict(model.named_parameters()), (x,)), model(x))
    assert _rel(functional_call(model, model.state_dict() if level == "fp8" else dict(model.named_parameters()),
                                (x,)), ref(x)) < 0.1
    halved = {k: v.detach().clone().mul_(0.5) for k, v in model.named_parameters()}  # EMA-style copies
    halved_ref = {k: v.detach().clone().mul_(0.5) for k, v in ref.named_parameters()}
    assert _rel(functional_call(model, halved, (x,)), functional_call(ref, halved_ref, (x,))) < 0.1
    if level == "fp8":  # plain replacements, with gradients to them (first-order meta-learning)
        fast = {k: v.detach().clone().requires_grad_() for k, v in ref.named_parameters()}
        fast_ref = {k: v.detach().clone().requires_grad_() for k, v in ref.named_parameters()}
        functional_call(model, fast, (x,)).square().mean().backward()
        functional_call(ref, fast_ref, (x,)).square().mean().backward()
        _close_grads([fast[k].grad for k in fast], [fast_ref[k].grad for k in fast_ref])
        assert all(p.grad is None for p in model.parameters())
    else:  # documented: the masters or nothing
        plain = {k: _real(v) for k, v in model.named_parameters()}
        with pytest.raises(RuntimeError, match=r"functional_call given a plain tensor"):
            functional_call(model, plain, (x,))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_twice_with_retain_graph_sums_and_records_once(level, recipe):
    ref, model, _, x = _pair(level, recipe)
    _, once, _, _ = _pair(level, recipe)
    for m in (ref, model):
        loss = m(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    once(x).square().mean().backward()
    _close_grads(_grads(model), _grads(ref))
    assert _scaling(model).keys() == _scaling(once).keys()
    assert all(torch.equal(a, b) for a, b in zip(_scaling(model).values(), _scaling(once).values()))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_autograd_grad_of_some_inputs_only(level, recipe):
    ref, model, _, x = _pair(level, recipe)
    got, want = [], []
    for m, out in ((ref, want), (model, got)):
        xi = x.clone().requires_grad_()
        out.append(torch.autograd.grad(m(xi).square().mean(), xi)[0])
        out.extend(torch.autograd.grad(m(x).square().mean(), [m[0].weight, m[2].bias]))
        extra = torch.zeros(3, requires_grad=True)
        out.extend(torch.autograd.grad(m(x).sum(), [m[4].weight, extra], allow_unused=True, materialize_grads=True))
        m(x).square().mean().backward(inputs=[m[2].weight])
    _close_grads(got, want)
    _close_grads(_grads(model), _grads(ref))
    assert [p.grad is None for p in model.parameters()] == [True, True, False, True, True, True]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_module_hooks_see_and_change_what_nn_linears_do(level, recipe):
    ref, model, _, x = _pair(level, recipe)
    seen = {}
    for name, m in (("ref", ref), ("fp8", model)):
        m[2].register_full_backward_hook(
            lambda mod, gin, gout, name=name: seen.__setitem__(name, (gin[0].clone(), gout[0].clone())))
        m[4].register_full_backward_pre_hook(lambda mod, gout: (gout[0] * 3,))
        m[0].register_forward_hook(lambda mod, args, kwargs, out: out + 1, with_kwargs=True)
        m(x).square().mean().backward()
    assert _rel(seen["fp8"][0], seen["ref"][0]) < 0.2 and _rel(seen["fp8"][1], seen["ref"][1]) < 0.2
    _close_grads(_grads(model), _grads(ref))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("parametrization", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrizations_before_and_after_converting(level, when, parametrization):
    apply = getattr(torch.nn.utils.parametrizations, parametrization)
    ref, model = _mlp(32), _mlp(32)
    torch.manual_seed(3)
    apply(ref[2])
    if when == "before":
        torch.manual_seed(3)
        apply(model[2])
    model, _ = _convert(model, level)
    if when == "after":
        torch.manual_seed(3)
        apply(model[2])
    x = torch.randn(16, 32)
    assert _rel(model(x), ref(x)) < 0.1
    model(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    _close_grads(_grads(model), _grads(ref))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_is_bit_for_bit(level, recipe, use_reentrant):
    _, model, _, x = _pair(level, recipe)
    _, plain, _, _ = _pair(level, recipe)
    _, sequential, _, _ = _pair(level, recipe)
    y = checkpoint(model, x.clone().requires_grad_(), use_reentrant=use_reentrant)
    y.square().mean().backward()
    checkpoint_sequential(sequential, 2, x.clone().requires_grad_(), use_reentrant=use_reentrant).square().mean().backward()
    plain(x).square().mean().backward()
    for m in (model, sequential):
        assert all(torch.equal(_real(a.grad), _real(b.grad)) for a, b in zip(m.parameters(), plain.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(_scaling(m).values(), _scaling(plain).values()))


@pytest.mark.parametrize("level", LEVELS)
def test_batched_grad_outputs_are_refused_by_name(level):
    _, model, _, x = _pair(level, "tensorwise")
    xi = x.clone().requires_grad_()
    y = model(xi)
    with pytest.raises(NotImplementedError, match=r"is_grads_batched=True"):
        torch.autograd.grad(y, xi, torch.randn(2, *y.shape), is_grads_batched=True)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_write_to_the_weights_inside_allow_mutation_on_saved_tensors(level, recipe):
    """Inside torch.autograd.graph.allow_mutation_on_saved_tensors() a weight written between the
    forward and the backward gives the forward's gradients in torch. At O1/O2 (tensorwise) the
    backward made the weight's transpose from the master then, and refused the write, saying that
    nn.Linear raises there."""
    ref, model, _, x = _pair(level, recipe)
    for m in (ref, model):
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            loss = m(x).square().mean()
            with torch.no_grad():
                m[2].weight.mul_(0.5)
            loss.backward()
    _close_grads(_grads(model), _grads(ref))
    assert _rel(model[2].weight, ref[2].weight) < 0.01
