"""Host time of fp8amp's O2 training step on a CPU, where tiny tensors make the arithmetic
negligible: what is left is the Python and dispatch time a GPU step pays while the host enqueues
(docs/benchmarks.md#where-a-small-models-step-goes).

Not a benchmark of the GPU (gpu_check.sh runs only bench_*.py): medians of many repeats on the
CPU of

- one Linear's forward + backward, 16 rows x 64 features: nn.Linear against Fp8Linear at O2;
- one training step (fp8amp.testing.train_step: forward, backward, clipping, optimizer step,
  zero_grad) of the built-in GPT at a tiny width (default d 16, 12 layers, 16 tokens), eager,
  BF16's recipe (float32 on the CPU, torch's fused AdamW) against O2 (fp8amp.initialize);
- the O2 optimizer's step alone (with the scaling hooks initialize registers on it);

each also with the time spent inside fp8amp's ops (their CPU kernels: on a GPU, launches of a
few microseconds) taken out, which leaves the host time proper; and, with --profile, the call counts of one O2 step under cProfile (they do not depend on the
machine) with the functions that take the most host time.

Usage: python benchmarks/host_time.py [--repeats 300] [--d-model 16] [--layers 12] [--seq 16] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time
from typing import Callable, Iterator

import torch
from torch import nn

import fp8amp
import fp8amp.ops.fast
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step


@contextlib.contextmanager
def timing_fp8amp_ops(optimizer=None) -> Iterator[list]:
    """Inside it every op of fp8amp.ops.fast (through which all of fp8amp's code calls the core)
    and every step of an ``AdamPlan`` made inside it adds the seconds it ran to the list yielded.
    ``optimizer`` (fp8amp's): its kept plans are dropped on the way in and out, so that its steps
    inside make timed ones."""
    spent = [0.0]
    originals = {name: op for name, op in vars(fp8amp.ops.fast).items() if isinstance(op, torch._ops.OpOverload)}
    adam_plan = fp8amp.ops.fast.AdamPlan

    def timed(op):
        def call(*args, **kwargs):
            start = time.thread_time()
            try:
                return op(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start
        return call

    class TimedPlan:
        def __init__(self, *buffers):
            self.step = timed(adam_plan(*buffers).step)

    kept = getattr(optimizer, "_call_lists", {})
    for name, op in originals.items():
        setattr(fp8amp.ops.fast, name, timed(op))
    fp8amp.ops.fast.AdamPlan = TimedPlan
    kept.clear()
    try:
        yield spent
    finally:
        for name, op in originals.items():
            setattr(fp8amp.ops.fast, name, op)
        fp8amp.ops.fast.AdamPlan = adam_plan
        kept.clear()


def median_us(fn: Callable[[], object], repeats: int, warmup: int = 5, optimizer=None) -> tuple[float, float]:
    """Median CPU microseconds of this thread (where all of the step runs, with one thread: a
    loaded machine's other processes do not count) of one fn() call, and of one call less the time inside fp8amp's ops
    (measured in separate calls, which the timing wrappers slow a little; ``optimizer``: the one
    fn steps, see timing_fp8amp_ops)."""
    for _ in range(warmup):
        fn()
    times, outside = [], []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    with timing_fp8amp_ops(optimizer) as spent:
        fn()  # (makes the optimizer's timed plans)
        for _ in range(repeats):
            spent[0] = 0.0
            start = time.thread_time()
            fn()
            outside.append(time.thread_time() - start - spent[0])
    return statistics.median(times) * 1e6, statistics.median(outside) * 1e6


def _both(us: tuple[float, float], unit: float = 1.0, digits: int = 0) -> str:
    return f"{us[0] / unit:.{digits}f} ({us[1] / unit:.{digits}f} outside fp8amp's ops)"


def linear_step(layer: nn.Module) -> Callable[[], None]:
    """One forward + backward of ``layer`` on 16 rows, its gradients dropped after."""
    x = torch.randn(16, layer.in_features, requires_grad=True)

    def step() -> None:
        layer(x).sum().backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return step


def build_gpt(mode: str, cfg: GPTConfig):
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    if mode == "O2":
        model, optimizer = fp8amp.initialize(model, optimizer, "O2", policy="all")
    return model, optimizer


def gpt_step(model: nn.Module, optimizer, cfg: GPTConfig) -> Callable[[], None]:
    data = batches(load_text_bytes(max_bytes=1 << 20), 1, cfg.seq_len)
    return lambda: train_step(model, optimizer, *next(data))


def optimizer_step(model: nn.Module, optimizer, cfg: GPTConfig) -> Callable[[], None]:
    """optimizer.step() over the gradients of one backward, kept (the step does not consume them)."""
    x, y = next(batches(load_text_bytes(max_bytes=1 << 20), 1, cfg.seq_len))
    model(x, y)[1].backward()
    return optimizer.step


def profile_step(step: Callable[[], None], steps: int, top: int) -> None:
    """Call counts a step of the functions taking the most host time (own time, cProfile)."""
    step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    total_calls = sum(s[1] for s in stats.stats.values())
    print(f"  cProfile of {steps} O2 steps: {total_calls / steps:.0f} Python calls a step; the {top} functions "
          "with the most own time (calls a step, own us a step):")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (path, line, name), (_, ncalls, tottime, _, _) in rows:
        where = path.split("/python/fp8amp/")[-1] if "/fp8amp/" in path else path.split("/")[-1]
        print(f"    {ncalls / steps:7.0f}  {tottime / steps * 1e6:8.0f}  {name} ({where}:{line})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="also the cProfile call counts of an O2 step")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    print(f"host time on the CPU (torch {torch.__version__}, 1 thread), medians of {args.repeats}:")

    plain = nn.Linear(64, 64)
    o2 = fp8amp.initialize(nn.Sequential(nn.Linear(64, 64)), None, "O2", policy="all")[0][0]
    t_plain, t_o2 = (median_us(linear_step(layer), args.repeats) for layer in (plain, o2))
    print(f"  one Linear forward + backward, 16 x 64, us: nn.Linear {t_plain[0]:.0f}, Fp8Linear O2 {_both(t_o2)}")

    steps = {mode: build_gpt(mode, cfg) for mode in ("bf16", "O2")}
    t_step = {mode: median_us(gpt_step(*built, cfg), args.repeats, optimizer=built[1])
              for mode, built in steps.items()}
    print(f"  one GPT step (d {args.d_model}, {args.layers} layers, {args.seq} tokens, eager), ms: BF16 recipe "
          f"{t_step['bf16'][0] / 1e3:.2f}, O2 {_both(t_step['O2'], 1e3, 2)}")
    model, optimizer = steps["O2"]
    t_optim = median_us(optimizer_step(model, optimizer, cfg), args.repeats, optimizer=optimizer)
    print(f"  the O2 optimizer step alone (with its scaling hooks), ms: {_both(t_optim, 1e3, 2)}")
    if args.profile:
        optimizer.zero_grad(set_to_none=True)
        profile_step(gpt_step(model, optimizer, cfg), 20, args.top)


if __name__ == "__main__":
    main()
