"""Hugging Face transformers with fp8amp, the real package, on the CPU (FP8 emulation): a tiny
LlamaForCausalLM built from a config (nothing downloaded) trains at O2, goes back through
unconvert + save_pretrained / from_pretrained, resumes from its own state dict bit for bit, and
trains under the Trainer; GPT-2's Conv1D layers are reported as kept."""

import io
import itertools

import pytest
import torch

import fp8amp
from fp8amp.testing import batches, load_text_bytes
from hf_models import o2, step, tiny_llama

transformers = pytest.importorskip("transformers")

SEQ = 32


@pytest.fixture(scope="module")
def data():
    return list(itertools.islice(batches(load_text_bytes(max_bytes=1 << 18), 8, SEQ), 12))


def test_llama_o2_converts_every_projection_and_trains(data):
    model, opt = o2(tiny_llama())
    report = fp8amp.conversion_report(model)
    assert len(report.converted) == 2 * 7 + 1 and not report.skipped  # q k v o gate up down, lm_head
    losses = [step(model, opt, x, y) for x, y in data]
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_unconvert_save_pretrained_from_pretrained(tmp_path, data):
    model, opt = o2(tiny_llama())
    for x, y in data[:3]:
        step(model, opt, x, y)
    masters = {name: p.dequantize() for name, p in model.named_parameters() if isinstance(p, fp8amp.ScaledTensor)}
    assert masters
    x = data[0][0]
    with torch.no_grad():
        fp8_logits = model(input_ids=x).logits

    fp8amp.unconvert(model)
    model.save_pretrained(tmp_path)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    params = dict(loaded.named_parameters())
    for name, real in masters.items():  # the masters' real values, exactly (FP16 values fit in float32)
        assert params[name].dtype == torch.float32 and torch.equal(params[name], real), name
    with torch.no_grad():
        logits = loaded(input_ids=x).logits
        assert torch.equal(logits, model(input_ids=x).logits)
    # the FP8 forward of the converted model is within FP8's rounding of the real-valued one
    assert (fp8_logits - logits).norm() < 0.1 * logits.norm()


def test_converted_state_dict_resumes_bit_for_bit(data):
    model, opt = o2(tiny_llama())
    for x, y in data[:3]:
        step(model, opt, x, y)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    straight = [step(model, opt, x, y) for x, y in data[3:6]]

    buf.seek(0)
    checkpoint = torch.load(buf, weights_only=True)
    resumed, opt2 = o2(tiny_llama(seed=1))  # another init: everything comes from the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    again = [step(resumed, opt2, x, y) for x, y in data[3:6]]
    assert again == straight
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        a = a.codes if isinstance(a, fp8amp.ScaledTensor) else a
        b = b.codes if isinstance(b, fp8amp.ScaledTensor) else b
        assert torch.equal(a, b), name


def test_trainer_with_fp8amp_optimizer(tmp_path, data):
    model, opt = o2(tiny_llama())
    windows = [{"input_ids": x[i], "labels": x[i]} for x, _ in data[:2] for i in range(len(x))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                          learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=windows, optimizers=(opt, None))
    before = model.model.layers[0].self_attn.q_proj.weight.dequantize().clone()
    history = model.model.layers[0].self_attn.q_proj.input_scaling.amax_history.clone()
    result = trainer.train()
    assert result.global_step == 4
    assert getattr(trainer.optimizer, "optimizer", trainer.optimizer) is opt  # Accelerate may wrap it
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, fp8amp.Fp8Linear) and isinstance(layer.weight, fp8amp.ScaledTensor)
    assert not torch.equal(layer.weight.dequantize(), before)
    assert not torch.equal(layer.input_scaling.amax_history, history)  # the step hook updated the scaling
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses)


def test_trainer_create_optimizer_override(tmp_path, data):
    class Fp8Trainer(transformers.Trainer):
        def create_optimizer(self):
            super().create_optimizer()
            self.optimizer = fp8amp.initialize_optimizer(self.model, self.optimizer, "O2")
            return self.optimizer

    model, _ = fp8amp.initialize(tiny_llama(), None, "O2", policy="all")
    windows = [{"input_ids": x[i], "labels": x[i]} for x, _ in data[:1] for i in range(len(x))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                          learning_rate=3e-3, weight_decay=0.1, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True)
    trainer = Fp8Trainer(model=model, args=args, train_dataset=windows)
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(optimizer, fp8amp.optim.AdamW)
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, 0.1}  # the Trainer's groups, kept
    assert all(s["exp_avg"].dtype == fp8amp.E4M3 for s in optimizer.state.values())
    assert float(next(iter(optimizer.state.values()))["step"]) == 2


def tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=256, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_conv1d_layers_become_fp8_with_their_own_layout(data):
    conv1d = transformers.pytorch_utils.Conv1D
    reference = tiny_gpt2().eval()  # no dropout: the two forwards compare
    model = fp8amp.convert(tiny_gpt2().eval(), policy="all")
    report = fp8amp.conversion_report(model)
    names = [f"transformer.h.0.{n}" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert [d.name for d in report.converted] == names + ["lm_head"] and not report.skipped
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, fp8amp.Fp8Conv1D) and (c_attn.in_features, c_attn.out_features) == (32, 96)
    assert c_attn.weight is not None and tuple(c_attn.weight.shape) == (32, 96)  # the Conv1D's [in, out]
    keys = {k for k in model.state_dict() if "scaling" not in k}
    assert keys == set(reference.state_dict())
    x = data[0][0]
    with torch.no_grad():
        expected, got = reference(input_ids=x).logits, model(input_ids=x).logits
    assert (got - expected).norm() < 0.05 * expected.norm()  # FP8 rounding of the same computation
    fp8amp.unconvert(model)
    assert type(model.transformer.h[0].attn.c_attn) is conv1d
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, expected)


def test_gpt2_trains_at_o2_and_goes_back_through_save_pretrained(tmp_path, data):
    model, opt = o2(tiny_gpt2())
    c_fc = model.transformer.h[0].mlp.c_fc
    assert isinstance(c_fc, fp8amp.Fp8Conv1D) and type(c_fc.weight) is torch.nn.Parameter  # plain: FP8 compute
    losses = [step(model, opt, x, y) for x, y in data]
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    assert all(float(s["step"]) == len(data) for s in opt.state.values())
    x = data[0][0]
    model.eval()  # no dropout: the forwards compare
    with torch.no_grad():
        fp8_logits = model(input_ids=x).logits
    model, _ = fp8amp.unconvert(model, opt)
    model.save_pretrained(tmp_path)
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        logits = loaded(input_ids=x).logits
    assert torch.equal(logits, model(input_ids=x).logits)
    assert (fp8_logits - logits).norm() < 0.1 * logits.norm()


def test_fp8_conv1d_matches_conv1d_and_shares_its_parameters():
    torch.manual_seed(0)
    conv = transformers.pytorch_utils.Conv1D(96, 32)
    torch.nn.init.normal_(conv.bias)
    seen = []
    parent = torch.nn.Sequential(conv)
    fp8amp.convert(parent, policy="all", module_filter_fn=lambda m, name: seen.append(type(m)) or True)
    assert seen == [transformers.pytorch_utils.Conv1D]  # the filter sees the real module
    layer = parent[0]
    assert isinstance(layer, fp8amp.Fp8Conv1D) and layer.weight is conv.weight and layer.bias is conv.bias
    x = torch.randn(5, 7, 32, requires_grad=True)  # 35 rows: padded inside
    expected = conv(x)
    (expected * expected).sum().backward()
    grads = conv.weight.grad.clone(), x.grad.clone()
    conv.weight.grad = conv.bias.grad = x.grad = None
    got = layer(x)
    (got * got).sum().backward()
    # E4M3 inputs and weights, E5M2 output gradients: errors of a few 2^-4 relative at most
    assert (got - expected).norm() < 2.0 ** -5 * expected.norm()
    for fp8_grad, grad in zip((conv.weight.grad, x.grad), grads):
        assert fp8_grad.shape == grad.shape and (fp8_grad - grad).norm() < 2.0 ** -3 * grad.norm()
