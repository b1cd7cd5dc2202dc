"""The ``"mxfp8"`` recipe (docs/tiles.md#mxfp8) on the CPU, in FP8 emulation through the ops' CPU
reference: names and refusals, shapes it cannot take, forward and backward against fp32, the
outlier case, O2 training, torch.compile and the numerics report; on a GPU below Blackwell (the
H200), the refusal at construction and conversion."""

import copy
import math

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import E4M3, E5M2, Fp8Linear, Recipe

from test_recipes import SQNR_FLOOR_DB, outlier_batch, run, sqnr_db


def test_names_and_refusals():
    assert Recipe("mxfp8").grad_format == E4M3 and Recipe("mxfp8", grad_format=E5M2).grad_format == E5M2
    assert Recipe("mxfp8").tiled and Recipe("mxfp8").feature_multiple == 32 and Recipe("mxfp8").token_multiple == 32
    assert Fp8Linear(256, 128, recipe="mxfp8").recipe == Recipe("mxfp8")
    assert "recipe=mxfp8 (e4m3/e4m3)" in repr(fp8amp.convert(nn.Sequential(nn.Linear(64, 32)), recipe="mxfp8",
                                                            policy="all"))
    with pytest.raises(ValueError, match="kind 'mxfp8' has a fixed E8M0 scale rule: margin must be 0"):
        Recipe("mxfp8", margin=1)
    with pytest.raises(ValueError, match="pow2_scale True"):
        Recipe("mxfp8", pow2_scale=False)


def test_shapes_it_cannot_take_stay_high_precision():
    model = fp8amp.convert(nn.Sequential(nn.Linear(256, 96), nn.Linear(96, 48), nn.Linear(48, 24)),
                           recipe="mxfp8", policy="all")
    assert [type(m) for m in model] == [Fp8Linear, nn.Linear, nn.Linear]
    report = fp8amp.conversion_report(model)
    reasons = {d.name: d.reason for d in report.decisions}
    assert report.recipe == "mxfp8" and "recipe mxfp8 (e4m3/e4m3)" in reasons["0"]
    assert "not multiples of 32 (mxfp8 recipe: 1 x 32 blocks)" in reasons["1"]
    assert "not multiples of 16" in reasons["2"]
    with pytest.raises(ValueError, match=r"Fp8Linear: in_features \(48\) .* not multiples of 32"):
        Fp8Linear(48, 64, recipe="mxfp8")


@pytest.mark.parametrize("grad_format", [E4M3, E5M2])
@pytest.mark.parametrize("lead_shape", [(256,), (4, 37)])  # 148 rows: padded to whole blocks
def test_forward_and_grads_against_fp32(grad_format, lead_shape):
    torch.manual_seed(0)
    reference = nn.Linear(256, 96)
    fp8 = Fp8Linear.from_linear(copy.deepcopy(reference), Recipe("mxfp8", grad_format=grad_format))
    x, grad_out = torch.randn(*lead_shape, 256), torch.randn(*lead_shape, 96)
    y, dx = run(fp8, x, grad_out)
    y_ref, dx_ref = run(reference, x, grad_out)
    assert y.shape == y_ref.shape and y.dtype == torch.float32 and dx.shape == dx_ref.shape
    assert SQNR_FLOOR_DB[E4M3] < sqnr_db(y, y_ref) < 40  # quantized, within E4M3's precision
    assert sqnr_db(dx, dx_ref) > SQNR_FLOOR_DB[grad_format]
    assert sqnr_db(fp8.weight.grad, reference.weight.grad) > SQNR_FLOOR_DB[grad_format]
    torch.testing.assert_close(fp8.bias.grad, reference.bias.grad)


def test_outlier_rows_keep_their_precision():
    """Issue 19's case: rows of 3e4x outliers; one E8M0 scale per 1 x 32 block keeps the regular
    rows at >= 25 dB where one scale per tensor falls far below."""
    torch.manual_seed(0)
    linear = nn.Linear(512, 256)
    x, regular = outlier_batch()
    exact = (x.double() @ linear.weight.double().T + linear.bias.double())[regular]
    with torch.no_grad():
        mx = Fp8Linear.from_linear(linear, "mxfp8")(x)[regular]
        tensorwise = Fp8Linear.from_linear(linear)(x)[regular]
    assert sqnr_db(mx, exact) >= 25
    assert sqnr_db(mx, exact) - sqnr_db(tensorwise, exact) > 10


def test_numerics_report_reads_the_e8m0_scales():
    x, _ = outlier_batch(features=256)
    model = fp8amp.convert(nn.Sequential(nn.Linear(256, 128)), recipe="mxfp8", policy="all")
    with fp8amp.numerics_report(model) as report:
        model(x).backward(torch.randn(64, 128))
    rows = {r.role: r for r in report.rows}
    assert set(rows) == {"input", "weight", "grad_output"}
    assert rows["input"].sqnr_db > 25 and rows["input"].underflow == 0 and rows["input"].numel == 64 * 256
    # The smallest block scale: the outliers' blocks, 2^-e for the smallest e with amax <= 448 * 2^e.
    amax = x.abs().max().item()
    assert rows["input"].scale == 2.0 ** -math.ceil(math.log2(amax / 448.0))


@pytest.mark.gpu
def test_refused_below_blackwell():
    major, minor = torch.cuda.get_device_capability()
    if major >= 10:
        pytest.skip("a Blackwell GPU runs mxfp8")
    message = rf"mxfp8 needs a Blackwell GPU \(sm_100\+\); this GPU is sm_{major}{minor}: use recipe='blockwise'"
    with pytest.raises(NotImplementedError, match="Fp8Linear: " + message):
        Fp8Linear(256, 128, device="cuda", recipe="mxfp8")
    model = nn.Sequential(nn.Linear(256, 128)).cuda()
    with pytest.raises(NotImplementedError, match="fp8amp.convert: " + message):
        fp8amp.convert(model, recipe="mxfp8", policy="all")
    assert type(model[0]) is nn.Linear  # nothing was changed
    with pytest.raises(NotImplementedError, match="fp8amp.convert: " + message):
        fp8amp.initialize(model, None, "O2", recipe="mxfp8", policy="all")
