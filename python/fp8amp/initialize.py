"""``initialize``: the one call that turns a model and its Adam/AdamW optimizer into O1/O2 (docs/o1_o2.md#optimization-levels).

What it does, in place on ``model`` and with a new optimizer:

1. :func:`fp8amp.convert` swaps the ``nn.Linear`` layers FP8 can take for :class:`Fp8Linear`
   (FP8 GEMMs, delayed scaling; same parameters and state-dict keys).
2. Each converted layer's weight becomes a :class:`~fp8amp.MasterWeight` parameter (FP16 codes, the master
   copy: 2 bytes per element, no FP32 copy anywhere) carrying the E4M3 copy the forward GEMM reads
   (1 byte per element, rewritten by the optimizer's step); its gradient will be an E4M3 ScaledTensor.
   A weight that is also used outside converted Linears (say an embedding tied to the output
   head) stays as it is: other modules need a plain tensor; so does the ``[in, out]`` weight of a
   Hugging Face Conv1D (:class:`~fp8amp.linear.Fp8Conv1D`: FP8 compute, its weight cast each forward).
3. The optimizer is rebuilt as :class:`fp8amp.optim.Adam` / :class:`~fp8amp.optim.AdamW` with the
   same param groups and hyperparameters and ``state_dtypes=opt_level`` (O1: FP32 m and v; O2: E4M3 m
   and FP16 v, each with a scale), stepping every param (Linear masters and the rest) in fused
   multi-tensor calls; after each step it updates the FP8 scaling of every Fp8Linear.

Create lr schedulers after this call (a scheduler holds the optimizer it was built with: one built
before is warned about). Hooks registered on the optimizer passed in (``register_step_post_hook``
and the state-dict ones) run on the returned one. The optimizer passed in is retired: its ``step``
and ``zero_grad`` raise a ``RuntimeError`` that points at the returned one (stepping it would not
train the Linear weights).
Non-Linear parameters (norms, embeddings, biases) keep their dtype,
and their optimizer states follow the level (their m and v take the same formats).
"""

from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from . import optim as fp8_optim
from .convert import ModuleFilter, check_options, conversion_report, convert, register_scaling_hooks
from .convert_policy import DEFAULT_TOKENS
from .linear import Fp8Conv1D, Fp8Linear, MasterPolicy, RecipeArg
from .master_weight import MasterWeight
from .scaling_hooks import carry_hooks, hand_over_scaling, registered_optimizers, release_scaling, scales_after_step
from .scaled_tensor import ScaledTensor
from .user_hooks import carry_tensor_attributes, carry_tensor_hooks

__all__ = ["initialize", "initialize_optimizer", "OPT_LEVELS"]

#: The accepted ``opt_level`` values.
OPT_LEVELS = ("O1", "O2")
#: The accepted ``weight_grad`` values.
WEIGHT_GRADS = ("fp8", "fp32")

_ACCEPTED_OPTIMIZERS = "torch.optim.Adam, torch.optim.AdamW, fp8amp.optim.Adam, fp8amp.optim.AdamW"


def initialize(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    opt_level: str = "O1",
    *,
    module_filter_fn: Optional[ModuleFilter] = None,
    recipe: RecipeArg = None,
    weight_grad: str = "fp8",
    policy: str = "auto",
    tokens: int = DEFAULT_TOKENS,
    compiled: Optional[bool] = None,
    master_rounding: Optional[str] = None,
) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
    """Converts ``model`` (in place) and ``optimizer`` to ``opt_level``; returns ``(model, optimizer)``.

    Args:
        model: the model, on its final device (move it before: the masters are made where the
            weights are).
        optimizer: ``torch.optim.Adam`` / ``AdamW`` (or fp8amp's) over ``model``'s parameters,
            before its first step; ``None`` converts the model only (the returned optimizer is
            ``None``; build the optimizer over ``model.parameters()`` later and pass it to
            :func:`initialize_optimizer`, or build an :class:`fp8amp.optim.AdamW` and call
            :func:`fp8amp.register_scaling_hooks` on it: without either, or
            :func:`fp8amp.update_scaling` after each step, the FP8 scaling is never updated).
        opt_level: ``"O1"`` or ``"O2"`` (docs/o1_o2.md#optimization-levels's table).
        module_filter_fn: ``(module, fully_qualified_name) -> bool``, which Linears to convert.
        recipe: how the Fp8Linear layers scale their FP8 operands, as :func:`fp8amp.convert`
            takes it: ``"tensorwise"`` (default), ``"rowwise"``, ``"blockwise"``, ``"mxfp8"``
            (docs/tiles.md#mxfp8) or an :class:`fp8amp.Recipe` (docs/tiles.md#recipes). Under the
            tiled recipes (and a tensorwise one with a margin or ``pow2_scale=False``) the masters
            carry no E4M3 copy: each forward quantizes the master by the recipe's scales; under
            blockwise the E4M3 weight gradients are in 128 x 128 blocks (a BlockScaledTensor).
        weight_grad: ``"fp8"`` (docs/o1_o2.md#optimization-levels: E4M3 ScaledTensor gradients, 1 byte per element,
            accumulated across micro-batches by a fused dequantize-add-requantize) or ``"fp32"``
            (plain gradients in the weight's dtype, float32 for a float32 model: a higher-precision
            accumulator for long accumulations, 4 bytes; a bfloat16 or float16 model's are warned about).
        policy, tokens: which Linears FP8 takes, as :func:`fp8amp.convert` decides: ``"auto"``
            (default) keeps the whole model in BF16 compute where a step of ``tokens`` tokens (your
            micro-batch's) is below the measured FP8 crossover, and otherwise keeps ``nn.Linear``
            where FP8 is measured slower on the GPU; ``"layers"`` the second stage alone; ``"all"``
            converts every Linear FP8 can take. Below the crossover the level's optimizer state
            formats still apply (``conversion_report`` says so).
        compiled: whether the model will run under ``torch.compile`` (True) or eagerly (False),
            for the crossover, as :func:`fp8amp.convert` takes it; None (default): not known, the
            lower of the two estimates.
        master_rounding: how the optimizer rounds the FP16 masters' new values: ``"nearest"``
            (what a torch optimizer passed in gets by default) or ``"stochastic"``, which keeps
            updates below half an FP16 unit of a weight on average (small fine-tuning lrs:
            docs/o1_o2.md#limits-today); None keeps an fp8amp optimizer's own. An option of the optimizer
            (:class:`fp8amp.optim.Adam`): with ``optimizer=None`` pass it to :func:`initialize_optimizer`.

    Raises:
        ValueError: an unknown ``opt_level``, an optimizer that is not Adam/AdamW, an optimizer that
            has already stepped, or hyperparameters fp8amp's Adam does not take (``amsgrad``...); a
            model already wrapped in ``DistributedDataParallel`` (initialize it before wrapping).
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        # DDP's reducer holds the Linear weights that the masters replace: their gradients would
        # not be all-reduced (silently so with find_unused_parameters=True).
        raise ValueError("initialize: model is a DistributedDataParallel; call fp8amp.initialize(model, ...) before "
                         "wrapping it, then DistributedDataParallel(model) (docs/distributed.md)")
    check_level(opt_level, weight_grad)
    if isinstance(optimizer, (list, tuple, dict)):  # (torchtune's optimizer in backward: one per parameter)
        raise ValueError(f"initialize: optimizer must be one optimizer, got a {type(optimizer).__name__}; for several "
                         f"(say one per parameter, stepped in backward): fp8amp.initialize(model, None, {opt_level!r}), "
                         f"then fp8amp.initialize_optimizer(model, optimizer, {opt_level!r}) for each")
    if optimizer is None and master_rounding is not None:
        raise ValueError("initialize: master_rounding is an option of the optimizer, and optimizer is None: pass it "
                         f"to fp8amp.initialize_optimizer(model, optimizer, {opt_level!r}, "
                         f"master_rounding={master_rounding!r}) once the optimizer is built")
    if optimizer is not None:
        _check_optimizer(optimizer, or_none=True)
        _check_optimizer_of(model, optimizer)
        try:  # fp8amp's Adam checks every group (dtypes, options, hyperparameters) before the model changes
            _rebuild_optimizer(optimizer, {}, opt_level, master_rounding)
        except ValueError as error:
            raise ValueError(f"initialize: {error}") from None

    # The options' errors name initialize; convert takes the resolved Recipe as it is.
    resolved = check_options(module_filter_fn=module_filter_fn, recipe=recipe, policy=policy, tokens=tokens,
                             compiled=compiled, caller="initialize")
    recipe = None if recipe is None else resolved
    model = convert(model, module_filter_fn=module_filter_fn, recipe=recipe, policy=policy, tokens=tokens,
                    compiled=compiled)
    _note_level_below_crossover(model, opt_level)
    masters = _make_masters(model)
    _warn_optimizers_holding_replaced(model, masters, optimizer, opt_level)
    if weight_grad == "fp32":
        _warn_16_bit_weight_grads(model)
    terms = MasterPolicy(fp8_weight_grad=weight_grad == "fp8", optimizer_built=optimizer is not None)
    _use_masters(model, terms)
    if optimizer is None:
        return model, None
    new_optimizer = _optimizer_at_level(model, optimizer, masters, opt_level, master_rounding)
    _warn_updates_below_master_units(model, new_optimizer, "initialize")
    retire(optimizer, "initialize", "fp8amp optimizer",
           "model, optimizer = fp8amp.initialize(model, optimizer, ...)")
    return model, new_optimizer


def _use_masters(model: nn.Module, terms: MasterPolicy) -> None:
    """Gives each master layer ``terms``; those an earlier initialize made keep its weight_grad (as
    convert keeps an earlier recipe: a second call, say for a layer added later, switched their
    weight gradients silently), and count an optimizer built by either call."""
    kept = 0
    for module in model.modules():
        if not (isinstance(module, Fp8Linear) and isinstance(module.weight, ScaledTensor)):
            continue
        earlier = module.master
        if earlier is None:
            module.use_master(terms)
            continue
        kept += earlier.fp8_weight_grad != terms.fp8_weight_grad
        module.use_master(replace(earlier, optimizer_built=earlier.optimizer_built or terms.optimizer_built))
    if kept:
        given, other = ("fp8", "fp32") if terms.fp8_weight_grad else ("fp32", "fp8")
        warnings.warn(f"initialize: {kept} layer(s) made O1/O2 masters by an earlier fp8amp.initialize keep its "
                      f"weight_grad={other!r}: weight_grad={given!r} applies only to the layers this call makes "
                      "masters (fp8amp.unconvert(model) first to make them all again)", UserWarning, stacklevel=3)


def _warn_optimizers_holding_replaced(model: nn.Module, masters: dict,
                                      rebuilt: Optional[torch.optim.Optimizer], opt_level: str) -> None:
    """An optimizer registered for the model or another one (an earlier initialize's) that holds
    weights this call replaced by masters (a new layer's group added before this call; one optimizer
    over two models, given to the first one's initialize only) would step the old tensors, and those
    layers would not train, silently. (``rebuilt``, the one passed in, is replaced.)"""
    others = [opt for opt in registered_optimizers() if opt is not rebuilt] if masters else []
    names = {id(p): name for name, p in model.named_parameters()} if others else {}
    mine = {id(opt) for opt in registered_optimizers(model)} if others else set()
    for optimizer in others:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        stale = [names[id(master)] for old, master in masters.items() if id(old) in held]
        if stale:
            whose = "this model" if id(optimizer) in mine else "another model"
            warnings.warn(f"initialize: the {type(optimizer).__name__} registered for {whose} holds {len(stale)} "
                          f"Linear weight(s) that this call replaced by FP16 masters ({_first_names(stale)}): it "
                          "would step the old tensors and those layers would not train. Before its first step, pass "
                          f"it to this call (model, optimizer = fp8amp.initialize(model, optimizer, {opt_level!r})), "
                          "which rebuilds it over the masters and updates this model's scaling too. Or add a new "
                          "layer's parameters to an optimizer, or build one (fp8amp.initialize_optimizer), after "
                          "fp8amp.initialize; or add the masters to this one: optimizer.add_param_group({'params': "
                          f"[model.get_parameter({stale[0]!r}), ...]}}) (the old tensors get no gradient)",
                          UserWarning, stacklevel=3)


def _warn_16_bit_weight_grads(model: nn.Module) -> None:
    """weight_grad="fp32" keeps plain gradients, which autograd makes in each parameter's dtype: a
    bfloat16 or float16 model's are 16-bit, not the float32 accumulator asked for."""
    low = {}
    for name, p in model.named_parameters():
        if isinstance(p, MasterWeight) and p.dtype != torch.float32:
            low.setdefault(p.dtype, []).append(name)
    for dtype, names in low.items():
        warnings.warn(f"initialize: weight_grad='fp32' keeps plain weight gradients, in their weight's dtype, and "
                      f"{len(names)} Linear weights are {dtype} ({_first_names(names)}): their gradients are "
                      f"{dtype}, not float32 (autograd gives a gradient its parameter's dtype). For float32 gradients "
                      "keep the model in float32 (torch.autocast chooses the compute dtype)", UserWarning, stacklevel=3)


#: The share of a master's elements out of an update's reach at which initialize warns.
FROZEN_SHARE = 0.01


def _warn_updates_below_master_units(model: nn.Module, optimizer: fp8_optim.Adam, caller: str) -> None:
    """A master stores FP16 codes rounded to nearest unless its group rounds stochastically: an
    update below half an FP16 unit of an element is then lost. Adam's updates are about lr or
    smaller, and half a unit exceeds lr wherever ``|w| >= 2^(floor(log2 lr) + 12)``: a master with
    many such elements (a fine-tuning lr, weights near 1) does not train there, silently. Counted from each group's lr
    here (a scheduler built later starts from it), with one host read."""
    names = {id(p): name for name, p in model.named_parameters()}
    found, counts = [], []  # (name, lr, bound, numel); elements at or above the bound
    for group in optimizer.param_groups:
        lr = float(group["lr"])
        # an lr of 0 changes nothing by intent; inf or NaN moves nothing finite; stochastic rounding
        # keeps the updates on average
        if not 0 < lr < math.inf or group.get("master_rounding") == "stochastic":
            continue
        bound = 2.0 ** (math.floor(math.log2(lr)) + 12)
        for p in group["params"]:
            if isinstance(p, MasterWeight) and not p.is_meta and p.numel():
                counts.append(torch.count_nonzero(p.codes.abs() >= bound / p.scale_inv))
                found.append((names.get(id(p), "?"), lr, bound, p.numel()))
    if not counts:
        return
    frozen = [(name, lr, bound, n / numel) for (name, lr, bound, numel), n
              in zip(found, torch.stack([c.to(counts[0].device) for c in counts]).tolist())
              if n / numel >= FROZEN_SHARE]
    if frozen:
        listed = [f"{name} ({share:.0%} of its elements at |w| >= {bound:g}, lr={lr:g})"
                  for name, lr, bound, share in frozen]
        warnings.warn(f"{caller}: {len(frozen)} Linear master(s) hold weights that Adam's updates cannot change: "
                      f"{_first_names(listed)}. An FP16 master rounds each update to nearest, and where |w| >= "
                      "2^(floor(log2 lr) + 12) half an FP16 unit is above lr, the most an Adam update usually is, so "
                      "those weights stay as they are (at O1 and O2 alike). To train them: round the masters "
                      f"stochastically ({caller}(..., master_rounding='stochastic'), which keeps the updates on "
                      "average), or keep these layers in high precision (module_filter_fn), or use FP8 compute over "
                      "float32 weights (fp8amp.convert(model, optimizer=optimizer) with torch's AdamW), or a larger "
                      "lr (docs/o1_o2.md#limits-today)",
                      UserWarning, stacklevel=3)


def _first_names(names: list[str]) -> str:
    """The first three names of a warning's list, "..." after them if there are more."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _note_level_below_crossover(model: nn.Module, opt_level: str) -> None:
    """A model that convert kept in BF16 compute (below the step crossover) still gets the level's
    optimizer state formats: conversion_report says which of the level applies."""
    report = conversion_report(model)
    if report is None or report.step is None or report.step.fp8:
        return
    m_dtype, v_dtype = (str(d).removeprefix("torch.") for d in fp8_optim.STATE_DTYPES[opt_level])
    report.notes.append(f"{opt_level}: the optimizer states of every parameter still take the level's formats "
                        f"(exp_avg {m_dtype}, exp_avg_sq {v_dtype}); FP16 master weights are made for FP8 layers "
                        "only, so the Linear weights keep their dtype")


def check_level(opt_level: str, weight_grad: str = "fp8", caller: str = "initialize") -> None:
    """:func:`initialize`'s checks of ``opt_level`` and ``weight_grad`` (``caller`` names who took them)."""
    if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
        extra = (" (O3's sharding: O1/O2 under FSDP2's fully_shard, docs/distributed.md)" if opt_level == "O3"
                 else "")
        raise ValueError(f"{caller}: opt_level must be one of {', '.join(map(repr, OPT_LEVELS))}; "
                         f"got {opt_level!r}{extra}")
    if not isinstance(weight_grad, str) or weight_grad not in WEIGHT_GRADS:
        raise ValueError(f"{caller}: weight_grad must be one of {', '.join(map(repr, WEIGHT_GRADS))}; "
                         f"got {weight_grad!r}")


def initialize_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, opt_level: str = "O1",
                         *, master_rounding: Optional[str] = None,
                         caller: str = "initialize_optimizer") -> fp8_optim.Adam:
    """The optimizer half of :func:`initialize`, for a ``model`` that ``initialize(model, None,
    opt_level)`` converted before its optimizer was built (frameworks that build it afterwards:
    Lightning's ``configure_optimizers``): returns the fp8amp Adam/AdamW at ``opt_level`` with
    ``optimizer``'s param groups and hyperparameters, updating ``model``'s FP8 scaling after each
    step. ``master_rounding`` as :func:`initialize` takes it. ``caller`` names who asks, in the
    error messages. What it returned for ``model`` and ``opt_level`` (or Accelerate's wrapper of
    that: a second ``Trainer.train()`` calls ``create_optimizer`` again) comes back as it is.

    Raises:
        ValueError: as :func:`initialize` for the optimizer and the level.
    """
    if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
        raise ValueError(f"{caller}: opt_level must be one of {', '.join(map(repr, OPT_LEVELS))}; got {opt_level!r}")
    if _initialized_for(model, optimizer, opt_level, master_rounding):
        return optimizer  # (rebuilt, it would lose its state; once stepped, it would be refused)
    _check_optimizer(optimizer, caller)
    _check_params_are_the_models(model, optimizer, caller)
    new_optimizer = _optimizer_at_level(model, optimizer, {}, opt_level, master_rounding)
    _warn_updates_below_master_units(model, new_optimizer, caller)
    return new_optimizer


def _initialized_for(model: nn.Module, optimizer: object, opt_level: str, master_rounding: Optional[str]) -> bool:
    """Whether ``optimizer``, or the one it wraps (Accelerate's ``AcceleratedOptimizer`` runs no
    step hooks of its own), is an fp8amp one at ``opt_level`` that updates ``model``'s scaling."""
    inner = optimizer if hasattr(optimizer, "_optimizer_step_pre_hooks") else getattr(optimizer, "optimizer", None)
    return (isinstance(inner, fp8_optim.Adam) and scales_after_step(inner, model)
            and all(group["state_dtypes"] == opt_level and master_rounding in (None, group["master_rounding"])
                    for group in inner.param_groups))


def _foreign_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(how many of the optimizer's parameters are not ``model``'s, how many it holds)."""
    own = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return sum(id(p) not in own for p in params), len(params)


def _check_params_are_the_models(model: nn.Module, optimizer: torch.optim.Optimizer, caller: str) -> None:
    """An optimizer built before ``initialize(model, None, ...)`` holds the Linear weights that the
    masters replaced: it would step those, and the model's Linear weights would not train."""
    stale, _ = _foreign_params(model, optimizer)
    if stale:
        warnings.warn(f"{caller}: {stale} of the optimizer's parameters are not the model's (e.g. Linear weights "
                      "that fp8amp.initialize replaced by FP16 masters, when the optimizer was built before it, or "
                      "before fully_shard): they would be stepped and the model's would not; build the optimizer "
                      "after initialize (and fully_shard), over model.parameters()", UserWarning, stacklevel=3)


def _optimizer_at_level(model: nn.Module, optimizer: torch.optim.Optimizer, masters: dict,
                        opt_level: str, master_rounding: Optional[str]) -> fp8_optim.Adam:
    new_optimizer = _rebuild_optimizer(optimizer, masters, opt_level, master_rounding)
    _seed_groups_by_name(model, optimizer, new_optimizer)
    carry_hooks(optimizer, new_optimizer)  # (dropped, an EMA or logging hook stopped without a word)
    hand_over_scaling(optimizer, new_optimizer)
    register_scaling_hooks(model, new_optimizer)
    return new_optimizer


def _check_optimizer(optimizer: object, caller: str = "initialize", or_none: bool = False) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, fp8_optim.Adam)):
        raise ValueError(f"{caller}: optimizer must be one of {_ACCEPTED_OPTIMIZERS}{' (or None)' if or_none else ''}; "
                         f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    if any(optimizer.state.values()):
        raise ValueError(f"{caller}: the optimizer has already taken steps (it holds state); convert it "
                         "before the first step, or load the checkpoint into the optimizer fp8amp returns")
    for k, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if getattr(p, "_fp8amp_replaced_by_master", False):
                raise ValueError(f"{caller}: param {i} of group {k} is a Linear weight that an earlier "
                                 "fp8amp.initialize replaced by an FP16 master: stepping it would not train the "
                                 "model's layer; build the optimizer after initialize, over model.parameters() "
                                 "(several optimizers: fp8amp.initialize(model, None, ...), then "
                                 "fp8amp.initialize_optimizer(model, optimizer, opt_level) for each)")


def _check_optimizer_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer over none of the model's parameters (built on another model) would leave the
    model untrained without a word."""
    foreign, held = _foreign_params(model, optimizer)
    if held and foreign == held:
        warnings.warn(f"initialize: the optimizer holds {held} parameter(s), none of them the model's, so "
                      "the model will not train: build it on model.parameters() of the model you pass",
                      UserWarning, stacklevel=3)


def retire(optimizer: torch.optim.Optimizer, caller: str, returned: str, usage: str) -> None:
    """Makes the optimizer that ``caller`` (initialize, unconvert) replaced by the ``returned`` one
    unusable: it does not hold the model's new weights, so stepping it would leave them unchanged,
    and zeroing its grads would let theirs accumulate. Both now raise with the fix (``usage``, the
    call to write). An lr scheduler built on it (torch marks the optimizer's step and sets each
    group's initial_lr) would change nothing: warned once, here."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched") or any("initial_lr" in g for g in optimizer.param_groups):
        warnings.warn(f"{caller}: an lr scheduler was built on the optimizer passed in; it will not change the "
                      f"learning rate of the optimizer {caller} returns: build the scheduler after {caller}, "
                      "on the returned optimizer", UserWarning, stacklevel=3)

    def replaced(*args, **kwargs):
        raise RuntimeError(f"fp8amp.{caller} replaced this optimizer by the {returned} it returned, which holds the "
                           f"model's new weights: step and zero_grad that one ({usage}) and build lr schedulers on it")

    optimizer.step = optimizer.zero_grad = replaced
    optimizer._fp8amp_replaced_by = caller  # (unconvert refuses it, naming the optimizer to pass)
    # A scheduler that marks nothing on it (ReduceLROnPlateau) is only seen when it sets the lr.
    optimizer.param_groups[:] = [_ReplacedGroup(group, caller=caller) for group in optimizer.param_groups]
    release_scaling(optimizer)  # (convert(..., optimizer) registered it: it would keep the states it updated)


class _ReplacedGroup(dict):
    """A param group of an optimizer that ``caller`` replaced: setting its lr warns that nothing
    changes (an lr scheduler still built on it)."""

    def __init__(self, group: dict, caller: str) -> None:
        super().__init__(group)
        self.caller = caller

    def __setitem__(self, key, value) -> None:
        if key == "lr":
            warnings.warn(f"fp8amp.{self.caller} replaced this optimizer: setting its lr (an lr scheduler built on "
                          f"it?) changes nothing; point the scheduler at the optimizer {self.caller} returned "
                          f"(scheduler.optimizer = optimizer) or build it on that one", UserWarning, stacklevel=2)
        super().__setitem__(key, value)


def _make_masters(model: nn.Module) -> dict[torch.Tensor, torch.Tensor]:
    """Replaces each Fp8Linear weight that nothing else uses by a MasterWeight parameter;
    returns {old parameter: new parameter}."""
    users: dict[torch.Tensor, list[tuple[nn.Module, str]]] = {}
    qualified: dict[torch.Tensor, str] = {}
    for prefix, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                users.setdefault(param, []).append((module, name))
                qualified.setdefault(param, f"{prefix}.{name}" if prefix else name)
    masters: dict[torch.Tensor, torch.Tensor] = {}
    for param, owners in users.items():
        if isinstance(param, ScaledTensor) or not all(  # a Conv1D's [in, out] weight stays plain: Fp8Conv1D
                isinstance(m, Fp8Linear) and not isinstance(m, Fp8Conv1D) and name == "weight" for m, name in owners):
            continue
        if not param.is_meta and not bool(param.isfinite().all()):  # once per weight, at initialize only
            raise ValueError(f"initialize: {qualified[param]} holds inf or NaN; an O1/O2 master stores finite "
                             "values only (docs/numerics.md#non-finite-values). A model made with to_empty() holds "
                             "uninitialized memory until its weights are loaded: load them before initialize")
        with torch.no_grad():
            master = MasterWeight.from_tensor(param.detach())
            # The E4M3 copy has one power-of-two scale with margin 0: a layer of a tiled recipe or of
            # another scale rule casts the master by its own rule in each forward instead.
            if not all(_reads_fp8_copy(m.recipe) for m, _ in owners):
                master.drop_fp8_copy()
            master = nn.Parameter(master, requires_grad=param.requires_grad)
        carry_tensor_hooks(param, master)
        carry_tensor_attributes(param, master)
        for module, name in owners:
            setattr(module, name, master)
        param._fp8amp_replaced_by_master = True  # an optimizer built before holds it: refused (_check_optimizer)
        masters[param] = master
    return masters


def _reads_fp8_copy(recipe) -> bool:
    """Whether a layer of ``recipe`` can take a master's E4M3 copy as its weight operand."""
    return not recipe.tiled and recipe.margin == 0 and recipe.pow2_scale


def _seed_groups_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, new_optimizer: fp8_optim.Adam) -> None:
    """Each group of ``optimizer`` without a ``rounding_seed`` (a torch optimizer's) gets one from the
    name of its first parameter in ``model``: the same on every rank and in every run, and apart for
    optimizers built one per parameter, whose bits the seed alone tells apart (each numbers its
    params from 0; docs/numerics.md#stochastic-rounding)."""
    if "rounding_seed" in optimizer.defaults:
        return
    names = {id(p): name for name, p in model.named_parameters()}
    for old, new in zip(optimizer.param_groups, new_optimizer.param_groups):
        first = next((names[id(p)] for p in new["params"] if id(p) in names), None)
        if "rounding_seed" not in old and first is not None:
            new["rounding_seed"] = zlib.crc32(first.encode())


def _rebuild_optimizer(optimizer: torch.optim.Optimizer, masters: dict, opt_level: str,
                       master_rounding: Optional[str]) -> fp8_optim.Adam:
    defaults = optimizer.defaults
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(defaults.get("decoupled_weight_decay", False))
    groups = []
    for group in optimizer.param_groups:
        new_group = dict(group)
        new_group["params"] = [masters.get(p, p) for p in group["params"]]
        new_group["state_dtypes"] = opt_level
        if master_rounding is not None:
            new_group["master_rounding"] = master_rounding
        if decoupled:
            new_group["decoupled_weight_decay"] = True
        groups.append(new_group)
    kwargs = {key: defaults[key] for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "capturable",
                                             "differentiable", "rounding_seed") if key in defaults}
    # (an fp8amp optimizer's own rounding stays the default of groups added later)
    rounding = master_rounding or defaults.get("master_rounding", "nearest")
    cls = fp8_optim.AdamW if decoupled else fp8_optim.Adam
    return cls(groups, state_dtypes=opt_level, master_rounding=rounding, **kwargs)
