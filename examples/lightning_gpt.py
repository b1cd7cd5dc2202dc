"""Train fp8amp's small GPT (fp8amp.testing) with Lightning, at O2 through the precision plugin,
on the built-in data (the Python standard library's sources, as bytes).

    python examples/lightning_gpt.py                    # FP8 emulation on CPU, or the GPU
    python examples/lightning_gpt.py --devices 2        # DDP (gloo processes on CPU)
    python examples/lightning_gpt.py --devices 2 --fp8-allreduce   # DDP with FP8 gradients on the wire
    python examples/lightning_gpt.py --ckpt run.ckpt    # save at the end; run again to resume

The fp8amp part is the plugin: ``Trainer(plugins=[Fp8ampPrecision("O2")])``. The LightningModule
builds a plain ``torch.optim.AdamW`` and an lr scheduler; the plugin converts both.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch

from fp8amp.integrations.lightning import Fp8ampPrecision
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_args import positive_int  # noqa: E402


class ByteWindows(torch.utils.data.IterableDataset):
    def __init__(self, batch: int, seq: int, steps: int):
        self.batch, self.seq, self.steps = batch, seq, steps

    def __iter__(self):
        data = batches(load_text_bytes(max_bytes=4 << 20), self.batch, self.seq)
        for _ in range(self.steps):
            yield next(data)


class LitGPT(L.LightningModule):
    def __init__(self, config: GPTConfig, lr: float, steps: int):
        super().__init__()
        self.model = GPT(config)
        self.lr, self.steps = lr, steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class PrintLoss(L.Callback):
    def __init__(self, every: int):
        self.every = every

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_global_zero and (batch_idx % self.every == 0 or trainer.global_step == trainer.max_steps):
            print(f"step {trainer.global_step:5d}  loss {outputs['loss'].item():.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opt-level", choices=["O1", "O2"], default="O2")
    p.add_argument("--steps", type=positive_int, default=None)
    p.add_argument("--devices", type=positive_int, default=1)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--fp8-allreduce", action="store_true",
                   help="under DDP, average the gradients with fp8amp's FP8 all-reduce (the plugin's comm hook)")
    p.add_argument("--ckpt", default=None, help="resume from this checkpoint if it exists; save to it at the end")
    p.add_argument("--log-every", type=positive_int, default=10)
    args = p.parse_args()
    if args.ckpt and os.path.isdir(args.ckpt):
        p.error(f"argument --ckpt: {args.ckpt!r} is a directory; accepted: a checkpoint file's path (resumed from if "
                "it exists, written at the end)")
    gpu = torch.cuda.is_available() and not args.cpu
    config = (GPTConfig(seq_len=512, n_layer=6, n_head=8, d_model=512) if gpu
              else GPTConfig(seq_len=64, n_layer=2, n_head=4, d_model=64))
    steps = args.steps or (300 if gpu else 30)
    batch = 32 if gpu else 8
    torch.manual_seed(0)
    module = LitGPT(config, lr=1e-3 if gpu else 2e-3, steps=steps)
    trainer = L.Trainer(
        max_steps=steps, accelerator="gpu" if gpu else "cpu", devices=args.devices,
        plugins=[Fp8ampPrecision(args.opt_level, autocast_dtype=torch.bfloat16 if gpu else None,
                                 fp8_allreduce=args.fp8_allreduce)],
        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[PrintLoss(args.log_every)],
    )
    resume = args.ckpt if args.ckpt and os.path.exists(args.ckpt) else None
    data = torch.utils.data.DataLoader(ByteWindows(batch, config.seq_len, steps), batch_size=None)
    trainer.fit(module, data, ckpt_path=resume)
    if args.ckpt:
        trainer.save_checkpoint(args.ckpt)
    if trainer.is_global_zero:
        print(f"final: loss {trainer.callback_metrics['loss'].item():.4f} after {trainer.global_step} steps")


if __name__ == "__main__":
    main()
