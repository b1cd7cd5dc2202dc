"""``convert``: swap a model's ``nn.Linear`` layers for :class:`~fp8amp.linear.Fp8Linear`."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .linear import Fp8Linear, fp8_linear_supported
from .scaling import ScalingRecipe

__all__ = ["convert", "update_scaling"]

ModuleFilter = Callable[[nn.Module, str], bool]


def convert(
    model: nn.Module,
    *,
    module_filter_fn: Optional[ModuleFilter] = None,
    recipe: Optional[ScalingRecipe] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
) -> nn.Module:
    """Replaces, in place, every ``nn.Linear`` of ``model`` that FP8 can take by an ``Fp8Linear``
    sharing its parameters, and returns ``model``.

    Args:
        model: any module. If it is itself an ``nn.Linear``, the new module is returned (there is
            no parent to put it in).
        module_filter_fn: ``(module, fully_qualified_name) -> bool``; a Linear is converted only
            if this returns True. Linears whose in/out features are not multiples of 16 (cuBLASLt's
            FP8 rule) are always left as they are.
        recipe: the delayed-scaling recipe of the new layers (default ``ScalingRecipe()``).
        optimizer: if given, :func:`update_scaling` runs after each of its ``step()`` calls, so the
            training loop needs no extra line.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be an nn.Module, got {type(model).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError("convert: module_filter_fn must be a callable (module, name) -> bool")
    if recipe is not None and not isinstance(recipe, ScalingRecipe):
        raise TypeError(f"convert: recipe must be a ScalingRecipe, got {type(recipe).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"convert: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")

    def wanted(module: nn.Module, name: str) -> bool:
        return (
            type(module) is nn.Linear
            and fp8_linear_supported(module.in_features, module.out_features)
            and (module_filter_fn is None or bool(module_filter_fn(module, name)))
        )

    if wanted(model, ""):
        model = Fp8Linear.from_linear(model, recipe)
    else:
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                fqn = f"{name}.{child_name}" if name else child_name
                if wanted(child, fqn):
                    setattr(module, child_name, Fp8Linear.from_linear(child, recipe))
    if optimizer is not None:
        optimizer.register_step_post_hook(lambda *_: update_scaling(model))
    return model


def update_scaling(model: nn.Module) -> None:
    """Delayed-scaling update of every ``Fp8Linear`` in ``model``; call after each optimizer step."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                module.update_scaling()
