"""A timm VisionTransformer (the real package) at O2 with FP16 autocast and a GradScaler, on the
CPU (FP8 emulation): trains, with odd batch sizes (token counts that are no multiple of 16)."""

import pytest
import torch
import torch.nn.functional as F

import fp8amp

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402


def test_vit_o2_fp16_autocast_gradscaler_trains_with_odd_batches():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0,
                              num_classes=10)
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", policy="all")
    report = fp8amp.conversion_report(model)
    assert len(report.converted) == 8 and [d.name for d in report.skipped] == ["head"]  # 10 classes: not /16
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(0)
    images, labels = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    losses = []
    for batch in [7, 13, 16] * 4:  # 17 tokens an image: 119 and 221 rows, padded inside Fp8Linear
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(images[:batch])
            loss = F.cross_entropy(logits.float(), labels[:batch])
        assert logits.dtype == torch.float16
        scaler.scale(loss).backward()
        assert isinstance(model.blocks[0].mlp.fc1.weight.grad, fp8amp.ScaledTensor)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    assert float(next(iter(opt.state.values()))["step"]) == 12  # no step skipped
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_gradscaler_skips_a_step_with_an_overflowing_fp8_gradient():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=4, mlp_ratio=2.0,
                              num_classes=16)
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", policy="all")
    before = model.blocks[0].attn.qkv.weight.dequantize().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 120)  # the scaled loss overflows fp16/FP8
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(5, 3, 32, 32)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 119
    assert torch.equal(model.blocks[0].attn.qkv.weight.dequantize(), before)
    assert not opt.state or all(float(s["step"]) == 0 for s in opt.state.values())
