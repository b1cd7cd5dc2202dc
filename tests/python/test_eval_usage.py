"""Evaluation, generation and serving of converted models as users run them (2026-12-07), at FP8
compute, O1 and O2 and the tensorwise / rowwise / blockwise recipes: eval forwards between training
steps, batch sizes and sequence lengths that change every call, serving dtypes, state dicts loaded
into fresh converted models, models built or copied under ``torch.inference_mode()`` and Hugging
Face ``generate()``. Compared with the same run without the evaluation (bit for bit) or with the
same model dequantized (``fp8amp.unconvert`` of a deep copy; FP8 tolerances)."""

import copy
import io

import pytest
import torch
from torch import nn

import fp8amp

LEVELS = ("fp8", "O1", "O2")
RECIPES = ("tensorwise", "rowwise", "blockwise")
D = 128  # blockwise's multiple


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * D, D))


def _convert(model, level, recipe, optimizer=None):
    if level == "fp8":
        return fp8amp.convert(model, recipe=recipe, optimizer=optimizer, policy="all"), optimizer
    return fp8amp.initialize(model, optimizer, level, recipe=recipe, policy="all")


def _setup(level, recipe, seed=0):
    model = _model(seed)
    return _convert(model, level, recipe, torch.optim.AdamW(model.parameters(), lr=1e-3))


def _train(model, optimizer, steps=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        model(torch.randn(32, D, generator=gen)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _state(model):
    return {k: v.dequantize() if isinstance(v, fp8amp.ScaledTensor) else v.clone()
            for k, v in model.state_dict().items()}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _trained(level, recipe):
    model, optimizer = _setup(level, recipe)
    _train(model, optimizer)
    return model.eval(), optimizer


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_eval_between_steps_leaves_training_bit_for_bit(level, recipe):
    """Validation forwards (no_grad and inference_mode, batch sizes 1, 7, 16, 33, sequence length 13)
    between steps with dropout on: the weights and scaling buffers after the next step are those of
    the run without them."""
    runs = []
    for evaluate in (True, False):
        model, optimizer = _setup(level, recipe)
        gen = torch.Generator().manual_seed(1)
        torch.manual_seed(2)
        for step in range(3):
            _train(model, optimizer, 1, seed=step)
            if evaluate:
                model.eval()
                for context in (torch.no_grad, torch.inference_mode):
                    with context():
                        for shape in ((1, D), (7, D), (16, D), (33, D), (2, 13, D)):
                            assert torch.isfinite(model(torch.randn(*shape, generator=gen))).all()
        _train(model, optimizer, 1, seed=9)
        runs.append(_state(model))
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_eval_forwards_leave_every_scaling_buffer(level, recipe):
    """docs/numerics.md: only training forwards write the history. The weight's current-scaling
    cast (FP8 compute, and masters without an E4M3 copy: GPT-2's Fp8Conv1D, a margin) wrote its
    amax into column 0 of the weight's history in eval too, so a checkpoint saved after validation
    differed from one saved without it."""
    model, _ = _trained(level, recipe)
    before = {name: b.clone() for name, b in model.named_buffers()}
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            model(torch.randn(7, D))
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_a_state_dict_served_by_a_fresh_converted_model(level, recipe):
    """torch.save of the trained model's state dict, loaded into a fresh converted model in eval,
    gives its outputs bit for bit; a plain model loading it (strict=False) is within FP8 distance."""
    model, _ = _trained(level, recipe)
    x = torch.randn(3, 13, D)
    with torch.no_grad():
        expected = model(x)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    fresh, _ = _convert(_model(seed=7), level, recipe)
    fresh.eval().load_state_dict(saved)
    plain = _model(seed=3).eval()
    plain.load_state_dict(saved, strict=False)
    with torch.no_grad():
        assert torch.equal(fresh(x), expected)
        assert _rel(expected, plain(x)) < 0.1


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_a_model_deep_copied_under_inference_mode_evaluates(level, recipe):
    """A serving copy made inside torch.inference_mode() (its parameters and buffers are inference
    tensors, as torch makes them there), run inside it and then under no_grad (as generate() runs):
    an O1/O2 tensorwise master raised torch's "Inference tensors do not track version counter", and
    at FP8 compute the weight's cast raised "Inplace update to inference tensor outside
    InferenceMode" outside the block, where a copied nn.Linear runs."""
    model, _ = _trained(level, recipe)
    x = torch.randn(5, D)
    with torch.no_grad():
        expected = model(x)
    with torch.inference_mode():
        served = copy.deepcopy(model)
        assert torch.equal(served(x), expected)
    with torch.no_grad():
        assert torch.equal(served(x), expected)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_a_model_built_and_loaded_under_inference_mode_serves(level, recipe):
    """The serving recipe of building the model, converting it and loading the weights inside
    torch.inference_mode(), then running it there and under no_grad."""
    model, _ = _trained(level, recipe)
    saved = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        expected = model(x)
    with torch.inference_mode():
        served, _ = _convert(_model(seed=4), level, recipe)
        served.eval().load_state_dict(saved)
        assert torch.equal(served(x), expected)
    with torch.no_grad():
        assert torch.equal(served(x), expected)


@pytest.mark.parametrize("recipe", RECIPES)
def test_serving_dtypes_at_fp8_compute(recipe):
    """half(), to(bfloat16) and float() after training: outputs in that dtype within FP8 distance of
    the dequantized model in the same dtype, scaling buffers kept in float32 throughout."""
    model, _ = _trained("fp8", recipe)
    reference = fp8amp.unconvert(copy.deepcopy(model))
    x = torch.randn(7, D)
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.float()):
        cast(model)
        cast(reference)
        dtype = model[0].weight.dtype
        with torch.inference_mode():
            got, want = model(x.to(dtype)), reference(x.to(dtype))
        assert got.dtype == want.dtype == dtype and _rel(got, want) < 0.1
        assert all(b.dtype in (torch.float32, torch.int32) for n, b in model.named_buffers() if "scaling" in n)


@pytest.mark.parametrize("level", LEVELS)
def test_generate_of_a_copy_made_under_inference_mode(level):
    """GPT-2 (Fp8Conv1D) after training steps, its serving copy made inside inference_mode:
    generate() (which runs under no_grad) with a left-padded batch and the KV cache gives the trained
    model's tokens; M=1 decode steps, with and without the cache. Both raised before (above)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config)
    model, optimizer = _convert(model, level, "tensorwise", torch.optim.AdamW(model.parameters(), lr=3e-3))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, 256, (4, 17), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    prompt = torch.randint(3, 256, (3, 9), generator=gen)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    options = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(prompt, **options)
    with torch.inference_mode():
        served = copy.deepcopy(model)
    for use_cache in (True, False):
        assert torch.equal(served.generate(prompt, use_cache=use_cache, **options), expected)
    assert served.generate(prompt[1:2], max_new_tokens=5, do_sample=False, pad_token_id=0).shape == (1, 14)
