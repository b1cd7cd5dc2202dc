"""The compiled-graph half of :class:`~fp8amp.saved_activations.save_activations_in_fp8`: which of
the tensors a ``torch.compile``'d forward saves are activations (read from the fx graphs that
AOTAutograd compiles), their quantize and dequantize in torch ops for Inductor to fuse, and the
GraphModules that hold the context's saved-tensor hooks for AOTAutograd to trace. The rules are
those of saved_activations' docstring; saved_activations imports this module, never the reverse.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import warnings

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import ops
from .ops._args import has_row_runs
from .formats import HIGH_PRECISION_DTYPES, format_max
from .wrapper_ops import returns_view

# When the saved-tensor hooks on top of the stack are torch.fx.GraphModules, AOTAutograd traces them
# and inlines them into the compiled forward (pack, after the save) and backward (unpack, before
# the first use), for the tensors the compiled graph saves, and it turns the Python hooks off while
# the compiled code runs. It calls the pack hook during compilation with the saved tensor (fake)
# and, through _get_saved_tensor_hook_context, the saved fx node and the forward and backward
# graphs. Which saved tensors reach the hook is torch._functorch.config's
# saved_tensors_hooks_filtering_mode: "donated" (the default, intermediates only), "no_static"
# (also the graph's inputs that are not parameters or buffers; the context sets it while
# entered, so that each compiled block's input, the residual stream, is stored too) or "all".
# The hooks are GraphModules (_hook_module) calling saved_activations' _pack_saved/_unpack_saved,
# which run the eager code there when called with a real tensor outside compilation (autograd
# calls a GraphModule like a function) and _pack_in_graph/_dequantize_in_graph here when traced.
# All private torch API (graph_compile.py says "may change without backward compatibility"):
# _graph_hooks_supported() looks for each piece at run time, and without them the hooks are
# plain functions, as in eager mode.

# Shared with the eager hooks in saved_activations (which imports them from here).
_WHERE = "fp8amp.save_activations_in_fp8"
_DEVICES = ("cpu", "cuda")


def _is_broadcast(x: torch.Tensor) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(x.shape, x.stride()))


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
            if not (isinstance(parent, torch.fx.Node) and parent.op == "call_function" and returns_view(parent.target)):
                break
        elif returns_view(node.target) or _packet(node.target) in _CASTS:
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
        # (the items of a view op, unbind's or split's, are peers: k and v of timm's unbound qkv)
        if isinstance(parent, torch.fx.Node) and parent.op == "call_function" and not returns_view(parent.target):
            return index != 0 or _packet(parent.target) in _STATISTICS_FIRST  # LayerNorm's mean, rstd; SDPA's lse
        return False
    return _packet(node.target) in _STATISTIC_OPS


def _scales_a_statistic(node: torch.fx.Node) -> bool:
    """A product or quotient of statistics and graph inputs, at least one a statistic: the tile
    scales of an O1/O2 master's FP8 cast times the master's scale (tiled_linear), which the
    backward's GEMM reads as scales (an FP8 rounding of them would be a second quantization)."""
    if node.op != "call_function" or _packet(node.target) not in (_aten.mul, _aten.div):
        return False
    sources = [_source(a) for a in node.args if isinstance(a, torch.fx.Node)]
    return (any(_is_statistic(s) for s in sources)
            and all(_is_statistic(s) or s.op == "placeholder" for s in sources))


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
                if returns_view(user.target) or (packet in _SHIFTS and (packet not in (_aten.mul, _aten.div) or scaled_by_number)):
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
        # A graph input: parameters and buffers (static inputs) are not stored, the others are if
        # the backward computes their gradient (an activation from the code before the graph).
        # Where torch marks no input (2.11), the input itself reaching the hook is non-static
        # ("no_static" passes no other), and views and casts of one (autocast's copies of
        # weights) are not stored.
        static = _static_inputs(fw_graph).get(source)
        if static if static is not None else source is not node:
            return False
        return _input_gets_gradient(source, fw_graph, bw_graph)
    if (_is_statistic(node) or _is_statistic(source) or _scales_a_statistic(source)
            or source in _graph_outputs(fw_graph, bw_graph)
            or source not in _requires_grad(fw_graph, bw_graph)):
        return False
    return not _backward_exponentiates(node.name, bw_graph)


def _static_inputs(fw_graph: torch.fx.Graph) -> dict:
    """Whether each forward input is static (a parameter or buffer), where torch marks it
    (meta "is_static_input"); cached as _graph_outputs is. Torch 2.15 marks the inputs by the
    positions of the static ones among the inputs before tensor subclasses (O1/O2 masters) are
    split into their inner tensors, so every input after a master reads another's mark (a plain
    parameter after one was stored in FP8). AOTAutograd's descriptors name the unsplit input k of
    each; the mark at position k is then k's own. Where the marks are by the split inputs'
    positions (a static one beyond the unsplit count shows it) or an input has no such descriptor,
    they are taken as they are."""
    cached = getattr(fw_graph, "_fp8amp_static_inputs", None)
    if cached is not None:
        return cached
    inputs = list(fw_graph.find_nodes(op="placeholder"))
    marks = [n.meta.get("is_static_input") for n in inputs]
    unsplit = [_unsplit_index(n.meta.get("desc")) for n in inputs]
    by_unsplit_position = (None not in marks and None not in unsplit and unsplit != list(range(len(inputs)))
                           and not any(marks[max(unsplit) + 1:]))
    result = {n: marks[k] if by_unsplit_position else mark for n, mark, k in zip(inputs, marks, unsplit)}
    fw_graph._fp8amp_static_inputs = result
    return result


def _unsplit_index(desc: object) -> int | None:
    """The position among the graph's inputs before subclasses are split of the input an
    AOTAutograd descriptor names (None: another kind of input)."""
    desc = _described(desc)
    index = getattr(desc, "idx", None)
    return index if type(desc).__name__ == "PlainAOTInput" and isinstance(index, int) else None


def _requires_grad(fw_graph: torch.fx.Graph, bw_graph: torch.fx.Graph) -> frozenset:
    """The forward's nodes computed from an input that gets a gradient (a parameter, an activation
    from the code before the graph), as requires_grad tells the eager hooks; cached as
    _graph_outputs is. The others (an attention mask or rotary angles built from positions and
    buffers) are kept as eager keeps them: a mask's -inf would come back NaN, and a rounded angle is
    a phase error in the cos and sin the backward recomputes from it."""
    cached = getattr(fw_graph, "_fp8amp_requires_grad", None)
    if cached is not None:
        return cached
    nodes: set[torch.fx.Node] = set()
    for n in fw_graph.nodes:
        if (_input_gets_gradient(n, fw_graph, bw_graph) if n.op == "placeholder"
                else any(a in nodes for a in n.all_input_nodes)):
            nodes.add(n)
    result = frozenset(nodes)
    fw_graph._fp8amp_requires_grad = result
    return result


def _input_gets_gradient(placeholder: torch.fx.Node, fw_graph: torch.fx.Graph, bw_graph: torch.fx.Graph) -> bool:
    """Whether the backward returns a gradient for this forward input; True when that cannot be
    told. AOTAutograd's descriptors (the nodes' meta "desc") name the input each gradient is of: a
    tensor subclass (an O1/O2 master) is several inputs (its inner tensors) and its gradient other
    outputs, so positions pair them only without subclasses (the outputs are then the inputs'
    gradients in order, None where there is none)."""
    output = bw_graph.output_node()
    grads = output.args[0]
    if not isinstance(grads, (list, tuple)):
        return True
    descs, desc = output.meta.get("desc"), placeholder.meta.get("desc")
    if desc is not None and isinstance(descs, (list, tuple)) and len(descs) == len(grads):
        differentiated = {_described(getattr(_described(d), "grad_of", None)) for g, d in zip(grads, descs)
                          if g is not None}
        return _described(desc) in differentiated
    inputs = list(fw_graph.find_nodes(op="placeholder"))
    return len(grads) != len(inputs) or grads[inputs.index(placeholder)] is not None


def _described(desc: object) -> object:
    """The input or output an AOTAutograd descriptor names, through a subclass's inner tensors."""
    while hasattr(desc, "base"):  # SubclassGetAttrAOTInput / Output and its size and stride kin
        desc = desc.base
    return desc


def _amax_in_graph(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a float32 [1] (NaN if x holds one). Inductor lowers a whole-tensor amax to a split
    reduction, which ran at 1.5 TB/s on the H200 for the 1B GPT's GELU input (16384 x 8192 bf16:
    192 us a block; fp8amp's amax kernel 67 us), and at about half of copy bandwidth for SDPA's
    strided q, k, v (33 us each), so x takes fp8amp's kernel wherever it reads x in place: a
    contiguous x, a permutation of one (SDPA's output) or rows at one stride (q, k, v, views of one
    GEMM output). Other layouts keep Inductor's reduction (the kernel would read a copy)."""
    if has_row_runs(x):
        return ops.amax_of(x)
    return x.to(torch.float32).abs().amax().reshape(1)


def _quantize_in_graph(x: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ScaledTensor.from_tensor(x, fmt, nan_if_nonfinite=True) in torch ops, for Inductor to fuse:
    scale = 2^clamp(floor(log2(fl(fmax / amax))), -126, 126) (1 for an amax of 0; scale_inv NaN for
    an inf or NaN), codes = saturate(round(x * scale)) with an infinity coded as NaN; the exponents
    come from the float bits, as fp8amp's kernels take them, so the codes are the same bit for bit."""
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
    scaled = xf * scale
    codes = torch.where(scaled.isinf(), math.nan, scaled.clamp(-fmax, fmax)).to(fmt)
    return codes, scale_inv


def _dequantize_in_graph(codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What _quantize_in_graph stored, back in the saved tensor's dtype, in torch ops."""
    return (codes.to(torch.float32) * scale_inv).to(dtype)


_CONTEXT_KEYS = frozenset({"_node", "_fw_graph", "_bw_graph"})  # what torch 2.10 to 2.15 give


@functools.cache
def _warn_once_unknown_context() -> None:
    warnings.warn(
        f"{_WHERE}: this torch ({torch.__version__}) passes the traced saved-tensor hook a context "
        "without the saved node and graphs it expects; compiled graphs keep what they save in its dtype")


def _pack_in_graph(x: torch.Tensor, fmt: torch.dtype, min_numel: int, state: object) -> object:
    """The pack hook as traced into a compiled forward (state: the compile-time context torch gives
    it): x itself where it is kept, else (codes, scale_inv, dtype)."""
    if not (isinstance(state, dict) and _CONTEXT_KEYS <= state.keys()):
        _warn_once_unknown_context()
        return x
    if not _is_graph_activation(x, min_numel, state):
        return x
    codes, scale_inv = _quantize_in_graph(x, fmt)
    return codes, scale_inv, x.dtype


def _cache_hash(fn) -> str | None:
    """For AOTAutograd's cache, which keys a graph's calls of wrapped functions by this: a digest of
    the files of the traced code (this one and ``fn``'s) and torch's version, so that a change to
    any never loads a stale compiled graph (None, and no caching of such graphs, where a file
    cannot be read)."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in (__file__, fn.__code__.co_filename):
        try:
            with open(path, "rb") as f:
                digest.update(b"\n" + f.read())
        except OSError:
            return None
    return digest.hexdigest()


def _hook_module(fn, *constants) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    out = graph.call_function(fn, (graph.placeholder("x"), *constants))
    digest = _cache_hash(fn)
    if digest is not None:
        out.meta["is_wrapped"] = True  # what torch.fx.wrap marks: with a hash, AOTAutograd may cache
        out.meta["user_cache_hash"] = f"fp8amp:{digest}:{constants}"
    graph.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), graph)
