"""What one training step allocates above what it starts with (its activations and transients), for
fp8amp O2 with and without FP8 saved activations, eager and with each block compiled
(docs/benchmarks.md#models-as-users-have-them-benchmarksbench_modelspy).

Not a benchmark of speed (gpu_check.sh runs only bench_*.py): the bytes a step allocates depend
on what autograd and the compiled graphs save, which is the same on a CPU (FP8 emulated) as on a
GPU, so the rules of fp8amp.save_activations_in_fp8 can be checked on either. Measured:

- on a CUDA GPU: torch.cuda.max_memory_allocated over the step minus what was allocated at its start;
- on a CPU: the highest running sum of torch.profiler's allocation events over the step
  (profile_memory=True: every allocation and free of the CPU allocator, Inductor's buffers included).

Models: a timm VisionTransformer (float16 autocast, as bench_models' ViT; default width 384,
4 blocks, 6 heads, patch 8, 64 px, 32 images) and fp8amp.testing's GPT (bfloat16 autocast;
default width 256, 4 layers, 256 tokens, batch 8), both with every Linear in FP8 (policy "all"),
fp8amp's AdamW at O2. Modes: amp (the model without fp8amp), o2, o2-fp8act, and each + compile
(every block compiled: regional compilation, as bench_models). After --warmup steps one step is
measured; the ratios are against amp eager and against the same mode without FP8 activations.

Usage: python benchmarks/activation_memory.py [--models vit,gpt] [--modes ...] [--batch N] [--width D]
       [--depth L] [--warmup N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import fp8amp
from fp8amp.testing import GPT, GPTConfig
from _common import markdown_table, parse_subset, report, set_recompile_limit

MODES = ["amp", "o2", "o2-fp8act", "amp-compile", "o2-compile", "o2-fp8act-compile"]
MODELS = ["vit", "gpt"]


class Workload(NamedTuple):
    name: str
    build: Callable[[], torch.nn.Module]
    blocks: Callable[[torch.nn.Module], list]
    loss: Callable[[torch.nn.Module], torch.Tensor]
    autocast: torch.dtype


def vit(args, device: torch.device) -> Workload:
    from timm.models.vision_transformer import VisionTransformer

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.batch or 32, 3, 64, 64, device=device, generator=gen)
    y = torch.randint(0, 16, (x.shape[0],), device=device, generator=gen)
    width, depth = args.width or 384, args.depth or 4

    def build():
        return VisionTransformer(img_size=64, patch_size=8, embed_dim=width, depth=depth, num_heads=width // 64,
                                 num_classes=16)

    return Workload(f"timm ViT, width {width}, {depth} blocks, {x.shape[0]} images of 64 px",
                    build, lambda m: list(m.blocks), lambda m: F.cross_entropy(m(x), y), torch.float16)


def gpt(args, device: torch.device) -> Workload:
    cfg = GPTConfig(seq_len=256, n_layer=args.depth or 4, n_head=(args.width or 256) // 64, d_model=args.width or 256)
    idx = torch.randint(0, cfg.vocab_size, (args.batch or 8, cfg.seq_len), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    return Workload(f"fp8amp.testing GPT, width {cfg.d_model}, {cfg.n_layer} layers, {idx.numel()} tokens",
                    lambda: GPT(cfg), lambda m: list(m.blocks), lambda m: m(idx, idx)[1], torch.bfloat16)


def step_peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """The most bytes ``step`` had allocated at once above what was allocated when it began."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocations = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in allocations:
        held += nbytes
        peak = max(peak, held)
    return peak


def measure(work: Workload, mode: str, args, device: torch.device) -> int:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = work.build().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode.startswith("o2"):
        model, optimizer = fp8amp.initialize(model, optimizer, "O2", policy="all")
    if mode.endswith("compile"):
        for block in work.blocks(model):
            block.compile(dynamic=False)
    hooks = fp8amp.save_activations_in_fp8 if "fp8act" in mode else contextlib.nullcontext

    def step() -> None:
        with torch.autocast(device.type, dtype=work.autocast), hooks():
            loss = work.loss(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    return step_peak_bytes(step, device)


def table(results: dict[str, int]) -> str:
    rows, base = [], results.get("amp")
    for mode, peak in results.items():
        without = results.get(mode.replace("-fp8act", "")) if "fp8act" in mode else None
        rows.append([mode, f"{peak / 2**20:.1f}", f"{peak / base:.2f}x" if base else "-",
                     f"{peak / without:.2f}x" if without else "-"])
    return markdown_table(["mode", "step allocates, MiB", "vs amp eager", "vs the mode without FP8 activations"], rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda t: parse_subset(t, MODELS), default=MODELS, help=", ".join(MODELS))
    p.add_argument("--modes", type=lambda t: parse_subset(t, MODES), default=MODES, help=", ".join(MODES))
    p.add_argument("--batch", type=int, default=None, help="images (ViT, default 32) or sequences (GPT, default 8)")
    p.add_argument("--width", type=int, default=None, help="a multiple of 64 (default: ViT 384, GPT 256)")
    p.add_argument("--depth", type=int, default=None, help="blocks (default 4)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured one (compilation, scaling warm-up)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    for name, value in (("--batch", args.batch), ("--width", args.width), ("--depth", args.depth)):
        if value is not None and (value < 1 or (name == "--width" and value % 64)):
            p.error(f"{name} must be a positive integer{' and a multiple of 64' if name == '--width' else ''}, "
                    f"got {value}")
    if args.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {args.warmup}")
    device = torch.device(args.device)
    set_recompile_limit(64)
    sections = []
    for name in args.models:
        try:
            work = {"vit": vit, "gpt": gpt}[name](args, device)
        except ModuleNotFoundError as e:
            sections.append(f"{name}: not measured ({e.name} is not installed)\n")
            continue
        results = {mode: measure(work, mode, args, device) for mode in args.modes}
        sections.append(f"{work.name}, {str(work.autocast).replace('torch.', '')} autocast\n\n{table(results)}\n")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (FP8 emulated; profiler allocation events)"
    report("activation_memory", f"What one training step allocates on {where}, torch {torch.__version__}\n\n"
           + "\n".join(sections))


if __name__ == "__main__":
    main()
