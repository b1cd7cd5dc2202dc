"""Train a GPT on the built-in data (the Python standard library's sources, as bytes) and compare
precisions: each one named in --precision trains in turn from the same initial weights on the same
batches, and the run leaves metrics.csv, a picture (loss, tokens/s, peak memory) and summary.md
with the ratios to BF16 in --out.

    python examples/train_gpt.py                        # bf16, then O2 (FP8 emulation on a CPU)
    python examples/train_gpt.py --precision bf16,O1,O2 --steps 200
    python examples/train_gpt.py --precision fp8        # FP8 GEMMs only (fp8amp.convert)
    python examples/train_gpt.py --preset 1b --precision bf16,O1,O2 --compile
    python examples/train_gpt.py --fp8-activations      # also store saved activations in FP8
    python examples/train_gpt.py --precision bf16,O2 --recipe tensorwise,blockwise   # O2 with each recipe
    python examples/train_gpt.py --numerics-report      # then how well each FP8 cast fits its tensor

Many processes (one a GPU, or CPU processes with gloo), launched by torchrun:

    torchrun --nproc-per-node=8 examples/train_gpt.py --precision O2                  # DDP
    torchrun --nproc-per-node=8 examples/train_gpt.py --precision O2 --fp8-allreduce  # FP8 on the wire
    torchrun --nproc-per-node=8 examples/train_gpt.py --precision O2 --parallel fsdp
                        # FSDP2: masters and states sharded, weights all-gathered in E4M3
    torchrun --nproc-per-node=1 examples/train_gpt.py --precision bf16,O2 --parallel fsdp
                        # FSDP2 on one GPU (one rank): its per-GPU memory, BF16 against O2

On a GPU the default preset (medium) is a ~0.3B-parameter GPT of width 2048 (seq 1024), big enough
for FP8 to pay; --preset 1b is the 1B GPT of benchmarks/bench_train.py. On a CPU-only machine the
default is a tiny one, so that the FP8 emulation (the CPU reference kernels) finishes in minutes. On a CPU the
baseline runs in float32 (autocast to bf16 is used on CUDA only) and is labelled fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_args import positive_float, positive_int, resolve_device  # noqa: E402
from train_gpt_outputs import FINAL_LOSS_STEPS, RunRow, summarize, write_outputs  # noqa: E402

PRESETS = {
    "tiny": dict(model=GPTConfig(seq_len=128, n_layer=2, n_head=4, d_model=128), batch=8, steps=60, lr=2e-3),
    "small": dict(model=GPTConfig(seq_len=512, n_layer=6, n_head=8, d_model=512), batch=32, steps=400, lr=1e-3),
    "gpt2": dict(model=GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768), batch=16, steps=600, lr=6e-4),
    # The GPU default: width 2048, where benchmarks/bench_train.py measures FP8 faster than BF16 (the
    # 1B GPT); 6 blocks (~0.3B parameters) keep two precisions to a few minutes on one GPU.
    "medium": dict(model=GPTConfig(seq_len=1024, n_layer=6, n_head=16, d_model=2048), batch=16, steps=400, lr=6e-4),
    "1b": dict(model=GPTConfig(seq_len=2048, n_layer=20, n_head=16, d_model=2048), batch=8, steps=300, lr=3e-4),
}
GPU_PRESET, CPU_PRESET = "medium", "tiny"
PRECISIONS = ("bf16", "fp8", "O1", "O2")
EVAL_BATCHES = 8
REPO = Path(__file__).resolve().parents[1]


def seed_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not -2**63 <= value < 2**63:  # torch.manual_seed's range, with room for the rank added to it
        raise argparse.ArgumentTypeError(f"must be an integer from -2**63 to 2**63 - 1, got {value}")
    return value


def precision_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    wrong = [name for name in names if name not in PRECISIONS]
    if wrong or not names:
        raise argparse.ArgumentTypeError(
            f"accepted: one or more of {', '.join(PRECISIONS)}, comma-separated (e.g. bf16,O2); got {text!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"names a precision twice: {text!r}")
    return names


def recipe_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    wrong = [name for name in names if name not in fp8amp.RECIPES]
    if wrong or not names:
        raise argparse.ArgumentTypeError(
            f"accepted: one or more of {', '.join(fp8amp.RECIPES)}, comma-separated (e.g. tensorwise,blockwise); "
            f"got {text!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"names a recipe twice: {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", type=precision_list, default=["bf16", "O2"], metavar="P[,P...]",
                   help="one or more of bf16, fp8, O1, O2, comma-separated, trained one after another. "
                        "O1/O2: fp8amp.initialize (FP8 GEMMs, FP16 master weights, FP8 weight gradients, fused "
                        "Adam with FP32 (O1) or FP8/FP16 (O2) states); fp8: FP8 GEMMs only (fp8amp.convert); "
                        "bf16: the baseline (bf16 autocast on CUDA; float32, labelled fp32, on a CPU) "
                        "(default: bf16,O2)")
    p.add_argument("--policy", choices=["all", "auto"], default="all",
                   help="which Linears take FP8 (fp8amp.convert): all, to show FP8 training at any size, or auto: "
                        "only where FP8 is measured faster on this GPU (default: all)")
    p.add_argument("--recipe", type=recipe_list, default=["tensorwise"], metavar="R[,R...]",
                   help="how the FP8 precisions scale their GEMM operands (fp8amp.Recipe): one or more of "
                        f"{', '.join(fp8amp.RECIPES)}, comma-separated; each FP8 precision trains once with each, "
                        "labelled P-R (just P for tensorwise) (default: tensorwise)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help=f"the model, batch, step count and learning rate (default: {GPU_PRESET} on a GPU, {CPU_PRESET} on a CPU)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps (default: the preset's)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="sequences a step, a process (default: the preset's)")
    p.add_argument("--lr", type=positive_float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (default: off)")
    p.add_argument("--fp8-activations", action="store_true",
                   help="run the forward inside fp8amp.save_activations_in_fp8(): what attention, GELU and the "
                        "LayerNorms save for backward is stored in FP8 (less memory; eager, or compiled on "
                        "torch >= 2.10) (default: off)")
    p.add_argument("--gemm-autotune", action="store_true",
                   help="fp8amp.ops.set_gemm_autotune(True): each FP8 GEMM keeps the fastest of cuBLASLt's first 8 "
                        "algorithms (timed on its first calls; results may differ in the last bits between runs) "
                        "(default: off)")
    p.add_argument("--numerics-report", action="store_true",
                   help="after training each FP8 precision, one more batch (forward and backward, eager, no "
                        "optimizer step) inside fp8amp.numerics_report: saturation, underflow and SQNR of every "
                        "FP8 cast, printed (default: off)")
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp",
                   help="under torchrun: DDP (with more than one process) or FSDP2's fully_shard (with any "
                        "number, one included; O1/O2: FP16 masters and optimizer states sharded; every FP8 "
                        "precision: weights all-gathered in E4M3) (default: ddp)")
    p.add_argument("--fp8-allreduce", action="store_true",
                   help="DDP: fp8amp.distributed.fp8_allreduce_hook (FP8 gradients on the wire) (default: off)")
    p.add_argument("--no-fp8-all-gather", dest="fp8_all_gather", action="store_false",
                   help="FSDP2 with --precision fp8: all-gather the weights in their own dtype instead of E4M3 "
                        "(default: E4M3, fp8amp.fsdp.enable_fp8_all_gather)")
    p.add_argument("--data", default=None,
                   help="a text file or a directory of .py files (default: the Python standard library's sources)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the initial weights and the batches (default: 0)")
    p.add_argument("--log-every", type=positive_int, default=20,
                   help="steps between log lines and throughput measurements (default: 20)")
    p.add_argument("--eval-every", type=positive_int, default=None,
                   help="steps between validation losses (default: after the last step only)")
    p.add_argument("--out", default=None,
                   help="directory for metrics.csv, train.png and summary.md (default: a new folder under runs/)")
    return p


@dataclass
class Setup:
    device: torch.device
    preset: str
    cfg: GPTConfig
    steps: int
    batch: int
    lr: float
    train: torch.Tensor
    val: torch.Tensor
    out: Path


def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Setup:
    """Checks what parse_args cannot (the device, the data, the output directory) and fills in the
    preset; every failure is one parser.error line naming the argument."""
    if args.fp8_allreduce and (int(os.environ.get("WORLD_SIZE", "1")) == 1 or args.parallel == "fsdp"):
        parser.error("argument --fp8-allreduce: it is for DDP: launch with torchrun --nproc-per-node=N (N > 1)")
    if args.parallel == "fsdp" and "WORLD_SIZE" not in os.environ:
        parser.error("argument --parallel: fsdp runs under torchrun: launch with torchrun --nproc-per-node=N "
                     "(N = 1 on one GPU)")
    if args.recipe != ["tensorwise"] and args.precision == ["bf16"]:
        parser.error("argument --recipe: it applies to the FP8 precisions (fp8, O1, O2), and --precision names "
                     "only bf16")
    if args.numerics_report and args.precision == ["bf16"]:
        parser.error("argument --numerics-report: it reports the FP8 precisions (fp8, O1, O2), and --precision names "
                     "only bf16")
    if not args.fp8_all_gather and (args.parallel != "fsdp" or "fp8" not in args.precision):
        parser.error("argument --no-fp8-all-gather: it applies to --parallel fsdp with --precision fp8")
    device = resolve_device(parser, args.device)
    preset_name = args.preset or (GPU_PRESET if device.type == "cuda" else CPU_PRESET)
    preset = PRESETS[preset_name]
    cfg: GPTConfig = preset["model"]
    if args.data is not None and not os.path.exists(args.data):
        parser.error(f"argument --data: no such file or directory: {args.data!r}")
    try:
        data = load_text_bytes(args.data)
    except (ValueError, OSError) as e:
        parser.error(f"argument --data: {e}")
    # Validation holds out the last 5 % of the text, and at least one window; training the rest.
    window = cfg.seq_len + 2
    if data.numel() < 2 * window:
        parser.error(f"argument --data: {args.data!r} holds {data.numel()} bytes of text, fewer than the "
                     f"{2 * window} that the {preset_name} preset (seq_len {cfg.seq_len}) needs: one window of "
                     f"{window} bytes for training and one for validation")
    held_out = max(window, data.numel() // 20)
    if args.out == "":  # --out "$DIR" with DIR unset
        parser.error("argument --out: empty; accepted: a directory that exists or can be created, and is writable "
                     "(leave --out out for a new folder under runs/)")
    out = Path(args.out) if args.out else REPO / "runs" / (time.strftime("%Y%m%d-%H%M%S") + "-"
                                                           + "-".join(args.precision))
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 writes (and its clock names the run)
        try:
            out.mkdir(parents=True, exist_ok=True)
            if not os.access(out, os.W_OK):
                raise PermissionError(13, "permission denied")
        except OSError as e:
            parser.error(f"argument --out: cannot write into {str(out)!r} ({e.strerror or e}); accepted: a "
                         "directory that exists or can be created, and is writable")
    return Setup(device=device, preset=preset_name, cfg=cfg, steps=args.steps or preset["steps"],
                 batch=args.batch or preset["batch"], lr=args.lr or preset["lr"],
                 train=data[:-held_out], val=data[-held_out:], out=out)


def join_processes(device: torch.device, parallel: str) -> tuple[int, int, torch.device]:
    """Under torchrun with more than one process, or with ``parallel`` "fsdp" (one process
    included), joins the process group: NCCL with one GPU a process, gloo on CPUs. Returns (rank,
    world size, this process's device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and parallel != "fsdp":
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def runs_of(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(precision, recipe) in training order: bf16 once, each FP8 precision once a recipe."""
    return [(precision, None) if precision == "bf16" else (precision, recipe)
            for precision in args.precision for recipe in (args.recipe if precision != "bf16" else [None])]


def label_of(precision: str, recipe: str | None, device: torch.device) -> str:
    """What runs: the bf16 baseline is float32 on a CPU (train_step autocasts on CUDA only); an FP8
    precision with a recipe other than tensorwise is labelled with it."""
    if precision == "bf16":
        return "fp32" if device.type == "cpu" else precision
    return precision if recipe == "tensorwise" else f"{precision}-{recipe}"


def build(precision: str, recipe: str | None, args, setup: Setup, init_state: dict, world: int,
          device: torch.device):
    """The model (from init_state), its optimizer and schedule for one precision and recipe."""
    fsdp = args.parallel == "fsdp"  # (under torchrun: resolve checks it)
    model = GPT(setup.cfg)
    model.load_state_dict(init_state)
    model.to(device)
    lr, tokens = setup.lr, setup.batch * setup.cfg.seq_len
    adamw = dict(lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        if precision in fp8amp.OPT_LEVELS:  # the masters, sharded below with their scales
            model, _ = fp8amp.initialize(model, opt_level=precision, policy=args.policy, tokens=tokens,
                                         recipe=recipe)
        elif precision == "fp8":
            fp8amp.convert(model, policy=args.policy, tokens=tokens, recipe=recipe)
            if args.fp8_all_gather:
                fp8amp.fsdp.enable_fp8_all_gather(model)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        # FSDP2 replaced the parameters: the optimizer comes after it, then the scaling hooks (the
        # amax reduction across ranks started before each step, the update after it).
        if precision in fp8amp.OPT_LEVELS:
            optimizer = fp8amp.optim.AdamW(model.parameters(), state_dtypes=precision, **adamw)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        if precision != "bf16":
            fp8amp.register_scaling_hooks(model, optimizer)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        if precision in fp8amp.OPT_LEVELS:
            model, optimizer = fp8amp.initialize(model, optimizer, opt_level=precision, policy=args.policy,
                                                 tokens=tokens, recipe=recipe)
        elif precision == "fp8":
            model = fp8amp.convert(model, optimizer=optimizer, policy=args.policy, tokens=tokens, recipe=recipe)
    steps = setup.steps
    schedule = torch.optim.lr_scheduler.LambdaLR(  # after initialize: it holds the optimizer
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    core = model  # the GPT itself (the report and the parameter count look at it)
    if world > 1 and not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if args.fp8_allreduce:
            from fp8amp.distributed import FP8CommState, fp8_allreduce_hook

            model.register_comm_hook(FP8CommState(), fp8_allreduce_hook)
    return core, model, optimizer, schedule


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def validation_loss(step_model, setup: Setup, device: torch.device) -> float:
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    loader = batches(setup.val, setup.batch, setup.cfg.seq_len, device, seed=1234)  # the same batches each time
    step_model.eval()
    with torch.no_grad(), autocast:
        loss = sum(step_model(*next(loader))[1].item() for _ in range(EVAL_BATCHES)) / EVAL_BATCHES
    step_model.train()
    return loss


def train_one(precision: str, recipe: str | None, args, setup: Setup, init_state: dict, rank: int, world: int,
              device: torch.device, log) -> list[RunRow]:
    """Trains one precision and recipe from init_state; returns a row a step (throughput and memory
    on log steps, the validation loss on evaluation steps)."""
    label = label_of(precision, recipe, device)
    torch._dynamo.reset()  # each precision compiles anew, within the recompile limits
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    core, model, optimizer, schedule = build(precision, recipe, args, setup, init_state, world, device)
    step_model = torch.compile(model) if args.compile else model
    converted = sum(isinstance(m, fp8amp.Fp8Linear) for m in core.modules())
    fsdp = args.parallel == "fsdp"
    processes = f"{world} process{'es' if world > 1 else ''}"
    parallel = f", {processes} ({'FSDP2' if fsdp else 'DDP'})" if world > 1 or fsdp else ""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        "CPU, float32" if label == "fp32" else "CPU emulation")
    requested = " (bf16 requested: autocast to bf16 runs on CUDA only)" if label == "fp32" else ""
    log(f"{label} on {device.type} ({where}{parallel}){requested}: {core.num_parameters() / 1e6:.1f}M parameters, "
        f"{converted} FP8 Linears, {setup.cfg.n_layer} layers x d_model {setup.cfg.d_model}, batch {setup.batch} x "
        f"{setup.cfg.seq_len} a process, {setup.steps} steps")

    saved_activations = fp8amp.save_activations_in_fp8() if args.fp8_activations else None
    loader = batches(setup.train, setup.batch, setup.cfg.seq_len, device, seed=args.seed + rank)
    tokens_per_step = setup.batch * setup.cfg.seq_len * world
    rows: list[RunRow] = []
    pending: list[torch.Tensor] = []  # losses not yet read back: one host sync a log interval
    bar = tqdm(total=setup.steps, desc=label, unit="step", disable=rank != 0, dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 5.0)
    last_time, last_step = time.perf_counter(), 0
    for step in range(1, setup.steps + 1):
        x, y = next(loader)
        pending.append(train_step(model, optimizer, x, y, forward=step_model, scheduler=schedule,
                                  saved_tensors_hooks=saved_activations))
        bar.update(1)
        log_now = step % args.log_every == 0 or step == setup.steps
        eval_now = step == setup.steps or (args.eval_every is not None and step % args.eval_every == 0)
        if not (log_now or eval_now):
            continue
        losses = torch.stack(pending).float().tolist()  # the sync that makes the time below true
        for offset, loss in enumerate(losses):
            rows.append(RunRow(label, step - len(losses) + 1 + offset, loss))
        pending.clear()
        if log_now:
            now = time.perf_counter()
            rows[-1].tokens_per_s = tokens_per_step * (step - last_step) / (now - last_time)
            rows[-1].peak_memory_gib = peak_memory_gib(device)
            memory = "" if rows[-1].peak_memory_gib is None else f", peak {rows[-1].peak_memory_gib:.2f} GiB"
            bar.set_postfix_str(f"loss {losses[-1]:.3f}, {rows[-1].tokens_per_s:,.0f} tokens/s{memory}")
            if rank == 0:
                bar.write(f"{label:>4} step {step:5d}/{setup.steps}  loss {losses[-1]:.4f}  "
                          f"{rows[-1].tokens_per_s:,.0f} tokens/s{memory}", file=sys.stdout)
        if eval_now:
            rows[-1].val_loss = validation_loss(step_model, setup, device)
        last_time, last_step = time.perf_counter(), step  # validation is not training time
    bar.close()

    if args.numerics_report and converted:
        x, y = next(loader)
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda"
                    else contextlib.nullcontext())
        with fp8amp.numerics_report(core) as report:  # the uncompiled model: compiled code records nothing
            with autocast:
                _, report_loss = model(x, y)
            report_loss.backward()
        optimizer.zero_grad(set_to_none=True)
        log(f"numerics report, {label} (one more batch, eager, no optimizer step{', rank 0' if world > 1 else ''}):"
            f"\n{report}")
    peak = rows[-1].peak_memory_gib
    final = statistics.fmean(r.loss for r in rows[-FINAL_LOSS_STEPS:])  # as summary.md reports it
    log(f"final {label}: train loss {final:.4f}, val loss {rows[-1].val_loss:.4f}, peak memory "
        f"{'n/a (CPU)' if peak is None else f'{peak:.2f} GiB'} (train loss: the mean of the last "
        f"{min(FINAL_LOSS_STEPS, len(rows))} steps, as summary.md)")
    del core, model, optimizer, schedule, step_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    setup = resolve(parser, args)
    rank, world, device = join_processes(setup.device, args.parallel)
    log = print if rank == 0 else (lambda *a, **k: None)
    fp8amp.ops.set_gemm_autotune(args.gemm_autotune)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and for every precision
    init_state = {k: v.clone() for k, v in GPT(setup.cfg).state_dict().items()}
    runs = runs_of(args)
    log(f"{', '.join(label_of(p, r, device) for p, r in runs)}: the {setup.preset} preset on "
        f"{(setup.train.numel() + setup.val.numel()) / 1e6:.1f} MB of text, the same initial weights and batches")
    rows, interrupted = [], False
    try:
        for precision, recipe in runs:
            rows += train_one(precision, recipe, args, setup, init_state, rank, world, device, log)
    except KeyboardInterrupt:  # Ctrl-C: keep what the precisions that finished measured
        interrupted = True
        log(f"\ninterrupted: {len({r.precision for r in rows})} of {len(runs)} precisions finished"
            + ("" if rows else "; nothing written"))
    if rank == 0 and rows:
        meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (FP8 emulation)",
                    torch=torch.__version__, preset=setup.preset, steps=setup.steps, batch=setup.batch,
                    seq_len=setup.cfg.seq_len, processes=world, compile=args.compile,
                    fp8_activations=args.fp8_activations)
        paths = write_outputs(setup.out, rows, summarize(rows), meta)
        log("wrote " + ", ".join(str(p) for p in paths))
    if dist.is_initialized() and not interrupted:  # the other ranks may not reach it
        dist.destroy_process_group()
    if interrupted:
        sys.exit(130)  # the shell's code for a run ended by SIGINT


if __name__ == "__main__":
    main()
