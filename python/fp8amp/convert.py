"""``convert``: swap a model's ``nn.Linear`` layers for :class:`~fp8amp.linear.Fp8Linear`.

FP8 must never make a training step slower (docs/benchmarks.md#targets). ``convert``'s default
``policy="auto"`` therefore first judges the whole step: on a CUDA GPU, a model whose step at
``tokens`` tokens is below the FP8 crossover measured on whole GPT steps
(:data:`~fp8amp.convert_policy.STEP_CROSSOVER`, docs/benchmarks.md#model-sizes) keeps every
Linear in BF16 compute, since FP8's fixed per-layer costs outweigh its faster GEMMs there. Above
the crossover it converts a Linear only where FP8 is measured to be faster (``policy="layers"``
runs this stage alone): for each distinct layer
shape it times one training micro-step (forward + backward, input and output gradient of
``tokens`` rows in bfloat16, under bfloat16 autocast) of a fresh ``nn.Linear`` and of a fresh
``Fp8Linear`` of that shape, parameters and device, with CUDA events, once per process (the
result is cached), and keeps ``nn.Linear`` where FP8 is not at least ``min_speedup`` times as
fast. ``policy="all"`` converts every Linear that FP8 can take (no timing). On the CPU, where
the FP8 path is an emulation and a timing would say nothing about a GPU, ``"auto"`` converts
every Linear FP8 can take, like ``"all"``. Hugging Face ``Conv1D`` layers (GPT-2: a Linear whose
weight is stored ``[in, out]``) are decided by the same rules and become
:class:`~fp8amp.linear.Fp8Conv1D`, which keeps their parameters and state-dict layout.

What ``convert`` decided, and why, is logged (logger ``fp8amp.convert``, INFO) and kept:
:func:`conversion_report` returns, for each ``nn.Linear`` it saw, whether it was converted,
the reason, and the measured times.

:mod:`fp8amp.convert_policy` holds the timing (:func:`~fp8amp.convert_policy.cuda_event_timer`,
its cache, the agreement across ranks) and :func:`~fp8amp.convert_policy.decide`, which says what
``"auto"`` would decide for one Linear.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None

from .convert_policy import (
    DEFAULT_MIN_SPEEDUP,
    DEFAULT_TOKENS,
    LayerDecision,
    StepDecision,
    Timer,
    _check_policy_args,
    _decide_auto,
    _decision,
    check_compiled,
    decide_step,
    step_rule_applies,
)
from .linear import Fp8Conv1D, Fp8Linear, RecipeArg, is_hf_conv1d, weight_not_parameter_reason
from .recipes import Recipe, resolve_recipe
from .scaling_hooks import check_hookable, register_scaling_hooks, update_scaling, watch_scaling_updates

__all__ = [
    "convert",
    "check_options",
    "update_scaling",
    "register_scaling_hooks",
    "POLICIES",
    "LayerDecision",
    "ConversionReport",
    "conversion_report",
]

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

#: The accepted ``policy`` values of :func:`convert`.
POLICIES = ("auto", "layers", "all")


@dataclass
class ConversionReport:
    """The decisions of one :func:`convert` call, one per ``nn.Linear`` (or Hugging Face ``Conv1D``)
    seen, in module order."""

    policy: str
    tokens: int
    min_speedup: float
    #: How the caller said the model runs (convert's ``compiled``: None, not said).
    compiled: Optional[bool] = None
    #: The recipe's kind ("tensorwise", "rowwise", "blockwise", "mxfp8").
    recipe: str = "tensorwise"
    decisions: list[LayerDecision] = field(default_factory=list)
    #: The whole-step stage of ``"auto"`` (None where it did not judge: other policies, a CPU).
    step: Optional[StepDecision] = None
    #: What the caller adds (initialize: which of the level's formats apply).
    notes: list[str] = field(default_factory=list)

    @property
    def converted(self) -> list[LayerDecision]:
        return [d for d in self.decisions if d.converted]

    @property
    def skipped(self) -> list[LayerDecision]:
        """The Linears left as they are (FP8 slower, filtered out, or a shape FP8 cannot take)."""
        return [d for d in self.decisions if not d.converted]

    def __str__(self) -> str:
        head = (f"fp8amp.convert(policy={self.policy!r}, recipe={self.recipe!r}, tokens={self.tokens}, "
                + ("" if self.compiled is None else f"compiled={self.compiled}, ") +
                f"min_speedup={self.min_speedup}): "
                f"{len(self.converted)} of {len(self.decisions)} Linear layers converted")
        step = [] if self.step is None else [f"  whole step: {self.step}"]
        return "\n".join([head] + step + [f"  {note}" for note in self.notes] + [f"  {d}" for d in self.decisions])


def conversion_report(model: nn.Module) -> Optional[ConversionReport]:
    """The :class:`ConversionReport` of the last :func:`convert` that returned ``model``
    (``None`` if it never went through ``convert``). Layers an earlier ``convert`` made
    Fp8Linear are counted in its notes, not judged again."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"conversion_report: model must be an nn.Module, got {type(model).__name__}")
    holder = report_holder(model)
    report = holder.__dict__.get("_fp8amp_conversion_report")
    if report is not None:
        _mark_unconverted(holder, report)
    return report


_UNCONVERTED = "converted, then made a plain layer again (fp8amp.unconvert of a submodule, or replaced)"


def _mark_unconverted(holder: nn.Module, report: ConversionReport) -> None:
    """Marks, in place, the layers the report converted whose name now holds a plain Linear (or
    Conv1D) of their shape: an ``unconvert`` of a submodule cannot reach the report its root keeps.
    (A name that now holds something else, under a wrapper that moved its children, says nothing.)"""
    for i, decision in enumerate(report.decisions):
        if not decision.converted:
            continue
        try:
            layer = holder.get_submodule(decision.name)
        except AttributeError:
            continue
        plain = (isinstance(layer, nn.Linear) and not isinstance(layer, Fp8Linear)) or is_hf_conv1d(layer)
        if plain and tuple(layer.weight.shape) in {(decision.out_features, decision.in_features),
                                                   (decision.in_features, decision.out_features)}:
            report.decisions[i] = replace(decision, converted=False, reason=_UNCONVERTED)


def report_holder(model: nn.Module) -> nn.Module:
    """The module that keeps ``model``'s report: for ``torch.compile(model)`` (an OptimizedModule),
    the module it compiles, whose layers convert changes, so that either reads the same report."""
    return model._orig_mod if isinstance(model, OptimizedModule) else model


def is_sharded(linear: nn.Module) -> bool:
    """A Linear whose weight a distributed wrapper replaced by a DTensor (FSDP2's fully_shard makes
    the layer an instance of a subclass, which convert would skip without a word)."""
    return DTensor is not None and isinstance(getattr(linear, "weight", None), DTensor)


def check_options(*, module_filter_fn: Optional[ModuleFilter] = None, recipe: RecipeArg = None, policy: str = "auto",
                  tokens: int = DEFAULT_TOKENS, compiled: Optional[bool] = None,
                  min_speedup: float = DEFAULT_MIN_SPEEDUP, timer: Optional[Timer] = None,
                  caller: str = "convert") -> Recipe:
    """:func:`convert`'s checks of its options, without a model (for what takes the options before
    the model, as the Lightning plugins do, naming themselves as ``caller``); returns the recipe
    resolved."""
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"{caller}: module_filter_fn must be a callable (module, name) -> bool")
    if module_filter_fn is not None:
        _check_filter_signature(module_filter_fn, caller)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"{caller}: policy must be one of {', '.join(map(repr, POLICIES))}; got {policy!r}")
    _check_policy_args(tokens, min_speedup, timer, caller)
    check_compiled(compiled, caller)
    return resolve_recipe(recipe, caller)


def _check_filter_signature(module_filter_fn: ModuleFilter, caller: str) -> None:
    """module_filter_fn takes (module, fqn) positionally: a clear TypeError before any call (Python's
    names neither the argument nor what it takes)."""
    try:
        signature = inspect.signature(module_filter_fn)
    except (TypeError, ValueError):  # a callable without a signature (some builtins): called as it is
        return
    try:
        signature.bind(None, "")
    except TypeError:
        raise TypeError(f"{caller}: module_filter_fn must take (module, fqn) positionally and return a bool "
                        f"(True: convert the Linear); got a callable of signature {signature}") from None


def _filter_accepts(module_filter_fn: ModuleFilter, linear: nn.Module, fqn: str) -> bool:
    answer = module_filter_fn(linear, fqn)
    try:
        return bool(answer)
    except (TypeError, ValueError, RuntimeError):  # a tensor or array of several values
        raise TypeError(f"module_filter_fn (of fp8amp.convert / fp8amp.initialize) must return a bool; for {fqn!r} "
                        f"it returned {type(answer).__name__} {answer!r}, which has no truth value") from None


def convert(
    model: nn.Module,
    *,
    module_filter_fn: Optional[ModuleFilter] = None,
    recipe: RecipeArg = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    policy: str = "auto",
    tokens: int = DEFAULT_TOKENS,
    compiled: Optional[bool] = None,
    min_speedup: float = DEFAULT_MIN_SPEEDUP,
    timer: Optional[Timer] = None,
) -> nn.Module:
    """Replaces, in place, the ``nn.Linear`` layers of ``model`` that FP8 can take (and, with
    ``policy="auto"``, where it is faster) by ``Fp8Linear`` layers sharing their parameters, and
    returns ``model``. :func:`conversion_report` (``model``) says what was decided and why.

    Args:
        model: any module, on the device it will train on (``"auto"`` times there). If it is
            itself an ``nn.Linear``, the new module is returned (there is no parent to put it in).
        module_filter_fn: ``(module, fully_qualified_name) -> bool``; a Linear is converted only
            if this returns True. Linears whose in/out features are not multiples of 16 (cuBLASLt's
            FP8 rule), or whose weight is not float32, bfloat16 or float16 (float64), are always
            left as they are.
        recipe: how the new layers scale their FP8 operands (docs/tiles.md#recipes):
            ``"tensorwise"`` (default: one scale per tensor, delayed scaling), ``"rowwise"``,
            ``"blockwise"``, ``"mxfp8"`` (OCP MX 1 x 32 blocks; CPU emulation or a Blackwell
            GPU: on a CUDA GPU below sm_100 convert raises NotImplementedError before changing
            anything), an :class:`fp8amp.Recipe`, or an :class:`fp8amp.ScalingRecipe`
            (tensorwise with that history, margin and scale rule). A Linear whose shape the
            recipe cannot take (blockwise: in/out features not multiples of 128; mxfp8: of 32)
            is left as it is, with the reason in the report.
        optimizer: if given, :func:`update_scaling` runs after each of its ``step()`` calls, so the
            training loop needs no extra line.
        policy: ``"auto"`` (default): on a CUDA device, first the whole step: if a step of the
            Linears FP8 can take, at ``tokens`` tokens, is estimated below the FP8 crossover
            measured on whole GPT steps (:func:`~fp8amp.convert_policy.decide_step`), none is
            converted (the model stays in BF16 compute; the report says so); otherwise as
            ``"layers"``. ``"layers"``: on a CUDA device, convert a Linear only if one forward +
            backward of it in FP8 is measured at least ``min_speedup`` times as fast as in
            bfloat16 autocast (measured once per distinct (in_features, out_features, bias,
            dtype, device, tokens) per process). On other devices (CPU: FP8 emulation) both
            convert every Linear FP8 can take. ``"all"``: convert every Linear FP8 can take, no
            timing.
        tokens: the tokens (batch x sequence) of one training micro-batch: what ``"auto"``
            judges the step at and times each layer with (default 8192). Ignored by ``"all"``.
        compiled: how the model will run, for ``"auto"``'s whole-step stage: ``True`` (under
            ``torch.compile``) or ``False`` (eager) judges by that column of the measured
            crossover; ``None`` (default: not known) by the lower of the two, so that neither way
            is slower (docs/benchmarks.md#model-sizes: at width 1024 and 16k tokens, O2 is 1.16x
            BF16 eager but 0.74x compiled). Ignored by ``"layers"`` and ``"all"``.
        min_speedup: the factor by which FP8 must be faster for ``"auto"`` to convert
            (default 1.05: a margin over timing noise and the per-step scale update).
        timer: ``(module, tokens) -> seconds`` of one forward + backward, replacing
            :func:`~fp8amp.convert_policy.cuda_event_timer` for ``"auto"``; a timer given here is
            used on every device (CPU included), so the policy can be tried with made-up timings
            (the whole-step stage of ``"auto"`` then judges as on a GPU).

    Raises:
        ValueError: an unknown ``policy`` or ``recipe`` (the message names the accepted ones), ``tokens`` < 1,
            a ``min_speedup`` that is not a positive finite number.
        TypeError: an argument of the wrong type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None:
        check_hookable(optimizer, "convert")  # (before the model changes)
    recipe_given = recipe is not None
    recipe = check_options(module_filter_fn=module_filter_fn, recipe=recipe, policy=policy, tokens=tokens,
                           compiled=compiled, min_speedup=min_speedup, timer=timer)
    for device in {p.device for p in model.parameters()}:  # before any layer changes (mxfp8 below Blackwell)
        recipe.check_device(device, "fp8amp.convert")
    report = ConversionReport(policy=policy, tokens=tokens, min_speedup=float(min_speedup), recipe=recipe.kind,
                              compiled=compiled)
    earlier = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if earlier:  # this report judges the remaining Linears only
        report.notes.append(f"{len(earlier)} layer(s) already Fp8Linear before this call (an earlier convert), "
                            "not counted below")
        other = sorted({str(m.recipe) for m in earlier if m.recipe != recipe})
        if recipe_given and other:
            note = (f"{sum(m.recipe != recipe for m in earlier)} layer(s) already Fp8Linear with recipe "
                    f"{', '.join(other)} keep it: recipe {recipe} applies only to the Linears this call converts "
                    "(fp8amp.unconvert(model) first to convert them again with another recipe)")
            report.notes.append(note)
            warnings.warn(f"convert: {note}", stacklevel=2)

    # Which Linears, and where a timing is needed.
    # (parent, child name, fqn, linear); a Conv1D enters as its _Conv1DShape, the same for every
    # name that reaches it.
    candidates: list[tuple[nn.Module, str, str, nn.Linear]] = []
    conv1d_shapes: dict[int, _Conv1DShape] = {}
    if type(model) is nn.Linear:
        candidates.append((None, "", "", model))
    else:
        for name, module in list(model.named_modules()):
            for child_name, child in list(module._modules.items()):  # every reference, shared ones too
                fqn = f"{name}.{child_name}" if name else child_name
                if type(child) is nn.Linear:
                    candidates.append((module, child_name, fqn, child))
                elif isinstance(child, nn.Linear) and not isinstance(child, Fp8Linear) and is_sharded(child):
                    raise ValueError(
                        f"fp8amp.convert: {fqn} is already sharded (its weight is a DTensor: fully_shard / FSDP2 "
                        "or tensor parallelism ran first), and convert takes plain nn.Linear layers only, so it "
                        "would convert nothing; call fp8amp.convert / fp8amp.initialize before fully_shard "
                        "(docs/distributed.md)")
                elif is_hf_conv1d(child):
                    if id(child) not in conv1d_shapes:
                        conv1d_shapes[id(child)] = _Conv1DShape(child)
                    candidates.append((module, child_name, fqn, conv1d_shapes[id(child)]))
        # Module order, so that a Linear reachable under two names (an alias set on the root) is
        # filtered and reported under its first, the name named_modules and numerics_report give it.
        order = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
        candidates.sort(key=lambda candidate: order[candidate[2]])
        if isinstance(model, OptimizedModule):  # the names of the module it compiles, which keeps the report
            candidates = [(parent, child_name, fqn.removeprefix("_orig_mod."), linear)
                          for parent, child_name, fqn, linear in candidates]

    decisions = {}
    to_time = []
    for parent, child_name, fqn, linear in candidates:
        if id(linear) in decisions:  # a Linear reachable under two names is decided once
            continue
        if (why := weight_not_parameter_reason(getattr(linear, "conv", linear))) is not None:
            decisions[id(linear)] = _decision(fqn, linear, False, why)
        elif (why := recipe.unsupported_reason(linear.in_features, linear.out_features, linear.weight.dtype)) is not None:
            decisions[id(linear)] = _decision(fqn, linear, False, why)
        elif (module_filter_fn is not None
              and not _filter_accepts(module_filter_fn, getattr(linear, "conv", linear), fqn)):
            decisions[id(linear)] = _decision(fqn, linear, False, "module_filter_fn returned False")
        elif is_sharded(linear):  # parallelize_module ran first (it keeps the class): the forward could not run
            raise ValueError(
                f"fp8amp.convert: {fqn} is tensor-parallel (its weight is a DTensor: parallelize_module ran first), "
                "and Fp8Linear computes on local tensors, not DTensors: tensor parallelism of fp8amp layers is not "
                "supported. Keep it nn.Linear (module_filter_fn returning False for the tensor-parallel Linears); "
                "FSDP2, DDP and pipeline parallelism take fp8amp layers "
                "(docs/distributed.md#tensor-and-pipeline-parallelism)")
        elif policy == "all":
            decisions[id(linear)] = _decision(fqn, linear, True, "policy='all'" + _recipe_note(recipe))
        else:
            decisions[id(linear)] = None
            to_time.append((fqn, linear))
    if to_time and policy == "auto" and step_rule_applies([linear for _, linear in to_time], timer):
        report.step = decide_step([(linear.in_features, linear.out_features) for _, linear in to_time], tokens,
                                  compiled=compiled)
        logger.info("whole step: %s", report.step)
        if not report.step.fp8:
            for fqn, linear in to_time:
                decisions[id(linear)] = _decision(fqn, linear, False, "kept in BF16 compute: the whole step is below "
                                                  "the measured FP8 crossover")
            to_time = []
    if to_time:
        _decide_auto(to_time, decisions, tokens, float(min_speedup), timer, recipe)

    for parent, _, fqn, linear in candidates:
        if isinstance(parent, OptimizedModule) and decisions[id(linear)].converted:
            # Its forward is bound to the Linear it compiled: a layer put in its place would never run.
            raise ValueError(f"fp8amp.convert: {fqn} is a Linear layer that torch.compile wraps, whose compiled "
                             "forward would keep calling that Linear; convert / initialize the Linear first, "
                             "then torch.compile the module they return")
    converted: dict[int, nn.Module] = {}
    for parent, child_name, fqn, linear in candidates:
        decision = decisions[id(linear)]
        if decision.name == fqn:  # reported under its first name
            report.decisions.append(decision)
        if not decision.converted:
            continue
        if id(linear) not in converted:
            converted[id(linear)] = (Fp8Conv1D.from_conv1d(linear.conv, recipe) if isinstance(linear, _Conv1DShape)
                                     else Fp8Linear.from_linear(linear, recipe))
            layer = converted[id(linear)]
            for state in (layer.input_scaling, layer.weight_scaling, layer.grad_output_scaling):
                state.layer_name = decision.name
        if parent is None:
            model = converted[id(linear)]
        else:
            setattr(parent, child_name, converted[id(linear)])

    logger.info("%d of %d Linear layers converted to FP8 (policy=%r)", len(report.converted), len(report.decisions),
                policy)
    object.__setattr__(report_holder(model), "_fp8amp_conversion_report", report)
    if optimizer is not None:
        register_scaling_hooks(model, optimizer)
    else:
        watch_scaling_updates(model)
    return model


def _recipe_note(recipe) -> str:
    return "" if recipe.kind == "tensorwise" else f", recipe {recipe}"


class _Conv1DShape:
    """A Hugging Face Conv1D (weight ``[in, out]``) as the decision rules and the timing read a
    Linear: its in/out features, bias, and a weight of its device and dtype (a transposed view)."""

    def __init__(self, conv: nn.Module) -> None:
        self.conv = conv
        self.in_features, self.out_features = conv.weight.shape
        self.bias = conv.bias
        self.weight = conv.weight.detach().t()
