"""The policy behind ``convert(policy="auto")``, in two stages that :mod:`fp8amp.convert` applies:

1. the whole step (:func:`decide_step`): whether a training step of this model, at ``tokens``
   tokens a step, is above the FP8 crossover measured on whole GPT steps (:data:`STEP_CROSSOVER`);
   below it every Linear stays in BF16 compute, whatever a single layer's timing says, because the
   fixed per-layer costs of FP8 (casts, scaling, launches, host time) outweigh its faster GEMMs;
2. each Linear (:func:`decide`, ``policy="layers"`` alone): whether it is faster in FP8 than in
   bfloat16, measured by :func:`cuda_event_timer` once per process and layer shape
   (:func:`clear_timing_cache` forgets the measurements).

The timing is of the GPU's work in an eager step (:func:`cuda_event_timer` queues it behind a GPU
sleep so that the host's Python and launch time is not in it): in a training step the host runs
ahead of the GPU and its time overlaps with other layers' GPU work, unless the whole model is so
small that the step is host-bound, where FP8 brings nothing anyway. Under ``torch.distributed``
every rank times, then all use rank 0's measurements, so the replicas' modules stay identical.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .linear import Fp8Linear, RecipeArg
from .recipes import Recipe, resolve_recipe

__all__ = [
    "LayerDecision",
    "StepDecision",
    "STEP_CROSSOVER",
    "decide",
    "decide_step",
    "check_compiled",
    "cuda_event_timer",
    "clear_timing_cache",
]

# convert's logger: its docstring says the decisions are logged there.
logger = logging.getLogger("fp8amp.convert")

#: ``timer(module, tokens) -> seconds`` of one forward + backward of ``module`` (an ``nn.Linear``
#: or an ``Fp8Linear``, made for the measurement on the layer's device) on ``tokens`` rows.
Timer = Callable[[nn.Module, int], float]

DEFAULT_TOKENS = 8192
DEFAULT_MIN_SPEEDUP = 1.05

#: Whole training steps measured on one H200, fp8amp O2 against BF16 with fp8amp.testing's GPT
#: (benchmarks/bench_sizes.py, docs/benchmarks.md#model-sizes, where the runs are):
#: (d_model, tokens per step, BF16 step time / O2 step time eager, the same both compiled per
#: block), None where not measured. Fill it from bench_sizes' O2 rows.
STEP_CROSSOVER: tuple[tuple[int, int, Optional[float], Optional[float]], ...] = (
    # bench_sizes.py, torch 2.11, 2026-12-02, after the host-time cuts; 8, 12, 12, 8, 8, 4 layers.
    # 768 and 1536 at 8192 tokens were measured twice: the lower of the two runs (a slower host
    # makes O2's step host-bound there, and the default must not be slower than BF16).
    (512, 8192, 0.64, 0.71),
    (768, 8192, 0.42, 0.46),
    (1024, 8192, 0.86, 0.68),
    (1536, 8192, 0.94, 0.84),
    (2048, 8192, 1.47, 1.46),
    (4096, 8192, 1.56, 1.53),
    (512, 16384, 0.54, 0.55),
    (768, 16384, 0.53, 0.59),
    (1024, 16384, 1.16, 0.74),
    (1536, 16384, 1.26, 1.21),
    (2048, 16384, 1.43, 1.41),
    (4096, 16384, 1.56, 1.53),
)
#: The whole step takes FP8 where its estimated speed is at least this times BF16's.
STEP_MIN_SPEEDUP = 1.0

# (timer, device, in_features, out_features, bias, dtype, tokens, recipe) -> (nn.Linear s, Fp8Linear s)
_TIMINGS: dict[tuple, tuple[float, float]] = {}


# Here rather than in convert, which imports this module: decide returns one too.
@dataclass(frozen=True)
class LayerDecision:
    """What :func:`fp8amp.convert` did with one ``nn.Linear`` and why.

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


def clear_timing_cache() -> None:
    """Forgets every timing ``policy="auto"`` made in this process (they are made once per
    distinct layer shape, dtype, device and token count)."""
    _TIMINGS.clear()


def _check_policy_args(tokens, min_speedup, timer, caller: str = "convert") -> None:
    """The arguments of the timing, for convert and decide alike (named after ``caller``, convert
    by default, whose arguments they are; the recipe is resolved by each)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"{caller}: tokens must be an int, got {type(tokens).__name__}")
    if tokens < 1:
        raise ValueError(f"{caller}: tokens must be >= 1, got {tokens}")
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)):
        raise TypeError(f"{caller}: min_speedup must be a float, got {type(min_speedup).__name__}")
    if not min_speedup > 0 or min_speedup == float("inf"):
        raise ValueError(f"{caller}: min_speedup must be a positive finite number, got {min_speedup}")
    if timer is not None and not callable(timer):
        raise TypeError(f"{caller}: timer must be a callable (module, tokens) -> seconds")


def _timing_key(linear: nn.Linear, tokens: int, timer: Optional[Timer], recipe: Recipe) -> tuple:
    w = linear.weight
    return (timer, str(w.device), linear.in_features, linear.out_features, linear.bias is not None, w.dtype, tokens,
            recipe)


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
        key = _timing_key(linear, tokens, timer, recipe)
        if key not in measured:
            if key not in _TIMINGS:
                _TIMINGS[key] = _time_pair(linear, tokens, timer or cuda_event_timer, recipe)
            measured[key] = _TIMINGS[key]
    measured = _agree_across_ranks(measured)
    for fqn, linear in to_time:
        if decisions[id(linear)] is not None:
            continue
        t_linear, t_fp8 = measured[_timing_key(linear, tokens, timer, recipe)]
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


def _time_pair(linear: nn.Linear, tokens: int, timer: Timer, recipe: Recipe) -> tuple[float, float]:
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
    recipe: RecipeArg = None,
) -> LayerDecision:
    """What ``convert(policy="auto", ...)`` would decide for ``linear`` (timing it if needed, with
    the same cache), without converting anything."""
    if not isinstance(linear, nn.Linear) or isinstance(linear, Fp8Linear):
        raise TypeError(f"decide: linear must be an nn.Linear (not yet converted), got {type(linear).__name__}")
    _check_policy_args(tokens, min_speedup, timer)
    recipe = resolve_recipe(recipe, "decide")
    if (why := recipe.unsupported_reason(linear.in_features, linear.out_features, linear.weight.dtype)) is not None:
        return _decision("", linear, False, why)
    decisions = {id(linear): None}
    _decide_auto([("", linear)], decisions, tokens, float(min_speedup), timer, recipe)
    return decisions[id(linear)]


@dataclass(frozen=True)
class StepDecision:
    """The whole-step stage of ``policy="auto"`` (:func:`decide_step`).

    ``work`` is the step's GEMM size: tokens x the work-weighted mean of in_features x
    out_features over the Linears FP8 could take (the size of the GEMM an average FLOP of the step
    runs in); ``gpt_width`` the width of fp8amp.testing's GPT whose step has that size;
    ``speedup`` the speed of FP8 against BF16 estimated from :data:`STEP_CROSSOVER`: the compiled
    or the eager estimate where ``compiled`` says how the model runs, the lower of the two where
    it is None (not known).
    """

    tokens: int
    work: float
    gpt_width: float
    speedup: float
    fp8: bool
    compiled: Optional[bool] = None

    def __str__(self) -> str:
        how = {None: "eager or compiled", False: "eager", True: "compiled"}[self.compiled]
        where = (f"estimated {self.speedup:.2f}x BF16's speed ({how}) for {self.tokens:,} tokens a step at the GEMM "
                 f"sizes of a GPT of width {self.gpt_width:.0f}")
        if self.fp8:
            return f"FP8: the step is above the measured FP8 crossover ({where})"
        return (f"kept in BF16 compute: the step is below the measured FP8 crossover ({where}; "
                "docs/benchmarks.md#model-sizes); policy='all' converts anyway")


def _gemm_size(shapes, tokens: int) -> float:
    """tokens x the work-weighted mean of in x out over (in_features, out_features) ``shapes``."""
    sizes = [float(i) * float(o) for i, o in shapes]
    return tokens * sum(m * m for m in sizes) / sum(sizes)


def _gpt_shapes(d_model: int) -> list[tuple[int, int]]:
    """The Linears of one block of fp8amp.testing's GPT (mlp_ratio 4)."""
    return [(d_model, 3 * d_model), (d_model, d_model), (d_model, 4 * d_model), (4 * d_model, d_model)]


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through (x, y) points, flat beyond the ends."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else max(y0, y1)
    return points[-1][1]


def decide_step(shapes, tokens: int = DEFAULT_TOKENS, *, compiled: Optional[bool] = None,
                table=None) -> StepDecision:
    """Whether a training step whose FP8-eligible Linears have these ``(in_features,
    out_features)`` ``shapes`` is above the FP8 crossover at ``tokens`` tokens a step. The speed is
    interpolated in log(GEMM size) between ``table``'s measured steps (flat beyond them), for
    eager and compiled steps apart; the step takes FP8 where the estimate of how the model runs
    (``compiled``: True, torch.compile; False, eager; None, not known: the lower of the two) is
    at least :data:`STEP_MIN_SPEEDUP`. ``table``: rows as :data:`STEP_CROSSOVER`'s (the default)."""
    check_compiled(compiled, "decide_step")
    table = STEP_CROSSOVER if table is None else table
    shapes = list(shapes)
    if not shapes:
        raise ValueError("decide_step: shapes must name at least one (in_features, out_features)")
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"decide_step: tokens must be an int, got {type(tokens).__name__}")
    if tokens < 1:
        raise ValueError(f"decide_step: tokens must be >= 1, got {tokens}")
    work = _gemm_size(shapes, tokens)
    estimates = []
    columns = {None: (2, 3), False: (2,), True: (3,)}[compiled]  # the table's eager, compiled columns
    for column in columns:
        points = [(math.log(_gemm_size(_gpt_shapes(row[0]), row[1])), row[column]) for row in table
                  if row[column] is not None]
        if points:
            estimates.append(_interpolate(points, math.log(work)))
    if not estimates:
        which = {None: "eager and compiled", False: "eager", True: "compiled"}[compiled]
        raise ValueError(f"decide_step: table holds no measured speed (every {which} entry is None)")
    speedup = min(estimates)
    gpt_width = math.sqrt(work / _gemm_size(_gpt_shapes(1), tokens))
    return StepDecision(tokens=tokens, work=work, gpt_width=gpt_width, speedup=speedup,
                        fp8=speedup >= STEP_MIN_SPEEDUP, compiled=compiled)


def check_compiled(compiled: object, caller: str) -> None:
    """``compiled`` is True, False or None (a clear TypeError otherwise)."""
    if compiled is not None and not isinstance(compiled, bool):
        raise TypeError(f"{caller}: compiled must be True (torch.compile), False (eager) or None (not known), "
                        f"got {compiled!r}")


def step_rule_applies(linears, timer: Optional[Timer]) -> bool:
    """Whether ``"auto"``'s whole-step stage judges these Linears: on a CUDA GPU with FP8 tensor
    cores (where the crossover was measured), or anywhere with a ``timer`` given (which stands
    for a GPU's timings)."""
    if timer is not None:
        return True
    devices = {linear.weight.device for linear in linears}
    return any(d.type == "cuda" and _untimed_reason(d) is None for d in devices)
