"""Training throughput and peak memory of models as users have them: a Hugging Face
``LlamaForCausalLM`` and a timm ``VisionTransformer``, about 1B parameters each, built from a config
(nothing downloaded), fp8amp against AMP and torchao float8 in one run (docs/integrations.md#benchmarks).

Modes (each model starts from the same weights and sees the same batches):

    amp (+ compile)              autocast (bfloat16 for Llama; float16 + GradScaler for the ViT, as in
                                 MS-AMP's ViT table) with float32 parameters and torch's fused AdamW
    o1, o2 (+ compile)           fp8amp.initialize(model, optimizer, "O1" | "O2") under the same autocast
                                 (and GradScaler): Fp8Linear layers, FP16 master weights, FP8 weight
                                 gradients, fp8amp's AdamW (O2: E4M3 m, FP16 v)
    o2-fp8act (+ compile)        O2 with the forward inside fp8amp.save_activations_in_fp8()
    torchao (+ compile)          torchao.float8.convert_to_float8_training (its default recipe) with
                                 torch's fused AdamW, when torchao is importable

"compile" compiles each transformer block (regional compilation: one graph for all blocks) with
torch.compile's default mode. Each step is the usual loop: forward under autocast, backward,
clip_grad_norm_(1.0, foreach), optimizer step, zero_grad. Warm-up steps first (compilation, and
fp8amp's current-scaling warm-up of history_len steps), then the timed steps between CUDA events:
tokens/s (images/s) from the median step time; peak memory is torch.cuda.max_memory_allocated over
the timed steps (weights, gradients and optimizer states included). The data are random tokens /
images made on the device beforehand: the loss shows that a mode trains and agrees, not
convergence.

Usage: python benchmarks/bench_models.py [--models llama,vit] [--modes amp,amp-compile,o2,o2-compile,
       torchao-compile,...] [--steps N] [--warmup N] [--llama-batch N] [--seq N] [--vit-batch N]
       [--vit-autocast float16|bfloat16] [--profile STEPS]
       python benchmarks/bench_models.py --tiny     # tiny models on the CPU (FP8 emulation): a smoke run
Prints the tables (last); with $OUT set, also writes them to $OUT/bench_models.md. With
--profile STEPS, each mode then profiles STEPS more steps (torch.profiler) and the tables are
followed by where each mode's GPU time goes (profile_train.py's kernel kinds and comparison) and
how long the GPU waited for the host. The default run
(two models, five modes: mostly compilation) is sized for a few minutes on one H200; stderr has the
time each mode ended at and the total.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import fp8amp
from _common import dynamo_reset_counters, dynamo_summary, import_torchao, markdown_table, parse_subset, report
from _common import RunResult, StepClock, require_gpu, run_modes, set_recompile_limit, torchao_skip
from profile_train import compare_categories, compare_modes, device_intervals, idle_summary, kernel_totals, profiled


@dataclass(frozen=True)
class Mode:
    kind: str  # amp, torchao, O1 or O2
    compiled: bool
    fp8_activations: bool = False


MODES = {
    "amp": Mode("amp", False), "amp-compile": Mode("amp", True),
    "o1": Mode("O1", False), "o1-compile": Mode("O1", True),
    "o2": Mode("O2", False), "o2-compile": Mode("O2", True),
    "o2-fp8act": Mode("O2", False, True), "o2-fp8act-compile": Mode("O2", True, True),
    "torchao": Mode("torchao", False), "torchao-compile": Mode("torchao", True),
}
DEFAULT_MODES = ["amp", "amp-compile", "o2", "o2-compile", "torchao-compile"]
TINY_MODES = ["amp", "o1", "o2", "o2-fp8act", "torchao"]
MODELS = ["llama", "vit"]

# About 1.1B parameters (TinyLlama's shape): every Linear's features are multiples of 16.
LLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4)
LLAMA_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
# About 0.9B in the blocks (12 d^2 a block): examples/timm_vit.py's "1b" preset.
VIT = dict(img_size=224, patch_size=14, embed_dim=1536, depth=32, num_heads=16, num_classes=1000)
VIT_TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=16)


@dataclass
class Workload:
    """A model family at one size: how to build it, its batches, its loss and its blocks."""

    name: str
    unit: str  # what a step processes: tokens or images
    per_step: int
    gemm_rows: int  # the rows of each Linear's GEMMs in a step: what convert's policy times
    autocast: torch.dtype
    build: Callable[[], torch.nn.Module]
    batches: list
    loss: Callable[[torch.nn.Module, tuple], torch.Tensor]
    blocks: Callable[[torch.nn.Module], list]
    describe: str = ""


def llama_workload(args, device: torch.device, count: int) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(LLAMA_TINY if args.tiny else LLAMA), max_position_embeddings=args.seq, use_cache=False,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    data = [torch.randint(0, config.vocab_size, (args.llama_batch, args.seq + 1), device=device, generator=gen)
            for _ in range(count)]

    def loss(model, tokens):
        logits = model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    return Workload(
        "llama", "tokens", args.llama_batch * args.seq, args.llama_batch * args.seq, torch.bfloat16,
        lambda: LlamaForCausalLM(config), data, loss, lambda m: list(m.model.layers),
        f"HF LlamaForCausalLM (hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads, vocab {config.vocab_size}), "
        f"batch {args.llama_batch} x seq {args.seq}")


def vit_workload(args, device: torch.device, count: int) -> Workload:
    from timm.models.vision_transformer import VisionTransformer

    shape = VIT_TINY if args.tiny else VIT
    gen = torch.Generator(device=device).manual_seed(args.seed)
    data = [(torch.randn(args.vit_batch, 3, shape["img_size"], shape["img_size"], device=device, generator=gen),
             torch.randint(0, shape["num_classes"], (args.vit_batch,), device=device, generator=gen))
            for _ in range(count)]

    def loss(model, batch):
        images, labels = batch
        return F.cross_entropy(model(images).float(), labels)

    tokens = (shape["img_size"] // shape["patch_size"]) ** 2 + 1  # the patches and the class token
    return Workload(
        "vit", "images", args.vit_batch, args.vit_batch * tokens, getattr(torch, args.vit_autocast),
        lambda: VisionTransformer(**shape), data, loss, lambda m: list(m.blocks),
        f"timm VisionTransformer (embed {shape['embed_dim']}, depth {shape['depth']}, {shape['num_heads']} heads, "
        f"patch {shape['patch_size']}, {shape['img_size']}px, {shape['num_classes']} classes), batch {args.vit_batch}")


def run_mode(work: Workload, mode: Mode, args, device: torch.device, torchao_convert,
             profiles: dict | None = None) -> RunResult:
    """The mode's warm-up and timed steps; with ``profiles`` (--profile), then args.profile
    profiled steps, whose kernel totals and idle summary go to ``profiles[label]``."""
    result = RunResult()
    t0 = time.perf_counter()
    dynamo_reset_counters()
    torch.manual_seed(args.seed)
    model = work.build().to(device)
    if mode.kind == "torchao":
        model = torchao_convert(model)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=fused)
    if mode.kind in fp8amp.OPT_LEVELS:
        model, optimizer = fp8amp.initialize(model, optimizer, mode.kind, tokens=work.gemm_rows)
        converted = fp8amp.conversion_report(model)
        result.notes.append(f"{len(converted.converted)} of {len(converted.decisions)} Linears in FP8")
    if mode.compiled:
        for block in work.blocks(model):
            block.compile(dynamic=False)
    scaler = torch.amp.GradScaler(device.type) if work.autocast == torch.float16 else None
    hooks = fp8amp.save_activations_in_fp8() if mode.fp8_activations else None

    def step(batch) -> torch.Tensor:
        with torch.autocast(device.type, dtype=work.autocast), hooks or contextlib.nullcontext():
            loss = work.loss(model, batch)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(args.warmup):
        step(work.batches[i % len(work.batches)])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    result.warmup_seconds = time.perf_counter() - t0
    if mode.compiled:
        result.notes.append(dynamo_summary())
    timer, losses = StepClock(device), []
    timer.mark()
    for i in range(args.steps):
        losses.append(step(work.batches[(args.warmup + i) % len(work.batches)]))
        timer.mark()
    times = timer.seconds()
    result.step_seconds = statistics.median(times)
    result.peak_bytes = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    result.final_loss = losses[-1].item()
    if profiles is not None:
        prof, step_ms = profiled(lambda: step(work.batches[0]), args.profile)
        intervals = device_intervals(prof)
        profiles[label(mode, work.autocast)] = (kernel_totals(intervals, args.profile), f"{step_ms:.1f} ms a step profiled; "
                                 + idle_summary(intervals, top=4))
    if not all(torch.isfinite(torch.stack(losses)).tolist()):
        result.notes.append("non-finite loss")
    if scaler is not None:
        result.notes.append(f"loss scale {scaler.get_scale():g}")
    return result


def label(mode: Mode, autocast: torch.dtype | None = None) -> str:
    """The mode's name in tables ("fp8amp O2 + FP8 activations + compile"); amp by ``autocast``'s name."""
    amp = {torch.bfloat16: "BF16 autocast", torch.float16: "FP16 AMP", None: "AMP"}[autocast]
    labels = {"amp": amp, "torchao": "torchao float8", "O1": "fp8amp O1", "O2": "fp8amp O2"}
    return labels[mode.kind] + (" + FP8 activations" if mode.fp8_activations else "") + (
        " + compile" if mode.compiled else "")


def profile_section(profiles: dict) -> str:
    """--profile's text: each mode's GPU time by kind of kernel, its idle time, and (two or more
    modes) the kernel-by-kernel comparison with the first."""
    totals = {name: kernels for name, (kernels, _) in profiles.items()}
    text = "GPU time a step by kind of kernel (--profile)\n\n" + compare_categories(totals) + "\n\n"
    text += "\n".join(f"{name}: {idle}" for name, (_, idle) in profiles.items()) + "\n"
    if len(totals) > 1:
        text += "\n" + compare_modes(totals, 30) + "\n"
    return text


def table(work: Workload, results: dict[str, RunResult]) -> str:
    amp = {torch.bfloat16: "BF16 autocast", torch.float16: "FP16 AMP"}[work.autocast]
    header = ["mode", "step ms", f"{work.unit}/s", f"vs {amp} + compile", "peak GiB", f"memory vs {amp}",
              "final loss", "warm-up s", "notes"]
    speed_base = results.get("amp-compile", RunResult()).step_seconds
    mem_base = results.get("amp", RunResult()).peak_bytes
    rows = []
    for key, r in results.items():
        name = label(MODES[key], work.autocast)
        if r.step_seconds is None:
            rows.append([name, r.failure or "not run"] + ["–"] * (len(header) - 2))
            continue
        rows.append([
            name, f"{r.step_seconds * 1e3:.1f}", f"{work.per_step / r.step_seconds:,.0f}",
            f"{speed_base / r.step_seconds:.2f}x" if speed_base else "–",
            f"{r.peak_bytes / 2**30:.1f}" if r.peak_bytes else "–",
            f"{r.peak_bytes / mem_base:.2f}x" if r.peak_bytes and mem_base else "–",
            f"{r.final_loss:.4f}", f"{r.warmup_seconds:.0f}", "; ".join(r.notes),
        ])
    return markdown_table(header, rows)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda t: parse_subset(t, MODELS), default=MODELS, help=", ".join(MODELS))
    p.add_argument("--modes", type=lambda t: parse_subset(t, list(MODES)), default=None,
                   help=f"{', '.join(MODES)} (default: {','.join(DEFAULT_MODES)}; --tiny: {','.join(TINY_MODES)})")
    p.add_argument("--steps", type=positive, default=None, help="timed steps (default 8; --tiny 2)")
    p.add_argument("--warmup", type=positive, default=None,
                   help="untimed steps first (default: fp8amp's history_len + 2, i.e. 18; --tiny 2)")
    p.add_argument("--llama-batch", type=positive, default=None, help="sequences a step (default 4; --tiny 2)")
    p.add_argument("--seq", type=positive, default=None, help="Llama's sequence length (default 2048; --tiny 32)")
    p.add_argument("--vit-batch", type=positive, default=None, help="images a step (default 64; --tiny 5)")
    p.add_argument("--vit-autocast", choices=["float16", "bfloat16"], default="float16",
                   help="the ViT's autocast dtype (float16 adds a GradScaler)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (FP8 emulation): a smoke run")
    p.add_argument("--profile", type=positive, default=None, metavar="STEPS",
                   help="after the timed steps, profile STEPS more (GPU only) and print where each mode's GPU "
                        "time goes, by kind of kernel and kernel by kernel, and its idle time")
    args = p.parse_args(argv)
    tiny = args.tiny
    if tiny and args.profile:
        p.error("--profile needs a GPU: it reads the CUDA kernels' times (leave out --tiny)")
    args.modes = args.modes or (TINY_MODES if tiny else DEFAULT_MODES)
    args.steps = args.steps or (2 if tiny else 8)
    args.warmup = args.warmup or (2 if tiny else fp8amp.ScalingRecipe().history_len + 2)
    args.llama_batch = args.llama_batch or (2 if tiny else 4)
    args.seq = args.seq or (32 if tiny else 2048)
    args.vit_batch = args.vit_batch or (5 if tiny else 64)  # 5: an odd batch, as users have
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.tiny:
        device = torch.device("cpu")
    else:
        require_gpu("bench_models", min_capability=(8, 9))
        device = torch.device("cuda")
    torchao_convert, torchao_note = import_torchao()

    set_recompile_limit(64)
    count = min(args.warmup + args.steps, 4)  # batches made beforehand, reused in turn
    builders = {"llama": llama_workload, "vit": vit_workload}
    sections = []
    start = time.perf_counter()
    for name in args.models:
        try:
            work = builders[name](args, device, count)
        except ModuleNotFoundError as e:  # the GPU image may lack transformers or timm: say so, measure the rest
            sections.append(f"{name}: not measured ({e.name} is not installed)\n")
            print(f"bench_models: {name}: {e.name} is not installed", file=sys.stderr, flush=True)
            continue
        with torch.device("meta"):
            n_params = sum(p.numel() for p in work.build().parameters())
        print(f"bench_models: {work.describe}: {n_params / 1e6:,.2f}M parameters", file=sys.stderr, flush=True)
        profiles = {} if args.profile else None
        results = run_modes(args.modes, lambda key: run_mode(work, MODES[key], args, device, torchao_convert, profiles),
                            skip=torchao_skip(MODES, torchao_convert, torchao_note), per_step=work.per_step,
                            unit=work.unit, start=start)
        autocast = {torch.bfloat16: "bfloat16 autocast", torch.float16: "float16 autocast + GradScaler"}[work.autocast]
        sections.append(f"{work.describe}: {n_params / 1e6:,.2f}M parameters, {autocast}, AdamW lr 1e-4, "
                        f"{args.warmup} warm-up + {args.steps} timed steps, median step time\n\n"
                        f"{table(work, results)}\n" + (f"\n{profile_section(profiles)}" if profiles else ""))
    print(f"bench_models: {time.perf_counter() - start:.0f} s in all", file=sys.stderr, flush=True)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (FP8 emulation; --tiny)"
    report("models", f"Model training on {where}, torch {torch.__version__}, {torchao_note}\n\n" + "\n".join(sections))


if __name__ == "__main__":
    main()
