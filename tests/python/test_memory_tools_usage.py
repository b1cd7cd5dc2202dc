"""PyTorch's memory-saving tools combined with fp8amp, as users combine them (2026-12-07): selective
activation checkpointing with a policy that saves fp8amp's ops, torch.compile with FP8 saved
activations at O1/O2, users' offloading saved-tensor hooks, torch.distributed's checkpoint
wrappers and activation_memory_budget. Each is compared against the same model without fp8amp
(FP8 tolerances) or against fp8amp's own eager run."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fp8amp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    def __init__(self, d: int = 64, h: int = 128):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, wrap=None):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(64, 32)
        self.wrap = wrap

    def forward(self, x):
        for block in self.blocks:
            x = self.wrap(block, x) if self.wrap else block(x)
        return self.head(x)


def _converted(model, level, recipe=None):
    if level == "fp8":
        return fp8amp.convert(model, recipe=recipe)
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), level, recipe=recipe)[0]


def _real(t):
    return t.dequantize(torch.float32) if hasattr(t, "dequantize") and not type(t) is torch.Tensor else t.float()


def _rel(a, b):
    a, b = _real(a), _real(b)
    return ((a - b).norm() / b.norm()).item()


def _grads_match_plain(ref, model, x_ref, x, tol=0.15):
    names = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        assert (names[name].grad is None) == (p.grad is None), name
        assert names[name].grad.shape == p.grad.shape, name
        assert _rel(names[name].grad, p.grad) < tol, name
    assert x.grad.dtype == x_ref.grad.dtype and x.grad.shape == x_ref.grad.shape
    assert _rel(x.grad, x_ref.grad) < tol


def _save_fp8amp_ops(ctx, op, *args, **kwargs):
    """A selective-checkpointing policy that keeps the outputs of fp8amp's ops (its casts and GEMMs)."""
    return CheckpointPolicy.MUST_SAVE if op.namespace == "fp8amp" else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_selective_checkpointing_that_saves_fp8amp_ops(level, recipe):
    # rowwise's GEMM added its float32 bias in place to the output that the policy had cached:
    # torch's "Tensor cached during selective activation checkpoint has been mutated" in backward.
    torch.manual_seed(0)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_fp8amp_ops)
    ref = Net(functools.partial(checkpoint, use_reentrant=False, context_fn=context_fn))
    model = _converted(copy.deepcopy(ref), level, recipe)
    x = torch.randn(4, 32, 64)
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x_ref).square().mean().backward()
    model(x_fp8).square().mean().backward()
    _grads_match_plain(ref, model, x_ref, x_fp8)
