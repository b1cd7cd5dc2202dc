"""Hugging Face transformers models used as their users use them, after fp8amp.initialize (CPU, FP8
emulation, tiny models built from configs): generate() in its modes, gradient checkpointing,
resize_token_embeddings, bfloat16 models, the Trainer's resume from its own checkpoints, and
save_pretrained of a converted model. test_integration_transformers.py covers the basic recipes."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import fp8amp
from fp8amp.testing import batches, load_text_bytes

transformers = pytest.importorskip("transformers")

SEQ = 32


def tiny_llama(seed: int = 0, **config):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      **config)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def data():
    return list(itertools.islice(batches(load_text_bytes(max_bytes=1 << 16), 4, SEQ), 8))


def o2(model, lr=3e-3):
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), "O2", policy="all")


def step(model, opt, x, y) -> float:
    loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


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
