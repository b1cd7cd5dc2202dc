"""Scaling recipes as users use them (docs/tiles.md#recipes): every recipe at every level against
plain torch, the scale-rule settings of a Recipe honoured at every level, shapes a recipe cannot
take, odd inputs, state dicts across recipes and levels, copies, unconvert, eval, frozen layers
and accumulation. CPU (FP8 emulation)."""

import copy
import math
import pickle

import numpy as np
import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import E4M3, Recipe, ScalingRecipe

RECIPES = ["tensorwise", "rowwise", "blockwise", "mxfp8"]
LEVELS = [None, "O1", "O2"]  # None: convert (FP8 compute, high-precision weights)


def rel(actual, reference):
    actual, reference = actual.detach().double(), reference.detach().double()
    return ((actual - reference).norm() / reference.norm()).item()


def real(t):
    return t.dequantize() if isinstance(t, (fp8amp.ScaledTensor, fp8amp.BlockScaledTensor)) else t.detach()


def mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 48))


def to_level(model, recipe, level, lr=1e-3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if level is None:
        return fp8amp.convert(model, recipe=recipe, optimizer=optimizer, policy="all"), optimizer
    return fp8amp.initialize(model, optimizer, level, recipe=recipe, policy="all")


def weight_scale(model, x):
    """The scale of the forward GEMM's E4M3 weight operand, as the numerics report saw it."""
    with fp8amp.numerics_report(model) as report:
        model(x).sum().backward()
    (row,) = [r for r in report.rows if r.role == "weight"]
    return row.scale


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", [Recipe("tensorwise", margin=2), ScalingRecipe(16, 3, True),
                                    Recipe("tensorwise", pow2_scale=False), Recipe("blockwise", margin=2)],
                         ids=["margin", "scaling-recipe", "not-pow2", "blockwise-margin"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_weight_cast_takes_the_recipes_scale_rule_at_every_level(recipe, level, device):
    # At O1/O2 the tensorwise weight operand came from the master's E4M3 copy, made with margin 0
    # and power-of-two scales whatever the recipe said.
    model, optimizer = to_level(nn.Sequential(nn.Linear(128, 128)).to(device), recipe, level)
    x = torch.randn(32, 128, device=device)
    for _ in range(2):  # and after a step of the optimizer, which rewrites a master
        amax = real(model[0].weight).abs().max().item()
        rule = Recipe(margin=recipe.margin, pow2_scale=recipe.pow2_scale)
        expected = (2.0 ** (math.floor(math.log2(448 / amax)) - rule.margin) if rule.pow2_scale
                    else 448 / amax / 2 ** rule.margin)
        assert weight_scale(model, x) == pytest.approx(expected, rel=1e-6)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("make", [lambda v: Recipe("blockwise", pow2_scale=v), lambda v: ScalingRecipe(pow2_scale=v)],
                         ids=["Recipe", "ScalingRecipe"])
def test_a_numpy_bool_scale_rule_is_refused_naming_its_type(make):
    # The message said "pow2_scale must be a bool, got bool" (numpy's bool is named "bool").
    with pytest.raises(TypeError, match=r"pow2_scale must be a Python bool .*got numpy\.bool"):
        make(np.bool_(False))
    with pytest.raises(TypeError, match=r"margin must be a Python int .*got numpy\.int64"):
        Recipe("blockwise", margin=np.int64(1))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_training_follows_plain_torch(recipe, level):
    torch.manual_seed(0)
    x, target = torch.randn(64, 128), torch.randint(0, 48, (64,))
    losses = {}
    for name in ("torch", "fp8"):
        model = mlp()
        if name == "torch":
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        else:
            model, optimizer = to_level(model, recipe, level, lr=3e-3)
        losses[name] = []
        for _ in range(8):
            for micro in range(2):  # two micro-batches a step
                loss = nn.functional.cross_entropy(model(x[micro::2]), target[micro::2]) / 2
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item() * 2)
    assert losses["fp8"][-1] < 0.5 * losses["fp8"][0]
    assert losses["fp8"] == pytest.approx(losses["torch"], rel=0.05, abs=0.02)


@pytest.mark.parametrize("level", [None, "O2"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape,dtype", [((3, 5, 7, 256), torch.float32), ((0, 256), torch.float32),
                                         ((2, 0, 256), torch.float32), ((256,), torch.float32),
                                         ((17, 256), torch.bfloat16), ((17, 256), torch.float16)])
def test_inputs_of_any_batch_shape_and_dtype(recipe, level, shape, dtype):
    torch.manual_seed(0)
    reference = nn.Linear(256, 128)
    model = nn.Sequential(copy.deepcopy(reference))
    to_level(model, recipe, level)
    # A non-contiguous input: every other column of a wider tensor.
    x = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2].to(dtype)
    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    y, y_ref = model(xs[0]), reference(xs[1].float())
    assert y.shape == y_ref.shape and y.dtype == dtype
    grad = torch.randn_like(y_ref)
    y.backward(grad.to(dtype))
    y_ref.backward(grad)
    assert xs[0].grad.shape == x.shape and xs[0].grad.dtype == dtype
    if x.numel():
        assert rel(y, y_ref) < 0.08 and rel(xs[0].grad, xs[1].grad) < 0.1
    else:
        assert not real(model[0].weight.grad).any()


@pytest.mark.parametrize("recipe", RECIPES)
def test_autocast(recipe):
    torch.manual_seed(0)
    reference = nn.Linear(256, 128)
    model = fp8amp.convert(nn.Sequential(copy.deepcopy(reference)), recipe=recipe, policy="all")
    x = torch.randn(4, 8, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = model(x), reference(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and rel(y, y_ref) < 0.08
    y.float().sum().backward()


@pytest.mark.parametrize("level", [None, "O2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_shapes_a_recipe_cannot_take_stay_high_precision_and_are_named(recipe, level):
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 96), nn.Linear(96, 64, bias=False),
                          nn.Linear(64, 40), nn.Linear(40, 256), nn.Linear(256, 1))
    reference = copy.deepcopy(model)
    to_level(model, recipe, level)
    kept = {"tensorwise": {"3", "4", "5"}, "rowwise": {"3", "4", "5"}, "mxfp8": {"3", "4", "5"},
            "blockwise": {"1", "2", "3", "4", "5"}}[recipe]
    report = fp8amp.conversion_report(model)
    assert {d.name for d in report.skipped} == kept
    for d in report.decisions:
        assert isinstance(model.get_submodule(d.name), fp8amp.Fp8Linear) == d.converted
        if not d.converted:
            assert "not multiples of" in d.reason
    x = torch.randn(5, 256)
    y = model(x)
    y.sum().backward()
    assert rel(y, reference(x)) < 0.15


@pytest.mark.parametrize("saved,loaded", [("tensorwise", "blockwise"), ("blockwise", "tensorwise"),
                                          ("rowwise", "mxfp8"), ("mxfp8", "blockwise")])
@pytest.mark.parametrize("level", [None, "O2"])
def test_state_dicts_load_across_recipes(saved, loaded, level):
    source, optimizer = to_level(mlp(), saved, level, lr=1e-2)
    x = torch.randn(16, 128)
    for _ in range(2):
        source(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = source.state_dict()
    target, _ = to_level(mlp(), loaded, level)
    target.load_state_dict(state, strict=False)  # the 128 -> 48 layer: FP8 in one, nn.Linear in the other
    for name, value in target.state_dict().items():
        if "scaling" in name:
            continue
        if isinstance(target.get_parameter(name), fp8amp.MasterWeight) and type(source.get_parameter(name)) is nn.Parameter:
            assert rel(real(value), state[name]) < 2 ** -11, name  # a float32 weight into an FP16 master
        else:
            assert torch.equal(real(value), real(state[name])), name
    # and back
    back, _ = to_level(mlp(), saved, level)
    back.load_state_dict(target.state_dict(), strict=False)
    takes_48 = {"tensorwise", "rowwise"}  # the recipes that convert the 128 -> 48 layer
    if (saved in takes_48) == (loaded in takes_48):
        assert torch.equal(back(x), source(x))
    else:  # its scaling state (or, at O2, its float32 values) did not make the round trip
        assert rel(back(x), source(x)) < 0.08


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_o2_state_dict_loads_into_the_plain_model(recipe):
    model, optimizer = to_level(mlp(), recipe, "O2", lr=1e-2)
    x = torch.randn(16, 128)
    model(x).square().mean().backward()
    optimizer.step()
    plain = mlp()
    result = plain.load_state_dict(model.state_dict(), strict=False)
    assert not result.missing_keys and all("scaling" in k for k in result.unexpected_keys)
    for name, value in plain.state_dict().items():
        assert type(value) is torch.Tensor and value.dtype == torch.float32
        assert torch.equal(value, real(model.state_dict()[name])), name
    assert rel(model(x), plain(x)) < 0.08


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_copies_train_as_the_original(recipe, level):
    model, optimizer = to_level(mlp(), recipe, level, lr=1e-2)
    x = torch.randn(16, 128)

    def step(m, o):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()

    step(model, optimizer)
    copies = [copy.deepcopy((model, optimizer)), pickle.loads(pickle.dumps((model, optimizer)))]
    for _ in range(2):
        for m, o in [(model, optimizer)] + copies:
            step(m, o)
    for m, _ in copies:
        assert torch.equal(m(x), model(x))
        assert isinstance(m[0], fp8amp.Fp8Linear) and m[0].recipe == model[0].recipe


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_unconvert_gives_the_plain_model_of_the_same_values(recipe, level):
    model, optimizer = to_level(mlp(), recipe, level, lr=1e-2)
    x = torch.randn(16, 128)
    model(x).square().mean().backward()
    optimizer.step()
    values = {k: real(v).clone() for k, v in model.state_dict().items() if "scaling" not in k}
    model, optimizer = fp8amp.unconvert(model, optimizer)
    assert not any(isinstance(m, fp8amp.Fp8Linear) for m in model.modules())
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    assert {k: v for k, v in model.state_dict().items()}.keys() == values.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, values[name]), name
    before = model[0].weight.detach().clone()
    model(x).square().mean().backward()
    optimizer.step()
    assert not torch.equal(model[0].weight, before)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_eval_under_no_grad_and_inference_mode(recipe, level):
    model, optimizer = to_level(mlp(), recipe, level)
    x = torch.randn(16, 128)
    model(x).sum().backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        y = model(x)
    with torch.inference_mode():
        assert torch.equal(model(x), y)
        assert model(torch.randn(0, 128)).shape == (0, 48)
    assert torch.equal(model(x), y)
    model.train()
    model(x).sum().backward()
    optimizer.step()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_frozen_layers_stay_and_the_others_train(recipe, level):
    model = mlp()
    model[0].requires_grad_(False)
    model[4].weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if level is None:
        fp8amp.convert(model, recipe=recipe, optimizer=optimizer, policy="all")
    else:
        model, optimizer = fp8amp.initialize(model, optimizer, level, recipe=recipe, policy="all")
    before = {k: real(v).clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 128)
    for _ in range(2):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    after = {k: real(v) for k, v in model.state_dict().items()}
    for name in ("0.weight", "0.bias", "4.weight"):
        assert torch.equal(after[name], before[name]), name
        assert model.get_parameter(name).grad is None
    for name in ("2.weight", "2.bias", "4.bias"):
        assert not torch.equal(after[name], before[name]), name


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_head_tied_to_the_embeddings(recipe, level):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.emb, self.mid = nn.Embedding(256, 128), nn.Linear(128, 128)
            self.head = nn.Linear(128, 256, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t):
            return self.head(torch.relu(self.mid(self.emb(t))))

    tokens = torch.randint(0, 256, (8, 16))
    models = {}
    for name in ("torch", "fp8"):
        model = Tied()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if name == "fp8":
            model, optimizer = to_level(model, recipe, level, lr=1e-2) if level else (
                fp8amp.convert(model, recipe=recipe, optimizer=optimizer, policy="all"), optimizer)
        for _ in range(3):
            nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
        models[name] = model
    fp8 = models["fp8"]
    assert isinstance(fp8.head, fp8amp.Fp8Linear) and fp8.head.weight is fp8.emb.weight
    assert rel(real(fp8.emb.weight), models["torch"].emb.weight) < 0.02


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("level", [None, "O2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_training_equals_eager(recipe, level, backend):
    torch._dynamo.reset()
    model, optimizer = to_level(mlp(), recipe, level, lr=1e-2)
    eager, eager_optimizer = copy.deepcopy((model, optimizer))
    compiled = torch.compile(model, backend=backend)
    for rows in (8, 37):
        x = torch.randn(rows, 128)
        for m, o in ((compiled, optimizer), (eager, eager_optimizer)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    x = torch.randn(5, 128)
    assert torch.equal(compiled(x), eager(x))


def test_the_blockwise_report_counts_one_blocks_underflow():
    model = fp8amp.convert(nn.Sequential(nn.Linear(256, 256)), recipe="blockwise", policy="all")
    with torch.no_grad():
        model[0].weight[0, 0] = 1e5  # one outlier coarsens its own 128 x 128 block only
    with fp8amp.numerics_report(model) as report:
        model(torch.randn(4, 256)).sum().backward()
    weight = {r.role: r for r in report.rows}["weight"]
    assert weight.saturated == 0
    assert weight.underflow == pytest.approx(0.25, abs=0.01)  # one block of four
    assert weight.scale == 2.0 ** math.floor(math.log2(448 / 1e5))
