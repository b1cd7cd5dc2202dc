"""The tensors users feed converted Linears, at FP8 compute (``convert``), O1 and O2 under the
tensorwise, rowwise and blockwise recipes, against ``nn.Linear`` with plain torch: layouts
(transposed, stepped, expanded, channels-last, ``as_strided``), ranks from 1-D to 5-D, empty and
odd batches, dtypes with and without autocast, and autograd's uses of inputs and outputs
(in-place writes after the forward, reuse, ``retain_graph``, ``autograd.grad``, output views and
hooks). Shapes, dtypes and strides exactly, values within FP8's error. CPU (FP8 emulation)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import fp8amp

LEVELS = ["fp8", "O1", "O2"]
RECIPES = ["tensorwise", "rowwise", "blockwise"]


def real(t):
    return t.dequantize() if isinstance(t, (fp8amp.ScaledTensor, fp8amp.BlockScaledTensor)) else t.detach()


def rel(actual, reference):
    actual, reference = real(actual).double(), real(reference).double()
    return ((actual - reference).norm() / reference.norm()).item()


def pair(level, recipe, optimizer=False):
    """(nn.Linear, the same layer at ``level`` under ``recipe``), and with ``optimizer`` the
    layer's AdamW, updating its scaling."""
    torch.manual_seed(0)
    plain = nn.Linear(128, 128)
    model = copy.deepcopy(plain)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5) if optimizer else None
    if level == "fp8":
        model = fp8amp.convert(model, recipe=recipe, optimizer=opt, policy="all")
    else:
        model, opt = fp8amp.initialize(model, opt, level, recipe=recipe, policy="all")
    return (plain, model, opt) if optimizer else (plain, model)


# ------------------------------------------------------------------------------------------------
# Layouts and ranks: outputs, input gradients and parameter gradients as nn.Linear's

LAYOUTS = {
    "transposed": lambda: torch.randn(128, 37).t(),
    "stepped-slice": lambda: torch.randn(74, 256)[::2, ::2],
    "column-slice": lambda: torch.randn(37, 200)[:, 3:131],
    "expanded": lambda: torch.randn(1, 128).expand(37, 128),
    "expanded-3d": lambda: torch.randn(3, 1, 128).expand(3, 4, 128),
    "channels-last": lambda: torch.randn(2, 3, 5, 128).to(memory_format=torch.channels_last),
    "permuted": lambda: torch.randn(2, 128, 3, 5).permute(0, 2, 3, 1),
    "as-strided": lambda: torch.randn(1000).as_strided((20, 128), (7, 1)),
    "flipped": lambda: torch.randn(37, 128).flip(0),
    "1d": lambda: torch.randn(128),
    "5d": lambda: torch.randn(2, 1, 3, 2, 128),
    "empty": lambda: torch.randn(0, 128),
    "empty-3d": lambda: torch.randn(2, 0, 128),
    "one-row": lambda: torch.randn(1, 128),
    "17-rows": lambda: torch.randn(17, 128),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_every_layout_and_rank_gives_nn_linears_result(level, recipe, layout):
    plain, model = pair(level, recipe)
    torch.manual_seed(5)
    data = LAYOUTS[layout]()
    results = []
    for m in (plain, model):
        x = data.detach().requires_grad_()
        y = m(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)))
        results.append((y, x.grad, m.weight.grad, m.bias.grad))
    (y0, gx0, gw0, gb0), (y1, gx1, gw1, gb1) = results
    assert (y1.shape, y1.dtype, y1.stride(), y1.requires_grad) == (y0.shape, y0.dtype, y0.stride(), y0.requires_grad)
    assert (gx1.shape, gx1.dtype, gx1.stride()) == (gx0.shape, gx0.dtype, gx0.stride())
    if y0.numel():
        assert rel(y1, y0) < 0.1 and rel(gx1, gx0) < 0.15 and rel(gw1, gw0) < 0.15 and rel(gb1, gb0) < 0.01
    else:
        assert not real(gw1).any() and not gb1.any()


# ------------------------------------------------------------------------------------------------
# Autograd's uses of inputs and outputs


def _reused(m, x):
    return m(torch.relu(m(x))) + m(x * 0.5)


def _output_view(m, x):
    return m(x)[2:9, ::3]


def _hooked(m, x):
    y = m(x)
    y.register_hook(lambda g: g * 2)
    return y


def _written_output(m, x):
    y = m(x)
    y.mul_(2).relu_()
    return y


@pytest.mark.parametrize("use", [_reused, _output_view, _hooked, _written_output])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_autograd_uses_of_inputs_and_outputs_are_nn_linears(level, recipe, use):
    plain, model = pair(level, recipe)
    torch.manual_seed(3)
    data = torch.randn(17, 128)
    results = []
    for m in (plain, model):
        x = data.clone().requires_grad_()
        loss = use(m, x).square().sum()
        (gx_only,) = torch.autograd.grad(loss, x, retain_graph=True)
        loss.backward(retain_graph=True)
        loss.backward()  # a second backward through the retained graph accumulates
        results.append((gx_only, x.grad, m.weight.grad, m.bias.grad))
    for ours, torchs in zip(*reversed(results)):
        assert ours.shape == torchs.shape and real(ours).dtype == torchs.dtype
        assert rel(ours, torchs) < 0.2


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_an_input_written_after_the_forward_gives_the_gradient_of_the_forward_that_ran(level, recipe):
    # nn.Linear raises torch's version-counter error; Fp8Linear saved its own FP8 copy of the
    # input, so its gradients are those of the values the forward read.
    plain, model = pair(level, recipe)
    torch.manual_seed(3)
    data, grad = torch.randn(17, 128), torch.randn(17, 128)
    x0 = data.clone().requires_grad_()
    plain(x0).backward(grad)
    x = data.clone().requires_grad_()
    h = x * 1
    y = model(h)
    h.mul_(3)
    y.backward(grad)
    assert rel(x.grad, x0.grad) < 0.1 and rel(model.weight.grad, plain.weight.grad) < 0.1


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_an_input_made_in_inference_mode_trains(level, recipe):
    # nn.Linear refuses to save an inference tensor for backward; Fp8Linear saves its own FP8 copy.
    plain, model = pair(level, recipe)
    with torch.inference_mode():
        x = torch.randn(17, 128)
    plain(x.clone()).square().sum().backward()
    model(x).square().sum().backward()
    assert rel(model.weight.grad, plain.weight.grad) < 0.15


def _step(model, optimizer):
    model(torch.randn(16, 128)).square().sum().backward()  # another loss through the layer, stepped
    optimizer.step()


def _write(model, optimizer):
    with torch.no_grad():
        model.weight.mul_(-3)


# Compiled, O2 only: the masters' path is O1's too, and FP8 compute has no master.
WRITE_CASES = ([(level, recipe, False) for level in LEVELS for recipe in RECIPES]
               + [("O2", recipe, True) for recipe in RECIPES])


def _forward(model, compiled):
    if not compiled:
        return model
    torch._dynamo.reset()  # each test's model compiles afresh (no recompile limit reached: eager)
    return torch.compile(model, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("change", [_step, _write])
@pytest.mark.parametrize("level, recipe, compiled", WRITE_CASES)
def test_a_weight_changed_between_forward_and_backward_gives_the_forwards_gradient_or_torchs_error(
        level, recipe, compiled, change):
    # The GAN mistake: a loss through D computed before D's optimizer step, backpropagated after.
    # nn.Linear raises torch's version-counter error. At O1/O2 under the default (tensorwise)
    # recipe the backward cast the weight's transpose from the master as it was at backward time:
    # the input gradient came from the new weight, silently; compiled, still so until the
    # compiled forward saved the master's tensors (the graph checks their counters).
    plain, model, optimizer = pair(level, recipe, optimizer=True)
    forward = _forward(model, compiled)
    torch.manual_seed(3)
    data, grad = torch.randn(17, 128), torch.randn(17, 128)
    x0 = data.clone().requires_grad_()
    plain(x0).backward(grad)
    x = data.clone().requires_grad_()
    y = forward(x)
    change(forward, optimizer)
    try:
        y.backward(grad)
    except RuntimeError as e:
        # eager, the layer's own message; compiled, torch's (Dynamo cannot read a version counter)
        assert "modified" in str(e) and ("after loss.backward()" in str(e) or compiled), str(e)
    else:
        assert rel(x.grad, x0.grad) < 0.1


@pytest.mark.parametrize("level, recipe, compiled", WRITE_CASES)
def test_a_weight_changed_before_a_backward_that_needs_no_input_gradient_runs(level, recipe, compiled):
    # As with nn.Linear, which saves the weight only for dX: a first layer fed data, stepped between
    # two backwards through one retained graph (Lightning's manual optimization with two optimizers).
    plain, model, optimizer = pair(level, recipe, optimizer=True)
    forward = _forward(model, compiled)
    torch.manual_seed(3)
    x, grad = torch.randn(17, 128), torch.randn(17, 128)
    plain(x).backward(grad)
    y = forward(x)
    _step(model, optimizer)
    model.weight.grad = None
    y.backward(grad)
    assert rel(model.weight.grad, plain.weight.grad) < 0.1


# ------------------------------------------------------------------------------------------------
# Inputs the layer cannot take: a clear error, as for any other


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.parametrize("level", LEVELS)
def test_a_nested_tensor_is_refused_naming_what_works(level, layout):
    # A strided nested tensor failed inside torch ("NestedTensorImpl doesn't support sizes"), and
    # a jagged one was told to call .to_dense(), which torch refuses for it.
    _, model = pair(level, "tensorwise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype warning for strided nested tensors
        x = torch.nested.nested_tensor([torch.randn(3, 128), torch.randn(5, 128)], layout=layout)
    with pytest.raises(ValueError, match="nested tensor.*values().*to_padded_tensor"):
        model(x)
    # what the message says works, and gives nn.Linear's values
    if layout == torch.jagged:
        y = torch.nested.nested_tensor_from_jagged(model(x.values()), x.offsets())
        assert rel(y.values(), nn.functional.linear(x.values(), real(model.weight), model.bias)) < 0.1


def test_numpy_bool_flags_are_refused_naming_numpys_type():
    # The messages said "must be a bool, got bool": numpy's bool is named "bool" too.
    import numpy as np

    model = fp8amp.convert(nn.Sequential(nn.Linear(32, 32)))
    with pytest.raises(TypeError, match=r"enabled must be a bool, got numpy\.bool"):
        fp8amp.amax_sync.set_amax_reduction(model, enabled=np.bool_(True))
    with pytest.raises(TypeError, match=r"compiled_graphs must be a bool, got numpy\.bool"):
        with fp8amp.save_activations_in_fp8(compiled_graphs=np.bool_(True)):
            pass
