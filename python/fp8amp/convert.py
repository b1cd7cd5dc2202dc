"""``convert``: swap a model's ``nn.Linear`` layers for :class:`~fp8amp.linear.Fp8Linear`.

FP8 must never make a layer slower (DESIGN §9). ``convert``'s default ``policy="auto"`` therefore
converts a Linear on a CUDA GPU only where FP8 is measured to be faster: for each distinct layer
shape it times one training micro-step (forward + backward, input and output gradient of
``tokens`` rows in bfloat16, under bfloat16 autocast) of a fresh ``nn.Linear`` and of a fresh
``Fp8Linear`` of that shape, parameters and device, with CUDA events, once per process (the
result is cached), and keeps ``nn.Linear`` where FP8 is not at least ``min_speedup`` times as
fast. ``policy="all"`` converts every Linear that FP8 can take (no timing). On the CPU, where
the FP8 path is an emulation and a timing would say nothing about a GPU, ``"auto"`` converts
every Linear FP8 can take, like ``"all"``.

What ``convert`` decided, and why, is logged (logger ``fp8amp.convert``, INFO) and kept:
:func:`conversion_report` returns, for each ``nn.Linear`` it saw, whether it was converted,
the reason, and the measured times.

The timing is of the GPU's work in an eager step (:func:`cuda_event_timer` queues it behind a GPU
sleep so that the host's Python and launch time is not in it): in a training step the host runs
ahead of the GPU and its time overlaps with other layers' GPU work, unless the whole model is so
small that the step is host-bound, where FP8 brings nothing anyway. Under ``torch.distributed``
every rank times, then all use rank 0's measurements, so the replicas' modules stay identical.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .linear import Fp8Linear, fp8_linear_supported
from .scaling import ScalingRecipe, update_states

__all__ = [
    "convert",
    "update_scaling",
    "POLICIES",
    "LayerDecision",
    "ConversionReport",
    "conversion_report",
    "decide",
    "cuda_event_timer",
    "clear_timing_cache",
]

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

#: ``timer(module, tokens) -> seconds`` of one forward + backward of ``module`` (an ``nn.Linear``
#: or an ``Fp8Linear``, made for the measurement on the layer's device) on ``tokens`` rows.
Timer = Callable[[nn.Module, int], float]

#: The accepted ``policy`` values of :func:`convert`.
POLICIES = ("auto", "all")

DEFAULT_TOKENS = 8192
DEFAULT_MIN_SPEEDUP = 1.05

# (timer, device, in_features, out_features, bias, dtype, tokens) -> (nn.Linear s, Fp8Linear s)
_TIMINGS: dict[tuple, tuple[float, float]] = {}


@dataclass(frozen=True)
class LayerDecision:
    """What :func:`convert` did with one ``nn.Linear`` and why.

    ``linear_seconds`` / ``fp8_seconds`` are the measured times of one forward + backward
    (``None`` where nothing was timed); ``speedup`` is their ratio (> 1: FP8 faster).
    """

    name: str
    in_features: int
    out_features: int
    bias: bool
    dtype: torch.dtype
    device: str
    converted: bool
    reason: str
    linear_seconds: Optional[float] = None
    fp8_seconds: Optional[float] = None

    @property
    def speedup(self) -> Optional[float]:
        if self.linear_seconds is None or self.fp8_seconds is None or self.fp8_seconds <= 0:
            return None
        return self.linear_seconds / self.fp8_seconds

    def __str__(self) -> str:
        what = "FP8" if self.converted else "kept"
        shape = f"{self.in_features}->{self.out_features}{' +bias' if self.bias else ''}"
        return f"{self.name or '<model>'} ({shape}, {self.dtype}, {self.device}): {what}: {self.reason}"


@dataclass
class ConversionReport:
    """The decisions of one :func:`convert` call, one per ``nn.Linear`` seen, in module order."""

    policy: str
    tokens: int
    min_speedup: float
    decisions: list[LayerDecision] = field(default_factory=list)

    @property
    def converted(self) -> list[LayerDecision]:
        return [d for d in self.decisions if d.converted]

    @property
    def skipped(self) -> list[LayerDecision]:
        """The Linears left as they are (FP8 slower, filtered out, or a shape FP8 cannot take)."""
        return [d for d in self.decisions if not d.converted]

    def __str__(self) -> str:
        head = (f"fp8amp.convert(policy={self.policy!r}, tokens={self.tokens}, min_speedup={self.min_speedup}): "
                f"{len(self.converted)} of {len(self.decisions)} Linear layers converted")
        return "\n".join([head] + [f"  {d}" for d in self.decisions])


def conversion_report(model: nn.Module) -> Optional[ConversionReport]:
    """The :class:`ConversionReport` of the last :func:`convert` that returned ``model``
    (``None`` if it never went through ``convert``)."""
    return model.__dict__.get("_fp8amp_conversion_report")


def clear_timing_cache() -> None:
    """Forgets every timing ``policy="auto"`` made in this process (they are made once per
    distinct layer shape, dtype, device and token count)."""
    _TIMINGS.clear()


def _check_convert_args(model, module_filter_fn, recipe, optimizer, policy, tokens, min_speedup, timer) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be an nn.Module, got {type(model).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError("convert: module_filter_fn must be a callable (module, name) -> bool")
    if recipe is not None and not isinstance(recipe, ScalingRecipe):
        raise TypeError(f"convert: recipe must be a ScalingRecipe, got {type(recipe).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"convert: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"convert: policy must be one of {', '.join(map(repr, POLICIES))}; got {policy!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"convert: tokens must be an int, got {type(tokens).__name__}")
    if tokens < 1:
        raise ValueError(f"convert: tokens must be >= 1, got {tokens}")
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)):
        raise TypeError(f"convert: min_speedup must be a float, got {type(min_speedup).__name__}")
    if not min_speedup > 0 or min_speedup == float("inf"):
        raise ValueError(f"convert: min_speedup must be a positive finite number, got {min_speedup}")
    if timer is not None and not callable(timer):
        raise TypeError("convert: timer must be a callable (module, tokens) -> seconds")


def convert(
    model: nn.Module,
    *,
    module_filter_fn: Optional[ModuleFilter] = None,
    recipe: Optional[ScalingRecipe] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    policy: str = "auto",
    tokens: int = DEFAULT_TOKENS,
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
            FP8 rule) are always left as they are.
        recipe: the delayed-scaling recipe of the new layers (default ``ScalingRecipe()``).
        optimizer: if given, :func:`update_scaling` runs after each of its ``step()`` calls, so the
            training loop needs no extra line.
        policy: ``"auto"`` (default): on a CUDA device, convert a Linear only if one forward +
            backward of it in FP8 is measured at least ``min_speedup`` times as fast as in
            bfloat16 autocast (measured once per distinct (in_features, out_features, bias,
            dtype, device, tokens) per process); on other devices (CPU: FP8 emulation) convert
            every Linear FP8 can take. ``"all"``: convert every Linear FP8 can take, no timing.
        tokens: the number of rows (batch x sequence) ``"auto"`` times with; use your training
            micro-batch's token count (default 8192). Ignored by ``"all"``.
        min_speedup: the factor by which FP8 must be faster for ``"auto"`` to convert
            (default 1.05: a margin over timing noise and the per-step scale update).
        timer: ``(module, tokens) -> seconds`` of one forward + backward, replacing
            :func:`cuda_event_timer` for ``"auto"``; a timer given here is used on every device
            (CPU included), so the policy can be tried with made-up timings.

    Raises:
        ValueError: an unknown ``policy`` (the message names the accepted ones), ``tokens`` < 1,
            a ``min_speedup`` that is not a positive finite number.
        TypeError: an argument of the wrong type.
    """
    _check_convert_args(model, module_filter_fn, recipe, optimizer, policy, tokens, min_speedup, timer)
    report = ConversionReport(policy=policy, tokens=tokens, min_speedup=float(min_speedup))
    model_in = model

    # Which Linears, and where a timing is needed.
    candidates: list[tuple[nn.Module, str, str, nn.Linear]] = []  # (parent, child name, fqn, linear)
    if type(model) is nn.Linear:
        candidates.append((None, "", "", model))
    else:
        for name, module in list(model.named_modules()):
            for child_name, child in list(module._modules.items()):  # every reference, shared ones too
                if type(child) is nn.Linear:
                    candidates.append((module, child_name, f"{name}.{child_name}" if name else child_name, child))

    decisions = {}
    to_time = []
    for parent, child_name, fqn, linear in candidates:
        if id(linear) in decisions:  # a Linear reachable under two names is decided once
            continue
        if not fp8_linear_supported(linear.in_features, linear.out_features):
            decisions[id(linear)] = _decision(fqn, linear, False, "in/out features not multiples of 16 (cuBLASLt FP8)")
        elif module_filter_fn is not None and not bool(module_filter_fn(linear, fqn)):
            decisions[id(linear)] = _decision(fqn, linear, False, "module_filter_fn returned False")
        elif policy == "all":
            decisions[id(linear)] = _decision(fqn, linear, True, "policy='all'")
        else:
            decisions[id(linear)] = None
            to_time.append((fqn, linear))
    if to_time:
        _decide_auto(to_time, decisions, tokens, float(min_speedup), timer, recipe)

    converted: dict[int, nn.Module] = {}
    for parent, child_name, fqn, linear in candidates:
        decision = decisions[id(linear)]
        if decision.name == fqn:  # reported under its first name
            report.decisions.append(decision)
        if not decision.converted:
            continue
        if id(linear) not in converted:
            converted[id(linear)] = Fp8Linear.from_linear(linear, recipe)
        if parent is None:
            model = converted[id(linear)]
        else:
            setattr(parent, child_name, converted[id(linear)])

    order = {name: i for i, (name, _) in enumerate(model_in.named_modules(remove_duplicate=False))}
    report.decisions.sort(key=lambda d: order.get(d.name, len(order)))
    logger.info("%d of %d Linear layers converted to FP8 (policy=%r)", len(report.converted), len(report.decisions),
                policy)
    object.__setattr__(model, "_fp8amp_conversion_report", report)
    if optimizer is not None:
        optimizer.register_step_post_hook(lambda *_: update_scaling(model))
    return model


def _decision(fqn: str, linear: nn.Linear, converted: bool, reason: str, times=(None, None)) -> LayerDecision:
    weight = linear.weight
    return LayerDecision(
        name=fqn,
        in_features=linear.in_features,
        out_features=linear.out_features,
        bias=linear.bias is not None,
        dtype=weight.dtype,
        device=str(weight.device),
        converted=converted,
        reason=reason,
        linear_seconds=times[0],
        fp8_seconds=times[1],
    )


def _timing_key(linear: nn.Linear, tokens: int, timer: Optional[Timer]) -> tuple:
    w = linear.weight
    return (timer, str(w.device), linear.in_features, linear.out_features, linear.bias is not None, w.dtype, tokens)


def _untimed_reason(device: torch.device) -> Optional[str]:
    """Why the default timer cannot judge FP8 on ``device`` (None: it can); such layers are
    converted (CPU: emulation) or kept (a GPU without FP8 tensor cores)."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"kept: FP8 GEMMs need compute capability 8.9 or newer, {device} has {capability[0]}.{capability[1]}"
    return None


def _decide_auto(to_time, decisions, tokens, min_speedup, timer, recipe) -> None:
    measured: dict[tuple, tuple[float, float]] = {}
    for fqn, linear in to_time:
        device = linear.weight.device
        if timer is None and device.type != "cuda":
            decisions[id(linear)] = _decision(
                fqn, linear, True, f"not timed on {device.type} (FP8 is timed on CUDA only; the CPU runs an "
                "emulation): converted")
            continue
        if timer is None and (why := _untimed_reason(device)):
            decisions[id(linear)] = _decision(fqn, linear, False, why)
            continue
        key = _timing_key(linear, tokens, timer)
        if key not in measured:
            if key not in _TIMINGS:
                _TIMINGS[key] = _time_pair(linear, tokens, timer or cuda_event_timer, recipe)
            measured[key] = _TIMINGS[key]
    measured = _agree_across_ranks(measured)
    for fqn, linear in to_time:
        if decisions[id(linear)] is not None:
            continue
        t_linear, t_fp8 = measured[_timing_key(linear, tokens, timer)]
        speedup = t_linear / t_fp8 if t_fp8 > 0 else float("inf")
        converted = speedup >= min_speedup
        reason = (f"FP8 {speedup:.2f}x as fast as BF16 ({t_fp8 * 1e3:.3f} vs {t_linear * 1e3:.3f} ms per fwd+bwd "
                  f"at {tokens} tokens)" + ("" if converted else f", below min_speedup {min_speedup:g}: kept"))
        decision = _decision(fqn, linear, converted, reason, (t_linear, t_fp8))
        decisions[id(linear)] = decision
        logger.info("%s", decision)


def _agree_across_ranks(measured: dict) -> dict:
    """Rank 0's timings on every rank (so that all replicas convert the same layers)."""
    if not measured or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return measured
    if torch.distributed.get_world_size() < 2:
        return measured
    keys = sorted(measured, key=repr)
    values = [[measured[k] for k in keys]]
    torch.distributed.broadcast_object_list(values, src=0)
    return dict(zip(keys, values[0]))


def _time_pair(linear: nn.Linear, tokens: int, timer: Timer, recipe: Optional[ScalingRecipe]) -> tuple[float, float]:
    """(nn.Linear seconds, Fp8Linear seconds) of fresh layers shaped like ``linear``; the global
    RNG states (CPU and the layer's GPU) are as they were before."""
    w = linear.weight
    devices = [w.device.index if w.device.index is not None else torch.cuda.current_device()] \
        if w.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        plain = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          device=w.device, dtype=w.dtype)
        t_linear = float(timer(plain, tokens))
        fp8 = Fp8Linear.from_linear(plain, recipe)
        t_fp8 = float(timer(fp8, tokens))
        del plain, fp8
    return t_linear, t_fp8


def cuda_event_timer(module: nn.Module, tokens: int, *, iters: int = 10, samples: int = 5) -> float:
    """GPU seconds of one training micro-step of ``module`` (an ``nn.Linear`` or ``Fp8Linear`` on a
    CUDA device): ``y = module(x)`` under bfloat16 autocast, ``y.backward(dy)``, with ``x``
    (requiring grad) and ``dy`` bfloat16 of ``tokens`` rows and the gradients reset each step.

    An ``Fp8Linear`` first runs past its current-scaling warm-up (``history_len`` steps, each
    followed by the scale update), so the steady state of training is timed. Then ``samples``
    batches of ``iters`` back-to-back steps are timed between CUDA events, each batch queued
    behind a GPU sleep that outlasts the host's enqueueing: the events measure the GPU's work
    alone, as in a training step where the host runs ahead of the GPU (host time would make
    every small layer look slower here while it overlaps with other layers' GPU work there). The
    median per step is returned.
    """
    weight = module.weight
    device = weight.device
    params = [p for p in module.parameters()]
    x = torch.randn(tokens, module.in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, module.out_features, device=device, dtype=torch.bfloat16)

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x)
        y.backward(dy)

    with torch.cuda.device(device):
        if isinstance(module, Fp8Linear):
            for _ in range(module.input_scaling.recipe.history_len + 1):
                step()
                module.update_scaling()
        for _ in range(3):
            step()
        torch.cuda.synchronize(device)
        host = time.perf_counter()
        for _ in range(iters):
            step()
        host = time.perf_counter() - host  # enqueueing time of a batch (the GPU may be slower)
        torch.cuda.synchronize(device)
        # torch.cuda._sleep counts SM clock cycles; 2 GHz is at least any current GPU's clock, so
        # the sleep lasts at least twice the enqueueing time.
        sleep_cycles = int(min(2.0 * host + 1e-3, 1.0) * 2.0e9)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
        for start, end in events:
            torch.cuda._sleep(sleep_cycles)
            start.record()
            for _ in range(iters):
                step()
            end.record()
        torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e-3 / iters


def decide(
    linear: nn.Linear,
    *,
    tokens: int = DEFAULT_TOKENS,
    min_speedup: float = DEFAULT_MIN_SPEEDUP,
    timer: Optional[Timer] = None,
    recipe: Optional[ScalingRecipe] = None,
) -> LayerDecision:
    """What ``convert(policy="auto", ...)`` would decide for ``linear`` (timing it if needed, with
    the same cache), without converting anything."""
    if not isinstance(linear, nn.Linear) or isinstance(linear, Fp8Linear):
        raise TypeError(f"decide: linear must be an nn.Linear (not yet converted), got {type(linear).__name__}")
    _check_convert_args(linear, None, recipe, None, "auto", tokens, min_speedup, timer)
    if not fp8_linear_supported(linear.in_features, linear.out_features):
        return _decision("", linear, False, "in/out features not multiples of 16 (cuBLASLt FP8)")
    decisions = {id(linear): None}
    _decide_auto([("", linear)], decisions, tokens, float(min_speedup), timer, recipe)
    return decisions[id(linear)]


def update_scaling(model: nn.Module) -> None:
    """Delayed-scaling update of every ``Fp8Linear`` in ``model``; call after each optimizer step.
    One launch for all their input states and one for their output-gradient states."""
    with torch.no_grad():
        update_states(s for m in model.modules() if isinstance(m, Fp8Linear)
                      for s in (m.input_scaling, m.grad_output_scaling))
