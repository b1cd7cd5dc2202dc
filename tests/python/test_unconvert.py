"""fp8amp.unconvert: back to nn.Linear and plain torch.optim, and fp8amp's optimizer state dict
read by a plain torch optimizer (real values, not the codes)."""

import io
import warnings

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp.optim import ScaledMoment


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16, bias=False), nn.LayerNorm(16)).to(dtype)


def _train(model, opt, steps=3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(24, 32, generator=gen).to(dtype)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _real_moments(opt, param):
    """(m, v) of an fp8amp optimizer's state as real float32 values."""
    state = opt.state[param]
    m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
    if "exp_avg_scale_inv" in state:
        m, v = m * state["exp_avg_scale_inv"], v * state["exp_avg_sq_scale_inv"]
    return m, v


def test_never_converted_model_and_optimizer_come_back_unchanged():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = list(model.modules())
    assert fp8amp.unconvert(model) is model
    got_model, got_opt = fp8amp.unconvert(model, opt)
    assert got_model is model and got_opt is opt
    assert list(model.modules()) == modules
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_loads_strictly_into_a_fresh_model_with_the_trained_values(level, dtype):
    model = _model(dtype)
    if level == "fp8":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fp8amp.convert(model, optimizer=opt, policy="all")
    else:
        model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, policy="all")
    _train(model, opt, dtype=dtype)
    # The converted state dict holds a master in float32 (exactly); the unconverted model in its dtype.
    expected = {k: (v.dequantize() if isinstance(v, fp8amp.ScaledTensor) else v).to(dtype, copy=True)
                for k, v in model.state_dict().items() if "scaling" not in k}

    if level == "fp8":  # the optimizer holds the model's own parameters: nothing to warn about
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert fp8amp.unconvert(model) is model
    else:  # opt holds the old masters: it would train the biases and norms only
        with pytest.warns(UserWarning, match="still holds the old masters.*fp8amp.unconvert.model, optimizer"):
            assert fp8amp.unconvert(model) is model
    assert not any(isinstance(m, fp8amp.Fp8Linear) for m in model.modules())
    assert fp8amp.conversion_report(model) is None
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in state.items():
        assert type(value) is torch.Tensor and value.dtype == dtype, key
        assert torch.equal(value, expected[key]), key

    fresh = _model(dtype)
    fresh.load_state_dict(state, strict=True)
    x = torch.randn(8, 32).to(dtype)
    assert torch.equal(fresh(x), model(x))


def test_a_layer_reached_under_two_names_becomes_one_linear():
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    model, _ = fp8amp.initialize(model, None, "O2", policy="all")
    with pytest.warns(UserWarning, match="1 O1/O2 master weight"):
        fp8amp.unconvert(model)
    assert type(model[0]) is nn.Linear and model[0] is model[2]


@pytest.mark.parametrize("cls, plain_cls", [(torch.optim.AdamW, torch.optim.AdamW), (torch.optim.Adam, torch.optim.Adam)])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_optimizer_becomes_plain_torch_with_real_moments(level, cls, plain_cls):
    model = _model()
    model, opt = fp8amp.initialize(model, cls(model.parameters(), lr=1e-2, weight_decay=0.1), level, policy="all")
    _train(model, opt)
    old_params = [p for g in opt.param_groups for p in g["params"]]
    moments = [_real_moments(opt, p) for p in old_params]

    model, plain = fp8amp.unconvert(model, opt)
    assert type(plain) is plain_cls
    new_params = [p for g in plain.param_groups for p in g["params"]]
    assert {id(p) for p in new_params} == {id(p) for p in model.parameters()}
    group = plain.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (1e-2, 0.1)
    for p, (m, v) in zip(new_params, moments):
        state = plain.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == 3.0 and state["step"].device.type == "cpu"
        assert type(state["exp_avg"]) is torch.Tensor
        assert torch.equal(state["exp_avg"], m) and torch.equal(state["exp_avg_sq"], v)
        assert m.abs().max() > 0
    _train(model, plain, steps=1)  # plain torch steps on
    assert float(plain.state[new_params[0]]["step"]) == 4.0
    # the fp8amp optimizer holds the old masters: stepping it would leave the model's weights alone
    for call in (opt.step, opt.zero_grad):
        with pytest.raises(RuntimeError, match="unconvert replaced this optimizer.*unconvert.model, optimizer"):
            call()


def test_plain_adamw_loading_fp8amp_o2_state_reads_real_values():
    """It took the E4M3 codes for values (2^k too large) before O2 moments were saved with their scale."""
    model = _model()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")
    _train(model, opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    moments = [_real_moments(opt, p) for p in params]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert isinstance(saved["state"][0]["exp_avg"], ScaledMoment)

    # As saved, and copied tensor by tensor (clone, detach, cpu: what checkpoint tools do; a copy
    # used to be a ScaledTensor, which torch's cast left as it was: FP8 moments in a plain AdamW).
    copied = {"param_groups": saved["param_groups"],
              "state": {i: {k: (v.clone().detach().cpu() if k != "step" else v) for k, v in st.items()}
                        for i, st in saved["state"].items()}}
    for state_dict in (saved, copied):
        plain_model = _model()
        plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
        plain.load_state_dict(state_dict)
        for p, (m, v) in zip(plain_model.parameters(), moments):
            assert type(plain.state[p]["exp_avg"]) is torch.Tensor
            assert torch.equal(plain.state[p]["exp_avg"], m) and torch.equal(plain.state[p]["exp_avg_sq"], v)


def test_fp8amp_reloads_its_own_o2_state_bit_for_bit():
    model = _model()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")
    _train(model, opt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    params = [p for g in opt.param_groups for p in g["params"]]
    again = fp8amp.optim.AdamW(params, lr=1e-2, state_dtypes="O2")
    again.load_state_dict(torch.load(buf, weights_only=True))
    for p in params:
        a, b = opt.state[p], again.state[p]
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key].view(torch.uint8) if a[key].element_size() == 1 else a[key],
                               b[key].view(torch.uint8) if b[key].element_size() == 1 else b[key]), key


def test_bad_arguments():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        fp8amp.unconvert("model")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        fp8amp.unconvert(_model(), "adam")
