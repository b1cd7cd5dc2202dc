"""Shared by the saved-activation tests (test_saved_activations.py and
test_saved_activations_compile.py): the SQNR measure and its floors, a mid-model activation, the
unpack hook as the backward calls it, a small GPT's gradients, and the bytes an autograd node
holds for its backward.

SQNR floors, as in test_linear.py: a stored value carries the relative rounding of its format,
an SQNR of 4.77 + 6.02 (m + 1) dB with m mantissa bits (28.8 dB for E4M3, 22.8 dB for E5M2); the
floors sit 3 dB under that, for the spread of random data: 25.8 and 19.8 dB. The GPT block's
gradients measured 32.8 / 26.3 dB at worst (qkv.weight); storing the statistics too (LayerNorm's
mean and rstd, SDPA's logsumexp, log_softmax's output) measured 22.7 / 17.4 dB, under the floors.
"""

from __future__ import annotations

import math

import torch

from fp8amp import E4M3, E5M2
from fp8amp.testing import GPT, GPTConfig

SQNR_FLOOR_DB = {E4M3: 25.8, E5M2: 19.8}
FORMATS = [E4M3, E5M2]


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    actual, reference = actual.detach().double(), reference.detach().double()
    noise = (actual - reference).pow(2).sum()
    return math.inf if noise == 0 else 10 * math.log10(reference.pow(2).sum() / noise)


def activation(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """A tensor as an op in the middle of a model sees it: not a leaf, requires grad."""
    g = torch.Generator().manual_seed(seed)
    leaf = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    return leaf * 1


def unpack(ctx, packed: object) -> torch.Tensor:
    """The unpack hook as the backward calls it: with grad mode off (on, it means double backward)."""
    with torch.no_grad():
        return ctx.unpack_hook(packed)


def gpt_block_grads(ctx=None, n_layer=1, seed=0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=64, n_layer=n_layer, n_head=4, d_model=128))
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(seed))
    if ctx is None:
        _, loss = model(idx, idx)
    else:
        with ctx:
            _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def held_for_backward(output: torch.Tensor) -> dict[torch.dtype, int]:
    """Bytes the autograd node that made ``output`` holds for its backward, by dtype: for the output
    of a compiled graph, all that the graph saved (FP8 codes where the context stored activations);
    nothing for an eager op's node."""
    held: dict[torch.dtype, int] = {}
    with torch.no_grad():  # reading saved tensors unpacks them, as the backward does
        saved = getattr(output.grad_fn, "saved_tensors", ())  # eager nodes: not seen
    for t in saved:
        held[t.dtype] = held.get(t.dtype, 0) + t.numel() * t.element_size()
    return held
