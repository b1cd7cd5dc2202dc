"""The MS-AMP migration table and the torchao / Transformer Engine notes of docs/integrations.md,
followed as a user would (CPU, FP8 emulation): each call the table names exists and does what its
row says."""

import warnings

import pytest
import torch
from torch import nn

import fp8amp


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _train(model, optimizer, steps=6):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_initialize_without_optimizer_then_either_named_optimizer_path_matches_initialize(level):
    # Row "msamp.initialize(model)": initialize_optimizer, or fp8amp.optim.AdamW + register_scaling_hooks.
    model = _model()
    reference = _train(*fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), opt_level=level))
    model = _model()
    assert fp8amp.initialize(model, None, level)[1] is None
    optimizer = fp8amp.initialize_optimizer(model, torch.optim.AdamW(model.parameters()), level)
    assert all(map(torch.equal, _train(model, optimizer), reference))
    model = _model()
    fp8amp.initialize(model, None, level)
    optimizer = fp8amp.optim.AdamW(model.parameters(), state_dtypes=level)
    fp8amp.register_scaling_hooks(model, optimizer)
    assert all(map(torch.equal, _train(model, optimizer), reference))
    assert int(model[0].input_scaling.counter) == 6


def test_o3_is_refused_pointing_at_fully_shard():
    with pytest.raises(ValueError, match="fully_shard"):
        fp8amp.initialize(_model(), None, opt_level="O3")


def test_scaling_recipe_defaults_are_ms_amps_and_te_recipe_gives_tes_scale():
    assert fp8amp.ScalingRecipe() == fp8amp.ScalingRecipe(history_len=16, margin=0, pow2_scale=True)
    model = _model()
    recipe = fp8amp.ScalingRecipe(history_len=4, margin=1, pow2_scale=False)  # DelayedScaling(4, margin=1)
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O1", recipe=recipe)
    _train(model, optimizer, steps=2)
    state = model[0].input_scaling
    amax = state.amax_history.max()
    assert state.scale.item() == (torch.tensor(448.0) / amax).item() * 0.5  # fp8_max / amax / 2^margin


def test_torchao_style_filter_sees_fully_qualified_linear_names():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.w1 = nn.Linear(32, 32), nn.Linear(32, 32)

    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    model.output = nn.Linear(32, 32)
    seen = []
    fp8amp.convert(model, module_filter_fn=lambda module, fqn: seen.append(fqn) or fqn != "output")
    assert seen == ["layers.0.wq", "layers.0.w1", "layers.1.wq", "layers.1.w1", "output"]
    assert isinstance(model.layers[1].w1, fp8amp.Fp8Linear) and type(model.output) is nn.Linear


def test_directly_built_fp8linear_with_scaling_updates_does_not_warn():
    model = nn.Sequential(fp8amp.Fp8Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, optimizer, steps=3)
    assert int(model[0].input_scaling.counter) == int(model[2].input_scaling.counter) == 3


def _unregistered_steps(model, optimizer, steps=3) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, optimizer, steps=steps)
    return [str(w.message) for w in caught if "nothing updated the model's FP8 scaling" in str(w.message)]


def test_directly_built_fp8linear_stepped_by_an_unregistered_optimizer_warns_once():
    """MS-AMP's FP8Linear counterpart built by hand and stepped by a torch optimizer that nobody
    registered kept its delayed scales in warm-up for the whole run, silently (a model converted
    without an optimizer was watched; a layer built by its constructor was not)."""
    model = nn.Sequential(fp8amp.Fp8Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    assert len(_unregistered_steps(model, torch.optim.AdamW(model.parameters()))) == 1
    assert int(model[0].input_scaling.counter) == 0  # nothing updated it: the warning is right
    assert not _unregistered_steps(model, torch.optim.AdamW(model.parameters()))  # once


def test_directly_built_fp8linear_registered_later_or_put_into_a_registered_model_does_not_warn():
    from fp8amp import scaling_hooks

    model = nn.Sequential(fp8amp.Fp8Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    optimizer = torch.optim.AdamW(model.parameters())
    fp8amp.register_scaling_hooks(model, optimizer)
    assert not _unregistered_steps(model, optimizer)
    assert int(model[0].input_scaling.counter) == 3
    # A layer built into a model that is already registered: the model's hooks find and update it.
    model[2] = fp8amp.Fp8Linear(64, 32)
    optimizer.add_param_group({"params": list(model[2].parameters())})
    assert not _unregistered_steps(model, optimizer)
    assert int(model[2].input_scaling.counter) == 3
    assert model[2] not in scaling_hooks._WATCHED and model[0] not in scaling_hooks._WATCHED
    # convert of a model with built layers in it watches the model, not each layer as well.
    model = nn.Sequential(fp8amp.Fp8Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    fp8amp.convert(model)
    assert model in scaling_hooks._WATCHED and model[0] not in scaling_hooks._WATCHED
    assert len(_unregistered_steps(model, torch.optim.AdamW(model.parameters()))) == 1
