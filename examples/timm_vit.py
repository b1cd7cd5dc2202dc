"""Train a timm VisionTransformer at O2 with FP16 autocast and a GradScaler, on synthetic images
(random pictures whose class is the brightest of a few fixed patterns: learnable, and nothing to
download).

    python examples/timm_vit.py                           # tiny ViT, FP8 emulation on CPU
    python examples/timm_vit.py --preset 1b --steps 50    # a ~0.9B ViT on one GPU
    python examples/timm_vit.py --opt-level none          # the FP16 AMP baseline

The fp8amp part is ``fp8amp.initialize(model, optimizer, "O2")``; FP16 autocast and
``torch.amp.GradScaler`` stay as in any FP16 AMP loop: GradScaler unscales fp8amp's FP8
gradients through their scales and skips a step with a non-finite one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

import fp8amp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_args import positive_int, resolve_device  # noqa: E402

PRESETS = {
    "tiny": dict(model=dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0),
                 batch=13, steps=30, lr=2e-3),  # an odd batch on purpose: fp8amp pads the token rows
    "base": dict(model=dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12), batch=64,
                 steps=100, lr=5e-4),
    "1b": dict(model=dict(img_size=224, patch_size=14, embed_dim=1536, depth=32, num_heads=16), batch=64,
               steps=50, lr=2e-4),
}
CLASSES = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opt-level", choices=["O1", "O2", "none"], default="O2")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: base on GPU, tiny on CPU")
    p.add_argument("--steps", type=positive_int, default=None)
    p.add_argument("--batch", type=positive_int, default=None)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--log-every", type=positive_int, default=10)
    args = p.parse_args()
    args.device = resolve_device(p, args.device)
    return args


def synthetic_batch(patterns: torch.Tensor, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise plus one of the patterns: the label is which."""
    labels = torch.randint(0, len(patterns), (batch,), generator=gen)
    images = torch.randn(batch, *patterns.shape[1:], generator=gen) + 2 * patterns[labels]
    return images, labels


def main() -> None:
    args = parse_args()
    device = args.device
    preset = PRESETS[args.preset or ("tiny" if device.type == "cpu" else "base")]
    steps, batch = args.steps or preset["steps"], args.batch or preset["batch"]
    torch.manual_seed(0)
    model = VisionTransformer(num_classes=CLASSES, **preset["model"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset["lr"], weight_decay=0.05)
    if args.opt_level != "none":
        model, optimizer = fp8amp.initialize(model, optimizer, args.opt_level, policy="all")
    scaler = torch.amp.GradScaler(device.type)
    size = preset["model"]["img_size"]
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randn(CLASSES, 3, size, size, generator=gen)
    print(f"ViT {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {args.opt_level} + FP16 autocast "
          f"+ GradScaler on {device}, batch {batch}")

    start = time.perf_counter()
    for step in range(steps):
        images, labels = (t.to(device, non_blocking=True) for t in synthetic_batch(patterns, batch, gen))
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(images).float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  scale {scaler.get_scale():.0f}")
    seconds = time.perf_counter() - start
    memory = f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if device.type == "cuda" else ""
    print(f"final: loss {loss.item():.4f}, {steps * batch / seconds:.1f} images/s{memory}")


if __name__ == "__main__":
    main()
