"""Typed wrapper over the core's fused Adam / AdamW step (``include/fp8amp/optim.h`` has the
element math, the scaled formats each buffer may hold and the non-finite rule)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import fast
from ._args import _bool, _float, _int, _optional_tensors, _tensor, _tensors

__all__ = ["adam_step"]

#: the per-param optional lists, in the op's order
_OPTIONAL_LISTS = ("param_scales", "param_scale_invs", "grad_scale_invs", "exp_avg_scales", "exp_avg_scale_invs",
                   "exp_avg_sq_scales", "exp_avg_sq_scale_invs", "weights_fp8", "weight_scales", "weight_scale_invs",
                   "step_counts", "param_amaxes")


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    maximize: bool = False,
    step: int = 0,
    step_tensor: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    margin: int = 0,
    stochastic_rounding: bool = False,
    rounding_seed: int = 0,
    **optional_lists: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """One Adam (``adamw=False``) or AdamW step over the tensors of one param group, in place.
    Params that require grad are written under ``torch.no_grad()``, as by an optimizer's step
    (torch refuses the in-place write otherwise, as it refuses ``p.add_(...)``).

    ``params[i]``, ``grads[i]``, ``exp_avgs[i]`` and ``exp_avg_sqs[i]`` are tensor i's buffers.
    Scaled buffers come with their scales through the keyword lists ``param_scales``,
    ``param_scale_invs``, ``grad_scale_invs``, ``exp_avg_scales``, ``exp_avg_scale_invs``,
    ``exp_avg_sq_scales``, ``exp_avg_sq_scale_invs`` and the optional E4M3 copy of each new master
    ``weights_fp8``, ``weight_scales``, ``weight_scale_invs``: each list is empty (no tensor has
    one) or holds one tensor or None per tensor. A scale list (``*_scales``, not ``*_scale_invs``)
    may be empty or None where the buffer is scaled: the step then takes the old scale as
    ``1 / scale_inv`` (exact for power-of-two scales) and writes only the scale_inv. The step
    number is ``step`` (a host count >= 1) or, with ``step=0``, ``step_tensor`` (float32 [1],
    incremented on the device). ``step_counts`` (empty, or a float32 [1] tensor or None per tensor):
    the tensors' own step counts, as torch keeps one per param, incremented with ``step_tensor``
    (so a caller with many counts needs no op of its own to advance them). ``param_amaxes`` (empty,
    or a float32 [1] tensor or None per tensor, in/out): each master's kept amax, the largest
    magnitude of its real values as the last step stored them, or NaN when unknown; a finite one
    spares the step a read of the master (``include/fp8amp/optim.h``, "Kept master amax"). A caller
    that writes a master otherwise must set its kept amax to the new amax, or to NaN.
    ``found_inf`` (float32 [1], in/out): a nonzero value on entry, or a non-finite value met in
    the step, makes the whole call a no-op and leaves 1 there. Returns the amaxes, float32
    ``[n, 5]`` (grad, exp_avg, exp_avg_sq, param or the bound its scale came from, param).
    ``stochastic_rounding``: float16 masters' new codes are rounded stochastically, from a random
    stream of ``rounding_seed`` (an int64), the step number and the tensor's position in the call
    (docs/numerics.md#stochastic-rounding); every other output rounds to nearest.

    Under ``torch.compile`` through Inductor, a written list holding None (a scale list of mixed
    formats, ``step_counts`` with gaps) fails in torch's functionalization: trace one call per
    set of like tensors instead, as :class:`fp8amp.optim.Adam` does (docs/compile.md).
    """
    op = "adam_step"
    unknown = sorted(set(optional_lists) - set(_OPTIONAL_LISTS))
    if unknown:
        raise TypeError(f"fp8amp.ops.{op}: unknown keyword argument(s) {unknown}; accepted: {list(_OPTIONAL_LISTS)}")
    lists = [_optional_tensors(optional_lists.get(name, ()), name, op) for name in _OPTIONAL_LISTS]
    if isinstance(rounding_seed, int) and not -2**63 <= rounding_seed < 2**63:
        raise ValueError(f"fp8amp.ops.{op}: rounding_seed must be an int64, in [-2**63, 2**63); got {rounding_seed}")
    if isinstance(params, (list, tuple)) and not params:
        raise ValueError(f"fp8amp.ops.{op}: params must hold at least one tensor (a step over nothing has no device)")
    return fast.adam_step(
        _tensors(params, "params", op), _tensors(grads, "grads", op), _tensors(exp_avgs, "exp_avgs", op),
        _tensors(exp_avg_sqs, "exp_avg_sqs", op), *lists,
        lr=_float(lr, "lr", op), beta1=_float(beta1, "beta1", op), beta2=_float(beta2, "beta2", op),
        eps=_float(eps, "eps", op), weight_decay=_float(weight_decay, "weight_decay", op),
        adamw=_bool(adamw, "adamw", op), maximize=_bool(maximize, "maximize", op), step=_int(step, "step", op),
        step_tensor=None if step_tensor is None else _tensor(step_tensor, "step_tensor", op),
        found_inf=None if found_inf is None else _tensor(found_inf, "found_inf", op),
        margin=_int(margin, "margin", op), stochastic_rounding=_bool(stochastic_rounding, "stochastic_rounding", op),
        rounding_seed=_int(rounding_seed, "rounding_seed", op),
    )
