"""Scaling recipes (docs/tiles.md#recipes): recipe= of Fp8Linear, convert and initialize, the
outlier case that tile scales fix, rowwise and blockwise forward and backward against fp32,
shapes a recipe cannot take, O2 training, torch.compile, activation checkpointing, state dicts
and the numerics report. CPU (the ops' CPU references); the small GPT on a GPU is in
test_initialize.py (test_small_gpt_loss_matches_bf16, "O2-blockwise")."""

import copy
import math

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp8amp
from fp8amp import E4M3, E5M2, Fp8Linear, Recipe
from fp8amp.block_scaled_tensor import BlockScaledTensor

TILED = ["rowwise", "blockwise"]

# SQNR floors, derived as in test_linear.py: round to nearest with m mantissa bits gives
# 4.77 + 6.02 (m + 1) dB per operand (28.8 dB for E4M3, 22.8 dB for E5M2); a product of two
# quantized operands adds both noises (-3 dB): 25.8 dB for E4M3 x E4M3, 21.8 dB with an E5M2
# gradient. The floors sit 3 dB under, as there.
SQNR_FLOOR_DB = {E4M3: 22.8, E5M2: 18.8}


def sqnr_db(actual, reference):
    actual, reference = actual.detach().double(), reference.detach().double()
    noise = (actual - reference).pow(2).sum()
    return math.inf if noise == 0 else 10 * math.log10(reference.pow(2).sum() / noise)


def run(module, x, grad_out):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(grad_out)
    return y, x.grad


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_a_converted_model_prints(recipe):
    model = fp8amp.convert(nn.Sequential(nn.Linear(128, 256)), recipe=recipe, policy="all")
    text = repr(model)
    assert ("fp8=e4m3/e5m2" if recipe == "tensorwise" else f"recipe={fp8amp.Recipe(recipe)}") in text


def test_names_and_objects_resolve():
    assert Recipe().kind == "tensorwise" and Recipe().grad_format == E5M2  # today's behaviour
    assert Recipe("blockwise").grad_format == E4M3 and Recipe("blockwise", grad_format=E5M2).grad_format == E5M2
    layer = Fp8Linear(256, 128)
    assert layer.recipe == Recipe() and layer.grad_output_scaling.dtype == E5M2
    assert Fp8Linear(256, 128, recipe="blockwise").recipe == Recipe("blockwise")
    old = fp8amp.ScalingRecipe(history_len=4, margin=1)
    assert Fp8Linear(256, 128, recipe=old).recipe == Recipe("tensorwise", margin=1, history_len=4)
    assert "recipe=rowwise (e4m3/e5m2)" in repr(Fp8Linear(64, 32, recipe=Recipe("rowwise", grad_format=E5M2)))


def test_a_second_convert_with_another_recipe_says_the_converted_layers_keep_theirs():
    """The layers an earlier convert made Fp8Linear keep their recipe (a second convert converts
    only the Linears left): asked for another one, convert warns and says so in the report."""
    model = nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 256))
    fp8amp.convert(model, recipe="tensorwise", policy="all")
    with pytest.warns(UserWarning, match=r"2 layer\(s\) already Fp8Linear with recipe tensorwise .*keep it.*unconvert"):
        fp8amp.convert(model, recipe="blockwise", policy="all")
    assert [m.recipe.kind for m in model if isinstance(m, Fp8Linear)] == ["tensorwise", "tensorwise"]
    assert "keep it" in str(fp8amp.conversion_report(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8amp.convert(model, recipe="tensorwise", policy="all")  # the same recipe: nothing to say
        fp8amp.convert(model, policy="all")  # none asked for


def test_unknown_names_and_bad_values_are_refused():
    accepted = "'tensorwise', 'rowwise', 'blockwise', 'mxfp8'"
    with pytest.raises(ValueError, match=f"Fp8Linear: recipe must be one of {accepted}"):
        Fp8Linear(256, 128, recipe="deepseek")
    with pytest.raises(ValueError, match=f"convert: recipe must be one of {accepted}"):
        fp8amp.convert(nn.Sequential(nn.Linear(256, 128)), recipe="block", policy="all")
    with pytest.raises(ValueError, match=f"initialize: recipe must be one of {accepted}"):
        fp8amp.initialize(nn.Sequential(nn.Linear(256, 128)), None, "O2", recipe="row", policy="all")
    with pytest.raises(TypeError, match="Fp8Linear.from_linear: recipe must be one of"):
        Fp8Linear.from_linear(nn.Linear(256, 128), recipe=128)
    with pytest.raises(ValueError, match="fp8amp.Recipe: kind must be one of"):
        Recipe("nvfp4")
    with pytest.raises(ValueError, match="grad_format must be torch.float8_e4m3fn or torch.float8_e5m2"):
        Recipe("blockwise", grad_format=torch.float16)
    with pytest.raises(ValueError, match="margin must be in"):
        Recipe("rowwise", margin=-1)


def outlier_batch(rows=64, features=512, factor=3e4):
    """N(0, 1) rows with every eighth row scaled by ``factor``, and the mask of the regular rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, features, generator=g)
    x[::8] *= factor
    regular = torch.ones(rows, dtype=torch.bool)
    regular[::8] = False
    return x, regular


@pytest.mark.parametrize("recipe", TILED)
def test_outlier_rows_keep_their_precision(recipe):
    """Rows of 3e4x outliers in a Linear's input: with one scale the regular rows' output falls
    far below E4M3's precision; with tile scales it keeps >= 25 dB against a float64 reference."""
    torch.manual_seed(0)
    linear = nn.Linear(512, 256)
    x, regular = outlier_batch()
    exact = (x.double() @ linear.weight.double().T + linear.bias.double())[regular]
    with torch.no_grad():
        tiled = Fp8Linear.from_linear(linear, recipe)(x)[regular]
        tensorwise = Fp8Linear.from_linear(linear)(x)[regular]
    assert sqnr_db(tiled, exact) >= 25
    assert sqnr_db(tensorwise, exact) < 15
    assert sqnr_db(tiled, exact) - sqnr_db(tensorwise, exact) > 10


@pytest.mark.parametrize("recipe", TILED)
@pytest.mark.parametrize("grad_format", [E4M3, E5M2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead_shape", [(256,), (4, 37)])  # 148 rows: padded to whole tiles
def test_forward_and_grads_against_fp32(recipe, grad_format, bias, lead_shape):
    torch.manual_seed(0)
    reference = nn.Linear(256, 128, bias=bias)
    fp8 = Fp8Linear.from_linear(copy.deepcopy(reference), Recipe(recipe, grad_format=grad_format))
    x, grad_out = torch.randn(*lead_shape, 256), torch.randn(*lead_shape, 128)
    y, dx = run(fp8, x, grad_out)
    y_ref, dx_ref = run(reference, x, grad_out)
    assert y.shape == y_ref.shape and y.dtype == torch.float32 and dx.shape == dx_ref.shape
    assert sqnr_db(y, y_ref) > SQNR_FLOOR_DB[E4M3]
    assert sqnr_db(dx, dx_ref) > SQNR_FLOOR_DB[grad_format]
    assert sqnr_db(fp8.weight.grad, reference.weight.grad) > SQNR_FLOOR_DB[grad_format]
    assert sqnr_db(y, y_ref) < 40  # the quantization is really there: the floors can fail
    if bias:  # a high-precision sum of the gradient
        torch.testing.assert_close(fp8.bias.grad, reference.bias.grad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["tensorwise", *TILED])
@pytest.mark.parametrize("lead_shape", [(0,), (2, 0)])
def test_an_empty_batch_gives_empty_outputs_and_zero_weight_grads(recipe, lead_shape, device):
    """No tokens (a rank's empty micro-batch, a filtered batch): an empty output and input grad,
    zero weight and bias grads, as nn.Linear gives, whatever the recipe (rowwise's tiles run along
    the token dimension in the weight-grad GEMM, where there are none)."""
    fp8 = Fp8Linear(256, 128, recipe=recipe, device=device)
    x = torch.randn(*lead_shape, 256, device=device, requires_grad=True)
    y = fp8(x)
    assert y.shape == (*lead_shape, 128)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(fp8.weight.grad, torch.zeros(128, 256, device=device))
    assert torch.equal(fp8.bias.grad, torch.zeros(128, device=device))
    with torch.no_grad():
        assert fp8(torch.randn(*lead_shape, 256, device=device)).shape == (*lead_shape, 128)


def test_shapes_a_recipe_cannot_take_stay_high_precision():
    def model():
        return nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 64), nn.Linear(64, 24))

    blockwise = fp8amp.convert(model(), recipe="blockwise", policy="all")
    assert [type(m) for m in blockwise] == [Fp8Linear, nn.Linear, nn.Linear]
    report = fp8amp.conversion_report(blockwise)
    assert report.recipe == "blockwise" and "recipe='blockwise'" in str(report)
    reasons = {d.name: d.reason for d in report.decisions}
    assert "not multiples of 128 (blockwise" in reasons["1"] and "not multiples of 16" in reasons["2"]
    assert "recipe blockwise (e4m3/e4m3)" in reasons["0"]
    rowwise = fp8amp.convert(model(), recipe="rowwise", policy="all")
    assert [type(m) for m in rowwise] == [Fp8Linear, Fp8Linear, nn.Linear]
    o2, _ = fp8amp.initialize(model(), None, "O2", recipe="blockwise", policy="all")
    assert [type(m) for m in o2] == [Fp8Linear, nn.Linear, nn.Linear]
    o2(torch.randn(8, 256)).sum().backward()  # the kept layers train in high precision
    with pytest.raises(ValueError, match=r"Fp8Linear: in_features \(64\) .* not multiples of 128"):
        Fp8Linear(64, 128, recipe="blockwise")


def test_o2_master_is_cast_with_tile_scales_from_its_codes():
    """At O2 the forward quantizes the FP16 master's codes with tile scales: the same output as
    a layer whose plain weight holds the master's real values (bit for bit), and no E4M3 copy."""
    torch.manual_seed(0)
    model, _ = fp8amp.initialize(nn.Sequential(nn.Linear(256, 128)), None, "O2", recipe="blockwise", policy="all")
    master = model[0].weight
    assert isinstance(master, fp8amp.MasterWeight) and master.fp8_copy is None
    plain = Fp8Linear(256, 128, recipe="blockwise")
    with torch.no_grad():
        plain.weight.copy_(master.dequantize(torch.float32))
        plain.bias.copy_(model[0].bias)
    x = torch.randn(130, 256)
    assert torch.equal(model(x), plain(x))


# O1/O2's E4M3 weight gradient: in 128 x 128 blocks under blockwise, per tensor under mxfp8.
@pytest.mark.parametrize("recipe, grad_type", [("blockwise", BlockScaledTensor), ("mxfp8", fp8amp.ScaledTensor)])
def test_o2_trains(recipe, grad_type):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    target = nn.Linear(128, 128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = fp8amp.initialize(model, opt, "O2", recipe=recipe, policy="all")
    assert all(m.recipe == Recipe(recipe) for m in (model[0], model[2]))
    x = torch.randn(256, 128)
    with torch.no_grad():
        y = target(x)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        assert isinstance(model[0].weight.grad, grad_type)
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_compiles_fullgraph_with_eager_results(recipe):
    torch.manual_seed(0)
    eager = Fp8Linear(256, 128, recipe=recipe)
    twin = copy.deepcopy(eager)
    x, grad_out = torch.randn(2, 70, 256), torch.randn(2, 70, 128)
    y, dx = run(eager, x, grad_out)
    torch._dynamo.reset()
    y_c, dx_c = run(torch.compile(twin, backend="aot_eager", fullgraph=True), x, grad_out)
    assert torch.equal(y, y_c) and torch.equal(dx, dx_c)
    assert torch.equal(eager.weight.grad, twin.weight.grad) and torch.equal(eager.bias.grad, twin.bias.grad)


def test_rowwise_compiles_once_for_every_token_count_and_exports_with_a_dynamic_batch():
    """Rowwise tiles are whole rows, named by a constant tile length, not by the row's symbolic
    length: one graph serves every batch under dynamic shapes (it was one per padded token count,
    up to Dynamo's recompile limit), and torch.export takes a dynamic batch dimension."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    layer = Fp8Linear(256, 128, recipe="rowwise")
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(layer), backend="aot_eager", dynamic=True)
    for batch in (37, 5, 200, 19):
        x, grad_out = torch.randn(batch, 256), torch.randn(batch, 128)
        y_c, dx_c = run(compiled, x, grad_out)
        y, dx = run(layer, x, grad_out)
        assert torch.equal(y, y_c) and torch.equal(dx, dx_c)
    assert counters["stats"]["unique_graphs"] == 1
    batch = torch.export.Dim("batch", min=1, max=64)
    exported = torch.export.export(layer.eval(), (torch.randn(32, 256),), dynamic_shapes=({0: 16 * batch},))
    x = torch.randn(48, 256)
    assert torch.equal(exported.module()(x), layer(x))


@pytest.mark.parametrize("recipe", TILED)
def test_activation_checkpointing_gives_the_same_gradients(recipe):
    torch.manual_seed(0)
    layer = Fp8Linear(256, 128, recipe=recipe)
    twin = copy.deepcopy(layer)
    x, grad_out = torch.randn(48, 256, requires_grad=True), torch.randn(48, 128)
    layer(x).backward(grad_out)
    x2 = x.detach().clone().requires_grad_()
    checkpoint(twin, x2, use_reentrant=False).backward(grad_out)
    assert torch.equal(x.grad, x2.grad) and torch.equal(layer.weight.grad, twin.weight.grad)


def test_state_dict_round_trip_and_across_recipes():
    torch.manual_seed(0)
    model, _ = fp8amp.initialize(nn.Sequential(nn.Linear(256, 128)), None, "O2", recipe="blockwise", policy="all")
    state = model.state_dict()
    again, _ = fp8amp.initialize(nn.Sequential(nn.Linear(256, 128)), None, "O2", recipe="blockwise", policy="all")
    again.load_state_dict(state)
    x = torch.randn(16, 256)
    assert torch.equal(model(x), again(x))
    tensorwise = fp8amp.convert(nn.Sequential(nn.Linear(256, 128)), policy="all")
    tensorwise.load_state_dict(state)  # the same keys whatever the recipe
    torch.testing.assert_close(tensorwise[0].weight, model[0].weight.dequantize())


def test_numerics_report_judges_each_tile_by_its_scale():
    x, _ = outlier_batch(features=256)
    rows = {}
    for recipe in ["tensorwise", "blockwise"]:
        torch.manual_seed(0)
        model = fp8amp.convert(nn.Sequential(nn.Linear(256, 128)), recipe=recipe, policy="all")
        with fp8amp.numerics_report(model) as report:
            model(x).backward(torch.randn(64, 128))
        rows[recipe] = {r.role: r for r in report.rows}
    tiled, single = rows["blockwise"], rows["tensorwise"]
    assert set(tiled) == {"input", "weight", "grad_output"}
    assert tiled["input"].warming_up is None and single["input"].warming_up is True
    assert tiled["input"].sqnr_db > 28 and single["input"].sqnr_db < tiled["input"].sqnr_db
    assert tiled["input"].underflow == 0 and single["input"].underflow > 0.01  # regular rows lost to zero
    assert tiled["input"].saturated == 0 and tiled["input"].numel == 64 * 256
    assert tiled["input"].scale == 2.0 ** math.floor(math.log2(448 / x.abs().max().item()))  # the outliers' tile


@pytest.mark.parametrize("recipe", TILED)
def test_autocast_output_dtype(recipe):
    torch.manual_seed(0)
    layer = Fp8Linear(256, 128, recipe=recipe)
    x = torch.randn(32, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert sqnr_db(y, nn.functional.linear(x, layer.weight, layer.bias)) > SQNR_FLOOR_DB[E4M3]


def test_update_scaling_leaves_tiled_layers_alone():
    model = nn.Sequential(Fp8Linear(256, 128, recipe="blockwise"), Fp8Linear(128, 128))
    model(torch.randn(16, 256)).sum().backward()
    fp8amp.update_scaling(model)
    assert model[0].input_scaling.counter.tolist() == [0] and model[1].input_scaling.counter.tolist() == [1]


def test_timing_policy_times_the_recipe_asked_for():
    from fp8amp.convert_policy import clear_timing_cache

    timed = []

    def timer(module, tokens):  # made-up timings: FP8 twice as fast
        timed.append(getattr(module, "recipe", None))
        return 1.0 if isinstance(module, Fp8Linear) else 2.0

    clear_timing_cache()
    model = fp8amp.convert(nn.Sequential(nn.Linear(256, 128)), recipe="blockwise", policy="layers", timer=timer)
    fp8amp.convert(nn.Sequential(nn.Linear(256, 128)), recipe="rowwise", policy="layers", timer=timer)
    assert timed == [None, Recipe("blockwise"), None, Recipe("rowwise")]  # one timing per recipe
    assert isinstance(model[0], Fp8Linear) and model[0].recipe == Recipe("blockwise")
    clear_timing_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", TILED)
def test_cuda_matches_the_cpu_reference(recipe):
    """The casts are bit for bit the CPU's; only the GEMMs' FP32 accumulation differs from the
    CPU's exact sums (about 2^-14 relative, docs/tiles.md): far above FP8's ~29 dB."""
    torch.manual_seed(0)
    cpu = Fp8Linear(512, 256, recipe=recipe)
    gpu = copy.deepcopy(cpu).cuda()
    x, grad_out = torch.randn(300, 512), torch.randn(300, 256)
    y, dx = run(cpu, x, grad_out)
    y_gpu, dx_gpu = run(gpu, x.cuda(), grad_out.cuda())
    assert sqnr_db(y_gpu.cpu(), y) > 60 and sqnr_db(dx_gpu.cpu(), dx) > 60
    assert sqnr_db(gpu.weight.grad.cpu(), cpu.weight.grad) > 60
