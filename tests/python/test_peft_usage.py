"""PEFT fine-tuning over fp8amp as its users run it (CPU, FP8 emulation, tiny models): adapters
added after initialize (the base's Linears already Fp8Linear with FP16 masters), initializations
that rewrite the base weight (PiSSA, OLoRA), merges of several tuner types into the masters, and
adapter files reloaded over a fresh converted base. test_transformers_usage.py has LoRA added
before initialize."""

import copy
import itertools
import json

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp.testing import batches, load_text_bytes
from hf_models import step, tiny_llama

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def data():
    return list(itertools.islice(batches(load_text_bytes(max_bytes=1 << 16), 4, 32), 4))


def real(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, fp8amp.ScaledTensor) else tensor.detach()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def lora_llama(config, level=None):
    """The PEFT model of tiny_llama, its base initialized at ``level`` first (None: plain), and the
    adapters' optimizer."""
    base = tiny_llama()
    if level is not None:
        base, _ = fp8amp.initialize(base, None, level, policy="all")
    torch.manual_seed(1)
    model = peft.get_peft_model(base, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if level is not None:
        opt = fp8amp.initialize_optimizer(model, opt, level)
    return model, opt


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_initializations_that_rewrite_the_base_weight_write_the_master(data, init):
    """PiSSA and OLoRA take the base weight's principal part into the adapters and write the rest
    back into it: over an O2 base they read the master's real values and write the residual into
    the master (still a MasterWeight), as they write it into the plain model's weight, and the
    model's output stays that of its base."""
    config = peft.LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=init)
    reference, _ = lora_llama(config)
    model, opt = lora_llama(config, "O2")
    x = data[0][0]
    with torch.no_grad():
        expected = reference(input_ids=x).logits
        assert rel(model(input_ids=x).logits, expected) < 0.1
    for layer, plain in zip(model.base_model.model.model.layers, reference.base_model.model.model.layers):
        base, plain_base = layer.self_attn.q_proj.base_layer, plain.self_attn.q_proj.base_layer
        assert isinstance(base, fp8amp.Fp8Linear) and isinstance(base.weight, fp8amp.MasterWeight)
        assert rel(real(base.weight), plain_base.weight.detach()) < 2.0 ** -9
        # the adapters come from the FP16 master's values
        assert rel(layer.self_attn.q_proj.lora_A["default"].weight, plain.self_attn.q_proj.lora_A["default"].weight) < 2.0 ** -8
    losses = [step(model, opt, x, y) for x, y in data[:2]]
    assert losses[1] < losses[0]


TUNERS = {
    "dora": lambda: peft.LoraConfig(r=16, target_modules=["0", "2", "4"], use_dora=True, init_lora_weights="gaussian"),
    "rslora": lambda: peft.LoraConfig(r=16, target_modules=["0", "2"], use_rslora=True, modules_to_save=["4"]),
    "ia3": lambda: peft.IA3Config(target_modules=["0", "2", "4"], feedforward_modules=["2"]),
    "loha": lambda: peft.LoHaConfig(r=8, target_modules=["0", "2"]),
    "lokr": lambda: peft.LoKrConfig(r=8, target_modules=["0", "2"]),
}


@pytest.mark.parametrize("tuner", sorted(TUNERS))
def test_tuners_train_and_merge_into_the_masters(tuner):
    """Tuners over an MLP initialized at O2 first: the optimizer holds the adapters only, the
    losses follow the plain PEFT model's, and merge_and_unload then unconvert gives the unmerged
    model's function (both in high precision) within FP16 rounding of the merged masters."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    runs = []
    for level in (None, "O2"):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
        if level is not None:
            base, _ = fp8amp.initialize(base, None, level, policy="all")
        torch.manual_seed(1)
        model = peft.get_peft_model(base, TUNERS[tuner]())
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=1e-2)
        if level is not None:
            opt = fp8amp.initialize_optimizer(model, opt, level)
            assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in trained}
        losses = []
        for _ in range(4):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((model, losses))
    (_, expected), (model, losses) = runs
    assert all(abs(a - b) < 0.1 * b for a, b in zip(losses, expected)), (losses, expected)
    unmerged = fp8amp.unconvert(copy.deepcopy(model))
    merged = model.merge_and_unload()
    assert all(isinstance(m.weight, fp8amp.MasterWeight) for m in merged.modules() if isinstance(m, fp8amp.Fp8Linear))
    fp8amp.unconvert(merged)
    with torch.no_grad():
        assert rel(merged(x), unmerged(x)) < 2e-3


def test_adapter_files_reload_over_a_fresh_converted_base(tmp_path, data):
    """save_pretrained of a PEFT model over an O2 base writes the plain model's adapter file (same
    keys, float32 values, same config), and PeftModel.from_pretrained over a freshly initialized
    base gives the trained model's logits bit for bit; over the plain base, within FP8 rounding."""
    from safetensors.torch import load_file

    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    reference, _ = lora_llama(config)
    model, opt = lora_llama(config, "O2")
    for x, y in data[:2]:
        step(model, opt, x, y)
    model.eval()
    reference.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "fp8")
    plain_file = load_file(tmp_path / "plain" / "adapter_model.safetensors")
    saved = load_file(tmp_path / "fp8" / "adapter_model.safetensors")
    weights = {k: v for k, v in saved.items() if "_scaling." not in k}  # the converted head's scaling buffers
    assert sorted(weights) == sorted(plain_file) and all(v.dtype == torch.float32 for v in weights.values())
    assert (json.loads((tmp_path / "fp8" / "adapter_config.json").read_text())
            == json.loads((tmp_path / "plain" / "adapter_config.json").read_text()))
    x = data[3][0]
    with torch.no_grad():
        expected = model(input_ids=x).logits
        fresh, _ = fp8amp.initialize(tiny_llama(), None, "O2", policy="all")
        assert torch.equal(peft.PeftModel.from_pretrained(fresh, tmp_path / "fp8").eval()(input_ids=x).logits, expected)
        plain = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "fp8").eval()
        assert rel(plain(input_ids=x).logits, expected) < 0.1


@pytest.mark.xfail(strict=True, reason="PEFT takes an Fp8Conv1D for an nn.Linear (its isinstance check comes first) "
                                       "and sets fan_in_fan_out=False: merges add the transposed delta. Add the "
                                       "adapters before convert / initialize.")
def test_lora_merge_over_a_converted_gpt2_conv1d(data):
    """LoRA on a GPT-2 Conv1D ([in, out] weight) that convert made an Fp8Conv1D: merging must not
    change the function (it does on the plain model)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0)
    base = fp8amp.convert(transformers.GPT2LMHeadModel(config).eval(), policy="all")
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, target_modules=r".*attn\.c_proj", fan_in_fan_out=True))
    x = data[0][0][:, :16]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
        expected = model(input_ids=x).logits
        model.merge_adapter()
        assert rel(model(input_ids=x).logits, expected) < 0.1
