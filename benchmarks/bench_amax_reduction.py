"""What the rank-consistent amax reduction costs a training step: the 1B GPT at O2 on one GPU, with and without it.

fp8amp MAX-reduces the amaxes of every delayed-scaled tensor over the data-parallel group once a
step (docs/distributed.md#rank-consistent-scaling): the optimizer's pre-hook concatenates this
step's history columns and issues one asynchronous all_reduce, the post-hook waits for it and
copies the maxima back before the scaling update. On one GPU that collective is an NCCL group of
one process (world size 1; `set_amax_reduction(model, group)` reduces over an explicit group even
with one rank), so the launches and the host work are the real ones and only the wire is missing.

One model (bench_train's preset, fp8amp.initialize O2 with torch's fused AdamW, compiled per block
unless --eager) trains on the built-in data; after the warm-up, blocks of --block steps alternate
between the reduction on and off (`set_amax_reduction(model, group)` / `(model, enabled=False)`),
so that clock drift hits both alike. It prints the median step of each, their ratio, the
reduction's own cost (GPU kernels per step from the profiler, with and without, and the extra
kernels' names and device time) against the target of docs/benchmarks.md (< 1 % of the step).
With --graph the step is also captured in a CUDA graph with the reduction on and replayed (the
collective inside the graph), against one captured with it off.

Usage: python3 benchmarks/bench_amax_reduction.py [--preset 1b|gpt2|small] [--eager] [--graph]
       [--blocks 8] [--block 4]
Prints a markdown table; with $OUT set, also writes it to $OUT/bench_amax_reduction.md.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import socket
import statistics
import sys

import torch
import torch.distributed as dist

import fp8amp
from fp8amp.amax_sync import delayed_states, set_amax_reduction
from fp8amp.testing import GPT, batches, load_text_bytes, train_step
from _common import markdown_table, report, require_gpu, set_recompile_limit
from bench_train import PRESETS, positive


def one_rank_nccl_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))


def kernels_of(fn) -> tuple[collections.Counter, collections.Counter]:
    """The device kernels one call of fn launches: (name -> count, name -> device µs)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    counts = collections.Counter()
    times = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts[event.name] += 1
            times[event.name] += event.device_time
    return counts, times


def graph_row(mode, model, optimizer, batch, side, step, reduction, alternate) -> list:
    """The step captured twice, with the reduction on and off, the replays timed alternately."""
    graphs, pool = {}, None
    static = [t.clone() for t in batch]
    for on in (True, False):
        reduction(on)
        for _ in range(2):  # steps of this setting before its capture, on the side stream
            with torch.cuda.stream(side):
                step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            train_step(model, optimizer, *static)
        pool = graph.pool()
        graphs[on] = graph
    ms = alternate({"on": (True, graphs[True].replay), "off": (False, graphs[False].replay)})
    return [f"O2 + {mode} + CUDA graph", f"{ms['off']:.2f}", f"{ms['on']:.2f}", f"{ms['on'] / ms['off']:.4f}x",
            "–", "–", "–", f"{(ms['on'] - ms['off']) / ms['off']:.3%} (difference of medians)", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--eager", action="store_true", help="do not compile the blocks")
    parser.add_argument("--graph", action="store_true", help="also time the step captured in a CUDA graph")
    parser.add_argument("--blocks", type=positive, default=8, help="timed blocks per setting")
    parser.add_argument("--block", type=positive, default=4, help="steps per timed block")
    args = parser.parse_args()
    require_gpu("bench_amax_reduction", min_capability=(8, 9))
    if not dist.is_nccl_available():
        sys.exit("bench_amax_reduction: this torch has no NCCL; nothing to measure")
    set_recompile_limit(64)
    one_rank_nccl_group()
    group = dist.group.WORLD

    preset = PRESETS[args.preset]
    cfg = preset["model"]
    warmup = fp8amp.ScalingRecipe().history_len + 2
    total = warmup + 2 * args.blocks * args.block + 8  # + the profiled steps and the graphs' warm-ups
    data = list(itertools.islice(batches(load_text_bytes(), preset["batch"], cfg.seq_len, "cuda"), total))
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset["lr"], fused=True, capturable=args.graph)
    model, optimizer = fp8amp.initialize(model, optimizer, "O2", tokens=preset["batch"] * cfg.seq_len)
    if not args.eager:
        for block in model.blocks:
            block.compile(dynamic=False)
    states = delayed_states(model)
    feed = iter(data)

    def step():
        x, y = next(feed)
        return train_step(model, optimizer, x, y)

    def reduction(on: bool) -> None:
        if on:
            set_amax_reduction(model, group)
        else:
            set_amax_reduction(model, enabled=False)

    # The warm-up runs on a side stream (what a later capture asks), with the reduction on.
    reduction(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def timed_block(run) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.block):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / args.block

    def alternate(runs: dict) -> dict:
        times = {key: [] for key in runs}
        for _ in range(args.blocks):
            for key, (on, run) in runs.items():
                reduction(on)
                times[key].append(timed_block(run))
        return {key: statistics.median(t) for key, t in times.items()}

    rows = []
    mode = "eager" if args.eager else "compile"
    step_ms = alternate({"on": (True, step), "off": (False, step)})
    reduction(True)
    with_counts, with_times = kernels_of(step)
    reduction(False)
    without_counts, _ = kernels_of(step)
    extra = with_counts - without_counts
    extra_us = sum(with_times[name] * extra[name] / with_counts[name] for name in extra)
    rows.append([f"O2 + {mode}", f"{step_ms['off']:.2f}", f"{step_ms['on']:.2f}",
                 f"{step_ms['on'] / step_ms['off']:.4f}x", f"{sum(without_counts.values())}",
                 f"{sum(with_counts.values())} (+{sum(extra.values())})", f"{extra_us:.1f}",
                 f"{extra_us / 1e3 / step_ms['off']:.3%}", ", ".join(f"{n} x{c}" for n, c in extra.items())])

    if args.graph:
        try:
            rows.append(graph_row(mode, model, optimizer, data[0], side, step, reduction, alternate))
        except RuntimeError as e:  # a torch or NCCL build that cannot capture the collective
            rows.append([f"O2 + {mode} + CUDA graph", f"capture failed: {str(e).splitlines()[0][:120]}"] + ["–"] * 7)

    text = (f"## Amax reduction per step ({torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL "
            f"{'.'.join(map(str, torch.cuda.nccl.version()))}, one-rank group): GPT {args.preset} "
            f"({cfg.n_layer} layers, d {cfg.d_model}), {len(states)} delayed-scaled tensors, "
            f"{preset['batch'] * cfg.seq_len:,} tokens a step; median of {args.blocks} blocks of {args.block} steps "
            f"per setting, alternating\n\n"
            + markdown_table(["mode", "step ms, reduction off", "step ms, on", "on / off", "kernels a step, off",
                              "kernels a step, on", "extra kernels' device µs", "of the step (target < 1 %)",
                              "extra kernels"], rows) + "\n")
    report("amax_reduction", text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
