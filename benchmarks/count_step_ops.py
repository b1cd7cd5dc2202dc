"""What one training step of a GPT launches, counted on any device (a CPU will do): the op calls of
fp8amp, the aten ops, and the host time around them (docs/benchmarks.md#where-a-small-models-step-goes).

Not a benchmark (gpu_check.sh runs only bench_*.py): a count. The GPT of fp8amp.testing (default
d 768, 12 layers, 12 heads, the GPT-2 small shape where O2 + compile measured 0.75x BF16 + compile
on the H200) trains with torch.optim.AdamW through fp8amp.initialize (or fp8amp.convert for
--mode fp8, or plain for bf16) past its warm-up; then one step runs under torch.profiler, and
each op called is counted. "leaf" ops are those that call no other op: on a GPU each is about one
kernel launch (or a host-side view / allocation). The count does not depend on the token count,
so a short sequence keeps the CPU's emulated FP8 fast.

Usage: python benchmarks/count_step_ops.py [--mode bf16|fp8|O1|O2] [--d-model 768] [--layers 12]
       [--heads 12] [--seq 32] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step

MODES = ("bf16", "fp8", "O1", "O2")


def build(mode: str, cfg: GPTConfig, device: str):
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if mode == "fp8":
        fp8amp.convert(model, optimizer=optimizer, policy="all")
    elif mode in fp8amp.OPT_LEVELS:
        model, optimizer = fp8amp.initialize(model, optimizer, mode, policy="all")
    return model, optimizer


def step_counts(model, optimizer, data) -> dict:
    """One step under the profiler: {"all": Counter, "leaf": Counter, "host_s": wall seconds,
    "op_self_s": the ops' summed self time}."""
    x, y = next(data)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        train_step(model, optimizer, x, y)
        wall = time.perf_counter() - start
    all_ops, leaf_ops = collections.Counter(), collections.Counter()
    self_us = 0.0
    for event in prof.events():
        if not event.name.startswith(("aten::", "fp8amp::")):
            continue
        all_ops[event.name] += 1
        self_us += event.self_cpu_time_total
        if not any(c.name.startswith(("aten::", "fp8amp::")) for c in event.cpu_children):
            leaf_ops[event.name] += 1
    return {"all": all_ops, "leaf": leaf_ops, "host_s": wall, "op_self_s": self_us * 1e-6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="O2")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=fp8amp.ScalingRecipe().history_len + 1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    cfg = GPTConfig(seq_len=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    model, optimizer = build(args.mode, cfg, args.device)
    data = batches(load_text_bytes(max_bytes=1 << 20), 1, args.seq, args.device)
    for x, y in itertools.islice(data, args.warmup):
        train_step(model, optimizer, x, y)
    counts = step_counts(model, optimizer, data)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    fp8 = {k: v for k, v in counts["all"].items() if k.startswith("fp8amp::")}
    leaf_total = sum(counts["leaf"].values())
    print(f"{args.mode}, GPT d {args.d_model}, {args.layers} layers ({linears} Linears), one step after "
          f"{args.warmup} warm-up steps on {args.device}:")
    print(f"  fp8amp op calls: {sum(fp8.values())} ({sum(fp8.values()) / max(linears, 1):.1f} a Linear)")
    print(f"  aten + fp8amp op calls: {sum(counts['all'].values())}, of which leaf ops (about one launch each): "
          f"{leaf_total} ({leaf_total / max(args.layers, 1):.0f} a block)")
    print(f"  host: {counts['host_s'] * 1e3:.1f} ms wall, {counts['op_self_s'] * 1e3:.1f} ms inside ops "
          f"(the rest, {(counts['host_s'] - counts['op_self_s']) * 1e3:.1f} ms, is Python and dispatch around them; "
          "under the profiler)")
    print("  fp8amp ops: " + ", ".join(f"{k.removeprefix('fp8amp::')} {v}" for k, v in sorted(fp8.items())))
    print(f"  the {args.top} most frequent leaf ops:")
    for name, n in counts["leaf"].most_common(args.top):
        print(f"    {n:6d}  {name}")


if __name__ == "__main__":
    main()
