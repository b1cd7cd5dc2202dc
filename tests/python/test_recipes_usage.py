"""Scaling recipes as users use them (docs/tiles.md#recipes): every recipe at every level against
plain torch, the scale-rule settings of a Recipe honoured at every level, shapes a recipe cannot
take, odd inputs, state dicts across recipes and levels, copies, unconvert, eval, frozen layers
and accumulation. CPU (FP8 emulation)."""

import copy
import math
import pickle

import numpy as np
import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import E4M3, Recipe, ScalingRecipe

RECIPES = ["tensorwise", "rowwise", "blockwise", "mxfp8"]
LEVELS = [None, "O1", "O2"]  # None: convert (FP8 compute, high-precision weights)


def rel(actual, reference):
    actual, reference = actual.detach().double(), reference.detach().double()
    return ((actual - reference).norm() / reference.norm()).item()


def real(t):
    return t.dequantize() if isinstance(t, (fp8amp.ScaledTensor, fp8amp.BlockScaledTensor)) else t.detach()


def mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 48))


def to_level(model, recipe, level, lr=1e-3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if level is None:
        return fp8amp.convert(model, recipe=recipe, optimizer=optimizer, policy="all"), optimizer
    return fp8amp.initialize(model, optimizer, level, recipe=recipe, policy="all")


def weight_scale(model, x):
    """The scale of the forward GEMM's E4M3 weight operand, as the numerics report saw it."""
    with fp8amp.numerics_report(model) as report:
        model(x).sum().backward()
    (row,) = [r for r in report.rows if r.role == "weight"]
    return row.scale


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", [Recipe("tensorwise", margin=2), ScalingRecipe(16, 3, True),
                                    Recipe("tensorwise", pow2_scale=False), Recipe("blockwise", margin=2)],
                         ids=["margin", "scaling-recipe", "not-pow2", "blockwise-margin"])
def test_the_weight_cast_takes_the_recipes_scale_rule_at_every_level(recipe, level):
    # At O1/O2 the tensorwise weight operand came from the master's E4M3 copy, made with margin 0
    # and power-of-two scales whatever the recipe said.
    model, optimizer = to_level(nn.Sequential(nn.Linear(128, 128)), recipe, level)
    x = torch.randn(32, 128)
    for _ in range(2):  # and after a step of the optimizer, which rewrites a master
        amax = real(model[0].weight).abs().max().item()
        rule = Recipe(margin=recipe.margin, pow2_scale=recipe.pow2_scale)
        expected = (2.0 ** (math.floor(math.log2(448 / amax)) - rule.margin) if rule.pow2_scale
                    else 448 / amax / 2 ** rule.margin)
        assert weight_scale(model, x) == pytest.approx(expected, rel=1e-6)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("make", [lambda v: Recipe("blockwise", pow2_scale=v), lambda v: ScalingRecipe(pow2_scale=v)],
                         ids=["Recipe", "ScalingRecipe"])
def test_a_numpy_bool_scale_rule_is_refused_naming_its_type(make):
    # The message said "pow2_scale must be a bool, got bool" (numpy's bool is named "bool").
    with pytest.raises(TypeError, match=r"pow2_scale must be a Python bool .*got numpy\.bool"):
        make(np.bool_(False))
    with pytest.raises(TypeError, match=r"margin must be a Python int .*got numpy\.int64"):
        Recipe("blockwise", margin=np.int64(1))
