"""The scaling hooks of several optimizers over one model (each history rolled once a step, by the
first optimizer registered) and of copies of a registered optimizer (deepcopy, pickle,
torch.save: the copy updates the scaling of the model copied with it)."""

import copy
import gc
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp.amax_sync import delayed_states


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))


def _batch(i, scale=1.0):
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) * scale


def _train(model, optimizers, steps, first=0, scale=1.0):
    for i in range(first, first + steps):
        for opt in optimizers:
            opt.zero_grad()
        model(_batch(i, scale)).pow(2).mean().backward()
        for opt in optimizers:
            opt.step()


def _histories(model):
    return [torch.cat([s.amax_history.flatten(), s.counter.flatten().float()]) for s in delayed_states(model)]


def _initialized_pair(level="O2"):
    """initialize(model, None) and one fp8amp optimizer per Linear (Muon + AdamW, say)."""
    model, _ = fp8amp.initialize(_mlp(), None, level, policy="all")
    return model, [fp8amp.initialize_optimizer(model, torch.optim.AdamW(model[k].parameters(), lr=1e-2), level)
                   for k in (0, 2)]


def _converted_pair():
    """convert (FP8 compute) and two torch optimizers, each registered for the whole model."""
    model = fp8amp.convert(_mlp(), policy="all")
    optimizers = [torch.optim.AdamW(model[k].parameters(), lr=1e-2) for k in (0, 2)]
    for opt in optimizers:
        fp8amp.register_scaling_hooks(model, opt)
    return model, optimizers


def _initialized_one(level="O2"):
    model = _mlp()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, policy="all")
    return model, [opt]


def _converted_one():
    model = fp8amp.convert(_mlp(), policy="all")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fp8amp.register_scaling_hooks(model, opt)
    return model, [opt]


@pytest.mark.parametrize("pair, one", [(_initialized_pair, None), (_converted_pair, _converted_one)],
                         ids=["initialize_optimizer", "convert + register_scaling_hooks"])
def test_two_optimizers_over_parts_of_a_model_roll_each_history_once_a_step(pair, one):
    """Each optimizer's post-hook updated every state of the model: the histories rolled twice per
    iteration (the counter at 8 after 4 iterations, every other history row 0)."""
    model, optimizers = pair()
    _train(model, optimizers, 4)
    for s in delayed_states(model):
        assert s.counter.eq(4).all()
        assert s.amax_history[:, 1:5].gt(0).all() and s.amax_history[:, 5:].eq(0).all()
    if one is not None:  # AdamW is elementwise: one optimizer over all params trains the same
        single, [opt] = one()
        _train(single, [opt], 4)
        for got, want in zip(_histories(model), _histories(single)):
            assert torch.equal(got, want)


def test_the_next_optimizer_takes_over_when_the_first_is_gone():
    model, (first, second) = _initialized_pair()
    _train(model, [first, second], 2)
    # The first (the owner) is alive and does not step: the second takes its states over (the
    # scales froze while anything held it, docs/hardening.md), once the first stays idle between
    # two of its steps.
    _train(model, [second], 1, first=2)
    assert all(s.counter.eq(3).all() for s in delayed_states(model))
    del first
    gc.collect()
    _train(model, [second], 2, first=3)
    for s in delayed_states(model):
        assert s.counter.eq(5).all() and s.amax_history[:, 1:6].gt(0).all()
    with pytest.warns(UserWarning, match="already updated after every optimizer.step"):
        fp8amp.update_scaling(model)
    del second
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8amp.update_scaling(model)  # no optimizer updates it any more


def _copied(how, obj):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _scaling_buffers(model):
    return [t.clone() for s in delayed_states(model) for t in s.buffers()]


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("setup", [_initialized_one, _converted_one], ids=["O2", "fp8 + torch AdamW"])
def test_a_copy_of_model_and_optimizer_updates_its_own_scaling(setup, how):
    """torch's Optimizer.__getstate__ keeps no hooks: the copy's scales froze, and after the
    warm-up its outputs saturated once its inputs grew (relative error 0.996)."""
    model, [opt] = setup()
    warm_up = model[0].input_scaling.amax_history.shape[-1]
    _train(model, [opt], warm_up + 2)
    model_copy, opt_copy = _copied(how, (model, opt))
    before = _scaling_buffers(model)
    scale = model_copy[0].input_scaling.scale.clone()
    x = _batch(100, 1000.0)
    _train(model_copy, [opt_copy], warm_up + 2, first=100, scale=1000.0)
    assert model_copy[0].input_scaling.scale.item() < scale.item() / 256  # follows the 1000x inputs
    y = model_copy[0](x)
    ref = nn.functional.linear(x, model_copy[0].weight.detach().float(), model_copy[0].bias.detach())
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 0.1  # not saturated
    for got, want in zip(_scaling_buffers(model), before):  # the original's, untouched by the copy's steps
        assert torch.equal(got, want)
    _train(model, [opt], 1)  # and still updated by its own optimizer
    assert not torch.equal(model[0].input_scaling.amax_history, before[0])


@pytest.mark.parametrize("setup", [_initialized_one, _converted_one], ids=["O2", "fp8 + torch AdamW"])
def test_a_copy_of_the_optimizer_alone_leaves_the_models_scaling_alone(setup):
    model, [opt] = setup()
    _train(model, [opt], 2)
    opt_copy = copy.deepcopy(opt)  # with copies of the params and of the model it scales
    before = _scaling_buffers(model)
    opt_copy.step()
    for got, want in zip(_scaling_buffers(model), before):
        assert torch.equal(got, want)
    _train(model, [opt], 1)
    assert model[0].input_scaling.counter.eq(3).all()


NEVER_UPDATED = r"nothing updated the model's FP8 scaling since its previous step"


def _converted(how):
    """A model converted without an optimizer, and the optimizer a user then builds over it."""
    model = _mlp()
    if how == "convert":
        return fp8amp.convert(model, policy="all"), torch.optim.AdamW
    model, _ = fp8amp.initialize(model, None, "O2", policy="all")
    return model, lambda params: fp8amp.optim.AdamW(params, state_dtypes="O2")


@pytest.mark.parametrize("how", ["convert", "initialize"])
def test_an_optimizer_stepping_a_model_whose_scaling_nothing_updates_warns_once(how):
    model, make = _converted(how)
    opt = make(model.parameters())
    _train(model, [opt], 1)
    with pytest.warns(UserWarning, match=NEVER_UPDATED):
        _train(model, [opt], 1, first=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, [opt], 2, first=2)  # once


@pytest.mark.parametrize("update", ["hooks", "by hand", "by hand, wrapped", "initialize_optimizer", "unconverted"])
def test_a_model_whose_scaling_is_updated_is_not_warned_about(update):
    model, make = _converted("initialize")
    if update == "initialize_optimizer":
        opt = fp8amp.initialize_optimizer(model, torch.optim.AdamW(model.parameters()), "O2")
    elif update == "unconverted":  # (nothing to update any more)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (unconvert's note on the optimizer's masters)
            model = fp8amp.unconvert(model)
        opt = torch.optim.AdamW(model.parameters())
    else:
        opt = make(model.parameters())
    if update == "hooks":
        fp8amp.register_scaling_hooks(model, opt)
    wrapper = nn.ModuleList([model])  # (as DDP holds the model: the update of the wrapper counts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(4):
            _train(model, [opt], 1, first=i)
            if update.startswith("by hand"):
                fp8amp.update_scaling(wrapper if update.endswith("wrapped") else model)
    assert update == "unconverted" or all(bool((s.counter == 4).all()) for s in delayed_states(model))


def test_an_optimizer_over_other_parameters_is_not_warned_about():
    model, _ = _converted("convert")
    other = nn.Linear(4, 4)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            other(torch.randn(2, 4)).sum().backward()
            opt.step()
    del model
