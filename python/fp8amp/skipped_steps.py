"""Steps skipped without ``optimizer.step()`` (GradScaler's skip for an inf / NaN gradient, a loop
that skips a non-finite loss): their inf / NaN amaxes must not reach the next step's casts.

A skipped step runs no scaling update, so what its casts recorded stays in column 0 of each
delayed-scaling history. The next step's warm-up casts fold their own amax into that column; a
non-finite one there made them take the stored scale (1 before any update) instead of their own
(docs/hardening.md). Two places set those amaxes to 0:

- fp8amp's optimizer's ``zero_grad``, when it has not stepped since its previous ``zero_grad``
  (:func:`fp8amp.scaling_hooks.drop_skipped_amaxes`);
- for any optimizer and any way of clearing gradients (``model.zero_grad()``, as the Hugging Face
  Trainer does), a forward pre-hook on each model registered for scaling updates: at a training
  forward whose gradients were cleared (a new step, not another micro-batch of the same one) with no
  step of a registered optimizer since the model's previous training forward; before the model's
  first step (its scales still 1) whether or not they were cleared (``zero_grad`` after the forward,
  an accumulation window that a skipped micro-batch left open). A training step that
  stands for the model's forward (Lightning's ``training_step``, which may call the model's layers
  and not its forward) runs the same check through :func:`training_step`.

Finite amaxes and warm-up counters stay: every rank skips the same steps, so ranks stay identical.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointFunction

from .amax_sync import delayed_states
from .scaling import ScalingState

__all__ = ["drop_nonfinite_amaxes", "watch_skipped_steps", "mark_stepped", "on_unstepped", "unwatch_skipped_steps",
           "training_step"]

# The model's attribute holding its _SkipWatch: in the model's own __dict__, so that a copy of the
# model carries its own (the hook finds it through the module it is called with).
_ATTR = "_fp8amp_skip_watch"
# Told of each model at a new step that no registered optimizer stepped since its previous one
# (fp8amp.scaling_hooks watches it then: an optimizer nobody registered may be stepping it).
_on_unstepped: Optional[Callable[[nn.Module], None]] = None


class _SkipWatch:
    """Whether a registered optimizer stepped since the model's previous training forward (and ever),
    and the name of a trained parameter whose cleared gradient tells a new step from another micro-batch."""

    def __init__(self, param_name: str) -> None:
        self.param_name = param_name
        self.stepped = True  # (the first forward has nothing to drop)
        self.first_step = True  # no step yet: a non-finite amax would make the casts take scale 1
        self.in_step = False  # inside training_step(): the model's forwards there are not new steps

    def __getstate__(self) -> dict:
        # (a copy made inside a training step, an EMA's, is not inside one)
        return {**self.__dict__, "in_step": False}


def drop_nonfinite_amaxes(states: Iterable[ScalingState]) -> None:
    """Sets the inf / NaN amaxes of this step's column of ``states`` to 0: three launches a device,
    whatever the number of states (a model run twice before its backward drops at every step)."""
    columns: dict[torch.device, list[torch.Tensor]] = {}
    for state in states:
        history = state._buffers["amax_history"]  # (not state.amax_history: Module.__getattr__ is slow)
        columns.setdefault(history.device, []).append(history[:, 0])
    with torch.no_grad():
        for cols in columns.values():
            finite = torch.cat(cols).nan_to_num_(nan=0.0, posinf=0.0)
            torch._foreach_copy_(cols, list(finite.split([c.numel() for c in cols])))


def _first_trained(model: nn.Module) -> Optional[str]:
    return next((n for n, p in model.named_parameters() if p.requires_grad), None)


def _trained_parameter(model: nn.Module, watch: _SkipWatch) -> Optional[torch.Tensor]:
    """The watched parameter; the model's first trained one again when it was frozen or removed
    since (a gradient that stays None read as a new step at every micro-batch; a parametrization
    moves it, and a name that found nothing never dropped again)."""
    try:
        param = model.get_parameter(watch.param_name)
    except AttributeError:
        param = None
    if param is None or not param.requires_grad:
        name = _first_trained(model)
        if name is None:
            return None
        watch.param_name, param = name, model.get_parameter(name)
    return param


def _drop_after_skipped_step(model: nn.Module, args) -> None:
    """The forward pre-hook (see the module docstring)."""
    if torch.compiler.is_compiling() or not model.training or not torch.is_grad_enabled():
        return
    # A forward recomputed in backward (checkpointing) is not a new step, unless a reentrant
    # checkpoint of the whole model recomputes it: its first forward ran under no_grad, unseen.
    if (torch._C._current_graph_task_id() != -1
            and type(torch._C._current_autograd_node()) is not CheckpointFunction._backward_cls):
        return
    watch = model.__dict__.get(_ATTR)
    if watch is None or watch.in_step:
        return
    stepped, watch.stepped = watch.stepped, False
    if stepped:
        return
    param = _trained_parameter(model, watch)
    # (before the first step, gradients not yet cleared may be a skipped step's: three launches a
    # micro-batch of that step only)
    if param is not None and (param.grad is None or watch.first_step):
        drop_nonfinite_amaxes(delayed_states(model))
        if param.grad is None and _on_unstepped is not None:
            _on_unstepped(model)


@contextlib.contextmanager
def training_step(model: nn.Module) -> Iterator[None]:
    """A training step that stands for ``model``'s training forward, whether or not it calls that
    forward (Lightning's ``training_step`` calling the model's layers): the hook's check runs once at
    its start, and the model's forwards inside it (its own, or DDP's redirected one) are not new steps."""
    watch = model.__dict__.get(_ATTR)
    if watch is None or watch.in_step:
        yield
        return
    _drop_after_skipped_step(model, ())
    watch.in_step = True
    try:
        yield
    finally:
        watch.in_step = False


def watch_skipped_steps(model: nn.Module) -> None:
    """Registers the forward pre-hook on ``model`` (once; a copy of the model carries it)."""
    if _drop_after_skipped_step not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_drop_after_skipped_step)
    name = _first_trained(model)
    if name is not None:
        model.__dict__[_ATTR] = _SkipWatch(name)


def on_unstepped(callback: Callable[[nn.Module], None]) -> None:
    """Calls ``callback(model)`` at each new training step of ``model`` that no optimizer registered
    for its scaling stepped since the previous one (a skipped step, or another optimizer's)."""
    global _on_unstepped
    _on_unstepped = callback


def mark_stepped(model: nn.Module) -> None:
    """Called after each step of an optimizer registered for ``model``'s scaling."""
    watch = model.__dict__.get(_ATTR)
    if watch is not None:
        watch.stepped, watch.first_step = True, False


def unwatch_skipped_steps(model: nn.Module) -> None:
    """Removes the hook and its record from ``model`` (``fp8amp.unconvert``)."""
    hooks = model._forward_pre_hooks
    for key in [k for k, hook in hooks.items() if hook is _drop_after_skipped_step]:
        del hooks[key]
        model._forward_pre_hooks_with_kwargs.pop(key, None)
    model.__dict__.pop(_ATTR, None)
