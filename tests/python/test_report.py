"""fp8amp.numerics_report: each statistic against an independent computation in torch ops (the
power-of-two scale of docs/numerics.md#numerics, torch's own float8 casts after clamping), saturation after the
delayed scale is outgrown, underflow, non-finite inputs, micro-batches, O2's weight gradient,
compiled code (nothing recorded), errors; on CPU and GPU."""

import math

import pytest
import torch
from torch import nn

import fp8amp

E4M3, E5M2 = fp8amp.E4M3, fp8amp.E5M2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pow2_scale(amax: float, fmax: float) -> float:
    return 2.0 ** math.floor(math.log2(fmax / amax))


def expected(x: torch.Tensor, scale: float, fmt: torch.dtype) -> dict:
    """The statistics of casting x with this scale, in torch ops (independent of fp8amp's kernels)."""
    fmax = torch.finfo(fmt).max
    x = x.detach().double().flatten()
    codes = (x * scale).clamp(-fmax, fmax).to(fmt)
    real = codes.double() / scale
    nonzero = x != 0
    noise = (x - real).square().sum().item()
    return {
        "saturated": ((x * scale).abs() > fmax).double().mean().item(),
        "underflow": (nonzero & (codes.double() == 0)).sum().item() / max(nonzero.sum().item(), 1),
        "sqnr_db": math.inf if noise == 0 else 10 * math.log10(x.square().sum().item() / noise),
        "amax": x.abs().max().item(),
    }


def check(row, want: dict) -> None:
    assert row.saturated == pytest.approx(want["saturated"], abs=1e-12)
    assert row.underflow == pytest.approx(want["underflow"], abs=1e-12)
    assert row.sqnr_db == pytest.approx(want["sqnr_db"], rel=1e-9)
    assert row.amax == pytest.approx(want["amax"], rel=1e-7)


def rows_by_role(report, layer):
    return {r.role: r for r in report.rows if r.layer == layer}


@pytest.mark.parametrize("device", DEVICES)
def test_first_step_statistics_match_torch(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, device=device))
    fp8amp.convert(model, policy="all")
    x = torch.randn(50, 64, device=device)  # 50 rows: padded to 64 inside, padding not counted
    grad = torch.randn(50, 32, device=device) * 1e-3
    with fp8amp.numerics_report(model) as report:
        model(x).backward(grad)
    rows = rows_by_role(report, "0")
    assert set(rows) == {"input", "weight", "grad_output"}  # plain weights: a high-precision wgrad
    # Step one is current scaling: each scale from the tensor's own amax.
    w = model[0].weight
    for role, t, fmt in [("input", x, E4M3), ("weight", w, E4M3), ("grad_output", grad, E5M2)]:
        scale = pow2_scale(t.abs().max().item(), torch.finfo(fmt).max)
        check(rows[role], expected(t, scale, fmt))
        assert rows[role].scale == scale and rows[role].fmt == fmt and rows[role].calls == 1
        assert rows[role].numel == t.numel() and rows[role].nonfinite == 0
    assert rows["input"].warming_up and rows["grad_output"].warming_up and rows["weight"].warming_up is None
    assert rows["input"].saturated == 0 and 25 < rows["input"].sqnr_db < 40  # E4M3 on normal data
    text = str(report)
    assert "| 0 | input | float8_e4m3fn | 1 |" in text and text.count("\n") == 4


@pytest.mark.parametrize("device", DEVICES)
def test_outgrown_delayed_scale_saturates(device):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 16, device=device))
    fp8amp.convert(model, policy="all")
    layer = model[0]
    history = layer.input_scaling.recipe.history_len
    for _ in range(history):  # past the warm-up, inputs of amax ~1
        model(torch.randn(16, 32, device=device).clamp(-1, 1)).sum().backward()
        fp8amp.update_scaling(model)
    scale = layer.input_scaling.scale.item()
    assert scale == pow2_scale(1.0, 448.0)  # 256, from the history's max (1: the clamp's bound)
    x = torch.randn(16, 32, device=device) * 100  # far above the history: delayed scale clips
    with fp8amp.numerics_report(model) as report:
        model(x).sum().backward()
    row = rows_by_role(report, "0")["input"]
    assert not row.warming_up and row.scale == scale
    check(row, expected(x, scale, E4M3))
    assert row.saturated > 0.5 and row.sqnr_db < 10


def test_underflow_and_nonfinite():
    model = nn.Sequential(nn.Linear(32, 16))
    fp8amp.convert(model, policy="all")
    x = torch.full((16, 32), 1e-6)
    x[0, 0] = 400.0  # scale 1: 1e-6 is below E4M3's smallest subnormal (2^-9), so it flushes
    x[1, 1] = 0.0
    with fp8amp.numerics_report(model) as report:
        model(x).sum().backward()
    row = rows_by_role(report, "0")["input"]
    assert row.scale == 1.0 and row.underflow == pytest.approx((16 * 32 - 2) / (16 * 32 - 1))
    check(row, expected(x, 1.0, E4M3))

    x[2, 2] = math.inf
    with fp8amp.numerics_report(model) as report:
        model(x)
    row = rows_by_role(report, "0")["input"]
    assert row.nonfinite == 1 and row.amax == 400.0  # amax over the finite elements
    assert report.worst(1)[0] is row  # non-finite rows first


def test_micro_batches_add_up_and_rows_keep_model_order():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    fp8amp.convert(model, policy="all")
    other = fp8amp.convert(nn.Sequential(nn.Linear(32, 16)), policy="all")
    with fp8amp.numerics_report(model) as report:
        for _ in range(3):
            model(torch.randn(8, 32)).sum().backward()
            other(torch.randn(8, 32)).sum().backward()  # not the reported model: not recorded
    assert [(r.layer, r.role) for r in report.rows] == [
        (layer, role) for layer in ("0", "2") for role in ("input", "weight", "grad_output")]
    first = rows_by_role(report, "0")
    assert first["input"].calls == 3 and first["input"].numel == 3 * 8 * 32
    assert first["weight"].numel == 3 * 48 * 32


def test_o2_weight_and_weight_grad_rows():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 16))
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
    x = torch.randn(24, 32)
    with fp8amp.numerics_report(model) as report:
        model(x).square().sum().backward()
    rows = rows_by_role(report, "0")
    assert set(rows) == {"input", "weight", "grad_output", "weight_grad"}
    master = model[0].weight.dequantize(torch.float32)  # the E4M3 copy against the FP16 master
    check(rows["weight"], expected(master, pow2_scale(master.abs().max().item(), 448.0), E4M3))
    grad = model[0].weight.grad
    assert rows["weight_grad"].fmt == E4M3 and rows["weight_grad"].saturated == 0
    assert rows["weight_grad"].scale == 1 / grad._scale_inv.item()
    assert rows["weight_grad"].numel == grad.numel() and 25 < rows["weight_grad"].sqnr_db < 40


def test_compiled_code_records_nothing_and_says_so():
    model = nn.Sequential(nn.Linear(32, 16))
    fp8amp.convert(model, policy="all")
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(16, 32)
    eager = model(x)
    with fp8amp.numerics_report(model) as report:
        y = compiled(x)
    assert report.rows == [] and "eagerly" in report.note and "eagerly" in str(report)
    torch.testing.assert_close(y, eager)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8"])
def test_an_empty_batch_under_the_tiled_recipes_is_reported(recipe):
    """An empty batch's casts have no tile scales: rows of numel 0 and no scale (it raised inside
    the report, and the exit's own KeyError hid that error)."""
    model = fp8amp.convert(nn.Sequential(nn.Linear(256, 256)), recipe=recipe, policy="all")
    x = torch.zeros(0, 256, requires_grad=True)
    with fp8amp.numerics_report(model) as report:
        model(x).sum().backward()
    rows = {row.role: row for row in report.rows}
    assert rows["input"].numel == 0 and math.isnan(rows["input"].scale) and rows["grad_output"].numel == 0
    assert rows["weight"].numel == 256 * 256
    assert "input" in str(report)


def test_an_error_inside_the_block_propagates_as_it_is_and_makes_no_report():
    """The exit does not build a report from a block that failed midway (its partial records could
    raise an error of their own over the block's)."""
    model = fp8amp.convert(nn.Sequential(nn.Linear(32, 32)), policy="all")
    with pytest.raises(ZeroDivisionError):
        with fp8amp.numerics_report(model) as report:
            model(torch.randn(4, 32))
            1 / 0
    assert report.rows == []


def test_errors_and_models_without_fp8():
    with pytest.raises(TypeError, match="model must be an nn.Module, got int"):
        fp8amp.numerics_report(42)
    model = nn.Sequential(nn.Linear(32, 16))
    report = fp8amp.numerics_report(model)
    with report:
        model(torch.randn(2, 32))
    assert report.rows == [] and "has no Fp8Linear" in report.note
    fp8amp.convert(model, policy="all")
    with report:  # entered again: the model as it is now, from scratch
        model(torch.randn(16, 32))
    assert report.note == "" and [r.role for r in report.rows] == ["input", "weight"]
    with fp8amp.numerics_report(model):
        with pytest.raises(RuntimeError, match="do not nest"):
            with fp8amp.numerics_report(model):
                pass
    # Recording has stopped: a later forward adds nothing to an exited report.
    with fp8amp.numerics_report(model) as report:
        model(torch.randn(16, 32))
    model(torch.randn(16, 32))
    assert rows_by_role(report, "0")["input"].calls == 1


def test_activation_checkpointing_counts_the_recomputed_forward():
    from torch.utils.checkpoint import checkpoint

    model = fp8amp.convert(nn.Sequential(nn.Linear(32, 16)), policy="all")
    x = torch.randn(16, 32, requires_grad=True)
    with fp8amp.numerics_report(model) as plain:
        model(x).sum().backward()
    model = fp8amp.convert(nn.Sequential(nn.Linear(32, 16)), policy="all")
    with fp8amp.numerics_report(model) as checkpointed:
        checkpoint(model, x, use_reentrant=False).sum().backward()
    once, twice = rows_by_role(plain, "0")["input"], rows_by_role(checkpointed, "0")["input"]
    assert twice.calls == 2 and twice.numel == 2 * once.numel
    assert twice.sqnr_db == pytest.approx(once.sqnr_db) and twice.underflow == once.underflow
