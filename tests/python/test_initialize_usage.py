"""Usage mistakes around fp8amp.initialize and the scaling hooks: what cannot be done to O2 masters
(share_memory, dtype changes) is refused, an optimizer of another model is warned about, the
scaling hooks registered twice update each state once a step, and an update by hand of a model
the hooks already update is warned about."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import fp8amp


def test_share_memory_of_masters_is_refused_not_a_crash():
    """It segfaulted (torch shared a wrapper subclass's storage); run in a child so a crash fails."""
    import subprocess
    import sys
    code = ("import torch, fp8amp\n"
            "m, _ = fp8amp.initialize(torch.nn.Sequential(torch.nn.Linear(16, 16)), None, 'O2', policy='all')\n"
            "try:\n    m.share_memory()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: fp8amp.ScaledTensor: share_memory_() is not supported" in out.stdout


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.float64), lambda m: m.half(), lambda m: m.double()])
def test_dtype_changes_of_masters_are_refused(cast):
    model, _ = fp8amp.initialize(nn.Sequential(nn.Linear(16, 16)), None, "O2", policy="all")
    with pytest.raises(ValueError, match="O1/O2 FP16 master of logical dtype torch.float32"):
        cast(model)
    model.to("cpu")  # a device move is fine
    assert isinstance(model[0].weight, fp8amp.ScaledTensor)
    model.state_dict()


def test_an_optimizer_of_another_model_is_warned_about():
    model_a, model_b = nn.Sequential(nn.Linear(16, 16)), nn.Sequential(nn.Linear(16, 16))
    with pytest.warns(UserWarning, match="none of them the model's, so the model will not train"):
        fp8amp.initialize(model_a, torch.optim.AdamW(model_b.parameters()), "O2", policy="all")


def _histories_after_steps(setup) -> list[torch.Tensor]:
    """The amax histories of a 2-layer MLP's delayed-scaling states after 4 steps whose inputs
    grow, with the model and optimizer that ``setup(model)`` returns."""
    torch.manual_seed(0)
    model, optimizer = setup(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    x = torch.randn(8, 32)
    for i in range(4):
        model(x * (i + 1)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [s.amax_history.clone() for s in fp8amp.amax_sync.delayed_states(model)]


def _converted_with_hooks(model, times=1, submodule=False):
    model = fp8amp.convert(model, policy="all")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(times):
        fp8amp.register_scaling_hooks(model, optimizer)
    if submodule:
        fp8amp.register_scaling_hooks(model[2], optimizer)
    return model, optimizer


def _initialized_then_hooks(model):
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")
    fp8amp.register_scaling_hooks(model, optimizer)
    return model, optimizer


@pytest.mark.parametrize("setup", [functools.partial(_converted_with_hooks, times=2),
                                   functools.partial(_converted_with_hooks, submodule=True)],
                         ids=["twice", "model and a layer of it"])
def test_scaling_hooks_registered_again_update_each_state_once_a_step(setup):
    """A second registration (of the model, or of a module inside it) on the same optimizer used to
    update the states twice a step: every other history entry 0, half the window."""
    once = _histories_after_steps(_converted_with_hooks)
    assert len(once) == 4 and all(h[1:5].gt(0).all() for h in once)
    for got, want in zip(_histories_after_steps(setup), once):
        assert torch.equal(got, want)


def test_register_scaling_hooks_after_initialize_changes_nothing():
    once = _histories_after_steps(
        lambda m: fp8amp.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-2), "O2", policy="all"))
    for got, want in zip(_histories_after_steps(_initialized_then_hooks), once):
        assert torch.equal(got, want)


def test_scaling_hook_and_update_arguments_are_checked():
    model = fp8amp.convert(nn.Sequential(nn.Linear(16, 16)), policy="all")
    with pytest.raises(TypeError, match="register_scaling_hooks: model must be an nn.Module, got int"):
        fp8amp.register_scaling_hooks(3, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="register_scaling_hooks: optimizer must be a torch.optim.Optimizer, got list"):
        fp8amp.register_scaling_hooks(model, [])
    with pytest.raises(TypeError, match="update_scaling: model must be an nn.Module, got NoneType"):
        fp8amp.update_scaling(None)


def test_update_scaling_by_hand_of_a_hooked_model_is_warned():
    """initialize's hooks already update after each step; an update by hand as well rolled every
    history twice a step with no word."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    for target in (model, model[2]):
        with pytest.warns(UserWarning, match="already updated after every optimizer.step"):
            fp8amp.update_scaling(target)
    plain = fp8amp.convert(nn.Sequential(nn.Linear(16, 16)), policy="all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8amp.update_scaling(plain)
        fp8amp.update_scaling(copy.deepcopy(model))  # a copy has no hooks
