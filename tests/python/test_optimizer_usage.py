"""fp8amp's optimizers as users configure them: constructor options, param lists, and the hooks
torch's optimizers take, each compared with ``torch.optim.AdamW`` on the unconverted model."""

import copy
import warnings

import pytest
import torch
from torch import nn

import fp8amp

LEVELS = ["O1", "O2"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def _train(model, optimizer, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _initialized(level):
    model = _model()
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)


def _real(t):
    """A state tensor's real values: O2's moments are codes with a scale_inv beside them."""
    return t.dequantize() if isinstance(t, fp8amp.ScaledTensor) else t.float()


def _moment(state, key):
    scale_inv = state.get(f"{key}_scale_inv")
    return state[key].float() if scale_inv is None else state[key].float() * scale_inv


@pytest.mark.parametrize("how", ["constructor", "add_param_group", "initialize"])
def test_a_param_listed_twice_in_a_group_is_refused_where_the_group_is_made(how):
    """torch warns about a duplicate param (and would step it twice a step); fp8amp's step failed
    at its first call with an error about the fused op's internal lists ("fp8amp.adam_step:
    params[0] and params[6] must not share memory"), naming nothing the user wrote."""
    model = _model()
    params = list(model.parameters())
    which = "param 2 of group 1" if how == "add_param_group" else "param 6 of group 0"
    with pytest.raises(ValueError, match=f"{which} is param 0 of the same group"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own warning about the duplicate)
        if how == "constructor":
            fp8amp.optim.AdamW(params + [params[0]], state_dtypes="O2")
        elif how == "add_param_group":
            optimizer = fp8amp.optim.AdamW(params[2:], state_dtypes="O2")
            optimizer.add_param_group({"params": params[:2] + [params[0]]})
        else:
            fp8amp.initialize(model, torch.optim.AdamW(params + [params[0]]), "O2")
    if how == "add_param_group":
        assert len(optimizer.param_groups) == 1
    if how == "initialize":  # refused before the model changed
        assert type(model[0]) is nn.Linear
