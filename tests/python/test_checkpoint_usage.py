"""Checkpoints as users save and load them (2026-12-06): model and optimizer state dicts of every
level into the same or another level, recipe or plain model, and what is refused when the
checkpoint does not fit. Each case is compared with what plain torch does for the same load."""

import copy

import pytest
import torch
from torch import nn

import fp8amp


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.LayerNorm(32))


def _setup(level, groups, seed=0):
    """A model at ``level`` ("plain": unconverted, torch's AdamW) and its optimizer, whose param
    groups ``groups(model)`` makes."""
    model = _model(seed)
    optimizer = torch.optim.AdamW(groups(model), lr=1e-2)
    if level == "plain":
        return model, optimizer
    return fp8amp.initialize(model, optimizer, level, policy="all")


def _train(model, optimizer, steps):
    for i in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 32, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        optimizer.step()


def _two_groups(model):
    return [{"params": list(model[0].parameters()) + list(model[3].parameters())},
            {"params": list(model[2].parameters()), "lr": 1e-3}]


@pytest.mark.parametrize("groups, message", [
    (lambda model: [{"params": list(model.parameters())}], r"2 param groups \(4, 2 params\), this optimizer 1 param group \(6 params\)"),
    (lambda model: _two_groups(model)[::-1], r"2 param groups \(4, 2 params\), this optimizer 2 param groups \(2, 4 params\)"),
], ids=["one_group", "groups_swapped"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_state_dict_of_other_param_groups_is_refused_naming_the_groups(level, groups, message):
    """A state dict saved with other param groups than the optimizer's: torch's AdamW says that
    the groups differ; fp8amp's said that a param's saved moment had another shape, "a state dict
    of another model", when the model was the same (its moments were matched to the wrong params)."""
    model, optimizer = _setup(level, _two_groups)
    _train(model, optimizer, 2)
    saved = optimizer.state_dict()
    with pytest.raises(ValueError, match="parameter group"):  # plain torch
        _setup("plain", groups)[1].load_state_dict(copy.deepcopy(saved))
    _, fresh = _setup(level, groups, seed=1)
    with pytest.raises(ValueError, match=r"fp8amp.optim.AdamW.load_state_dict: the state dict has " + message):
        fresh.load_state_dict(copy.deepcopy(saved))
    assert not fresh.state  # nothing loaded
