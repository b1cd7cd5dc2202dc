"""autocast, GradScaler and parameter dtypes as users combine them with fp8amp, at FP8 compute
(``convert``), O1 and O2, on the CPU. Each case is compared with the same thing done on the
unconverted model with plain torch: dtypes, skipped steps and scaler state exactly, values within
FP8's error."""

import copy
import math

import pytest
import torch
from torch import nn

import fp8amp

LEVELS = ["fp8", "O1", "O2"]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _model(dtype=F32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(dtype)


def _at(level, model, optimizer=None, **kwargs):
    """``model`` (and ``optimizer``) as ``level`` makes them."""
    if level == "fp8":
        return fp8amp.convert(model, optimizer=optimizer), optimizer
    return fp8amp.initialize(model, optimizer, level, **kwargs)


def _real(t):
    t = t.detach()
    return t.dequantize() if isinstance(t, fp8amp.ScaledTensor) else t


def _rel(a, b):
    return float((_real(a).float() - _real(b).float()).norm() / _real(b).float().norm())


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(n)]


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype or BF16, enabled=dtype is not None)


# ------------------------------------------------------------------------------------------------
# Output and gradient dtypes: those of nn.Linear in every setting


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("autocast", [None, BF16, F16])
@pytest.mark.parametrize("weights", [F32, BF16, F16])
def test_output_and_gradient_dtypes_are_nn_linears(level, autocast, weights):
    plain = _model(weights)
    model, _ = _at(level, copy.deepcopy(plain))
    data = torch.randn(5, 32, dtype=weights)  # 5 rows: padded to 16 inside
    for m in (plain, model):
        x = data.clone().requires_grad_()
        with _autocast(autocast):
            y = m(x)
        y.float().square().mean().backward()
        m.out = (y, x.grad)
    assert model.out[0].dtype == plain.out[0].dtype and model.out[1].dtype == plain.out[1].dtype
    assert _rel(model.out[0], plain.out[0]) < 0.1
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad.dtype == q.grad.dtype, name
        assert _rel(p.grad, q.grad) < 0.2, name


class _Regions(nn.Module):
    """autocast regions inside a model's forward: a region turned off around the second layer, one
    entered inside the forward, one of float16 inside bfloat16."""

    def __init__(self, mode):
        super().__init__()
        self.a, self.b, self.mode = nn.Linear(32, 64), nn.Linear(64, 32), mode

    def forward(self, x):
        if self.mode == "disabled":
            h = self.a(x)
            with torch.autocast("cpu", enabled=False):
                return self.b(torch.relu(h).float())
        if self.mode == "entered":
            with torch.autocast("cpu", dtype=BF16):
                h = self.a(x)
            return self.b(h.float())
        with torch.autocast("cpu", dtype=F16):
            h = self.a(x)
        return self.b(h)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", ["disabled", "entered", "float16_inside"])
def test_autocast_regions_inside_a_converted_model(level, mode):
    torch.manual_seed(0)
    plain = _Regions(mode)
    model, _ = _at(level, copy.deepcopy(plain))
    x = torch.randn(16, 32)
    for m in (plain, model):
        with torch.autocast("cpu", dtype=BF16):
            m.y = m(x)
        m.y.float().square().mean().backward()
    assert model.y.dtype == plain.y.dtype
    assert _rel(model.y, plain.y) < 0.1
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad.dtype == q.grad.dtype, name


# ------------------------------------------------------------------------------------------------
# GradScaler: the same steps skipped as plain torch, the same scale, sane scaling state


def _scaled_run(level, autocast, inject, batches):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if level != "plain":
        model, optimizer = _at(level, model, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    log = []
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=autocast):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if i == 3 and inject == "loss":
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if i == 3 and inject == "grad":
            with torch.no_grad():
                model[2].weight.grad[0, 0] = math.inf
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = [_real(p).clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        stepped = [not torch.equal(b, _real(p)) for b, p in zip(before, model.parameters())]
        optimizer.zero_grad()
        log.append((loss.item(), bool(norm.isfinite()), scaler.get_scale(), stepped))
    return model, optimizer, scaler, log


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("autocast", [BF16, F16])
@pytest.mark.parametrize("inject", ["loss", "grad"])
def test_grad_scaler_skips_the_steps_plain_torch_skips(level, autocast, inject):
    batches = _batches(6)
    _, _, plain_scaler, expected = _scaled_run("plain", autocast, inject, batches)
    model, optimizer, scaler, log = _scaled_run(level, autocast, inject, batches)
    assert [entry[1:] for entry in log] == [entry[1:] for entry in expected]
    assert not any(log[3][3]) and all(all(entry[3]) for entry in log[:3] + log[4:])
    for (loss, *_), (want, *_) in zip(log, expected):
        assert loss == want if not math.isfinite(want) else abs(loss - want) <= 0.05 * abs(want)
    steps = {int(optimizer.state[p]["step"]) for p in model.parameters()}
    assert steps == {5}  # 6 iterations, one skipped
    assert scaler.state_dict() == plain_scaler.state_dict()
    for name, state in model.named_modules():
        if isinstance(state, fp8amp.scaling.ScalingState):
            assert bool(state.scale.isfinite().all()) and bool((state.scale > 0).all()), name
            assert bool(state.amax_history.isfinite().all()), name  # the update dropped the inf


# ------------------------------------------------------------------------------------------------
# Parameter dtypes: 16-bit models, mixed models, dtype changes after conversion


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtypes", [(BF16, BF16), (BF16, F32), (F32, BF16)])
def test_16_bit_and_mixed_models_train_as_plain_torch(level, dtypes):
    def build():
        model = _model()
        model[0].to(dtypes[0])
        model[2].to(dtypes[1])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    runs = []
    for which in ("plain", level):
        model, optimizer = build()
        if which != "plain":
            model, optimizer = _at(level, model, optimizer)
        losses = []
        for x, y in _batches(5):
            with torch.autocast("cpu", dtype=BF16):
                out = model(x.to(dtypes[0]))
                loss = nn.functional.mse_loss(out.float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append((losses, out.dtype, [p.dtype for p in model.parameters()]))
    (want, *want_dtypes), (got, *got_dtypes) = runs
    assert got_dtypes == want_dtypes
    assert all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(got, want))


@pytest.mark.parametrize("to", [BF16, F16])
def test_a_dtype_change_after_convert_computes_in_the_new_dtype(to):
    plain = _model()
    model = fp8amp.convert(copy.deepcopy(plain))
    x = torch.randn(16, 32, dtype=to)
    for m in (plain, model):
        m.to(to)
        m.y = m(x)
    assert [p.dtype for p in model.parameters()] == [to] * 4
    assert model.y.dtype == plain.y.dtype and _rel(model.y, plain.y) < 0.1
    assert model[0].input_scaling.scale.dtype == F32  # the scaling state keeps float32


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("change", ["bfloat16", "half", "double"])
def test_a_dtype_change_of_an_o1_o2_master_is_refused(level, change):
    model, _ = _at(level, _model())
    with pytest.raises(ValueError, match="O1/O2 FP16 master of logical dtype torch.float32"):
        getattr(model, change)()
    model.float()  # its own dtype: nothing to change
    assert model(torch.randn(16, 32)).dtype == F32


# ------------------------------------------------------------------------------------------------
# Inputs FP8 cannot take


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.complex64])
def test_an_input_fp8_cannot_take_is_refused_saying_what_works(level, dtype):
    """autocast casts only float32, bfloat16 and float16 tensors, the dtypes Fp8Linear takes: the
    error told to run under torch.autocast, where the same input is refused again (and nn.Linear
    fails on it too)."""
    model, _ = _at(level, _model())
    x = torch.randn(16, 32).to(dtype)
    for autocast in (None, BF16):
        with _autocast(autocast), pytest.raises(ValueError) as error:
            model(x)
        message = str(error.value)
        assert f"the input x must be float32, bfloat16 or float16, got {dtype}" in message
        assert "x.float()" in message and "run under torch.autocast" not in message


# ------------------------------------------------------------------------------------------------
# weight_grad="fp32" of a 16-bit model


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_fp32_weight_grads_of_a_16_bit_model_are_warned_about(dtype):
    """weight_grad="fp32" promises float32 weight gradients, a higher-precision accumulator; autograd
    gives a gradient its parameter's dtype, so a 16-bit model's were 16-bit, silently."""
    with pytest.warns(UserWarning, match=rf"weight_grad='fp32'.*2 Linear weights are {dtype} \(0.weight, "
                                         rf"2.weight\).*gradients are {dtype}, not float32"):
        model, _ = fp8amp.initialize(_model(dtype), None, "O1", weight_grad="fp32")
    model(torch.randn(16, 32, dtype=dtype)).float().sum().backward()
    assert model[0].weight.grad.dtype == dtype  # what the warning says


def test_fp32_weight_grads_of_a_float32_model_are_float32(recwarn):
    model, _ = fp8amp.initialize(_model(), None, "O1", weight_grad="fp32")
    with torch.autocast("cpu", dtype=BF16):
        model(torch.randn(16, 32)).float().sum().backward()
    assert type(model[0].weight.grad) is torch.Tensor and model[0].weight.grad.dtype == F32
    assert not [w for w in recwarn if "weight_grad" in str(w.message)]
