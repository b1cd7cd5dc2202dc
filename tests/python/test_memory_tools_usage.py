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
import torch.nn.functional as F
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
    names = dict(model.named_parameters())
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


class _Rotary(nn.Module):
    """A Linear whose output is rotated by angles made from positions and a buffer (no gradient)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.register_buffer("freq", torch.rand(64))

    def forward(self, x, pos):
        angle = pos[:, None] * self.freq
        h = self.fc(x)
        return h * angle.cos() + h.flip(-1) * angle.sin()


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_compiled_graph_at_o1_o2_keeps_inputs_that_get_no_gradient(level):
    # At O1/O2 a master is several graph inputs (its codes, scales, E4M3 copy) and its gradient
    # fewer backward outputs, so the inputs and gradients were not paired: every graph input was
    # taken for one that gets a gradient and stored in FP8, the positions too (100.0 + 7.3 i
    # rounded to 3 mantissa bits), and the compiled gradients were 100 % off the eager ones.
    torch.manual_seed(0)
    base = _Rotary()
    x, pos = torch.randn(32, 64), torch.arange(32.0) * 7.3 + 100
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = _converted(copy.deepcopy(base), level)
        xi = x.clone().requires_grad_()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        with fp8amp.save_activations_in_fp8(min_numel=1):
            y = run(xi, pos)
        y.square().sum().backward()
        grads.append((xi.grad, _real(model.fc.weight.grad), model.fc.bias.grad))
    for eager, compiled in zip(*grads):
        assert _rel(compiled, eager) < 0.02


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_compiled_hf_llama_at_o2_with_fp8_activations(gradient_checkpointing):
    # The rotary angles (from positions and a buffer) were stored in FP8 in the compiled O2 graph
    # (without checkpointing): q_proj's weight gradient was 0.26 off plain torch's (eager: 0.15).
    pytest.importorskip("transformers")
    from hf_models import tiny_llama

    torch._dynamo.reset()
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2", policy="all")
    if gradient_checkpointing:
        for m in (ref, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(3)
    x, y = torch.randint(0, 256, (2, 48)), torch.randint(0, 256, (2, 48))
    F.cross_entropy(ref(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()
    with fp8amp.save_activations_in_fp8(min_numel=1):
        loss = F.cross_entropy(torch.compile(model, backend="aot_eager")(input_ids=x).logits.flatten(0, 1), y.flatten())
    loss.backward()
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert _rel(grads[name].grad, p.grad) < 0.2, name


class _OffloadById:
    """An offloading pair as torchtune's OffloadActivations makes it: pack returns an id."""

    def __init__(self):
        self.stored, self.packed = {}, 0

    def pack(self, t):
        self.packed += 1
        self.stored[self.packed] = t
        return self.packed

    def unpack(self, key):
        return self.stored.pop(key)


@pytest.mark.parametrize("level", ["fp8", "O2"])
@pytest.mark.parametrize("wrapper", ["checkpoint_wrapper", "reentrant_wrapper", "offload_wrapper", "offload_by_id"])
def test_checkpoint_and_offload_wrappers_with_fp8_activations(level, wrapper):
    # Checked and kept working: torch.distributed's wrappers and a user's offloading hooks inside
    # save_activations_in_fp8 (the innermost hooks take the saves, as in torch; nothing is left).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, checkpoint_wrapper,
                                                                             offload_wrapper)

    torch.manual_seed(0)
    ref = Net()
    model = _converted(copy.deepcopy(ref), level)
    hooks = _OffloadById()
    for net in (ref, model):
        for i, block in enumerate(net.blocks):
            if wrapper == "offload_wrapper":
                net.blocks[i] = offload_wrapper(block)
            elif wrapper != "offload_by_id":
                impl = CheckpointImpl.REENTRANT if wrapper == "reentrant_wrapper" else CheckpointImpl.NO_REENTRANT
                net.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=impl)
    x = torch.randn(4, 32, 64)
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x_ref).square().mean().backward()
    with fp8amp.save_activations_in_fp8(min_numel=1):
        if wrapper == "offload_by_id":
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                loss = model(x_fp8).square().mean()
        else:
            loss = model(x_fp8).square().mean()
    loss.backward()
    _grads_match_plain(ref, model, x_ref, x_fp8)
    assert hooks.stored == {} and (hooks.packed > 0) == (wrapper == "offload_by_id")


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_activation_memory_budget_recomputes_fp8amp_ops_as_eager_computes_them(level):
    # Checked and kept working: under a budget of 0 (the partitioner recomputes what it can in the
    # compiled backward) the gradients and scaling buffers are eager's bit for bit.
    torch.manual_seed(0)
    eager = _converted(Net(), level)
    model = copy.deepcopy(eager)
    x = torch.randn(4, 32, 64)
    eager(x.clone().requires_grad_()).square().mean().backward()
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=0.0):
        torch.compile(model, backend="aot_eager")(x.clone().requires_grad_()).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(_real(p.grad), _real(q.grad)), name
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        assert torch.equal(b, c), name
