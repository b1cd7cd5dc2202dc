"""pickle of fp8amp's optimizer and of its state dict: torch cannot pickle.loads a float8 tensor
("UntypedStorage has no attribute 'dtype'"), which O2's exp_avg codes are; they travel as uint8
views of their bytes, and come back bit-identical. torch.save / torch.load(weights_only=True)
keep working, also for state dicts saved in the earlier form."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp.optim import ScaledMoment


def _trained(level, recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=recipe,
                                   policy="all")
    for i in range(2):
        _step(model, opt, i)
    return model, opt


def _step(model, opt, i):
    opt.zero_grad()
    model(torch.randn(16, 128, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
    opt.step()


def _flat(t):
    """A tensor as [(dtype, shape), its bytes]; a ScaledTensor as its type, codes and scale."""
    if isinstance(t, fp8amp.ScaledTensor):
        return [type(t)] + _flat(t.codes) + _flat(t.scale_inv)
    return [(t.dtype, tuple(t.shape)), t.detach().reshape(-1).contiguous().view(torch.uint8)]


def _state_bits(states):
    """Every state tensor flattened, by param order and key."""
    return [x for state in states for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)
            for x in [k] + _flat(v)]


def _params_bits(model):
    return [x for p in model.parameters() for x in _flat(p.detach())]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


LEVELS_RECIPES = [("O1", "tensorwise"), ("O2", "tensorwise"), ("O1", "blockwise"), ("O2", "blockwise")]


@pytest.mark.parametrize("level, recipe", LEVELS_RECIPES)
def test_pickle_round_trip_of_the_state_dict_loads_and_steps_bit_identically(level, recipe):
    model, opt = _trained(level, recipe)
    resumed_model = copy.deepcopy(model)
    saved = opt.state_dict()
    loaded = pickle.loads(pickle.dumps(saved))  # an AttributeError at O2, before
    assert (isinstance(loaded["state"][0]["exp_avg"], ScaledMoment)) == (level == "O2")
    _same(_state_bits(loaded["state"].values()), _state_bits(saved["state"].values()))
    resumed = fp8amp.initialize_optimizer(resumed_model, torch.optim.AdamW(resumed_model.parameters(), lr=1e-2),
                                          level)
    resumed.load_state_dict(loaded)
    for i in (2, 3):
        _step(model, opt, i)
        _step(resumed_model, resumed, i)
    _same(_params_bits(resumed_model), _params_bits(model))
    _same(_state_bits(resumed.state.values()), _state_bits(opt.state.values()))


@pytest.mark.parametrize("level, recipe", LEVELS_RECIPES)
def test_pickle_round_trip_of_the_optimizer_keeps_its_state_and_steps_bit_identically(level, recipe):
    model, opt = _trained(level, recipe)
    model_copy, opt_copy = pickle.loads(pickle.dumps((model, opt)))  # an AttributeError at O2, before
    if level == "O2":
        assert opt_copy.state[opt_copy.param_groups[0]["params"][0]]["exp_avg"].dtype == fp8amp.E4M3
    _same(_state_bits(opt_copy.state.values()), _state_bits(opt.state.values()))
    for i in (2, 3):
        _step(model, opt, i)
        _step(model_copy, opt_copy, i)
    _same(_params_bits(model_copy), _params_bits(model))
    _same(_state_bits(opt_copy.state.values()), _state_bits(opt.state.values()))


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_torch_load_weights_only_takes_the_state_dict_and_the_earlier_form(monkeypatch):
    _, opt = _trained("O2", "tensorwise")
    saved = opt.state_dict()
    loaded = torch.load(_saved(saved), weights_only=True)
    _same(_state_bits(loaded["state"].values()), _state_bits(saved["state"].values()))
    # The earlier form: fp8amp.optim.ScaledMoment called on the float8 codes.
    monkeypatch.setattr(ScaledMoment, "__module__", "fp8amp.optim")
    monkeypatch.setattr(ScaledMoment, "__reduce_ex__", lambda m, _: (ScaledMoment, (m.codes, m.scale_inv, m.dtype)))
    earlier = _saved(saved)
    monkeypatch.undo()
    loaded = torch.load(earlier, weights_only=True)
    _same(_state_bits(loaded["state"].values()), _state_bits(saved["state"].values()))
