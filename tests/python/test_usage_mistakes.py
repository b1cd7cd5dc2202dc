"""Usage mistakes that did nothing silently, and errors that did not say what is unsupported
(issue 23, items 10 and 11): each now raises or warns with the fix."""

import pickle
import warnings

import pytest
import torch
from torch import nn

import fp8amp


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _loss(model):
    return model(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).square().mean()


# ------------------------------------------------------------------------------------------ item 10


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_optimizer_passed_into_initialize_refuses_to_step(level):
    model = _model()
    passed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, returned = fp8amp.initialize(model, passed, level, policy="all")
    _loss(model).backward()
    before = model[0].weight.dequantize()
    with pytest.raises(RuntimeError, match="initialize replaced this optimizer.*step and zero_grad that one"):
        passed.step()  # it used to run, leaving the Linear weights unchanged
    with pytest.raises(RuntimeError, match="initialize replaced this optimizer"):
        passed.zero_grad()  # the masters' grads would accumulate
    assert torch.equal(model[0].weight.dequantize(), before)
    returned.step()
    assert not torch.equal(model[0].weight.dequantize(), before)


def test_lr_scheduler_built_before_initialize_warns_once():
    model = _model()
    passed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.StepLR(passed, step_size=1, gamma=0.5)  # bound to `passed`: no effect later
    with pytest.warns(UserWarning, match="lr scheduler was built on the optimizer passed in") as record:
        fp8amp.initialize(model, passed, "O2", policy="all")
    assert sum("lr scheduler" in str(w.message) for w in record) == 1


def test_no_warning_without_a_scheduler():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2", policy="all")
