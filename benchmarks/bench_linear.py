"""Fp8Linear forward + backward on the GPU against BF16 and torchao float8, side by side (docs/architecture.md#tests-and-evidence, docs/benchmarks.md#targets).

One training micro-step of one Linear layer,

    x.grad = weight.grad = None                     (zero_grad(set_to_none=True))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(dy)

with float32 parameters (mixed-precision training), a bfloat16 input that requires grad and a
bfloat16 output gradient, timed for six layers made from one nn.Linear (copies of its weights):

    bf16 eager          nn.Linear; autocast runs its three GEMMs in bfloat16
    bf16 compiled       the same, torch.compile(layer, dynamic=False)
    fp8amp eager        fp8amp.Fp8Linear.from_linear (docs/architecture.md#fp8linear-dataflow): E4M3 input and weight, E5M2
                        output gradient, delayed scaling; the scaling states are advanced past their
                        current-scaling warm-up first, so the steady state of training is timed
    fp8amp compiled     the same under torch.compile
    torchao eager       torchao.float8.convert_to_float8_training (its default recipe: dynamic
                        tensorwise scaling, E4M3 forward, E5M2 gradients)
    torchao compiled    the same under torch.compile (the way torchao is meant to be used)

Times are medians over samples, each a batch of back-to-back steps between CUDA events (so launch
overhead hides behind the GPU where it can, as in training); the input and output-gradient sets
rotate so that small shapes do not run from L2 (the weight, as in a real step, is one tensor).
TFLOP/s counts 6·M·K·N (three GEMMs); "floor" is that over the datasheet dense peak of the
layer's GEMM precision (BF16 989, FP8 1979 TFLOP/s). "host ms" is the CPU time to issue one step
(10 steps from an idle GPU); where it reaches 90 % of the GPU time the step is host-bound and
marked so. "err" is ‖out − ref‖ / ‖ref‖ of y, dx and dW against bf16 eager on the same input:
FP8 lands at a few 1e-2, BF16 compiled near 0; NaN or ~1 means a broken path.

For each shape it also prints what ``fp8amp.convert``'s default policy (``policy="auto"``, which
keeps nn.Linear wherever FP8 is measured slower, docs/benchmarks.md#targets) decides for that layer at M tokens:
its own measurement (fp8amp.convert_policy.decide, the same timer and threshold convert uses),
beside this benchmark's fp8amp eager / bf16 eager ratio (--no-policy skips it).

Usage: python benchmarks/bench_linear.py [--shapes 8192x4096x16384,...] [--samples 15] [--bias]
       [--modes bf16,bf16-compiled,fp8amp,fp8amp-compiled,torchao,torchao-compiled] [--no-policy]
Shapes are MxKxN: M tokens, K in_features, N out_features. Prints a markdown table (last); with
$OUT set, also writes it to $OUT/bench_linear.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

import fp8amp
from fp8amp.convert_policy import LayerDecision, decide
from _common import (
    BF16_PEAK_FLOPS,
    FP8_PEAK_FLOPS,
    dynamo_reset_counters,
    dynamo_summary,
    import_torchao,
    markdown_table,
    median_seconds,
    parse_mkn,
    parse_subset,
    report,
    require_gpu,
    rotation_sets,
    set_recompile_limit,
    warm_up_gpu,
)

# Transformer Linears at 8192-16384 tokens, largest first, then the small ones that show where
# FP8 stops paying (MxKxN: tokens x in -> out).
DEFAULT_SHAPES = [
    (8192, 4096, 16384),  # 7B-class MLP up
    (8192, 16384, 4096),  # 7B-class MLP down
    (16384, 8192, 8192),  # 70B-class attention projection
    (8192, 2048, 2048),  # ~1B attention projection
    (8192, 1024, 1024),  # ~300M attention projection
]

# key: (label, kind, compiled)
MODES = {
    "bf16": ("bf16 eager", "bf16", False),
    "bf16-compiled": ("bf16 compiled", "bf16", True),
    "fp8amp": ("fp8amp eager", "fp8amp", False),
    "fp8amp-compiled": ("fp8amp compiled", "fp8amp", True),
    "torchao": ("torchao eager", "torchao", False),
    "torchao-compiled": ("torchao compiled", "torchao", True),
}
HOST_BOUND = 0.9  # host ms / GPU ms at which a step counts as host-bound


@dataclass
class Result:
    seconds: Optional[float] = None
    host_seconds: Optional[float] = None
    errors: Optional[tuple[float, float, float]] = None
    failure: Optional[str] = None  # shown instead of the numbers
    notes: list[str] = field(default_factory=list)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().float(), ref.detach().float()
    return ((a - ref).norm() / ref.norm()).item()


def host_seconds(step: Callable[[int], object], steps: int = 10, reps: int = 5) -> float:
    """CPU time to issue one step, from an idle GPU (10 steps stay far below the launch queue's
    depth, so the CPU never waits for the GPU unless something synchronizes)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        times.append((time.perf_counter() - t0) / steps)
    torch.cuda.synchronize()
    return statistics.median(times)


class Step:
    """One micro-step on input set i % n; returns y."""

    def __init__(self, module: nn.Module, layer: nn.Module, xs: list, dys: list):
        self.module, self.xs, self.dys = module, xs, dys
        self.params = list(layer.parameters())

    def __call__(self, i: int) -> torch.Tensor:
        x, dy = self.xs[i % len(self.xs)], self.dys[i % len(self.dys)]
        x.grad = None
        for p in self.params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = self.module(x)
        y.backward(dy)
        return y


def build(kind: str, base: nn.Linear, torchao_convert: Optional[Callable]) -> nn.Module:
    layer = copy.deepcopy(base)
    if kind == "fp8amp":
        return fp8amp.Fp8Linear.from_linear(layer)
    if kind == "torchao":
        return torchao_convert(layer)
    return layer


def measure(kind: str, compiled: bool, base: nn.Linear, xs: list, dys: list, ref, samples: int,
            torchao_convert: Optional[Callable]) -> tuple[Result, Optional[tuple]]:
    """Times one mode on one shape; returns (result, (y, dx, dW) of input set 0)."""
    t0 = time.perf_counter()
    dynamo_reset_counters()
    layer = build(kind, base, torchao_convert)
    module = torch.compile(layer, dynamic=False) if compiled else layer
    step = Step(module, layer, xs, dys)
    if kind == "fp8amp":
        # Past the current-scaling warm-up (history_len steps), as in steady training: each
        # optimizer step would call update_scaling once.
        for i in range(layer.input_scaling.recipe.history_len + 1):
            step(i)
            fp8amp.update_scaling(layer)
    else:
        for i in range(3):
            step(i)
    torch.cuda.synchronize()
    result = Result()
    result.notes.append(f"warm-up {time.perf_counter() - t0:.1f} s")
    if compiled:
        result.notes.append(dynamo_summary())

    y = step(0)
    outputs = (y.detach(), xs[0].grad, layer.weight.grad)
    if any(t is None for t in outputs):
        raise RuntimeError("no gradient reached x or the weight")
    if ref is not None:
        result.errors = tuple(rel_err(a, r) for a, r in zip(outputs, ref))
    result.seconds = median_seconds(step, samples)
    result.host_seconds = host_seconds(step)
    return result, outputs


def policy_decision(base: nn.Linear, tokens: int) -> object:
    """What convert(policy="auto") decides for this layer at `tokens` tokens (a LayerDecision),
    or the error it raised (a string)."""
    try:
        decision = decide(base, tokens=tokens)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return f"error: {type(e).__name__}: {str(e)[:100]}"
    print(f"  {base.in_features} -> {base.out_features} at {tokens} tokens, convert(policy='auto'): "
          f"{'FP8' if decision.converted else 'kept nn.Linear'}: {decision.reason}", file=sys.stderr, flush=True)
    return decision


def policy_line(shape: tuple[int, int, int], decision: object, results: dict[str, Result]) -> str:
    if not isinstance(decision, LayerDecision):
        return f"- {shape_name(shape)}: {decision}"
    what = "converted to FP8" if decision.converted else "kept as nn.Linear"
    line = f"- {shape_name(shape)}: {what}; {decision.reason}"
    ours, theirs = results.get("fp8amp"), results.get("bf16")
    if ours and theirs and ours.seconds and theirs.seconds:
        line += f"; this benchmark: fp8amp eager {theirs.seconds / ours.seconds:.2f}x bf16 eager"
    return line


def bench_shape(m: int, k: int, n: int, modes: list[str], samples: int, bias: bool,
                torchao_convert: Optional[Callable], torchao_note: str,
                policy: bool = True) -> tuple[dict[str, Result], object]:
    torch._dynamo.reset()  # a new shape compiles anew; keep no stale graphs around
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=bias, device="cuda")  # float32 parameters
    sets = rotation_sets(2 * (m * k + m * n), min_sets=2)  # bf16 bytes of one (x, dy) set
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(sets)]
    dys = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    results: dict[str, Result] = {}
    ref = None
    for key in modes:
        label, kind, compiled = MODES[key]
        if kind == "torchao" and torchao_convert is None:
            results[key] = Result(failure=torchao_note)
            continue
        try:
            result, outputs = measure(kind, compiled, base, xs, dys, ref, samples, torchao_convert)
            if key == "bf16":
                ref = outputs
            del outputs
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            oom = isinstance(e, torch.OutOfMemoryError)
            result = Result(failure="out of memory" if oom else f"error: {type(e).__name__}: {str(e)[:100]}")
        for x in xs:
            x.grad = None
        torch.cuda.synchronize()
        text = f"{result.seconds * 1e3:.3f} ms" if result.seconds is not None else result.failure
        print(f"  {m} x {k} -> {n} {label}: {text} ({'; '.join(result.notes)})", file=sys.stderr, flush=True)
        results[key] = result
    del xs, dys, ref
    torch.cuda.empty_cache()
    decision = policy_decision(base, m) if policy else None
    del base
    torch.cuda.empty_cache()
    return results, decision


def shape_name(shape: tuple[int, int, int]) -> str:
    m, k, n = shape
    return f"{m} x {k} -> {n}"


def table(all_results: dict, modes: list[str]) -> str:
    header = ["M x K -> N", "mode", "ms", "TFLOP/s", "vs bf16 eager", "vs bf16 compiled", "floor ms",
              "host ms", "err y / dx / dW"]
    rows = []
    for shape, results in all_results.items():
        flops = 6.0 * shape[0] * shape[1] * shape[2]
        base_eager = results.get("bf16", Result()).seconds
        base_compiled = results.get("bf16-compiled", Result()).seconds
        for key in modes:
            label, kind, _ = MODES[key]
            r = results[key]
            if r.seconds is None:
                rows.append([shape_name(shape), label, r.failure or "not run"] + ["–"] * (len(header) - 3))
                continue
            peak = BF16_PEAK_FLOPS if kind == "bf16" else FP8_PEAK_FLOPS
            host = f"{r.host_seconds * 1e3:.3f}"
            if r.host_seconds >= HOST_BOUND * r.seconds:
                host += " (host-bound)"
            rows.append([
                shape_name(shape), label, f"{r.seconds * 1e3:.3f}", f"{flops / r.seconds / 1e12:.0f}",
                f"{base_eager / r.seconds:.2f}x" if base_eager else "–",
                f"{base_compiled / r.seconds:.2f}x" if base_compiled else "–",
                f"{flops / peak * 1e3:.3f}", host,
                "reference" if key == "bf16" else " / ".join(f"{e:.1e}" for e in r.errors) if r.errors else "–",
            ])
    return markdown_table(header, rows)


def crossover(all_results: dict, mode: str, baseline: str) -> str:
    """Where `mode` starts to be at least as fast as `baseline`, over shapes ordered by FLOPs."""
    label, base_label = MODES[mode][0], MODES[baseline][0]
    ratios = []
    for shape in sorted(all_results, key=lambda s: s[0] * s[1] * s[2]):
        ours, theirs = all_results[shape].get(mode), all_results[shape].get(baseline)
        if ours and theirs and ours.seconds and theirs.seconds:
            ratios.append((shape, theirs.seconds / ours.seconds))
    if not ratios:
        return f"- {label} vs {base_label}: not measured"
    faster = [(s, r) for s, r in ratios if r >= 1.0]
    slower = ", ".join(f"{shape_name(s)} ({r:.2f}x)" for s, r in ratios if r < 1.0)
    if not faster:
        return f"- {label} ≥ 1.0x {base_label}: at none of the measured shapes (all slower: {slower})"
    first = faster[0]
    text = f"- {label} ≥ 1.0x {base_label}: from {shape_name(first[0])} ({first[1]:.2f}x) on, by FLOPs"
    return text + (f"; slower at {slower}" if slower else "; faster at every measured shape")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_mkn, default=DEFAULT_SHAPES, help="MxKxN,MxKxN,...")
    parser.add_argument("--samples", type=int, default=15, help="timed batches per measurement")
    parser.add_argument("--bias", action="store_true", help="Linear layers with a bias (default: none)")
    parser.add_argument("--modes", type=lambda t: parse_subset(t, list(MODES)), default=list(MODES),
                        help=", ".join(MODES))
    parser.add_argument("--no-policy", action="store_true",
                        help="do not report convert(policy='auto')'s decision per shape")
    args = parser.parse_args()
    require_gpu("bench_linear", min_capability=(8, 9))
    for m, k, n in args.shapes:
        if k % 16 or n % 16:
            sys.exit(f"bench_linear: K and N must be multiples of 16 for FP8 (cuBLASLt), got {m}x{k}x{n}")

    torchao_convert, torchao_note = import_torchao()
    set_recompile_limit(64)
    warm_up_gpu()
    start = time.perf_counter()
    all_results, decisions = {}, {}
    for shape in args.shapes:
        all_results[shape], decisions[shape] = bench_shape(*shape, args.modes, args.samples, args.bias,
                                                           torchao_convert, torchao_note, not args.no_policy)
    print(f"bench_linear: {time.perf_counter() - start:.0f} s", file=sys.stderr)

    summary = [crossover(all_results, "fp8amp-compiled", "bf16-compiled"),
               crossover(all_results, "fp8amp", "bf16"),
               crossover(all_results, "torchao-compiled", "bf16-compiled")]
    text = (f"Linear forward + backward (y = layer(x); y.backward(dy)) on {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, {torchao_note}: float32 weights{' + bias' if args.bias else ''}, "
            f"autocast bfloat16, bfloat16 x and dy; median of {args.samples} batches\n\n"
            "FP8 speedup crossover (smallest measured shape at which FP8 is at least as fast as BF16):\n"
            + "\n".join(summary) + "\n\n" + table(all_results, args.modes) + "\n")
    if not args.no_policy:
        text += ("\nfp8amp.convert(policy='auto') per shape (its own timing at M tokens; FP8 kept only where at "
                 "least min_speedup as fast):\n"
                 + "\n".join(policy_line(shape, decisions[shape], all_results[shape]) for shape in args.shapes)
                 + "\n")
    report("linear", text)


if __name__ == "__main__":
    main()
