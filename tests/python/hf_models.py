"""The tiny Hugging Face model and training step the transformers tests share
(test_integration_transformers.py, test_transformers_usage.py): a LlamaForCausalLM built from a
config (nothing downloaded), its O2 initialize and one training step."""

import torch
import torch.nn.functional as F

import fp8amp


def tiny_llama(seed: int = 0, **config):
    import transformers  # the callers skip without it

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      **config)
    return transformers.LlamaForCausalLM(config)


def o2(model, lr=3e-3):
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), "O2", policy="all")


def step(model, opt, x, y) -> float:
    loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()
