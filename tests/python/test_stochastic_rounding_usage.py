"""``master_rounding="stochastic"`` used as users ask for it (docs/numerics.md#stochastic-rounding):
through an fp8amp optimizer handed to initialize / initialize_optimizer / the Lightning plugins, and
param groups added later. Each test names what was wrong before its fix."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8amp


def model(seed=0, width=48):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 16))


@pytest.mark.parametrize("how", ["initialize", "initialize_optimizer"])
def test_an_fp8amp_optimizers_rounding_defaults_survive_initialize(how):
    """initialize rebuilds an fp8amp AdamW built with master_rounding="stochastic" and a
    rounding_seed: its groups kept both, but the new optimizer's defaults were "nearest" and 0, so
    a group added later without the keys (a finetuning callback unfreezing a backbone) rounded to
    nearest with seed 0, silently."""
    net = model()
    if how == "initialize_optimizer":
        net, _ = fp8amp.initialize(net, None, "O2", policy="all")
    opt = fp8amp.optim.AdamW(net.parameters(), lr=1e-3, master_rounding="stochastic", rounding_seed=7)
    if how == "initialize":
        net, opt = fp8amp.initialize(net, opt, "O2", policy="all")
    else:
        opt = fp8amp.initialize_optimizer(net, opt, "O2")
    assert (opt.defaults["master_rounding"], opt.defaults["rounding_seed"]) == ("stochastic", 7)
    opt.add_param_group({"params": nn.Linear(4, 4).parameters()})
    assert [(g["master_rounding"], g["rounding_seed"]) for g in opt.param_groups] == [("stochastic", 7)] * 2
    # an explicit master_rounding still wins over the optimizer's own
    net = model()
    opt = fp8amp.optim.AdamW(net.parameters(), master_rounding="stochastic")
    net, opt = fp8amp.initialize(net, opt, "O2", policy="all", master_rounding="nearest")
    assert opt.defaults["master_rounding"] == opt.param_groups[0]["master_rounding"] == "nearest"
