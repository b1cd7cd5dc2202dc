"""``save_activations_in_fp8``: the activations autograd saves for backward, stored in FP8 (DESIGN §9).

Fp8Linear already saves its input in FP8, but the non-Linear ops of a transformer save theirs in
the model's dtypes: SDPA keeps q, k, v and its output (BF16 under autocast), GELU its input, the
LayerNorms the fp32 residual stream. On the 1B GPT of ``benchmarks/bench_train.py`` those are most
of the step's peak memory (docs/o1_o2.md, "Memory of a training step"). Inside this context
manager, a pair of ``torch.autograd.graph.saved_tensors_hooks`` stores each such saved tensor as
FP8 codes with a per-tensor current power-of-two scale (:meth:`ScaledTensor.from_tensor`: an
amax pass and a quantize pass, no host sync) and the backward reads it back dequantized to its
original dtype and shape (:func:`fp8amp.dequantize`).

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
supports it (torch 2.11 does; checked at run time, see "compiled graphs" below) the hooks are
``torch.fx.GraphModule``s that AOTAutograd traces into each compiled forward (quantize after the
save) and backward (dequantize before the use), which Inductor fuses with the code around them.
There the tensors arrive as graph nodes, without grad, so the same rules are applied to the
graph instead: stored are the graph's inputs that get a gradient (each compiled block's input,
the residual stream; parameters and buffers never reach the hook) and its intermediates, except
statistics (the non-first outputs of multi-output ops: LayerNorm's mean and rstd, attention's
logsumexp; rsqrt, reciprocal, max, min, log-sum-exp, var; tensors whose last dimension is 1),
outputs of exp, log, tanh, sigmoid and log_softmax, tensors the backward exponentiates (logits
kept for a recomputed log_softmax), dtype casts of graph inputs (autocast's weight copies),
tensors that share memory with the graph's outputs, and broadcasts. The codes are bit for bit
those of the eager path. Where torch lacks that machinery (or ``compiled_graphs=False``) the
hooks are plain functions that see a compiled graph's saves at run time, its intermediates as
tensors that do not require grad: it keeps them, stores only the graph's inputs that are
activations, and warns once.

Limits: double backward (``create_graph=True``) through stored tensors raises; in-place changes
to a saved tensor after its save are not detected (with any saved-tensor hooks), and the backward
uses the values at save time. Entering the context sets torch's
``torch._functorch.config.saved_tensors_hooks_filtering_mode`` to "no_static" until it exits (a
process-wide setting), and a graph compiled inside it is compiled anew outside it (Dynamo guards
on the hooks).
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import sys
import threading
import warnings

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import ops
from .ops._args import has_row_runs
from .formats import E4M3, E5M2, HIGH_PRECISION_DTYPES, check_dtype, format_max
from .scaled_tensor import ScaledTensor

__all__ = ["save_activations_in_fp8", "ACTIVATION_FORMATS"]

#: The accepted ``fmt`` values.
ACTIVATION_FORMATS = (E4M3, E5M2)

_WHERE = "fp8amp.save_activations_in_fp8"
_DEVICES = ("cpu", "cuda")
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


def _is_broadcast(x: torch.Tensor) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(x.shape, x.stride()))


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

_active = threading.local()  # the contexts entered on this thread, innermost last


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


# ------------------------------------------------------- compiled graphs (hooks traced by AOTAutograd)
#
# When the saved-tensor hooks on top of the stack are torch.fx.GraphModules, AOTAutograd traces them
# and inlines them into the compiled forward (pack, after the save) and backward (unpack, before
# the first use), for the tensors the compiled graph saves, and it turns the Python hooks off while
# the compiled code runs. It calls the pack hook during compilation with the saved tensor (fake)
# and, through _get_saved_tensor_hook_context, the saved fx node and the forward and backward
# graphs. Which saved tensors reach the hook is torch._functorch.config's
# saved_tensors_hooks_filtering_mode: "donated" (the default, intermediates only), "no_static"
# (also the graph's inputs that are not parameters or buffers; this context sets it while
# entered, so that each compiled block's input, the residual stream, is stored too) or "all".
# The hooks here are GraphModules calling _pack_saved/_unpack_saved, which run the eager code
# above when called with a real tensor outside compilation (autograd calls a GraphModule like a
# function). All private torch API (graph_compile.py says "may change without backward
# compatibility"): _graph_hooks_supported() looks for each piece at run time, and without them
# the hooks are plain functions, as in eager mode.

_FILTERING_MODE = "no_static"
_aten = torch.ops.aten
_prims = torch.ops.prims


def _graph_hook_context_getter():
    """torch's getter of the compile-time context of a traced saved-tensor hook, or None."""
    try:
        from torch._functorch._aot_autograd import graph_compile
    except ImportError:
        return None
    return getattr(graph_compile, "_get_saved_tensor_hook_context", None)


def _graph_hooks_supported() -> bool:
    """Whether this torch inlines GraphModule saved-tensor hooks into compiled graphs (since 2.8.0,
    pytorch/pytorch PR 150032, with the filtering mode) and tells the hook which graph node it
    packs (since 2.10.0, PR 166887). 2.11.0, the GPU machine's, has both."""
    try:
        from torch._functorch._aot_autograd import utils as aot_utils
        import torch._functorch.config as functorch_config
    except ImportError:
        return False
    return (hasattr(aot_utils, "saved_tensors_hooks_are_inlineable")
            and hasattr(aot_utils, "top_saved_tensors_hooks")
            and getattr(functorch_config, "saved_tensors_hooks_filtering_mode", None) is not None
            and _graph_hook_context_getter() is not None)


def _packet(target: object) -> object:
    return getattr(target, "overloadpacket", target)


def _is_view_op(target: object) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


_CASTS = frozenset({_prims.convert_element_type, _aten._to_copy})
# Outputs that are statistics or whose backward amplifies a relative rounding: normalization and
# softmax statistics (rstd, 1/x, max, log-sum-exp), the saturating functions, exp and log.
_STATISTIC_OPS = frozenset({
    _aten.rsqrt, _aten.reciprocal, _aten.log, _aten.log2, _aten.exp, _aten.exp2, _aten.tanh,
    _aten.sigmoid, _aten._log_softmax, _aten.amax, _aten.amin, _aten.max, _aten.min, _aten.logsumexp,
    _aten.var, _aten.std, _aten.var_mean,
})
# Multi-output ops whose first output is a statistic too (var_mean's variance).
_STATISTICS_FIRST = frozenset({_aten.var_mean, _aten.std_mean})
# What the backward may do to a saved tensor before exponentiating it (a shift by a statistic,
# a view, a cast, a scale by a number): log_softmax's output or logits kept for a recomputation
# of exp(logits - log-sum-exp), where a relative rounding becomes an error of the exponent.
_SHIFTS = frozenset({_aten.add, _aten.sub, _aten.neg, _aten.clone, _aten.expand, _aten.mul, _aten.div,
                     _prims.convert_element_type, _aten._to_copy})
_EXPONENTIALS = frozenset({_aten.exp, _aten.exp2, _aten.expm1})


def _source(node: torch.fx.Node) -> torch.fx.Node:
    """The node that ``node`` comes from through views (unbind's and split's items included) and
    dtype casts."""
    while node.op == "call_function":
        if node.target is operator.getitem:
            parent = node.args[0]
            if not (isinstance(parent, torch.fx.Node) and parent.op == "call_function" and _is_view_op(parent.target)):
                break
        elif _is_view_op(node.target) or _packet(node.target) in _CASTS:
            parent = node.args[0]
        else:
            break
        if not isinstance(parent, torch.fx.Node):
            break
        node = parent
    return node


def _is_statistic(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        parent, index = node.args[0], node.args[1]
        if isinstance(parent, torch.fx.Node) and parent.op == "call_function":
            return index != 0 or _packet(parent.target) in _STATISTICS_FIRST  # LayerNorm's mean, rstd; SDPA's lse
        return False
    return _packet(node.target) in _STATISTIC_OPS


def _backward_exponentiates(name: str, bw_graph: torch.fx.Graph) -> bool:
    frontier = [n for n in bw_graph.find_nodes(op="placeholder") if n.name == name]
    seen: set[torch.fx.Node] = set()
    for _ in range(8):
        following = []
        for n in frontier:
            for user in n.users:
                if user in seen or user.op != "call_function":
                    continue
                seen.add(user)
                packet = _packet(user.target)
                if packet in _EXPONENTIALS:
                    return True
                scaled_by_number = packet in (_aten.mul, _aten.div) and not all(
                    isinstance(a, torch.fx.Node) for a in user.args)
                if _is_view_op(user.target) or (packet in _SHIFTS and (packet not in (_aten.mul, _aten.div) or scaled_by_number)):
                    following.append(user)
        frontier = following
    return False


def _graph_outputs(fw_graph: torch.fx.Graph, bw_graph: torch.fx.Graph) -> frozenset:
    """The sources of the compiled forward's own outputs (not its saves), computed on the first
    call for the graph, before any hook output is inlined into it: a saved tensor that shares one
    stays alive as an output, so a copy would add memory."""
    cached = getattr(fw_graph, "_fp8amp_outputs", None)
    if cached is not None:
        return cached
    saved_names = {n.name for n in bw_graph.find_nodes(op="placeholder")}
    outs = [a for a in torch.utils._pytree.tree_leaves(fw_graph.output_node().args) if isinstance(a, torch.fx.Node)]
    seen: set[torch.fx.Node] = set()
    user_outs = set()
    for n in outs:
        if n.name not in saved_names or n in seen:  # an output, or saved and output both
            user_outs.add(_source(n))
        seen.add(n)
    result = frozenset(user_outs)
    fw_graph._fp8amp_outputs = result
    return result


def _is_graph_activation(x: torch.Tensor, min_numel: int, state: dict) -> bool:
    """Whether a tensor a compiled forward saves (x, fake; state: the saved node and the two graphs)
    is an activation to store: the graph-level counterpart of _is_activation."""
    if (x.dtype not in HIGH_PRECISION_DTYPES or x.layout is not torch.strided or x.device.type not in _DEVICES
            or statically_known_true(x.numel() < min_numel) or _is_broadcast(x)
            or (x.dim() >= 2 and statically_known_true(x.shape[-1] == 1))):  # keepdim statistics
        return False
    node, fw_graph, bw_graph = state["_node"], state["_fw_graph"], state["_bw_graph"]
    source = _source(node)
    if source.op == "placeholder":
        # A graph input: parameters and buffers never reach the hook themselves ("no_static"), the
        # others are stored if the backward computes their gradient (an activation from the code
        # before the graph). Views and casts of an input (autocast's copies of weights) are stored
        # only where torch marks the input non-static (torch 2.15 does, 2.11 does not).
        if source is not node and source.meta.get("is_static_input", True):
            return False
        return _input_gets_gradient(source, fw_graph, bw_graph)
    if _is_statistic(node) or _is_statistic(source) or source in _graph_outputs(fw_graph, bw_graph):
        return False
    return not _backward_exponentiates(node.name, bw_graph)


def _input_gets_gradient(placeholder: torch.fx.Node, fw_graph: torch.fx.Graph, bw_graph: torch.fx.Graph) -> bool:
    """Whether the backward returns a gradient for this forward input (its outputs are the inputs'
    gradients in order, None where there is none); True when that cannot be told."""
    inputs = list(fw_graph.find_nodes(op="placeholder"))
    grads = bw_graph.output_node().args[0]
    if not isinstance(grads, (list, tuple)) or len(grads) != len(inputs):
        return True
    return grads[inputs.index(placeholder)] is not None


def _amax_in_graph(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a float32 [1] (NaN if x holds one). Inductor lowers a whole-tensor amax to a split
    reduction, which ran at 1.5 TB/s on the H200 for the 1B GPT's GELU input (16384 x 8192 bf16:
    192 us a block; fp8amp's amax kernel 67 us), and at about half of copy bandwidth for SDPA's
    strided q, k, v (33 us each), so x takes fp8amp's kernel wherever it reads x in place: a
    contiguous x, a permutation of one (SDPA's output) or rows at one stride (q, k, v, views of one
    GEMM output). Other layouts keep Inductor's reduction (the kernel would read a copy)."""
    if has_row_runs(x):
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        ops.amax(x, amax)
        return amax
    return x.to(torch.float32).abs().amax().reshape(1)


def _quantize_in_graph(x: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ScaledTensor.from_tensor(x, fmt, nan_if_nonfinite=True) in torch ops, for Inductor to fuse:
    scale = 2^clamp(floor(log2(fl(fmax / amax))), -126, 126) (1 for an amax of 0; scale_inv NaN for
    an inf or NaN), codes = saturate(round(x * scale)); the exponents come from the float bits, as
    fp8amp's kernels take them, so the codes are the same bit for bit."""
    fmax = format_max(fmt)
    xf = x.to(torch.float32)
    amax = _amax_in_graph(x)
    q = torch.full_like(amax, fmax) / amax
    exponent = (q.view(torch.int32) >> 23) - 127  # floor(log2 q) for a normal q; 128 for inf
    exponent = exponent.clamp(-126, 126)
    usable = (amax > 0) & torch.isfinite(amax)
    one = torch.ones_like(amax)
    scale = torch.where(usable, ((exponent + 127) << 23).view(torch.float32), one)
    scale_inv = torch.where(usable, ((127 - exponent) << 23).view(torch.float32), one)
    scale_inv = torch.where(torch.isfinite(amax), scale_inv, torch.full_like(amax, math.nan))
    codes = (xf * scale).clamp(-fmax, fmax).to(fmt)
    return codes, scale_inv


_CONTEXT_KEYS = frozenset({"_node", "_fw_graph", "_bw_graph"})  # what torch 2.10 to 2.15 give


@functools.cache
def _warn_once_unknown_context() -> None:
    warnings.warn(
        f"{_WHERE}: this torch ({torch.__version__}) passes the traced saved-tensor hook a context "
        "without the saved node and graphs it expects; compiled graphs keep what they save in its dtype")


def _pack_saved(x: torch.Tensor, fmt: torch.dtype, min_numel: int) -> object:
    """The pack hook (called through a GraphModule): eager, or traced into a compiled forward."""
    getter = _graph_hook_context_getter()
    state = getter() if getter is not None else None
    if state is None:
        return _pack_eager(x, fmt, min_numel)
    if not (isinstance(state, dict) and _CONTEXT_KEYS <= state.keys()):
        _warn_once_unknown_context()
        return x
    if not _is_graph_activation(x, min_numel, state):
        return x
    codes, scale_inv = _quantize_in_graph(x, fmt)
    return codes, scale_inv, x.dtype


def _unpack_saved(packed: object) -> torch.Tensor:
    """The unpack hook: eager, or traced into a compiled backward (packed: codes, scale_inv, dtype)."""
    if isinstance(packed, tuple):
        codes, scale_inv, dtype = packed
        return (codes.to(torch.float32) * scale_inv).to(dtype)
    return _unpack_eager(packed)


_GRAPH_HOOKS: dict[tuple[torch.dtype, int], tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = {}


def _cache_hash() -> str | None:
    """For AOTAutograd's cache, which keys a graph's calls of wrapped functions by this: a digest of
    this file and torch's version, so that a change to either never loads a stale compiled graph
    (None, and no caching of such graphs, where the file cannot be read)."""
    try:
        with open(__file__, "rb") as f:
            source = f.read()
    except OSError:
        return None
    return hashlib.sha256(torch.__version__.encode() + b"\n" + source).hexdigest()


def _hook_module(fn, *constants) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    out = graph.call_function(fn, (graph.placeholder("x"), *constants))
    digest = _cache_hash()
    if digest is not None:
        out.meta["is_wrapped"] = True  # what torch.fx.wrap marks: with a hash, AOTAutograd may cache
        out.meta["user_cache_hash"] = f"fp8amp:{digest}:{constants}"
    graph.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


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
        TypeError: ``fmt`` is not a torch.dtype, ``min_numel`` not an int.
        ValueError: ``fmt`` is not E4M3 or E5M2, ``min_numel`` is below 1.
    """

    def __init__(self, fmt: torch.dtype = E4M3, *, min_numel: int = 1 << 16, compiled_graphs: bool = True) -> None:
        self.fmt = check_dtype(fmt, ACTIVATION_FORMATS, "fmt", _WHERE)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int):
            raise TypeError(f"{_WHERE}: min_numel must be an int, got {type(min_numel).__name__}")
        if min_numel < 1:
            raise ValueError(f"{_WHERE}: min_numel must be a positive int (1 or more), got {min_numel}")
        self.min_numel = min_numel
        #: Whether compiled graphs store their activations too (compiled_graphs and this torch allows).
        self.in_compiled_graphs = bool(compiled_graphs) and _graph_hooks_supported()
        self._reset_counts()
        self._config_patch = None
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
        if self.in_compiled_graphs:
            self._config_patch = torch._functorch.config.patch(saved_tensors_hooks_filtering_mode=_FILTERING_MODE)
            self._config_patch.__enter__()
        super().__enter__()
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self)
        return self

    def __exit__(self, *args: object) -> None:
        stack = getattr(_active, "stack", [])
        if stack and stack[-1] is self:
            stack.pop()
        super().__exit__(*args)
        if self._config_patch is not None:
            self._config_patch.__exit__(None, None, None)
            self._config_patch = None

    def _warn_compiled(self) -> None:
        self._warned_compiled = True
        reason = ("compiled_graphs=False" if _graph_hooks_supported()
                  else f"this torch ({torch.__version__}) cannot inline saved-tensor hooks into compiled graphs")
        warnings.warn(
            f"{_WHERE}: a torch.compile'd graph saved tensors for backward; its intermediates reach the "
            "saved-tensor hooks as tensors that do not require grad, which this context cannot tell from "
            "statistics, so it keeps them in their dtype and stores only the graph's inputs that are "
            f"activations in FP8 ({reason}). Run the region eagerly for the full saving (docs/o1_o2.md).")

