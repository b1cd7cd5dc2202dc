"""fp8amp.save_activations_in_fp8 as users combine it with the rest of PyTorch: the state it sets
(torch's saved-tensor hook filtering mode) is restored however the contexts are entered and left (a
refused entry, one object entered twice, out of order, from threads); compiled graphs keep what
does not require grad (an attention mask, rotary angles) as eager does."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8amp
from fp8amp import E4M3, saved_activations
from saved_activations_reference import SQNR_FLOOR_DB, held_for_backward, sqnr_db

needs_graph_hooks = pytest.mark.skipif(
    not saved_activations._graph_hooks_supported(), reason="this torch cannot inline saved-tensor hooks")


def filtering_mode() -> str:
    return torch._functorch.config.saved_tensors_hooks_filtering_mode


@needs_graph_hooks
def test_an_entry_torch_refuses_leaves_the_filtering_mode_as_it_was():
    """Under disable_saved_tensors_hooks (torch.func's transforms enter it), torch refuses the hooks:
    the context's entry raises torch's error and changes nothing."""
    mode = filtering_mode()
    with torch.autograd.graph.disable_saved_tensors_hooks("hooks are off here"):
        with pytest.raises(RuntimeError, match="hooks are off here"):
            with fp8amp.save_activations_in_fp8():
                pass
    assert filtering_mode() == mode
    assert not getattr(saved_activations._active, "stack", [])


@needs_graph_hooks
def test_one_context_entered_twice_restores_the_filtering_mode():
    mode = filtering_mode()
    ctx = fp8amp.save_activations_in_fp8()
    with ctx:
        with ctx:
            assert filtering_mode() == "no_static"
        assert filtering_mode() == "no_static"
    assert filtering_mode() == mode


@needs_graph_hooks
def test_contexts_exited_out_of_order_restore_the_filtering_mode():
    mode = filtering_mode()
    first, second = fp8amp.save_activations_in_fp8(), fp8amp.save_activations_in_fp8(min_numel=1)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert filtering_mode() == "no_static"  # second is still entered
    second.__exit__(None, None, None)
    assert filtering_mode() == mode


def config_is_per_thread() -> bool:
    """Whether torch keeps its config overrides per thread (torch 2.12 and later)."""
    seen = []
    with torch._functorch.config.patch(saved_tensors_hooks_filtering_mode="all"):
        thread = threading.Thread(target=lambda: seen.append(filtering_mode()))
        thread.start()
        thread.join()
    return seen != ["all"]


@needs_graph_hooks
@pytest.mark.skipif(not config_is_per_thread(), reason="this torch's config is one for all threads")
def test_one_context_shared_by_threads_sets_the_filtering_mode_of_each():
    """One context object entered by two threads at once (as a module that enters it in its forward,
    under nn.DataParallel's replica threads): each thread's mode is set inside and restored after."""
    mode = filtering_mode()
    ctx = fp8amp.save_activations_in_fp8(min_numel=1)
    x = torch.randn(64, 64, requires_grad=True)
    both_inside = threading.Barrier(2)
    seen, errors = [], []

    def forward():
        try:
            with ctx:
                (x * 2).sin().sum().backward()
                both_inside.wait()
                seen.append(filtering_mode())
            seen.append(filtering_mode())
        except Exception as error:  # a thread's exception would not fail the test by itself
            errors.append(error)

    threads = [threading.Thread(target=forward) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(seen) == sorted(["no_static"] * 2 + [mode] * 2)
    assert filtering_mode() == mode


# ------------------------------------------------------------------------------------------ torch.compile


class RotaryAttention(nn.Module):
    """Attention with rotary embeddings and, with ``additive_mask``, the -inf causal mask that Hugging
    Face models build under torch.compile (eagerly they pass is_causal): both made from positions and a
    buffer, so they do not require grad."""

    def __init__(self, additive_mask: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.additive_mask = additive_mask
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16), persistent=False)

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(t.shape[-2], dtype=torch.float32)[:, None] * self.inv_freq
        angles = torch.cat([angles, angles], -1)  # up to 255 rad: a 2^-4 rounding is a phase error
        t1, t2 = t.chunk(2, -1)
        return t * angles.cos() + torch.cat([-t2, t1], -1) * angles.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 16).permute(2, 0, 3, 1, 4)
        q, k = self.rotate(q), self.rotate(k)
        if not self.additive_mask:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = torch.zeros(s, s).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@needs_graph_hooks
@pytest.mark.parametrize("additive_mask", [True, False], ids=["mask", "rotary"])
def test_compiled_graph_keeps_what_does_not_require_grad(additive_mask):
    """The mask came back all NaN (NaN gradients), the angles rounded (18 dB): both kept now, as eagerly;
    q, k, v and the output are still stored."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RotaryAttention(additive_mask)
    x = torch.randn(2, 256, 32)
    weights = torch.randn(2, 2, 256, 16)

    def grad(forward, ctx=None):
        model.zero_grad()
        with ctx or contextlib.nullcontext():
            out = forward(x)
        held = held_for_backward(out)
        (out * weights).sum().backward()
        return model.qkv.weight.grad.clone(), held

    reference, _ = grad(model)
    g, held = grad(torch.compile(model, backend="aot_eager"), fp8amp.save_activations_in_fp8(min_numel=1))
    assert torch.float8_e4m3fn in held
    assert sqnr_db(g, reference) > SQNR_FLOOR_DB[E4M3]
