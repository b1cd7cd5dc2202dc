"""timm as its users train with it (the real package, small configs on the CPU), at fp8amp's levels
and recipes, against the same model trained with plain torch: model families whose Linears see N-D
and permuted inputs, channels-last models, and timm's training pieces (its optimizer factory,
schedulers, EMA, checkpoints). Kept apart from test_integration_timm.py (a ViT under autocast)."""

import pytest
import torch
import torch.nn.functional as F

import fp8amp

timm = pytest.importorskip("timm")


def _xy(classes: int = 16, size: int = 32, batch: int = 8):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, classes, (batch,), generator=gen)


def _train(model, opt, x, y, steps=4):
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _convnext():
    """A ConvNeXt whose MLPs are Linears over channels-last 4-D activations (conv_mlp=False)."""
    torch.manual_seed(0)
    return timm.create_model("convnext_atto", dims=(32, 32, 64, 64), depths=(1, 1, 1, 1), num_classes=16,
                             conv_mlp=False)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_channels_last_model_trains_at_o1_o2_as_contiguous_one(opt_level):
    """timm's --channels-last: model.to(memory_format=torch.channels_last) makes every conv weight a
    non-contiguous (NHWC) parameter, which fp8amp's optimizer refused at its first step. It trains
    bit for bit as the contiguous model, and as plain torch within FP8 rounding."""
    x, y = _xy()
    runs = {}
    for channels_last in (False, True):
        model = _convnext()
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), opt_level,
                                       policy="all")
        assert len(fp8amp.conversion_report(model).converted) == 9
        stem = model.stem[0].weight
        assert stem.is_contiguous() != channels_last
        losses = _train(model, opt, x.to(memory_format=torch.channels_last) if channels_last else x, y)
        assert model.stem[0].weight is stem and stem.is_contiguous() != channels_last
        runs[channels_last] = losses, {k: v.float() for k, v in model.state_dict().items()}
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(v, runs[False][1][k]) for k, v in runs[True][1].items())
    ref = _convnext()
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), x, y)
    assert runs[True][0] == pytest.approx(ref_losses, rel=0.02), (runs[True][0], ref_losses)


def test_create_optimizer_v2_groups_and_scheduler_carry_through_initialize():
    """timm's optimizer factory (layer decay, no weight decay on norms and biases) passed to
    initialize: every group keeps its params' roles, weight decay and lr_scale, and timm's scheduler
    built on the returned optimizer sets the same lrs as on plain torch's."""
    from timm.models.vision_transformer import VisionTransformer
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    def make():
        torch.manual_seed(0)
        return VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0,
                                 num_classes=16)

    ref, model = make(), make()
    ref_opt = create_optimizer_v2(ref, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    plain = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    model, opt = fp8amp.initialize(model, plain, "O2", policy="all")
    names = {id(p): n for n, p in model.named_parameters()}
    ref_names = {id(p): n for n, p in ref.named_parameters()}
    assert len(opt.param_groups) == len(ref_opt.param_groups) == 8
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        assert [names[id(p)] for p in group["params"]] == [ref_names[id(p)] for p in ref_group["params"]]
        assert (group["weight_decay"], group["lr_scale"]) == (ref_group["weight_decay"], ref_group["lr_scale"])
    schedulers = [create_scheduler_v2(o, "cosine", num_epochs=6, warmup_epochs=2, warmup_lr=1e-5)[0]
                  for o in (opt, ref_opt)]
    x, y = _xy()
    for epoch in range(3):
        losses = [_train(m, o, x, y, steps=1)[0] for m, o in ((model, opt), (ref, ref_opt))]
        assert losses[0] == pytest.approx(losses[1], rel=0.02)
        for scheduler in schedulers:
            scheduler.step(epoch + 1)
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
