"""The integrations on the GPU, with the real packages (2026-12-07): the CPU tests
(test_integration_*.py) run FP8 emulation; these run the CUDA casts, GEMMs and optimizer under each
framework's own device handling. Lightning's Trainer with ``Fp8ampPrecision`` (accelerator
"cuda", a GradScaler-skipped step, resume bit for bit), a Hugging Face Llama at O2 through
``unconvert`` + ``save_pretrained`` / ``from_pretrained``, Accelerate's bf16 ``prepare`` and a timm ViT
with float16 autocast and GradScaler."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8amp
from fp8amp.testing import batches, load_text_bytes
from hf_models import step, tiny_llama

pytestmark = pytest.mark.gpu


def _llama_data(n):
    return [(x.cuda(), y.cuda()) for x, y in itertools.islice(batches(load_text_bytes(max_bytes=1 << 18), 8, 32), n)]


def test_hf_llama_o2_trains_and_goes_back_through_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_llama().cuda()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), "O2", policy="all")
    data = _llama_data(12)
    losses = []
    for x, y in data:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses.append(step(model, opt, x, y))
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    x = data[0][0]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        fp8_logits = model(input_ids=x).logits.float()
    masters = {name: p.dequantize() for name, p in model.named_parameters() if isinstance(p, fp8amp.ScaledTensor)}
    model, opt = fp8amp.unconvert(model, opt)
    model.save_pretrained(tmp_path)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded = loaded.cuda()
    params = dict(loaded.named_parameters())
    assert all(torch.equal(params[name], real) for name, real in masters.items())
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = loaded(input_ids=x).logits.float()
    assert (fp8_logits - logits).norm() < 0.1 * logits.norm()


def test_accelerate_bf16_prepare_trains_at_o2():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=False)
    model = tiny_llama()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), "O2", policy="all")
    model, opt = accelerator.prepare(model, opt)
    losses = []
    for x, y in _llama_data(12):
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert next(model.parameters()).is_cuda
    assert isinstance(accelerator.unwrap_model(model).model.layers[0].mlp.up_proj, fp8amp.Fp8Linear)
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_timm_vit_o2_float16_gradscaler_skips_an_overflow_and_trains():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=16).cuda()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", policy="all")
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(16, 3, 32, 32, generator=gen).cuda()
    labels = torch.randint(0, 16, (16,), generator=gen).cuda()
    losses = []
    for i, batch in enumerate([7, 13, 16] * 4):
        x = images[:batch].clone()
        if i == 0:
            x[0, 0, 0, 0] = float("inf")  # the first step overflows: GradScaler skips it
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), labels[:batch])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i > 0:
            losses.append(loss.item())
    assert float(next(iter(opt.state.values()))["step"]) == 11  # one skipped
    assert all(bool(s.amax_history.isfinite().all()) for s in fp8amp.amax_sync.delayed_states(model))
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_lightning_trainer_on_cuda_trains_and_resumes_bit_for_bit(tmp_path):
    L = pytest.importorskip("lightning")
    from fp8amp.integrations.lightning import Fp8ampPrecision

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))

        def training_step(self, batch, batch_idx):
            x, y = batch
            assert x.is_cuda and self.net[0].weight.is_cuda and isinstance(self.net[0], fp8amp.Fp8Linear)
            return F.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=gen)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x[:, :16] * 2))

    def fit(epochs, ckpt=None):
        module = Regression()
        trainer = L.Trainer(max_epochs=epochs, plugins=[Fp8ampPrecision("O2")], accelerator="cuda", devices=1,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, default_root_dir=tmp_path)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=10), ckpt_path=ckpt)
        return trainer, module

    straight, module = fit(4)
    half, _ = fit(2)
    half.save_checkpoint(tmp_path / "half.ckpt")
    _, resumed = fit(4, str(tmp_path / "half.ckpt"))
    for (name, a), b in zip(module.state_dict().items(), resumed.state_dict().values()):
        a = a.codes if isinstance(a, fp8amp.ScaledTensor) else a
        b = b.codes if isinstance(b, fp8amp.ScaledTensor) else b
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), name
