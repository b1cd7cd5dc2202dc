"""Where a GPT training step's GPU time goes, per mode: the kernels of a few profiled steps, summed.

Not a benchmark (gpu_check.sh runs only bench_*.py): a diagnostic for the gaps that
docs/benchmarks.md reports, e.g. why O2 steps are slower than FP8 compute with fp32 weights.
It trains the ~1B GPT of bench_train.py (same data, optimizer settings, autocast) for warm-up steps,
then records `--steps` steps with torch.profiler and prints, per mode, the step time and
torch.profiler's table of the ops and kernels with the most self CUDA time.

Modes: bf16, fp8amp (convert), o1, o2 (initialize) and o2-fp8act (O2 with the forward inside
fp8amp.save_activations_in_fp8(): the activations non-Linear ops save, stored in FP8); each also
with "-compile": every transformer block compiled, as bench_train.py's compiled modes do (where
FP8 activations become Inductor code fused into the blocks' kernels).

After each table: how much of the profiled steps' span the GPU ran nothing, in gaps grouped by
length, and the longest gaps with their neighbours (launch gaps are a few µs; long ones are the
GPU waiting for the host). Then each mode's GPU time by kind of kernel (fp8amp's, attention,
GEMMs, Inductor's, the optimizer's, other) and, with two or more modes, a table that compares each
mode with the first, kernel by kernel (by name: calls and ms a step), the largest differences
first: what a mode adds. (bench_models.py --profile prints the same for its models.)

Usage: python benchmarks/profile_train.py [--modes fp8amp,o2,o2-fp8act,o2-fp8act-compile,o2@blockwise]
       [--steps 3] [--top 25] [--preset 1b|small|86m] [--compare-top 40] [--policy auto|all]
       [--memory]   (also: what is alive at the peak of one step's allocated memory, by code location)
With $OUT set, also writes the tables to $OUT/profile_train.txt.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
from torch.profiler import ProfilerActivity, profile

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step
from _common import require_gpu, set_recompile_limit

PRESETS = {
    "1b": (GPTConfig(seq_len=2048, n_layer=20, n_head=16, d_model=2048), 8),
    "small": (GPTConfig(seq_len=512, n_layer=6, n_head=8, d_model=512), 16),
    # the 86M GPT below the FP8 crossover (docs/benchmarks.md#model-sizes): 16,384 tokens a step
    "86m": (GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768), 16),
}
FP8_ACTIVATIONS = "-fp8act"
COMPILE = "-compile"
MODES = [m + c for c in ("", COMPILE) for m in ("bf16", "fp8amp", "o1", "o2", "o2" + FP8_ACTIVATIONS)]


def mode_list(text: str) -> list[str]:
    """--modes: MODE or MODE@RECIPE (an fp8amp mode with that scaling recipe), comma-separated."""
    picked = [m.strip() for m in text.split(",") if m.strip()]
    for item in picked:
        mode, at, recipe = item.partition("@")
        if mode not in MODES or (at and (recipe not in fp8amp.RECIPES or mode.startswith("bf16"))):
            raise argparse.ArgumentTypeError(
                f"takes a comma-separated list of {', '.join(MODES)}, each fp8amp one optionally with @RECIPE "
                f"({', '.join(fp8amp.RECIPES)}); got {item!r}")
    if not picked:
        raise argparse.ArgumentTypeError("names no mode")
    return picked


def build(mode_key: str, cfg: GPTConfig, tokens: int, policy: str):
    """(model, optimizer, the saved-tensor hooks to train under or None) of a mode."""
    mode, _, recipe = mode_key.partition("@")
    recipe = recipe or "tensorwise"
    eager_mode = mode.removesuffix(COMPILE)
    level = eager_mode.removesuffix(FP8_ACTIVATIONS)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    if level == "fp8amp":
        fp8amp.convert(model, optimizer=optimizer, tokens=tokens, recipe=recipe, policy=policy)
    elif level in ("o1", "o2"):
        model, optimizer = fp8amp.initialize(model, optimizer, level.upper(), tokens=tokens, recipe=recipe,
                                             policy=policy)
    if mode.endswith(COMPILE):
        for block in model.blocks:
            block.compile(dynamic=False)
    hooks = fp8amp.save_activations_in_fp8() if eager_mode.endswith(FP8_ACTIVATIONS) else None
    return model, optimizer, hooks


def live_at_peak(step, top: int) -> str:
    """One `step()` under the CUDA allocator's history recording: the peak of allocated memory and,
    at that moment, the largest groups of the blocks allocated during the step (grouped by their
    innermost Python frames), so a step's transient memory can be attributed to code."""
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc", stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    current = peak = peak_index = 0
    for i, event in enumerate(trace):  # pass 1: where the peak is
        if event["action"] == "alloc":
            current += event["size"]
        elif event["action"] == "free_completed":
            current -= event["size"]
        if current > peak:
            peak, peak_index = current, i
    live: dict[int, dict] = {}
    for event in trace[: peak_index + 1]:  # pass 2: what is alive there
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    groups: dict[str, int] = {}
    for event in live.values():
        frames = [f"{f['name']} ({os.path.basename(f['filename'])}:{f['line']})" for f in event.get("frames", [])[:3]]
        key = " <- ".join(frames) or "?"
        groups[key] = groups.get(key, 0) + event["size"]
    rows = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    lines = [f"allocated before the step {baseline / 2**30:.2f} GiB; peak during it +{peak / 2**30:.2f} GiB "
             f"(= {(baseline + peak) / 2**30:.2f} GiB); blocks allocated in the step and alive at the peak:"]
    lines += [f"  {size / 2**30:7.3f} GiB  {key}" for key, size in rows]
    return "\n".join(lines)


# Gap sizes the idle summary groups by, in µs: launch-to-launch gaps on a busy stream are a few µs;
# longer ones mean the GPU waited for the host.
GAP_BUCKETS_US = (3.0, 20.0, 200.0)


def idle_summary(intervals: list[tuple[float, float, str]], top: int = 8) -> str:
    """Where the GPU ran nothing: `intervals` are (start µs, end µs, name) of the device activity
    (kernels, memsets, copies; any streams) of the profiled steps. Busy time is their union; the
    gaps in it, from the first start to the last end, are grouped by size, and the longest are
    listed with the activity that ended before and started after them."""
    if not intervals:
        return "idle: no device activity recorded"
    kernels = sorted(intervals)
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []  # (length µs, the kernel before, the kernel after)
    run_start, run_end, last_name = kernels[0]
    for start, end, name in kernels[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((start - run_end, last_name, name))
            run_start, run_end = start, end
        elif end > run_end:
            run_end = end
        if end >= run_end:
            last_name = name
    busy += run_end - run_start
    span = run_end - kernels[0][0]
    edges = (0.0, *GAP_BUCKETS_US, float("inf"))
    lines = [f"device activity over {span / 1e3:.1f} ms: busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms "
             f"in {len(gaps)} gaps ({len(kernels)} kernels, memsets and copies)"]
    for lo, hi in zip(edges, edges[1:]):
        sizes = [g for g, _, _ in gaps if lo <= g < hi]
        label = f">= {lo:g} us" if hi == float("inf") else f"{lo:g}-{hi:g} us"
        lines.append(f"  gaps {label:>12}: {len(sizes):6d}, {sum(sizes) / 1e3:7.2f} ms")
    lines.append(f"  the {min(top, len(gaps))} longest:")
    for length, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {length:9.1f} us  after {before[:70]}  before {after[:70]}")
    return "\n".join(lines)


def kernel_totals(intervals: list[tuple[float, float, str]], steps: int) -> dict[str, tuple[float, float]]:
    """{device activity name: (calls a step, ms a step)} of `steps` profiled steps."""
    totals: dict[str, list[float]] = {}
    for start, end, name in intervals:
        entry = totals.setdefault(name, [0.0, 0.0])
        entry[0] += 1
        entry[1] += end - start
    return {name: (calls / steps, us / steps / 1e3) for name, (calls, us) in totals.items()}


def compare_modes(totals: dict[str, dict[str, tuple[float, float]]], top: int) -> str:
    """Markdown table: per kernel name, each mode's calls and ms a step against the first mode's,
    sorted by the largest |ms difference| of any mode; a last row sums every kernel."""
    modes = list(totals)
    base = totals[modes[0]]
    names = set().union(*(t.keys() for t in totals.values()))
    zero = (0.0, 0.0)

    def change(name: str) -> float:
        return max(abs(totals[m].get(name, zero)[1] - base.get(name, zero)[1]) for m in modes[1:])

    header = "| kernel | " + " | ".join(f"{m} calls | {m} ms" for m in modes) + " | " + \
        " | ".join(f"{m} - {modes[0]} ms" for m in modes[1:]) + " |"
    lines = [f"### per kernel, a step: each mode against {modes[0]} (the {top} largest differences)", "",
             header, "|---" * (1 + 2 * len(modes) + len(modes) - 1) + "|"]
    rows = sorted(names, key=lambda n: (-change(n), n))[:top]
    sums = {m: (sum(c for c, _ in totals[m].values()), sum(ms for _, ms in totals[m].values())) for m in modes}
    for name, values in [(n, {m: totals[m].get(n, zero) for m in modes}) for n in rows] + [("all", sums)]:
        cells = [f"{values[m][0]:.0f} | {values[m][1]:.2f}" for m in modes]
        diffs = [f"{values[m][1] - values[modes[0]][1]:+.2f}" for m in modes[1:]]
        label = name if name == "all" else name.replace("|", "/")[:100]
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(diffs) + " |")
    return "\n".join(lines)


# What a kernel is, by its name: the first category whose words one of the name's words holds
# (lower case), in this order. fp8amp's kernels come first: their names hold "cast", "gemm"...
KERNEL_CATEGORIES = (
    ("fp8amp", ("fp8amp::",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas")),
    ("inductor", ("triton",)),
    ("optimizer", ("adam", "multi_tensor_apply")),
)


def kernel_category(name: str) -> str:
    """The KERNEL_CATEGORIES name of a device activity, or "other" (copies, memsets, torch's own kernels)."""
    lower = name.lower()
    for category, words in KERNEL_CATEGORIES:
        if any(w in lower for w in words):
            return category
    return "other"


def compare_categories(totals: dict[str, dict[str, tuple[float, float]]]) -> str:
    """Markdown table: per mode, ms a step of each kernel category and in all (kernel_totals per mode)."""
    modes = list(totals)
    names = [c for c, _ in KERNEL_CATEGORIES] + ["other"]
    by_mode = {m: dict.fromkeys(names, 0.0) for m in modes}
    for m in modes:
        for name, (_, ms) in totals[m].items():
            by_mode[m][kernel_category(name)] += ms
    lines = ["| kernels | " + " | ".join(f"{m} ms" for m in modes) + " |", "|---" * (1 + len(modes)) + "|"]
    for c in names + ["all"]:
        cells = [f"{sum(by_mode[m].values()) if c == 'all' else by_mode[m][c]:.2f}" for m in modes]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profiled(step, steps: int):
    """``(prof, ms a step)``: ``steps`` calls of ``step()`` under torch.profiler (CUDA activity),
    between a synchronize and CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    return prof, start.elapsed_time(end) / steps


def device_intervals(prof) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every device-side event torch.profiler recorded."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def profile_mode(mode: str, cfg: GPTConfig, batch: int, data, steps: int, warmup: int, top: int,
                 memory: bool = False, policy: str = "auto") -> tuple[str, dict[str, tuple[float, float]]]:
    """(the mode's text, its kernel_totals)"""
    model, optimizer, hooks = build(mode, cfg, batch * cfg.seq_len, policy)
    loader = batches(data, batch, cfg.seq_len, "cuda", seed=0)

    def step() -> None:
        train_step(model, optimizer, *next(loader), saved_tensors_hooks=hooks)

    for _ in range(warmup):
        step()
    prof, step_ms = profiled(step, steps)
    averages = prof.key_averages()
    try:
        table = averages.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=90)
    except (AttributeError, KeyError):  # older names
        table = averages.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=90)
    intervals = device_intervals(prof)
    text = (f"### {mode}: {step_ms:.1f} ms a step ({steps} profiled steps; totals below are over all of them)\n\n"
            f"{table}\n{idle_summary(intervals)}\n")
    if memory:
        text += "\n" + live_at_peak(step, top) + "\n"
    return text, kernel_totals(intervals, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", type=mode_list, default=["fp8amp", "o2"],
                        help="MODE or MODE@RECIPE, comma-separated: " + ", ".join(MODES))
    parser.add_argument("--policy", choices=["auto", "all"], default="auto",
                        help="which Linears the fp8amp modes convert (fp8amp.convert's policy; default: auto)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=18)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--compare-top", type=int, default=40,
                        help="rows of the per-kernel comparison of the modes (with two or more modes)")
    parser.add_argument("--memory", action="store_true",
                        help="also record one step's allocations and show what is alive at its peak")
    args = parser.parse_args()
    require_gpu("profile_train")
    set_recompile_limit(64)  # as bench_train.py: 20 compiled block instances never fall back to eager
    cfg, batch = PRESETS[args.preset]
    data = load_text_bytes(max_bytes=64 << 20)
    tables, totals = [], {}
    for mode in args.modes:
        text, totals[mode] = profile_mode(mode, cfg, batch, data, args.steps, args.warmup, args.top, args.memory,
                                              args.policy)
        tables.append(text)
        gc.collect()  # the mode's model and optimizer are gone: give their memory back
        torch.cuda.empty_cache()
    tables.append("### GPU time a step by kind of kernel\n\n" + compare_categories(totals) + "\n")
    if len(totals) > 1:
        tables.append(compare_modes(totals, args.compare_top) + "\n")
    text = "\n".join(tables)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_train.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
