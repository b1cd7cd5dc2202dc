"""Gradient accumulation into FP8 weight gradients (O1/O2): each micro-batch's gradient is added into
``param.grad`` and the sum rounded to E4M3, so many micro-batches lose the later ones; fp8amp warns
at LONG_ACCUMULATION of them, naming weight_grad="fp32" (docs/o1_o2.md#limits-today)."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fp8amp
from fp8amp.accumulation import LONG_ACCUMULATION


def converted_pair(weight_grad="fp8", recipe=None, width=64):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
    model = copy.deepcopy(plain)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = fp8amp.initialize(model, optimizer, "O2", policy="all", weight_grad=weight_grad, recipe=recipe)
    return model, plain


def accumulate(model, plain, micro_batches, width=64):
    """The same batch ``micro_batches`` times (gradients of one direction, as in a run whose
    micro-batches agree), each loss divided by the count; the first Linear's relative error."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, width, generator=gen), torch.randn(32, width, generator=gen)
    for _ in range(micro_batches):
        ((model(x) - y).square().mean() / micro_batches).backward()
        ((plain(x) - y).square().mean() / micro_batches).backward()
    grad = model[0].weight.grad
    grad = grad.dequantize(torch.float32) if isinstance(grad, (fp8amp.ScaledTensor, fp8amp.BlockScaledTensor)) \
        else grad.float()
    return ((grad - plain[0].weight.grad).norm() / plain[0].weight.grad.norm()).item()


def test_many_micro_batches_lose_precision_in_fp8_and_not_in_fp32_weight_grads():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp8 = {k: accumulate(*converted_pair(), k) for k in (1, 4, 64)}
        fp32 = {k: accumulate(*converted_pair("fp32"), k) for k in (1, 64)}
    assert fp8[4] == pytest.approx(fp8[1], rel=1e-6)  # sums of equal halves are exact in FP8
    assert fp8[64] > 3 * fp8[1], fp8  # the running sum's rounding swamps the later micro-batches
    assert fp32[64] <= 1.01 * fp32[1], fp32  # plain gradients sum them in float32


def test_the_warning_comes_at_its_micro_batch_and_zeroing_restarts_the_count():
    model, plain = converted_pair()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accumulate(model, plain, LONG_ACCUMULATION - 1)
        assert not [w for w in caught if "micro-batches" in str(w.message)]
        model.zero_grad(set_to_none=False)  # zero_: the count starts again
        accumulate(model, plain, LONG_ACCUMULATION - 1)
        assert not [w for w in caught if "micro-batches" in str(w.message)]
        accumulate(model, plain, 1)  # one more into the same gradients: LONG_ACCUMULATION summed
    messages = [str(w.message) for w in caught if "micro-batches" in str(w.message)]
    assert messages and f"summed {LONG_ACCUMULATION} micro-batches" in messages[0]
    assert "weight_grad='fp32'" in messages[0]


@pytest.mark.parametrize("weight_grad,recipe,warns", [("fp32", None, False), ("fp8", "blockwise", True)])
def test_plain_weight_grads_do_not_warn_and_block_scaled_ones_do(weight_grad, recipe, warns):
    model, plain = converted_pair(weight_grad, recipe, width=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accumulate(model, plain, LONG_ACCUMULATION, width=128)
    assert bool([w for w in caught if "micro-batches" in str(w.message)]) == warns
