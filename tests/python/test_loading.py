"""What loading a checkpoint refuses or converts (issue 23): a plain torch.optim state dict into
fp8amp's optimizer, a model state dict without scaling buffers, non-finite values into masters and
into ScaledTensor.from_tensor."""

import copy
import io

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp.formats import E4M3, FP16


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _initialize(model, level):
    """A copy of model at `level` and the optimizer initialize returns for it."""
    model = copy.deepcopy(model)
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), level, policy="all")[:2]


def _plain_adamw_state(model, frozen=()):
    """A torch.optim.AdamW state dict after two steps, with no state for the `frozen` params."""
    for p in frozen:
        p.requires_grad_(False)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for t in range(2):
        plain.zero_grad()
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(t))).square().mean().backward()
        plain.step()
    for p in frozen:
        p.requires_grad_(True)
    return plain.state_dict()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_plain_torch_adamw_state_is_converted_to_the_level(level):
    model = _model()
    saved = _plain_adamw_state(model, frozen=[model[2].bias])
    plain_states = copy.deepcopy(saved["state"])
    fp8_model, opt = _initialize(model, level)
    opt.load_state_dict(saved)
    m_dtype, v_dtype = fp8amp.optim.STATE_DTYPES[level]
    assert all(g["state_dtypes"] == level for g in opt.param_groups)
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if i not in plain_states:  # the frozen bias: no state yet
            continue
        st = opt.state[p]
        assert st["exp_avg"].dtype == m_dtype and st["exp_avg_sq"].dtype == v_dtype
        assert st["step"].item() == 2
        m, v = st["exp_avg"].float(), st["exp_avg_sq"].float()
        if level == "O2":
            m, v = m * st["exp_avg_scale_inv"], v * st["exp_avg_sq_scale_inv"]
            assert torch.allclose(m, plain_states[i]["exp_avg"], rtol=2 ** -3, atol=0)  # E4M3: 3 mantissa bits
            assert torch.allclose(v, plain_states[i]["exp_avg_sq"], rtol=2 ** -10, atol=0)
        else:
            assert torch.equal(m, plain_states[i]["exp_avg"]) and torch.equal(v, plain_states[i]["exp_avg_sq"])
    # The next step works, also for the param without state (it used to raise KeyError: 'state_dtypes').
    fp8_model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    assert 3 not in plain_states and opt.state[params[3]]["exp_avg"].dtype == m_dtype
    assert all(torch.isfinite(p.float()).all() for p in fp8_model.parameters())


def test_plain_state_with_amsgrad_is_refused_before_loading():
    model = _model()
    saved = _plain_adamw_state(model)
    saved["param_groups"][0]["amsgrad"] = True
    opt = _initialize(model, "O2")[1]
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        opt.load_state_dict(saved)
    assert not any(opt.state.values())  # nothing was loaded


def test_nonfinite_moment_in_a_state_dict_is_refused():
    model = _model()
    saved = _plain_adamw_state(model)
    saved["state"][1]["exp_avg_sq"][3] = float("inf")
    opt = fp8amp.optim.AdamW(model.parameters(), state_dtypes="O1")
    with pytest.raises(ValueError, match=r"param 1 of group 0: state 'exp_avg_sq' holds inf or NaN"):
        opt.load_state_dict(saved)


def test_negative_second_moment_in_a_state_dict_is_refused():
    """A negative exp_avg_sq (a corrupt checkpoint) made every later step skipped (its square root
    is NaN), silently."""
    model = _model()
    saved = _plain_adamw_state(model)
    saved["state"][1]["exp_avg_sq"][2] = -1e-6
    for level in ("O1", "O2"):
        opt = fp8amp.optim.AdamW(model.parameters(), state_dtypes=level)
        with pytest.raises(ValueError, match=r"param 1 of group 0: state 'exp_avg_sq' holds a negative value"):
            opt.load_state_dict(saved)


@pytest.mark.parametrize("saved_level, level", [("O1", "O2"), ("O2", "O1")])
def test_a_state_dict_of_the_other_level_loads_into_this_level(saved_level, level):
    """The optimizer keeps its level: an O1 state dict into an O2 optimizer is quantized (it used to
    turn the optimizer O1: float32 moments, 8 bytes a param more), an O2 one into O1 is made real
    values, exactly; the saved values within the formats' rounding, and the next step runs."""
    model = _model()
    fp8_model, source = _initialize(model, saved_level)
    for t in range(2):
        source.zero_grad()
        fp8_model(torch.randn(8, 16, generator=torch.Generator().manual_seed(t))).square().mean().backward()
        source.step()
    target = fp8amp.optim.AdamW([p for g in source.param_groups for p in g["params"]], state_dtypes=level)
    target.load_state_dict(source.state_dict())
    m_dtype, v_dtype = fp8amp.optim.STATE_DTYPES[level]
    assert all(g["state_dtypes"] == level for g in target.param_groups)
    for p in (p for g in source.param_groups for p in g["params"]):
        a, b = source.state[p], target.state[p]
        assert b["exp_avg"].dtype == m_dtype and b["exp_avg_sq"].dtype == v_dtype
        for key, scale_key in (("exp_avg", "exp_avg_scale_inv"), ("exp_avg_sq", "exp_avg_sq_scale_inv")):
            real_a = a[key].float() * a[scale_key] if scale_key in a else a[key]
            real_b = b[key].float() * b[scale_key] if scale_key in b else b[key]
            if level == "O1":  # real values: exactly the saved ones
                assert scale_key not in b and torch.equal(real_b, real_a), key
            else:  # quantized: within E4M3's / FP16's half ulp, or half its smallest subnormal
                rtol, eta = (2 ** -4, 2 ** -10) if key == "exp_avg" else (2 ** -11, 2 ** -25)
                torch.testing.assert_close(real_b, real_a, rtol=rtol, atol=eta * b[scale_key].item())
    fp8_model(torch.randn(8, 16)).square().mean().backward()
    target.step()


# ------------------------------------------------------------------------------------------ non-finite


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_checkpoint_with_inf_into_a_master_is_refused(level):
    model = fp8amp.initialize(_model(), None, level, policy="all")[0]
    saved = model.state_dict()
    saved["2.weight"][1, 2] = float("inf")  # it used to load as 65504
    before = model[2].weight.dequantize()
    with pytest.raises(ValueError, match=r"2\.weight holds inf or NaN"):
        model.load_state_dict(saved)
    assert torch.equal(model[2].weight.dequantize(), before)


def test_initialize_refuses_a_nonfinite_weight():
    model = _model()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    # (and names the likely cause: a model made with to_empty() whose weights were not loaded yet)
    with pytest.raises(ValueError, match=r"initialize: 0\.weight holds inf or NaN.*to_empty\(\).*load them before"):
        fp8amp.initialize(model, None, "O2", policy="all")


@pytest.mark.parametrize("fmt", [E4M3, FP16])
def test_nonfinite_values_into_a_scaled_tensor_read_nan(fmt):
    x = torch.tensor([1.0, float("inf")])
    assert fp8amp.ScaledTensor.from_tensor(x, fmt).dequantize().isnan().all()  # was [1, 448] / [1, 65504]
    # Without nan_if_nonfinite only the infinite element reads NaN: an inf is never saturated.
    kept = fp8amp.ScaledTensor.from_tensor(x, fmt, nan_if_nonfinite=False).dequantize()
    assert kept[0].item() == 1.0 and kept[1].isnan()
    master = fp8amp.MasterWeight.from_tensor(torch.ones(2))
    master.copy_(x)  # copy_ needs no host read: NaN, where it saturated
    assert master.dequantize().isnan().all()
    codes, _, scale_inv = master.fp8_copy
    assert (codes.float() * scale_inv).isnan().all()  # the E4M3 copy the forward reads too


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
@pytest.mark.parametrize("inf", [float("inf"), -float("inf")])
def test_an_infinite_input_gives_a_nonfinite_output_row_under_delayed_scaling(level, inf):
    """The delayed scale comes from the history, so the input's own inf never reaches scale_inv:
    the cast itself must code it as NaN (it used to saturate it to +-448: a finite row)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16))
    model = (fp8amp.convert(model, policy="all") if level == "fp8"
             else fp8amp.initialize(model, None, level, policy="all")[0])
    for _ in range(3):  # past the current-scaling warm-up: the scale is the history's
        model(torch.randn(4, 32))
    x = torch.randn(4, 32)
    x[1, 5] = inf
    y = model(x)
    assert not y[1].isfinite().any()
    assert y[[0, 2, 3]].isfinite().all()


def _fresh_scaling_buffers(model):
    return {n: b for n, b in model.named_buffers() if "scaling" in n}


def test_a_model_converted_on_the_meta_device_starts_its_scaling_fresh_after_to_empty():
    """The meta-device recipe (big models, FSDP2): convert on meta, to_empty(), then the model's
    own weight init, which knows nothing of the scaling buffers. to_empty() leaves uninitialized
    memory in every buffer; the states must read as new ones do, and the forward must equal a
    model converted from the same weights."""
    with torch.device("meta"):
        meta = fp8amp.convert(_model(), policy="all")
    meta.to_empty(device="cpu")
    reference = fp8amp.convert(_model(1), policy="all")
    with torch.no_grad():
        for p, q in zip(meta.parameters(), reference.parameters()):
            p.copy_(q)  # the model's own init: parameters only
    for (name, b), r in zip(_fresh_scaling_buffers(meta).items(), _fresh_scaling_buffers(reference).values()):
        assert torch.equal(b, r), name
    x = torch.randn(4, 16)
    assert torch.equal(meta(x), reference(x))


def test_load_state_dict_with_assign_into_a_model_converted_on_meta_runs_where_the_weights_are():
    """load_state_dict(..., assign=True) brings the persistent buffers; the scaling states' own
    constant (not in a checkpoint) follows them off the meta device."""
    with torch.device("meta"):
        meta = fp8amp.convert(_model(), policy="all")
    reference = fp8amp.convert(_model(1), policy="all")
    meta.load_state_dict(reference.state_dict(), assign=True)
    assert not any(b.is_meta for b in meta.buffers())
    x = torch.randn(4, 16)
    assert torch.equal(meta(x), reference(x))


@pytest.mark.parametrize("how", ["fresh_scaling_if_missing", "strict_false"])
def test_assign_loading_a_plain_checkpoint_into_a_model_converted_on_meta_makes_its_scaling_states(how):
    """A checkpoint without scaling buffers, loaded with assign=True: the states stayed on meta (the
    fresh branch returns before any buffer moves), and the forward failed in the cast op with "got
    scale on meta and x on cpu". They are made where the weights are, from the initial state."""
    with torch.device("meta"):
        meta = fp8amp.convert(_model(), policy="all")
    plain = _model(1)
    if how == "fresh_scaling_if_missing":
        with fp8amp.fresh_scaling_if_missing():
            meta.load_state_dict(plain.state_dict(), assign=True)
    else:
        missing = meta.load_state_dict(plain.state_dict(), strict=False, assign=True).missing_keys
        assert missing and all("scaling" in key for key in missing)
    reference = fp8amp.convert(copy.deepcopy(plain), policy="all")
    for (name, b), r in zip(_fresh_scaling_buffers(meta).items(), _fresh_scaling_buffers(reference).values()):
        assert b.device.type == "cpu" and torch.equal(b, r), name
    x = torch.randn(4, 16)
    assert torch.equal(meta(x), reference(x))


def test_a_forward_whose_scaling_state_is_still_on_meta_says_how_to_make_it():
    """Weights set by hand on a model converted on meta leave the scaling states there."""
    with torch.device("meta"):
        meta = fp8amp.convert(_model(), policy="all")
    for layer in (meta[0], meta[2]):
        layer.weight = nn.Parameter(torch.randn(layer.weight.shape))
        layer.bias = nn.Parameter(torch.zeros(layer.bias.shape))
    with pytest.raises(RuntimeError, match=r"ScalingState: .*input_scaling.* is on the meta device but x is on cpu"
                                           r".*to_empty\(device=\.\.\.\)"):
        meta(torch.randn(4, 16))
    for layer in (meta[0], meta[2]):
        for state in (layer.input_scaling, layer.weight_scaling, layer.grad_output_scaling):
            state.to_empty(device="cpu")
    meta(torch.randn(4, 16)).sum().backward()


def test_scaling_buffers_carried_in_the_metadata_load_into_converted_and_plain_models():
    """carry_in_metadata (the Lightning plugin's checkpoints): the scaling buffers out of the keys,
    in the state dict's per-module metadata; it survives torch.save, loads strictly into the
    plain model (which ignores it) and into a converted one (whose states take their values)."""
    trained = fp8amp.convert(_model(), policy="all")
    trained(torch.randn(4, 16)).sum().backward()
    fp8amp.update_scaling(trained)
    state = trained.state_dict()
    scaling = {key: state.pop(key) for key in list(state) if "scaling" in key}
    fp8amp.scaling.carry_in_metadata(state, scaling)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    _model().load_state_dict(state, strict=True)
    converted = fp8amp.convert(_model(1), policy="all")
    converted.load_state_dict(state, strict=True)
    loaded = converted.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in scaling.items())
    assert any(v.count_nonzero() for k, v in scaling.items() if k.endswith("amax_history"))
    with pytest.raises(RuntimeError, match="Missing key"):  # without the metadata: reported, as before
        fp8amp.convert(_model(1), policy="all").load_state_dict(dict(state), strict=True)
