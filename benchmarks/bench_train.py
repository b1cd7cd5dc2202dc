"""End-to-end GPT training on one GPU: fp8amp against BF16 and torchao float8, side by side (docs/benchmarks.md#targets).

A plain pre-norm GPT (fp8amp.testing.GPT) trains on the built-in data (the Python standard
library's sources as bytes, vocabulary 256) with float32 parameters, torch.autocast(bfloat16),
gradient clipping and torch.optim.AdamW(fused=True), in these modes:

    bf16 eager                 the baseline of docs/benchmarks.md#targets's memory target (BF16 autocast)
    bf16 + compile             the baseline of its speed target
    torchao float8 + compile   torchao.float8.convert_to_float8_training (default recipe: dynamic
                               tensorwise scaling), compiled as torchao recommends
    fp8amp eager               fp8amp.convert(model, optimizer=...): every Linear of the blocks
                               becomes an Fp8Linear (the tied output head is F.linear and stays BF16)
    fp8amp + compile           the same, compiled
    fp8amp O1 / O2 (+ compile) fp8amp.initialize(model, optimizer, "O1" | "O2"): the same Fp8Linear
                               layers with FP16 ScaledTensor master weights, FP8 weight gradients and
                               fp8amp's fused AdamW (O1: FP32 m, v; O2: E4M3 m, FP16 v), docs/o1_o2.md#optimization-levels
    fp8amp O2 + FP8 activations (+ compile)
                               O2 with the forward inside fp8amp.save_activations_in_fp8(): what
                               attention, GELU and the LayerNorms save for backward is stored in E4M3
                               (docs/o1_o2.md). Compiled, AOTAutograd inlines the quantize and
                               dequantize into each block's graphs (torch >= 2.10; on an older torch
                               only each block's input is stored, with a warning)
    ... + CUDA graph           the "-graph" modes: the whole step (forward, compiled or not,
                               backward, clipping, optimizer, scaling update) captured once with
                               torch.cuda.graph after the warm-up and replayed for the timed steps
                               (torch's AdamW with capturable=True, which fp8amp's accepts too;
                               docs/o1_o2.md, "CUDA graphs"). The learning rate is the captured one:
                               the warm-up schedule has reached its constant by then. Peak memory is
                               the captured step's (counters reset before the capture, which
                               allocates what an eager step does; replays allocate nothing)

"compile" compiles each transformer block (regional compilation: one compiled graph reused by
all blocks, which keeps compile time to seconds; --compile-scope model compiles the whole model),
in torch.compile's default mode unless --compile-mode names another ("reduce-overhead": each
compiled graph replays as a CUDA graph, which removes the launch gaps between its kernels).
Every mode starts from the same initial weights (same seed) and sees the same batches, prepared
on the GPU beforehand so no host-to-device copy stalls a step. Warm-up steps come first (they
include compilation, and take fp8amp's delayed scaling past its current-scaling warm-up of
history_len steps); then the timed steps, each between CUDA events: tokens/s is from the median
step time. Peak memory is torch.cuda.max_memory_allocated over the timed steps (counters reset
after warm-up, so weights, gradients and optimizer states are in it, compile-time scratch is not).
Model TFLOP/s counts 6·N + 12·L·d·T FLOPs per token (N: parameters without the position
embedding; the attention term as in nanoGPT). The final loss is the last step's: with a handful of
steps it shows that training runs and agrees, not convergence (tests/python/test_initialize.py's
test_small_gpt_loss_matches_bf16 checks that).

"fp8amp eager / + compile" is Fp8Linear with PyTorch's AdamW on float32 parameters (FP8 compute
only); the O1/O2 modes add the memory formats that docs/benchmarks.md#targets's ≤ 0.5x memory target needs.

Usage: python benchmarks/bench_train.py [--preset 1b|gpt2|small] [--steps N] [--warmup N] [--batch N]
       [--modes bf16,bf16-compile,torchao,torchao-compile,fp8amp,fp8amp-compile,o1,o1-compile,o2,o2-compile,
        o2-fp8act,o2-fp8act-compile, and each bf16/o2 mode + "-graph"] [--compile-scope block|model]
       [--recipes tensorwise,rowwise,blockwise,mxfp8] [--compile-mode MODE] [--gemm-autotune]
Prints a markdown table (last); with $OUT set, also writes it to $OUT/bench_train.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from typing import NamedTuple

import torch

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step
from _common import (
    RunResult,
    dynamo_reset_counters,
    dynamo_summary,
    import_torchao,
    markdown_table,
    parse_subset,
    report,
    require_gpu,
    run_modes,
    set_recompile_limit,
    torchao_skip,
)

PRESETS = {
    # 20 x 12·2048² (+ biases, norms, embeddings) = 1.01e9 parameters; at batch 8 x 2048 tokens
    # BF16 autocast needs roughly 16 GB of model and optimizer state and ~30 GB of activations.
    "1b": dict(model=GPTConfig(seq_len=2048, n_layer=20, n_head=16, d_model=2048), batch=8, lr=3e-4, steps=10),
    "small": dict(model=GPTConfig(seq_len=512, n_layer=6, n_head=8, d_model=512), batch=32, lr=1e-3, steps=20),
    # examples/train_gpt.py's gpt2 preset (86M parameters, 16,384 tokens a step): below the FP8
    # crossover, where the step is host-bound (docs/benchmarks.md#where-a-small-models-step-goes)
    "gpt2": dict(model=GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768), batch=16, lr=6e-4, steps=20),
}

class Mode(NamedTuple):
    label: str
    kind: str  # bf16, torchao, fp8amp, O1 or O2
    compiled: bool
    fp8_activations: bool = False  # the forward inside fp8amp.save_activations_in_fp8()
    graphed: bool = False  # the whole step captured in one CUDA graph after the warm-up


MODES = {
    "bf16": Mode("bf16 eager", "bf16", False),
    "bf16-compile": Mode("bf16 + compile", "bf16", True),
    "torchao": Mode("torchao float8 eager", "torchao", False),
    "torchao-compile": Mode("torchao float8 + compile", "torchao", True),
    "fp8amp": Mode("fp8amp eager", "fp8amp", False),
    "fp8amp-compile": Mode("fp8amp + compile", "fp8amp", True),
    "o1": Mode("fp8amp O1", "O1", False),
    "o1-compile": Mode("fp8amp O1 + compile", "O1", True),
    "o2": Mode("fp8amp O2", "O2", False),
    "o2-compile": Mode("fp8amp O2 + compile", "O2", True),
    "o2-fp8act": Mode("fp8amp O2 + FP8 activations", "O2", False, True),
    "o2-fp8act-compile": Mode("fp8amp O2 + FP8 activations + compile", "O2", True, True),
    "bf16-graph": Mode("bf16 eager + CUDA graph", "bf16", False, graphed=True),
    "bf16-compile-graph": Mode("bf16 + compile + CUDA graph", "bf16", True, graphed=True),
    "o2-graph": Mode("fp8amp O2 + CUDA graph", "O2", False, graphed=True),
    "o2-compile-graph": Mode("fp8amp O2 + compile + CUDA graph", "O2", True, graphed=True),
    "o2-fp8act-graph": Mode("fp8amp O2 + FP8 activations + CUDA graph", "O2", False, True, graphed=True),
    "o2-fp8act-compile-graph": Mode("fp8amp O2 + FP8 activations + compile + CUDA graph", "O2", True, True,
                                    graphed=True),
}
DEFAULT_MODES = ["bf16", "bf16-compile", "torchao-compile", "fp8amp-compile", "o1", "o2", "o2-compile", "o2-fp8act"]


def flops_per_token(model: GPT) -> float:
    cfg = model.cfg
    n = model.num_parameters() - model.pos.weight.numel()
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


def run_keys(modes: list[str], recipes: list[str]) -> list[str]:
    """The runs: each fp8amp mode once a recipe ("MODE@RECIPE", plain MODE for tensorwise), the
    others once."""
    return [key if MODES[key].kind in ("bf16", "torchao") or recipe == "tensorwise" else f"{key}@{recipe}"
            for key in modes for recipe in (recipes if MODES[key].kind not in ("bf16", "torchao") else [None])]


def run_label(key: str) -> str:
    mode, _, recipe = key.partition("@")
    return MODES[mode].label + (f" ({recipe})" if recipe else "")


def run_mode(key: str, cfg: GPTConfig, data: list, args, torchao_convert) -> RunResult:
    mode_key, _, recipe = key.partition("@")
    mode = MODES[mode_key]
    recipe = recipe or "tensorwise"
    kind, compiled = mode.kind, mode.compiled
    result = RunResult()
    t0 = time.perf_counter()
    dynamo_reset_counters()
    torch.manual_seed(args.seed)
    model = GPT(cfg).cuda()
    if kind == "torchao":
        model = torchao_convert(model)  # swaps the Linears in place, sharing their parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True,
                                  capturable=mode.graphed)
    tokens = args.batch * cfg.seq_len  # what convert's default policy times each layer shape with
    if kind == "fp8amp":
        # update_scaling after every step()
        model = fp8amp.convert(model, optimizer=optimizer, tokens=tokens, recipe=recipe)
    elif kind in fp8amp.OPT_LEVELS:
        model, optimizer = fp8amp.initialize(model, optimizer, kind, tokens=tokens, recipe=recipe)
    if kind == "fp8amp" or kind in fp8amp.OPT_LEVELS:
        report = fp8amp.conversion_report(model)
        result.notes.append(f"{len(report.converted)} of {len(report.decisions)} Linears in FP8")
        result.notes += [f"kept {d.name} ({d.speedup or 0:.2f}x)" for d in report.skipped[:2]]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    step_model = model
    if compiled:
        if args.compile_scope == "model":
            step_model = torch.compile(model, dynamic=False, mode=args.compile_mode)
        else:
            for block in model.blocks:
                block.compile(dynamic=False, mode=args.compile_mode)

    saved_tensors_hooks = fp8amp.save_activations_in_fp8() if mode.fp8_activations else None

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return train_step(model, optimizer, x, y, forward=step_model, scheduler=schedule,
                          saved_tensors_hooks=saved_tensors_hooks)

    # A graph's warm-up runs on a side stream, as torch.cuda.graph asks.
    warmup_stream = torch.cuda.Stream() if mode.graphed else torch.cuda.current_stream()
    warmup_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup_stream):
        for x, y in data[: args.warmup]:
            step(x, y)
    torch.cuda.current_stream().wait_stream(warmup_stream)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if mode.graphed:
        static_x, static_y = (t.clone() for t in data[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = step(static_x, static_y)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # noqa: F811: the replay
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
            return static_loss.clone()

    torch.cuda.synchronize()
    result.warmup_seconds = time.perf_counter() - t0
    if compiled:
        result.notes.append(dynamo_summary())
    if not mode.graphed:
        torch.cuda.reset_peak_memory_stats()
    timed = data[args.warmup:]
    starts = [torch.cuda.Event(enable_timing=True) for _ in timed]
    ends = [torch.cuda.Event(enable_timing=True) for _ in timed]
    losses = []
    for (x, y), start, end in zip(timed, starts, ends):
        start.record()
        losses.append(step(x, y))
        end.record()
    torch.cuda.synchronize()
    result.peak_bytes = torch.cuda.max_memory_allocated()
    times = [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]
    result.step_seconds = statistics.median(times)
    result.final_loss = losses[-1].item()
    if not all(torch.isfinite(torch.stack(losses)).tolist()):
        result.notes.append("non-finite loss")
    result.notes.append(f"steps {min(times) * 1e3:.0f}-{max(times) * 1e3:.0f} ms")
    if saved_tensors_hooks is not None:
        hooks = saved_tensors_hooks
        result.notes.append(f"{hooks.stored_tensors} saved tensors in FP8 a step: {hooks.stored_bytes / 2**30:.2f} "
                            f"-> {hooks.fp8_bytes / 2**30:.2f} GiB")
    return result


def table(results: dict[str, RunResult], tokens_per_step: int, flops_token: float) -> str:
    header = ["mode", "step ms", "tokens/s", "vs bf16 + compile", "model TFLOP/s", "peak GiB",
              "memory vs bf16 eager", "final loss", "warm-up s", "notes"]
    speed_base = results.get("bf16-compile", RunResult()).step_seconds
    mem_base = results.get("bf16", RunResult()).peak_bytes
    rows = []
    for key, r in results.items():
        label = run_label(key)
        if r.step_seconds is None:
            rows.append([label, r.failure or "not run"] + ["–"] * (len(header) - 2))
            continue
        rows.append([
            label, f"{r.step_seconds * 1e3:.1f}", f"{tokens_per_step / r.step_seconds:,.0f}",
            f"{speed_base / r.step_seconds:.2f}x" if speed_base else "–",
            f"{flops_token * tokens_per_step / r.step_seconds / 1e12:.0f}",
            f"{r.peak_bytes / 2**30:.1f}", f"{r.peak_bytes / mem_base:.2f}x" if mem_base else "–",
            f"{r.final_loss:.4f}", f"{r.warmup_seconds:.0f}", "; ".join(r.notes),
        ])
    return markdown_table(header, rows)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--steps", type=positive, default=None, help="timed steps (default: the preset's)")
    parser.add_argument("--warmup", type=positive, default=None,
                        help="untimed steps first (default: fp8amp's history_len + 2, i.e. 18)")
    parser.add_argument("--batch", type=positive, default=None, help="sequences per step (default: the preset's)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--modes", type=lambda t: parse_subset(t, list(MODES)), default=DEFAULT_MODES,
                        help=", ".join(MODES))
    parser.add_argument("--recipes", type=lambda t: parse_subset(t, list(fp8amp.RECIPES)), default=["tensorwise"],
                        help="the fp8amp modes run once with each recipe (fp8amp.Recipe): "
                             f"{', '.join(fp8amp.RECIPES)} (default: tensorwise)")
    parser.add_argument("--compile-scope", choices=["block", "model"], default="block")
    parser.add_argument("--compile-mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                        default="default", help="torch.compile's mode for the compiled modes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gemm-autotune", action="store_true",
                        help="fp8amp.ops.set_gemm_autotune(True) for the run (the fp8amp modes' GEMMs)")
    args = parser.parse_args()
    require_gpu("bench_train", min_capability=(8, 9))
    fp8amp.ops.set_gemm_autotune(args.gemm_autotune)

    preset = PRESETS[args.preset]
    cfg: GPTConfig = preset["model"]
    args.steps = args.steps or preset["steps"]
    args.batch = args.batch or preset["batch"]
    args.lr = args.lr or preset["lr"]
    args.warmup = args.warmup or fp8amp.ScalingRecipe().history_len + 2
    torchao_convert, torchao_note = import_torchao()

    set_recompile_limit(64)

    with torch.device("meta"):
        meta_model = GPT(cfg)
    n_params, flops_token = meta_model.num_parameters(), flops_per_token(meta_model)
    del meta_model
    text_bytes = load_text_bytes()
    loader = batches(text_bytes, args.batch, cfg.seq_len, "cuda", seed=args.seed)
    data = list(itertools.islice(loader, args.warmup + args.steps))
    torch.cuda.synchronize()
    tokens_per_step = args.batch * cfg.seq_len
    print(f"bench_train: {n_params / 1e6:,.1f}M parameters, {cfg}, batch {args.batch} x {cfg.seq_len}, "
          f"{args.warmup} warm-up + {args.steps} timed steps, {len(text_bytes) / 1e6:.1f} MB of text",
          file=sys.stderr, flush=True)

    skip_torchao = torchao_skip(MODES, torchao_convert, torchao_note)
    results = run_modes(run_keys(args.modes, args.recipes),
                        lambda key: run_mode(key, cfg, data, args, torchao_convert),
                        skip=lambda key: skip_torchao(key.partition("@")[0]), per_step=tokens_per_step,
                        unit="tokens", label=run_label)

    if args.gemm_autotune:
        print(f"  GEMM autotuning: {fp8amp.ops.gemm_autotune_stats()}", file=sys.stderr, flush=True)
    text = (f"GPT training on {torch.cuda.get_device_name()}, torch {torch.__version__}, {torchao_note}: "
            f"{n_params / 1e6:,.0f}M parameters (n_layer {cfg.n_layer}, d_model {cfg.d_model}, n_head {cfg.n_head}), "
            f"batch {args.batch} x seq {cfg.seq_len} = {tokens_per_step:,} tokens/step, AdamW(fused) lr {args.lr:g}, "
            f"autocast bfloat16, compile per {args.compile_scope} ({args.compile_mode} mode); fp8amp GEMM autotuning "
            f"{'on' if args.gemm_autotune else 'off'}; {args.warmup} warm-up + {args.steps} timed steps, "
            f"median step time\n\n{table(results, tokens_per_step, flops_token)}\n")
    report("train", text)


if __name__ == "__main__":
    main()
