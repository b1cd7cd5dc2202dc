"""The hooks a user registered on a module or a parameter that fp8amp replaces (``convert`` and
``unconvert`` a Linear, ``initialize`` a weight by its master, ``unconvert`` a master by a plain
parameter), which the replacement keeps, and the attributes a user set on such a parameter. Hooks
move as the same dicts, so that the handles taken on the old object still remove them.
(Optimizers' hooks: ``scaling_hooks.carry_hooks``.)"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["carry_module_hooks", "carry_tensor_attributes", "carry_tensor_hooks"]

# nn.Module's dicts of forward, backward and state-dict hooks (and the flag of full backward hooks).
_MODULE_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
                 "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook",
                 "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks")


def carry_module_hooks(module: nn.Module, new: nn.Module) -> None:
    """Makes the hooks registered on ``module`` run on ``new``, which replaces it."""
    for name in _MODULE_HOOKS:
        setattr(new, name, getattr(module, name))


def carry_tensor_hooks(tensor: torch.Tensor, new: torch.Tensor) -> None:
    """Makes the gradient hooks registered on the leaf ``tensor`` (``register_hook``,
    ``register_post_accumulate_grad_hook``) run on the leaf ``new``, which replaces it."""
    if tensor._backward_hooks:
        new._backward_hooks = tensor._backward_hooks  # (torch's setter registers them with autograd)
    if tensor._post_accumulate_grad_hooks:
        new._post_accumulate_grad_hooks = tensor._post_accumulate_grad_hooks


def carry_tensor_attributes(tensor: torch.Tensor, new: torch.Tensor) -> None:
    """Sets on ``new`` the public attributes set on ``tensor`` (``w.no_decay = True``, which code
    that groups params by such flags reads); names with a leading underscore are torch's and
    fp8amp's own (a master's codes and scales), not carried."""
    for name, value in vars(tensor).items():
        if not name.startswith("_") and name not in vars(new):
            setattr(new, name, value)
