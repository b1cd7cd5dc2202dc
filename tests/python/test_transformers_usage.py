"""Hugging Face transformers models used as their users use them, after fp8amp.initialize (CPU, FP8
emulation, tiny models built from configs): generate() in its modes, gradient checkpointing,
resize_token_embeddings, bfloat16 models, the Trainer's resume from its own checkpoints,
save_pretrained of a converted model, an encoder-decoder, PEFT LoRA and accelerate's offloading.
test_integration_transformers.py covers the basic recipes."""

import copy
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
    return list(itertools.islice(batches(load_text_bytes(max_bytes=1 << 16), 4, SEQ), 8))


def test_resize_token_embeddings_of_a_tied_head(data):
    """A tied output head stays an Fp8Linear over the embedding's plain weight: resizing the
    vocabulary after initialize resizes it too. To a multiple of 16 it trains; to another size
    (one added pad token) the forward says what changed and what to do, where the GEMM named its
    operand N."""
    model, opt = o2(tiny_llama(tie_word_embeddings=True))
    assert isinstance(model.lm_head, fp8amp.Fp8Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    model.resize_token_embeddings(257, mean_resizing=False)
    with pytest.raises(RuntimeError, match=r"(?s)out_features 257.*pad_to_multiple_of=16.*unconvert"):
        model(input_ids=data[0][0])

    model, opt = o2(tiny_llama(tie_word_embeddings=True))
    model.resize_token_embeddings(257, pad_to_multiple_of=16, mean_resizing=False)
    assert model.lm_head.weight.shape == (272, 64) and model.lm_head.weight is model.model.embed_tokens.weight
    losses = [step(model, opt, x, y) for x, y in data]
    assert model(input_ids=data[0][0]).logits.shape[-1] == 272
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def real(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, fp8amp.ScaledTensor) else tensor.detach()


def test_generate_after_training_in_every_mode(data):
    """Greedy, sampling and beam search, with and without the KV cache, batch 1 with an odd prompt
    and a left-padded batch, under no_grad and inference_mode: shapes as asked, greedy tokens as the
    unconverted model's, no scaling buffer touched, and training goes on afterwards."""
    model, opt = o2(tiny_llama())
    for x, y in data[:4]:
        step(model, opt, x, y)
    model.eval()
    reference = copy.deepcopy(model)
    fp8amp.unconvert(reference)  # (a copy no optimizer holds: unconvert does not warn)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    prompt = data[5][0][:1, :7]
    padded = data[5][0][:3, :5]
    mask = torch.ones_like(padded)
    mask[0, :2] = 0
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            for options in ({"do_sample": False}, {"do_sample": False, "use_cache": False},
                            {"do_sample": True, "top_k": 5}, {"num_beams": 3}):
                out = model.generate(prompt, max_new_tokens=5, pad_token_id=0, **options)
                assert out.shape == (1, 12) and torch.equal(out[:, :7], prompt)
            out = model.generate(padded, attention_mask=mask, max_new_tokens=4, pad_token_id=0, do_sample=False)
            assert out.shape == (3, 9)
            greedy = model.generate(prompt, max_new_tokens=8, pad_token_id=0, do_sample=False)
            assert torch.equal(greedy, model.generate(prompt, max_new_tokens=8, pad_token_id=0, do_sample=False,
                                                      use_cache=False))
            assert torch.equal(greedy, reference.generate(prompt, max_new_tokens=8, pad_token_id=0, do_sample=False))
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())  # eval records no amax
    model.train()
    losses = [step(model, opt, x, y) for x, y in data[4:]]
    assert all(0 < loss < 6 for loss in losses), losses


def test_gradient_checkpointing_trains_bit_for_bit(data):
    """The recomputed forward casts with the same scales and records the same amaxes: with and
    without checkpointing (reentrant or not, activations offloaded or not), the losses, masters and
    scaling buffers are equal."""
    runs = []
    for options in (None, {"use_reentrant": False}, {"use_reentrant": True}, {"offload": True}):
        model, opt = o2(tiny_llama())
        if options is not None:
            offload = options.pop("offload", False)
            if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=options or None, offload=offload)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options or None)
        model.train()
        losses = [step(model, opt, x, y) for x, y in data[:4]]
        runs.append((losses, [real(t) for t in itertools.chain(model.parameters(), model.buffers())]))
    for losses, tensors in runs[1:]:
        assert losses == runs[0][0]
        assert all(torch.equal(a, b) for a, b in zip(tensors, runs[0][1]))


def test_bfloat16_model_trains_generates_and_saves_converted(tmp_path, data):
    """A model built in bfloat16: O2 within bf16 rounding of the plain bf16 model's losses; generate
    under inference_mode; save_pretrained of the converted model (not unconverted) loads into a plain
    model with only the scaling buffers unexpected, equal to fp8amp.unconvert's weights."""
    torch.manual_seed(0)
    config = tiny_llama().config
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    model, opt = o2(model)
    assert model.dtype == torch.bfloat16 and model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    losses = [step(model, opt, x, y) for x, y in data[:4]]
    expected = [step(reference, ref_opt, x, y) for x, y in data[:4]]
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, expected)), (losses, expected)
    model.eval()
    with torch.inference_mode():
        out = model.generate(data[0][0][:1, :5], max_new_tokens=4, pad_token_id=0, num_beams=2)
    assert out.shape == (1, 9)

    model.save_pretrained(tmp_path)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all("_scaling." in key for key in info["unexpected_keys"])
    assert loaded.dtype == torch.bfloat16
    with pytest.warns(UserWarning, match="unconvert"):
        fp8amp.unconvert(model)
    loaded_params = dict(loaded.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(loaded_params[name], param), name


def test_trainer_resumes_from_its_checkpoint_bit_for_bit(tmp_path, data):
    """The Trainer's own checkpoint (model.safetensors with the scaling buffers, optimizer.pt with
    the O2 states) of an fp8amp model, with gradient accumulation and clipping, and the Trainer's
    optimizer made fp8amp's by create_optimizer: resume_from_checkpoint ends where the straight run
    ends, bit for bit."""
    windows = [{"input_ids": x[i], "labels": x[i]} for x, _ in data for i in range(len(x))]

    class Fp8Trainer(transformers.Trainer):
        def create_optimizer(self, model=None):
            super().create_optimizer()
            self.optimizer = fp8amp.initialize_optimizer(self.model, self.optimizer, "O2")
            return self.optimizer

    def trainer(out, save):
        model, _ = fp8amp.initialize(tiny_llama(), None, "O2", policy="all")
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_grad_norm=0.5, learning_rate=3e-3, weight_decay=0.1, report_to=[], use_cpu=True, disable_tqdm=True,
            save_strategy="steps" if save else "no", save_steps=2, seed=0)
        return model, Fp8Trainer(model=model, args=args, train_dataset=windows)

    model, straight = trainer(tmp_path / "straight", save=True)
    straight.train()
    resumed_model, resumed = trainer(tmp_path / "resumed", save=False)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    optimizer = getattr(resumed.optimizer, "optimizer", resumed.optimizer)
    assert isinstance(optimizer, fp8amp.optim.AdamW) and float(next(iter(optimizer.state.values()))["step"]) == 4
    expected, got = model.state_dict(), resumed_model.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_t5_with_padding_and_ignored_labels_trains_and_generates(data):
    """An encoder-decoder (T5: the output head tied to the shared embedding, every projection an
    Fp8Linear) on padded inputs with labels of -100: losses within FP8 rounding of the plain model's;
    greedy generation equals the unconverted model's, beam search runs under inference_mode."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    model, opt = o2(model)
    report = fp8amp.conversion_report(model)
    assert len(report.converted) == 33 and not report.skipped
    for x, y in data[:3]:
        mask = torch.ones_like(x)
        mask[0, 25:] = 0
        labels = y.clone()
        labels[:, 28:] = -100
        losses = []
        for m, o in ((model, opt), (reference, ref_opt)):
            loss = m(input_ids=x, attention_mask=mask, labels=labels).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 0.03 * losses[1], losses
    model.eval()
    plain = copy.deepcopy(model)
    fp8amp.unconvert(plain)
    source = data[5][0][:2, :9]
    with torch.no_grad():
        greedy = model.generate(source, max_new_tokens=6, do_sample=False)
        assert torch.equal(greedy, plain.generate(source, max_new_tokens=6, do_sample=False))
    with torch.inference_mode():
        assert model.generate(source, max_new_tokens=6, num_beams=3).shape == greedy.shape


def test_lora_over_a_converted_model(data):
    """PEFT LoRA adapters over an O2 model (get_peft_model, then initialize with the adapters'
    optimizer): the frozen base projections are Fp8Linear with FP16 masters; the adapters train as
    they do on the plain model; merge writes base + delta into the master (within FP16 rounding)
    and unmerge takes it back out."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    models = []
    for convert in (False, True):
        torch.manual_seed(5)
        model = peft.get_peft_model(tiny_llama(), config)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        if convert:
            model, opt = fp8amp.initialize(model, opt, "O2", policy="all")
        models.append((model, [step(model, opt, x, y) for x, y in data[:4]]))
    (reference, expected), (model, losses) = models
    assert all(abs(a - b) < 0.02 * b for a, b in zip(losses, expected)), (losses, expected)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    base = q_proj.base_layer
    assert isinstance(base, fp8amp.Fp8Linear) and isinstance(base.weight, fp8amp.MasterWeight)
    assert not base.weight.requires_grad and base.weight.grad is None
    before = real(base.weight).clone()
    delta = q_proj.get_delta_weight("default").detach()
    q_proj.merge()
    assert isinstance(base.weight, fp8amp.MasterWeight)
    assert (real(base.weight) - (before + delta)).norm() < 2.0 ** -10 * (before + delta).norm()
    x = torch.randn(16, 64)
    with torch.no_grad():  # the forward reads the merged master's E4M3 copy
        assert (base(x) - x @ real(base.weight).t()).norm() < 0.1 * (x @ real(base.weight).t()).norm()
    q_proj.unmerge()
    assert (real(base.weight) - before).norm() < 2.0 ** -9 * before.norm()


def test_accelerate_offload_of_a_converted_model(tmp_path, data):
    """accelerate's big-model offloading (cpu_offload, disk_offload: dispatch_model's hooks) keeps the
    weights off the module and rebuilds each parameter in its class for the forward, as
    ``type(param)(tensor, requires_grad=...)``. An O2 master is rebuilt from its saved real values:
    the logits are those of the model before offloading, bit for bit."""
    accelerate = pytest.importorskip("accelerate")
    for offload in ("cpu", "disk"):
        model, opt = o2(tiny_llama())
        for x, y in data[:2]:
            step(model, opt, x, y)
        model.eval()
        x = data[0][0]
        with torch.no_grad():
            expected = model(input_ids=x).logits
        if offload == "cpu":
            accelerate.cpu_offload(model, execution_device="cpu")
        else:
            accelerate.disk_offload(model, str(tmp_path), execution_device="cpu")
        weight = model.model.layers[0].mlp.up_proj.weight
        assert isinstance(weight, fp8amp.MasterWeight) and weight.is_meta
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, expected), offload


def test_the_trainers_own_optimizer_over_a_converted_model_is_warned_about(tmp_path, data):
    """Without the create_optimizer of the test above, the Trainer steps a plain torch AdamW over
    the masters: it trains, but nothing updates the FP8 scaling, which is warned."""
    windows = [{"input_ids": x[i], "labels": x[i]} for x, _ in data for i in range(len(x))]
    model, _ = fp8amp.initialize(tiny_llama(), None, "O2", policy="all")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                          report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    with pytest.warns(UserWarning, match=r"nothing updated the model's FP8 scaling.*initialize_optimizer"):
        transformers.Trainer(model=model, args=args, train_dataset=windows).train()
