"""fp8amp.save_activations_in_fp8 as users combine it with the rest of PyTorch: the process-wide
state it sets (torch's saved-tensor hook filtering mode) is restored however the contexts are
entered and left (a refused entry, one object entered twice, out of order, from threads)."""

from __future__ import annotations

import threading

import pytest
import torch

import fp8amp
from fp8amp import saved_activations

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
