"""Which part of O1/O2 moves the early loss: the same GPT trained from the same weights on the same
batches, adding one of fp8amp's formats at a time (docs/benchmarks.md#the-main-job-scriptstrainsh).

Variants, each adding one format to the row above it:

    bf16          float32 parameters, torch AdamW (fused on CUDA), autocast bf16
    fp8           + FP8 GEMMs (fp8amp.convert), torch AdamW
    fp8-adam      + fp8amp's AdamW over the same float32 parameters (float32 moments)
    O1-fp32grad   + FP16 master weights (initialize "O1", weight_grad="fp32")
    O1            + E4M3 weight gradients
    O2            + E4M3 m, FP16 v

Prints, per variant, the loss at some steps, the mean gap to bf16 over a window of early steps and
over the last steps, so that the row where the gap appears names the format that makes it.

Usage: python benchmarks/loss_ablation.py [--variants bf16,fp8,...] [--steps 60] [--size medium]
       [--schedule-steps 400] [--window 5:20] [--history-len 16] [--show 17,18,19,20]
On a CPU the default is the tiny model (FP8 emulated), a smoke run: its losses say little.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step
from _common import markdown_table, parse_subset, report

VARIANTS = ["bf16", "fp8", "fp8-adam", "O1-fp32grad", "O1", "O2"]
SIZES = {  # name: (model, batch, peak lr), as examples/train_gpt.py's presets of the same name
    "tiny": (GPTConfig(seq_len=128, n_layer=2, n_head=4, d_model=128), 8, 2e-3),
    "medium": (GPTConfig(seq_len=1024, n_layer=6, n_head=16, d_model=2048), 16, 6e-4),
    "1b": (GPTConfig(seq_len=2048, n_layer=20, n_head=16, d_model=2048), 8, 3e-4),
}
WARMUP = 20  # steps of linear lr warm-up, then cosine, as the main job


def build(variant: str, init_state: dict, cfg: GPTConfig, lr: float, device: torch.device, history_len: int):
    model = GPT(cfg).to(device)
    model.load_state_dict(init_state)
    adamw = dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    recipe = fp8amp.Recipe("tensorwise", history_len=history_len)
    if variant == "bf16":
        return model, torch.optim.AdamW(model.parameters(), fused=device.type == "cuda", **adamw)
    if variant in ("fp8", "fp8-adam"):
        optimizer = (torch.optim.AdamW(model.parameters(), **adamw) if variant == "fp8"
                     else fp8amp.optim.AdamW(model.parameters(), state_dtypes="O1", **adamw))
        return fp8amp.convert(model, optimizer=optimizer, policy="all", recipe=recipe), optimizer
    level, _, grad = variant.partition("-")
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), **adamw), opt_level=level,
                             weight_grad="fp32" if grad == "fp32grad" else "fp8", policy="all", recipe=recipe)


def losses_of(variant: str, args, cfg: GPTConfig, batch: int, lr: float, data: torch.Tensor,
              init_state: dict, device: torch.device) -> list[float]:
    model, optimizer = build(variant, init_state, cfg, lr, device, args.history_len)
    span = args.schedule_steps or args.steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * min(s, span) / span)))
    loader = batches(data, batch, cfg.seq_len, device, seed=args.seed)
    losses = [train_step(model, optimizer, *next(loader), scheduler=schedule) for _ in range(args.steps)]
    return torch.stack(losses).float().tolist()


def window(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        span = (int(first), int(last))
    except ValueError:
        span = None
    if not sep or span is None or not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"--window must be FIRST:LAST steps with 1 <= FIRST <= LAST, got {text!r}")
    return span


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", type=lambda t: parse_subset(t, VARIANTS), default=VARIANTS,
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="model size (default: medium on a GPU, tiny on a CPU)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="the steps the cosine learning-rate decay spans (default: --steps); e.g. 400 to follow "
                        "the main job's first steps in a shorter run")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is a GPU)")
    p.add_argument("--window", type=window, default=(5, 20),
                   help="the early steps whose mean loss gap is reported (default: 5:20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (default: 0)")
    p.add_argument("--history-len", type=int, default=16,
                   help="the FP8 variants' delayed-scaling history, also their warm-up steps of current scaling "
                        "(default: 16, fp8amp's)")
    p.add_argument("--show", type=lambda t: [int(v) for v in t.split(",")], default=None, metavar="S[,S...]",
                   help="the steps whose losses the table shows (default: 1, the window's ends and middle, the last)")
    args = p.parse_args(argv)
    if args.steps < args.window[1]:
        p.error(f"--steps ({args.steps}) must reach the end of --window ({args.window[1]})")
    if args.schedule_steps is not None and args.schedule_steps < args.steps:
        p.error(f"argument --schedule-steps: must be at least --steps ({args.steps}), got {args.schedule_steps}")
    if args.history_len < 1:
        p.error(f"argument --history-len: must be at least 1, got {args.history_len}")
    if args.show is not None and not all(1 <= step <= args.steps for step in args.show):
        p.error(f"argument --show: steps must lie in 1..{args.steps} (--steps), got {args.show}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg, batch, lr = SIZES[args.size or ("medium" if device.type == "cuda" else "tiny")]
    data = load_text_bytes()
    torch.manual_seed(args.seed)
    init_state = {k: v.clone() for k, v in GPT(cfg).state_dict().items()}
    runs = {}
    for variant in args.variants:
        runs[variant] = losses_of(variant, args, cfg, batch, lr, data, init_state, device)
        print(f"  {variant}: final loss {runs[variant][-1]:.4f}", file=sys.stderr)
    first, last = args.window
    shown = sorted(set(args.show) if args.show else {1, first, (first + last) // 2, last, args.steps})
    base = runs.get("bf16")
    rows = []
    for variant, losses in runs.items():
        gaps = ["–", "–"] if base is None else [
            f"{statistics.mean(a - b for a, b in zip(losses[first - 1:last], base[first - 1:last])):+.3f}",
            f"{statistics.mean(a - b for a, b in zip(losses[-10:], base[-10:])):+.3f}"]
        rows.append([variant, *(f"{losses[s - 1]:.3f}" for s in shown), *gaps])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (FP8 emulated)"
    title = (f"Loss ablation on {where}, torch {torch.__version__}: GPT d_model {cfg.d_model}, {cfg.n_layer} layers, "
             f"batch {batch} x {cfg.seq_len}, peak lr {lr}, {WARMUP} warm-up steps, {args.steps} steps (cosine over "
             f"{args.schedule_steps or args.steps}), FP8 "
             f"history_len {args.history_len}")
    header = ["variant", *(f"loss @{s}" for s in shown), f"mean gap to bf16, steps {first}-{last}",
              "mean gap, last 10 steps"]
    report(Path(__file__).stem, title + "\n\n" + markdown_table(header, rows))


if __name__ == "__main__":
    main()
