"""Train a Hugging Face LlamaForCausalLM (built from a config: nothing is downloaded) with fp8amp
under Accelerate, on the built-in data (the Python standard library's sources, as bytes).

    python examples/hf_llama.py                          # O2 on the GPU, FP8 emulation on CPU
    python examples/hf_llama.py --preset 1b --steps 200  # a ~1B Llama on one GPU
    python examples/hf_llama.py --save out/              # then unconvert + save_pretrained
    torchrun --nproc-per-node=8 examples/hf_llama.py     # DDP through Accelerate

The fp8amp part is one line, before ``accelerator.prepare`` (where MS-AMP users had
``Accelerator(mixed_precision="fp8", kwargs_handlers=[MSAMPRecipeKwargs(opt_level="O2")])`` or
``msamp.initialize``):

    model, optimizer = fp8amp.initialize(model, optimizer, "O2")

Accelerate's ``mixed_precision="bf16"`` runs the rest of the model (attention, norms) in bf16
autocast, as it would without fp8amp.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import fp8amp
from fp8amp.testing import batches, load_text_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_args import positive_int  # noqa: E402

PRESETS = {  # every Linear's in/out features a multiple of 16, so FP8 takes them all
    "tiny": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2), seq=64, batch=8, steps=30, lr=3e-3),
    "small": dict(model=dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                             num_key_value_heads=8), seq=512, batch=16, steps=300, lr=1e-3),
    "1b": dict(model=dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=16), seq=1024, batch=8, steps=100, lr=3e-4),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opt-level", choices=["O1", "O2", "none"], default="O2",
                   help="fp8amp.initialize's level; none: the bf16 baseline")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: small on GPU, tiny on CPU")
    p.add_argument("--steps", type=positive_int, default=None)
    p.add_argument("--batch", type=positive_int, default=None)
    p.add_argument("--cpu", action="store_true", help="run on CPU processes (FP8 emulation; gloo under torchrun)")
    p.add_argument("--data", default=None, help="a text file or a directory of .py files (default: stdlib)")
    p.add_argument("--save", default=None, help="after training: fp8amp.unconvert, then save_pretrained here")
    p.add_argument("--log-every", type=positive_int, default=10)
    args = p.parse_args()
    if args.data is not None and not os.path.exists(args.data):
        p.error(f"argument --data: no such file or directory: {args.data!r}")
    return args


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(mixed_precision="bf16", cpu=args.cpu or not torch.cuda.is_available())
    preset = PRESETS[args.preset or ("tiny" if accelerator.device.type == "cpu" else "small")]
    steps, batch = args.steps or preset["steps"], args.batch or preset["batch"]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, max_position_embeddings=preset["seq"], **preset["model"])
    model = LlamaForCausalLM(config).to(accelerator.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset["lr"], weight_decay=0.1)
    if args.opt_level != "none":
        model, optimizer = fp8amp.initialize(model, optimizer, args.opt_level, policy="all")
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.print(f"Llama {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {args.opt_level} on "
                      f"{accelerator.device} ({accelerator.num_processes} process(es))")

    data = batches(load_text_bytes(args.data, max_bytes=8 << 20), batch, preset["seq"], accelerator.device,
                   seed=accelerator.process_index)
    model.train()
    start, loss = time.perf_counter(), torch.tensor(math.nan)
    for step in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == steps - 1:
            accelerator.print(f"step {step:5d}  loss {loss.item():.4f}")
    seconds = time.perf_counter() - start
    accelerator.print(f"final: loss {loss.item():.4f}, {steps * batch * preset['seq'] / seconds:.0f} tokens/s "
                      "per process")

    if args.save:
        accelerator.wait_for_everyone()
        # plain nn.Linear, real-valued weights; the optimizer given too (Accelerate's wraps fp8amp's),
        # as it holds the replaced masters: it comes back a plain torch.optim.AdamW
        model, optimizer = fp8amp.unconvert(accelerator.unwrap_model(model), optimizer.optimizer)
        if accelerator.is_main_process:
            model.save_pretrained(args.save)
            accelerator.print(f"saved to {args.save} (loads with LlamaForCausalLM.from_pretrained)")


if __name__ == "__main__":
    main()
