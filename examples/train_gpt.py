"""Train a GPT on the built-in data (the Python standard library's sources, as bytes) with FP8.

    python examples/train_gpt.py                     # O2 on the GPU, or FP8 emulation on CPU
    python examples/train_gpt.py --precision bf16    # the baseline
    python examples/train_gpt.py --precision O1      # O1; "fp8": FP8 GEMMs only (fp8amp.convert)
    python examples/train_gpt.py --preset small --steps 500 --compile
    python examples/train_gpt.py --fp8-activations   # also store saved activations in FP8 (eager)
    python examples/train_gpt.py --numerics-report   # then how well each FP8 cast fits its tensor

Many processes (one a GPU, or CPU processes with gloo), launched by torchrun:

    torchrun --nproc-per-node=8 examples/train_gpt.py                    # DDP, O2
    torchrun --nproc-per-node=8 examples/train_gpt.py --fp8-allreduce    # DDP, FP8 on the wire
    torchrun --nproc-per-node=8 examples/train_gpt.py --parallel fsdp
                        # FSDP2, O2: masters and states sharded, weights all-gathered in E4M3

On a GPU the default preset is a ~20M-parameter GPT (seq 512); on a CPU-only machine a tiny one,
so that the FP8 emulation (the CPU reference kernels) finishes in a minute or two.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step

PRESETS = {
    "tiny": dict(model=GPTConfig(seq_len=128, n_layer=2, n_head=4, d_model=128), batch=8, steps=60, lr=2e-3),
    "small": dict(model=GPTConfig(seq_len=512, n_layer=6, n_head=8, d_model=512), batch=32, steps=400, lr=1e-3),
    "gpt2": dict(model=GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768), batch=16, steps=600, lr=6e-4),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=["O2", "O1", "fp8", "bf16"], default="O2",
                   help="O1/O2: fp8amp.initialize (FP8 GEMMs, FP16 master weights, FP8 weight gradients, "
                        "fused Adam with FP32 (O1) or FP8/FP16 (O2) states); fp8: FP8 GEMMs only; bf16: baseline")
    p.add_argument("--policy", choices=["all", "auto"], default="all",
                   help="which Linears take FP8 (fp8amp.convert): all (default here, to show FP8 training at any "
                        "size), or auto: only where FP8 is measured faster on this GPU")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: small on GPU, tiny on CPU")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--fp8-activations", action="store_true",
                   help="run the forward inside fp8amp.save_activations_in_fp8(): what attention, GELU and the "
                        "LayerNorms save for backward is stored in FP8 (less memory; in eager mode only)")
    p.add_argument("--gemm-autotune", action="store_true",
                   help="fp8amp.ops.set_gemm_autotune(True): each FP8 GEMM keeps the fastest of cuBLASLt's first 8 "
                        "algorithms (timed on its first calls; results may differ in the last bits between runs)")
    p.add_argument("--numerics-report", action="store_true",
                   help="after training, one more batch (forward and backward, eager, no optimizer step) inside "
                        "fp8amp.numerics_report: saturation, underflow and SQNR of every FP8 cast, printed")
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp",
                   help="under torchrun: DDP (default) or FSDP2's fully_shard (O1/O2: FP16 masters and optimizer "
                        "states sharded; every FP8 precision: weights all-gathered in E4M3)")
    p.add_argument("--fp8-allreduce", action="store_true",
                   help="DDP: fp8amp.distributed.fp8_allreduce_hook (FP8 gradients on the wire)")
    p.add_argument("--no-fp8-all-gather", dest="fp8_all_gather", action="store_false",
                   help="FSDP2 with --precision fp8: all-gather the weights in their own dtype instead of E4M3 "
                        "(fp8amp.fsdp.enable_fp8_all_gather, the default)")
    p.add_argument("--data", default=None, help="a text file or a directory of .py files (default: stdlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    return p.parse_args()


def join_processes(args) -> tuple[int, int, torch.device]:
    """Under torchrun (WORLD_SIZE > 1), joins the process group: NCCL with one GPU a process,
    gloo on CPUs. Returns (rank, world size, this process's device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(args.device)
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def main() -> None:
    args = parse_args()
    rank, world, device = join_processes(args)
    fsdp = world > 1 and args.parallel == "fsdp"
    if args.fp8_allreduce and (world == 1 or fsdp):
        raise SystemExit("train_gpt: --fp8-allreduce is for DDP: launch with torchrun --nproc-per-node=N (N > 1)")
    log = print if rank == 0 else (lambda *a, **k: None)
    preset = PRESETS[args.preset or ("small" if device.type == "cuda" else "tiny")]
    cfg: GPTConfig = preset["model"]
    steps = args.steps or preset["steps"]
    batch = args.batch or preset["batch"]
    lr = args.lr or preset["lr"]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    fp8amp.ops.set_gemm_autotune(args.gemm_autotune)

    data = load_text_bytes(args.data)
    split = int(0.95 * data.numel())
    train, val = data[:split], data[split:]

    model = GPT(cfg).to(device)
    tokens_per_rank = batch * cfg.seq_len
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        if args.precision in fp8amp.OPT_LEVELS:  # the masters, sharded below with their scales
            model, _ = fp8amp.initialize(model, opt_level=args.precision, policy=args.policy, tokens=tokens_per_rank)
        elif args.precision == "fp8":
            fp8amp.convert(model, policy=args.policy, tokens=tokens_per_rank)
            if args.fp8_all_gather:
                fp8amp.fsdp.enable_fp8_all_gather(model)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        # FSDP2 replaced the parameters: the optimizer comes after it, then the scaling-update hook.
        if args.precision in fp8amp.OPT_LEVELS:
            optimizer = fp8amp.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95),
                                           state_dtypes=args.precision)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
        if args.precision != "bf16":
            optimizer.register_step_post_hook(lambda *_: fp8amp.update_scaling(model))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
        if args.precision in fp8amp.OPT_LEVELS:
            model, optimizer = fp8amp.initialize(model, optimizer, opt_level=args.precision, policy=args.policy,
                                                 tokens=tokens_per_rank)
        elif args.precision == "fp8":
            model = fp8amp.convert(model, optimizer=optimizer, policy=args.policy, tokens=tokens_per_rank)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # after initialize: it holds the optimizer
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    converted = sum(isinstance(m, fp8amp.Fp8Linear) for m in model.modules())
    core = model  # the GPT itself (the report and the parameter count look at it)
    if world > 1 and not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if args.fp8_allreduce:
            from fp8amp.distributed import FP8CommState, fp8_allreduce_hook

            model.register_comm_hook(FP8CommState(), fp8_allreduce_hook)
    step_model = torch.compile(model) if args.compile else model
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )
    parallel = f", {world} processes ({'FSDP2' if fsdp else 'DDP'})" if world > 1 else ""
    log(
        f"{args.precision} on {device.type} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU emulation'}"
        f"{parallel}): {core.num_parameters() / 1e6:.1f}M parameters, {converted} FP8 Linears, "
        f"{len(data) / 1e6:.1f} MB of text, batch {batch} x {cfg.seq_len} a process, {steps} steps"
    )

    saved_activations = fp8amp.save_activations_in_fp8() if args.fp8_activations else None
    loader = batches(train, batch, cfg.seq_len, device, seed=args.seed + rank)
    tokens = 0
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = next(loader)
        loss = train_step(model, optimizer, x, y, forward=step_model, scheduler=schedule,
                          saved_tensors_hooks=saved_activations)
        tokens += x.numel() * world
        if step % args.log_every == 0 or step == steps:
            elapsed = time.perf_counter() - start
            log(f"step {step:5d}  loss {loss.item():.4f}  {tokens / elapsed:,.0f} tokens/s")

    if args.numerics_report:
        x, y = next(loader)
        with fp8amp.numerics_report(core) as report:  # the uncompiled model: compiled code records nothing
            with autocast:
                _, report_loss = model(x, y)
            report_loss.backward()
        optimizer.zero_grad(set_to_none=True)
        log(f"numerics report (one more batch, eager, no optimizer step{', rank 0' if world > 1 else ''}):\n{report}")

    model.eval()
    val_loader = batches(val, batch, cfg.seq_len, device, seed=1234)
    with torch.no_grad(), autocast:
        val_loss = sum(step_model(*next(val_loader))[1].item() for _ in range(8)) / 8
    peak = f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else "n/a"
    log(f"final: train loss {loss.item():.4f}, val loss {val_loss:.4f}, peak memory {peak}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
