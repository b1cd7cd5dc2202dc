"""``save_activations_in_fp8``: the activations autograd saves for backward, stored in FP8 (docs/benchmarks.md#targets).

Fp8Linear already saves its input in FP8, but the non-Linear ops of a transformer save theirs in
the model's dtypes: SDPA keeps q, k, v and its output (BF16 under autocast), GELU its input, the
LayerNorms the fp32 residual stream. On the 1B GPT of ``benchmarks/bench_train.py`` those are most
of the step's peak memory (docs/o1_o2.md, "Memory of a training step"). Inside this context
manager, a pair of ``torch.autograd.graph.saved_tensors_hooks`` stores each such saved tensor as
FP8 codes with a per-tensor current power-of-two scale (:meth:`ScaledTensor.from_tensor`: an
amax pass and a quantize pass, no host sync) and the backward reads it back dequantized to its
original dtype and shape (:func:`fp8amp.ops.dequantize`).

Which saved tensors are stored in FP8 (the rest is saved as autograd would save it):

* plain tensors of float32, bfloat16 or float16 with at least ``min_numel`` elements on the CPU
  or a CUDA device: FP8 and integer tensors (Fp8Linear's own saves, indices), float64,
  ScaledTensors and other subclasses are kept;
* that require grad and are not leaves nor views or dtype casts of leaves: parameters, the model
  inputs and autocast's weight copies are kept (a leaf stays alive anyway, so a copy would add
  memory, and weights reach the backward exact), and so are tensors that do not require grad,
  which is what separates activations from the statistics some ops save beside them (LayerNorm's
  mean and rstd, attention's logsumexp: the backward exponentiates or divides by those, so a
  relative rounding of 2^-4 would be amplified);
* that are not outputs of log_softmax, tanh or sigmoid, for the same reason: their backward
  computes exp(log p), 1 - y² or y (1 - y), which a relative rounding ruins near saturation;
* that are not broadcast (a stride of 0): a copy would materialize the broadcast.

Non-contiguous tensors (SDPA's q, k, v are strided views of one GEMM output) are quantized from
a contiguous copy and come back contiguous, as ``torch.autograd.graph.save_on_cpu`` does: same
values, shape and dtype, row-major strides. A saved tensor holding an inf or NaN comes back all
NaN (E4M3 has no inf, and a saturated code would hand the backward a silent finite value), so
the gradients and the loss scaler see it; an additive -inf attention mask that an op saves is
such a tensor: use ``is_causal`` or a boolean mask where the op keeps it boolean.

Under ``torch.compile``, enter the context outside the compiled code (inside, Dynamo breaks the
graph at it). Compiled graphs save their tensors without running Python hooks, so where torch
supports it (torch 2.11 does; checked at run time, see saved_activations_graph.py) the hooks are
``torch.fx.GraphModule``s that AOTAutograd traces into each compiled forward (quantize after the
save) and backward (dequantize before the use), which Inductor fuses with the code around them.
There the tensors arrive as graph nodes, without grad, so the same rules are applied to the
graph instead: stored are the graph's inputs that get a gradient (each compiled block's input,
the residual stream; parameters and buffers never reach the hook) and its intermediates computed
from those or from parameters (the graph's requires_grad: not an attention mask or rotary angles
made from positions and buffers), except statistics (the non-first outputs of multi-output ops:
LayerNorm's mean and rstd, attention's logsumexp, but not the items of a view op such as unbind's
k and v; rsqrt, reciprocal, max, min, log-sum-exp, var; tensors whose last dimension is 1;
products of statistics and graph inputs: the tiled recipes' O1/O2 weight scales), outputs of exp,
log, tanh, sigmoid and log_softmax, tensors the backward exponentiates (logits kept for a
recomputed log_softmax), dtype casts of graph inputs (autocast's weight copies), tensors that
share memory with the graph's outputs, and broadcasts. A tensor both paths save gets the codes of
the eager path bit for bit, but Inductor's partitioner may save other tensors than eager autograd
does (a LayerNorm's normalized output, a GELU intermediate, recomputing from them), so compiled
gradients agree with eager ones within FP8 rounding, not bit for bit. Where torch lacks that
machinery (or ``compiled_graphs=False``) the hooks are plain functions that see a compiled graph's
saves at run time, its intermediates as tensors that do not require grad: it keeps them, stores
only the graph's inputs that are activations, and warns once.

Limits: double backward (``create_graph=True``) through stored tensors raises; in-place changes
to a saved tensor after its save are not detected (with any saved-tensor hooks), and the backward
uses the values at save time. Entering the context sets torch's
``torch._functorch.config.saved_tensors_hooks_filtering_mode`` to "no_static" until it exits (a
setting of the thread from torch 2.12, of the process before: there, contexts on several threads
at once may restore it while one is still entered), and a graph compiled inside it is compiled
anew outside it (Dynamo guards on the hooks).
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings

import torch

from .formats import E4M3, E5M2, HIGH_PRECISION_DTYPES, check_dtype, type_name
from .saved_activations_graph import (
    _DEVICES,
    _FILTERING_MODE,
    _WHERE,
    _dequantize_in_graph,
    _graph_hook_context_getter,
    _graph_hooks_supported,
    _hook_module,
    _is_broadcast,
    _pack_in_graph,
)
from .scaled_tensor import ScaledTensor

__all__ = ["save_activations_in_fp8", "ACTIVATION_FORMATS"]

#: The accepted ``fmt`` values.
ACTIVATION_FORMATS = (E4M3, E5M2)

# Saved outputs whose backward amplifies a relative rounding (exp(log p), 1 - y², y (1 - y)).
_KEEP_OUTPUTS_OF = frozenset({"LogSoftmaxBackward0", "TanhBackward0", "SigmoidBackward0"})
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
_TO_COPY = "ToCopyBackward0"


class _StoredInFp8:
    """What autograd keeps of one activation stored in FP8: its codes and scale, as a ScaledTensor
    (a class of its own, so that a ScaledTensor the model saves itself is never taken for one)."""

    __slots__ = ("scaled",)

    def __init__(self, scaled: ScaledTensor) -> None:
        self.scaled = scaled


def _is_leaf_derived(x: torch.Tensor) -> bool:
    """Whether x (which has a grad_fn) is a view of a leaf that requires grad (a parameter, an input
    the caller holds) or a dtype cast of one (autocast's BF16 copy of a weight: ToCopyBackward0
    right after the weight's AccumulateGrad). A view whose base has neither grad_fn nor
    requires_grad is the output of an autograd.Function that returned a view of a tensor it made
    (Fp8Linear's reshaped GEMM output): an activation."""
    root = x if x._base is None else x._base
    fn = root.grad_fn
    if fn is None:
        return root.requires_grad
    if fn.name() != _TO_COPY:
        return False
    source = fn.next_functions[0][0]
    return source is not None and source.name() == _ACCUMULATE_GRAD


def _saved_by_compiled_graph() -> bool:
    """Whether the code saving the tensor (the first frame outside the hook's callers) is
    AOTAutograd's runtime (torch._functorch), which saves a compiled graph's tensors. A diagnostic
    for the warning only: if a later torch moves that code, the warning stops, nothing else
    changes."""
    frame = sys._getframe(1)
    while frame is not None and _is_hook_caller(frame.f_globals.get("__name__") or ""):
        frame = frame.f_back
    return frame is not None and (frame.f_globals.get("__name__") or "").startswith("torch._functorch")


# The frames between the code that saves a tensor and the pack hook: this module; where the hook
# is a GraphModule, its generated forward (no __name__) and nn.Module's and fx's call wrappers;
# autograd.Function's apply (torch 2.11 saves a compiled graph's tensors from there).
_HOOK_CALLERS = (__name__, "torch.fx.graph_module", "torch.nn.modules.module", "torch.autograd.function")


def _is_hook_caller(module_name: str) -> bool:
    return not module_name or module_name.startswith(_HOOK_CALLERS)


# ------------------------------------------------------------------------------ eager (hooks in Python)

_active = threading.local()  # the contexts entered on this thread and their filtering-mode patches


def _thread_list(name: str) -> list:
    """This thread's list ``name`` of ``_active`` (``stack``: the contexts entered, innermost last;
    ``filtering_patches``: their filtering-mode patches, innermost last), made on first use."""
    items = getattr(_active, name, None)
    if items is None:
        items = []
        setattr(_active, name, items)
    return items


def _innermost() -> "save_activations_in_fp8 | None":
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def _is_activation(x: torch.Tensor, min_numel: int, ctx: "save_activations_in_fp8 | None") -> bool:
    if (type(x) is not torch.Tensor or x.dtype not in HIGH_PRECISION_DTYPES or x.numel() < min_numel
            or x.layout is not torch.strided or x.device.type not in _DEVICES):
        return False  # parameters (nn.Parameter is a subclass), ScaledTensors, FP8, integers, small
    if x.grad_fn is None:  # a leaf, or no grad: statistics, inputs, a compiled graph's intermediates
        if ctx is not None and not ctx._warned_compiled and _saved_by_compiled_graph():
            ctx._warn_compiled()
        return False
    return x.grad_fn.name() not in _KEEP_OUTPUTS_OF and not _is_leaf_derived(x) and not _is_broadcast(x)


def _pack_eager(x: torch.Tensor, fmt: torch.dtype, min_numel: int) -> object:
    ctx = _innermost()
    if not _is_activation(x, min_numel, ctx):
        return x.detach()  # not x: a saved output would hold its own grad_fn in a cycle
    scaled = ScaledTensor.from_tensor(x.contiguous(), fmt, nan_if_nonfinite=True)
    if ctx is not None:
        ctx.stored_tensors += 1
        ctx.stored_bytes += x.numel() * x.element_size()
        ctx.fp8_bytes += scaled.codes.numel() * scaled.codes.element_size() + scaled.scale_inv.element_size()
    return _StoredInFp8(scaled)


def _unpack_eager(packed: object) -> torch.Tensor:
    if not isinstance(packed, _StoredInFp8):
        return packed
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{_WHERE}: double backward (create_graph=True) through activations stored in FP8 is not "
            "supported; run that forward outside the context")
    return packed.scaled.dequantize()


# ------------------------------------------ GraphModule hooks (their analysis: saved_activations_graph)
#
# The hooks of a context that stores in compiled graphs too. They are here, not in
# saved_activations_graph, because they run the eager hooks above when not traced.

def _pack_saved(x: torch.Tensor, fmt: torch.dtype, min_numel: int) -> object:
    """The pack hook (called through a GraphModule): eager, or traced into a compiled forward."""
    getter = _graph_hook_context_getter()
    state = getter() if getter is not None else None
    if state is None:
        return _pack_eager(x, fmt, min_numel)
    return _pack_in_graph(x, fmt, min_numel, state)


def _unpack_saved(packed: object) -> torch.Tensor:
    """The unpack hook: eager, or traced into a compiled backward (packed: codes, scale_inv, dtype)."""
    if isinstance(packed, tuple):
        return _dequantize_in_graph(*packed)
    return _unpack_eager(packed)


_GRAPH_HOOKS: dict[tuple[torch.dtype, int], tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = {}


def _graph_hooks(fmt: torch.dtype, min_numel: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """One pair per (fmt, min_numel), reused: Dynamo guards on the hooks' identity, so a new pair
    for every context (train_step enters one each step) would recompile every graph each step."""
    key = (fmt, min_numel)
    if key not in _GRAPH_HOOKS:
        _GRAPH_HOOKS[key] = (_hook_module(_pack_saved, fmt, min_numel), _hook_module(_unpack_saved))
    return _GRAPH_HOOKS[key]


class save_activations_in_fp8(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: the activations saved for backward inside it are stored in FP8.

    ``with fp8amp.save_activations_in_fp8(): loss = model(x)``, then ``loss.backward()`` (inside
    or outside). Which saved tensors are stored and the limits: the module's docstring and
    docs/o1_o2.md. Named like ``torch.autograd.graph.save_on_cpu``, which it mirrors.

    Args:
        fmt: ``fp8amp.E4M3`` (default: 3 mantissa bits, a relative rounding of at most 2^-4;
            normal values from 2^-6 to 448 times the scale) or ``fp8amp.E5M2`` (2 bits, 2^-3, but
            normal from 2^-14 to 57344: for tensors whose small values matter far below their amax).
        min_numel: saved tensors with fewer elements are kept as they are (the amax and quantize
            launches cost more than the bytes they save).
        compiled_graphs: also store the activations that ``torch.compile``'d graphs save, by
            having AOTAutograd inline the quantize and dequantize into the compiled forward and
            backward (default True; where torch lacks that, the graphs' intermediates are kept and
            a warning says so). ``False``: plain Python hooks, which see only what a compiled
            graph saves at run time.

    After a ``with`` block, ``stored_tensors`` counts the tensors it stored in FP8 outside
    compiled graphs, ``stored_bytes`` what they held in their own dtypes and ``fp8_bytes`` what
    they hold now (codes and scales); entering again resets them. ``stored_bytes - fp8_bytes`` is
    what the saved tensors stopped holding, not necessarily memory freed (another reference may
    keep one). What compiled graphs store is decided when they are compiled, and not counted.

    Raises:
        TypeError: ``fmt`` is not a torch.dtype, ``min_numel`` not an int, ``compiled_graphs`` not
            a bool.
        ValueError: ``fmt`` is not E4M3 or E5M2, ``min_numel`` is below 1.
        RuntimeError: made inside code torch.compile traces (enter it around the compiled call).
    """

    def __init__(self, fmt: torch.dtype = E4M3, *, min_numel: int = 1 << 16, compiled_graphs: bool = True) -> None:
        if torch.compiler.is_compiling():  # (else Dynamo's error names only the fx internals it cannot trace)
            raise RuntimeError(f"{_WHERE}: enter it outside compiled code: torch.compile does not trace "
                               "saved_tensors_hooks (compiled graphs inside it store their activations in FP8)")
        self.fmt = check_dtype(fmt, ACTIVATION_FORMATS, "fmt", _WHERE)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int):
            raise TypeError(f"{_WHERE}: min_numel must be an int, got {type(min_numel).__name__}")
        if min_numel < 1:
            raise ValueError(f"{_WHERE}: min_numel must be a positive int (1 or more), got {min_numel}")
        self.min_numel = min_numel
        if not isinstance(compiled_graphs, bool):
            raise TypeError(f"{_WHERE}: compiled_graphs must be a bool, got {type_name(compiled_graphs)}")
        #: Whether compiled graphs store their activations too (compiled_graphs and this torch allows).
        self.in_compiled_graphs = compiled_graphs and _graph_hooks_supported()
        self._reset_counts()
        if self.in_compiled_graphs:
            super().__init__(*_graph_hooks(self.fmt, min_numel))
        else:
            super().__init__(functools.partial(_pack_eager, fmt=self.fmt, min_numel=min_numel), _unpack_eager)

    def _reset_counts(self) -> None:
        self.stored_tensors = 0
        self.stored_bytes = 0
        self.fp8_bytes = 0
        self._warned_compiled = False

    def __enter__(self) -> "save_activations_in_fp8":
        self._reset_counts()
        super().__enter__()  # first: where torch refuses the hooks, nothing else has changed
        _thread_list("stack").append(self)
        if self.in_compiled_graphs:
            patch = torch._functorch.config.patch(saved_tensors_hooks_filtering_mode=_FILTERING_MODE)
            patch.__enter__()
            _thread_list("filtering_patches").append(patch)
        return self

    def __exit__(self, *args: object) -> None:
        stack = getattr(_active, "stack", [])
        if stack and stack[-1] is self:
            stack.pop()
        super().__exit__(*args)
        if self.in_compiled_graphs:
            # the innermost patch of this thread, whichever context entered it: each restores the
            # mode it found, so the mode is back where it was once the last context exits (nested,
            # one object re-entered, exited out of order), and torch >= 2.12 keeps it per thread
            _thread_list("filtering_patches").pop().__exit__(None, None, None)

    def _warn_compiled(self) -> None:
        self._warned_compiled = True
        reason = ("compiled_graphs=False" if _graph_hooks_supported()
                  else f"this torch ({torch.__version__}) cannot inline saved-tensor hooks into compiled graphs")
        warnings.warn(
            f"{_WHERE}: a torch.compile'd graph saved tensors for backward; its intermediates reach the "
            "saved-tensor hooks as tensors that do not require grad, which this context cannot tell from "
            "statistics, so it keeps them in their dtype and stores only the graph's inputs that are "
            f"activations in FP8 ({reason}). Run the region eagerly for the full saving (docs/o1_o2.md).")
