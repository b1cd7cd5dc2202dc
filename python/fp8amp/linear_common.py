"""What both of Fp8Linear's autograd Functions share (per-tensor scaling in linear.py, tile
scaling in tiled_linear.py): the output dtype, the padding of the token rows and the output made
from the GEMM's padded rows, the E4M3 weight gradient of O1/O2, and the refusals of double
backward, of functorch's transforms, of forward-mode AD and of TorchScript."""

from __future__ import annotations

import functools
import math

import torch
import torch.autograd.forward_ad as forward_ad
import torch.autograd.graph as autograd_graph
import torch.nn.functional as F

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()

from .formats import E4M3, HIGH_PRECISION_DTYPES
from .ops import fast
from .scaled_tensor import ScaledTensor

__all__ = ["output_dtype", "pad_rows", "unpadded_output", "fp8_weight_grad", "first_order_backward",
           "functorch_active", "NO_FUNCTORCH", "no_torchscript", "refuse_dual_tensors", "refuse_unsupported_input",
           "saved_tensors_mutable"]

_unsafe_view = torch.ops.aten._unsafe_view.default  # the overload itself: no packet lookup a call

# C functions bound once (no attribute lookups a call). The first is the forward's only check for a
# torch.func transform (inside one, torch's own errors named autograd.Function internals, or the
# O1/O2 master check fired on the transform's wrapped weight); Dynamo folds it to a constant.
functorch_active = torch._C._are_functorch_transforms_active
_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor

_HIGH_PRECISION_INSTEAD = (
    "keep the layers it goes through in high precision (fp8amp.convert / fp8amp.initialize with "
    "module_filter_fn=lambda module, name: ... returning False for them), or run it on an unconverted copy, "
    "fp8amp.unconvert(copy.deepcopy(model))")

_NO_DOUBLE_BACKWARD = (
    "Fp8Linear: double backward (a backward with create_graph=True: torch.autograd.functional.hessian, hvp, "
    "vhp, jvp, jacobian(create_graph=True), gradient penalties) is not supported: the FP8 GEMMs of its "
    "backward are not differentiable again. For such a computation, "
    + _HIGH_PRECISION_INSTEAD)

NO_FUNCTORCH = (
    "Fp8Linear: torch.func transforms (vmap, grad, vjp, jvp, jacrev, jacfwd, hessian, functional_call inside one "
    "of them), torch.autograd.functional's vectorize=True and torch.autograd.grad's is_grads_batched=True are not "
    "supported: the layer's FP8 casts update its scaling buffers in place inside a custom autograd Function, which "
    "functorch can neither batch nor differentiate. Use torch.autograd.functional.jacobian / vjp with "
    "vectorize=False (the default), a loop over samples or over the grad_outputs, or " + _HIGH_PRECISION_INSTEAD)

_NO_TORCHSCRIPT = (
    "Fp8Linear: TorchScript (torch.jit.script / torch.jit.trace) is not supported: the layer's forward runs "
    "fp8amp's custom ops, which update scaling buffers in place, inside a custom autograd Function, and its "
    "O1/O2 weights are a tensor subclass (ScaledTensor); TorchScript represents none of these. Use "
    "torch.compile to compile, torch.export to export (docs/compile.md), or script / trace the model in high "
    "precision: fp8amp.unconvert(copy.deepcopy(model))")

_NO_ONNX = (
    "Fp8Linear: torch.onnx.export cannot export it: its TorchScript-based exporter traces the layer with "
    "torch.jit.trace, which cannot represent fp8amp's custom ops (they update scaling buffers in place, inside "
    "a custom autograd Function), and ONNX has no operator for them. Export the model in high precision: "
    "torch.onnx.export(fp8amp.unconvert(copy.deepcopy(model)), ...); torch.export.export keeps the FP8 ops "
    "(docs/compile.md)")


def no_torchscript() -> str:
    """Why TorchScript cannot take an Fp8Linear, and what works. torch.onnx.export(dynamo=False) traces with
    it: the TorchScript message alone pointed ONNX users at torch.export, which writes no ONNX file."""
    return _NO_ONNX if torch.onnx.is_in_onnx_export() else _NO_TORCHSCRIPT


_NO_FORWARD_AD = (
    "Fp8Linear: forward-mode AD (torch.autograd.forward_ad's dual tensors) is not supported: the layer's FP8 "
    "GEMMs run in a custom autograd Function with no jvp. Use reverse mode (loss.backward(), "
    "torch.autograd.grad, torch.autograd.functional.jacobian), or " + _HIGH_PRECISION_INSTEAD)


def refuse_dual_tensors(x: torch.Tensor, layer: torch.nn.Module) -> None:
    """Refuses an input or a parameter of ``layer`` that carries a forward-mode tangent (torch's error
    named only the Function's missing jvp). Outside a dual level, one read of a module global and
    no parameter access: torch.compile lifts parameters in the order a forward first reads them,
    and an early read of the bias moved it after an O1/O2 master, where torch 2.15's static-input
    flags misplace it (docs/hardening.md)."""
    if forward_ad._current_level >= 0 and any(
            t is not None and forward_ad.unpack_dual(t).tangent is not None for t in (x, layer.weight, layer.bias)):
        raise NotImplementedError(_NO_FORWARD_AD)


def _exporting() -> bool:
    """Whether torch.export is tracing. Not ``torch.compiler.is_exporting()`` alone: torch 2.11's Dynamo
    folds that call to True under every torch.compile, export or not; the flag it reads, a module global,
    Dynamo reads as it is (and guards on)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else flag


def refuse_unsupported_input(x: torch.Tensor, weight: torch.Tensor, layer: torch.nn.Module) -> None:
    """TorchScript tracing, a training-mode torch.export, forward-mode AD, DTensors, sparse and nested inputs,
    inputs or weights of a dtype the casts do not take (named by the layer, not by the cast op that would refuse
    them) and an input on another device than the weights (a meta input gave autocast's "unknown device type"),
    refused with what works; Dynamo folds them."""
    if torch.jit.is_tracing():
        raise NotImplementedError(no_torchscript())
    refuse_dual_tensors(x, layer)
    if _exporting() and layer.training and torch.is_grad_enabled():
        # export inlines the autograd Function: the exported module's backward ran through the FP8 ops, which
        # have no derivative, and gave the weights no gradient (torch warned only that it "may" be wrong).
        raise NotImplementedError(
            "Fp8Linear: torch.export of a model in training mode (torch.distributed.pipelining.pipeline exports it "
            "too) would drop this layer's backward: the exported module's weights would get no gradients. Export "
            "it in eval() for inference; for pipeline parallelism, split the model into stage modules by hand and "
            "give each to PipelineStage (docs/distributed.md#tensor-and-pipeline-parallelism)")
    if isinstance(x, DTensor) or isinstance(weight, DTensor):
        # The casts and GEMMs are not DTensor ops: the first cast failed on "mixed torch.Tensor and DTensor".
        raise NotImplementedError(
            f"Fp8Linear: the {'input' if isinstance(x, DTensor) else 'weight'} is a DTensor (tensor or sequence "
            "parallelism: parallelize_module, SequenceParallel, PrepareModuleInput); Fp8Linear computes on local "
            "tensors, and tensor parallelism of fp8amp layers is not supported. Keep those layers nn.Linear "
            "(fp8amp.convert / initialize with module_filter_fn returning False for them), or pass this layer local "
            "tensors (use_local_output=True); FSDP2, DDP and pipeline parallelism take fp8amp layers "
            "(docs/distributed.md#tensor-and-pipeline-parallelism)")
    if weight.dtype not in HIGH_PRECISION_DTYPES:  # model.double() after convert
        raise ValueError(f"Fp8Linear: the weight is {weight.dtype}, which the FP8 casts do not read; keep the model "
                         "in float32, bfloat16 or float16 (torch.autocast chooses the compute dtype), or run it in "
                         "float64 as nn.Linear layers after fp8amp.unconvert(model)")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        # (torch.autocast casts only these three dtypes: it is no way out for the others)
        raise ValueError(f"Fp8Linear: the input x must be float32, bfloat16 or float16, got {x.dtype}; "
                         f"convert it first (x.float(); torch.autocast does not cast {x.dtype} inputs)")
    if x.is_nested:  # a strided one passed the layout check and failed inside torch at x.shape
        raise ValueError("Fp8Linear: the input is a nested tensor, which FP8 casts and GEMMs cannot read; for a "
                         "jagged one, torch.nested.nested_tensor_from_jagged(layer(x.values()), x.offsets()), or "
                         "pad it first: layer(torch.nested.to_padded_tensor(x, 0.0))")
    if x.layout != torch.strided:
        raise ValueError(f"Fp8Linear: the input must be a dense (strided) tensor, got layout {x.layout}: FP8 "
                         "casts and GEMMs read dense memory; call .to_dense() first")
    if x.device != weight.device:
        raise ValueError(f"Fp8Linear: the input x is on {x.device} but the layer's weight is on {weight.device}; "
                         "move one of them")


def saved_tensors_mutable() -> bool:
    """Whether torch.autograd.graph.allow_mutation_on_saved_tensors() is on: inside it a tensor the
    forward read may be written before the backward, which still sees the forward's values."""
    return autograd_graph._allow_mutation_on_saved_tensors_enabled


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on, else ``x``'s dtype (on the meta device, which has
    no autocast and whose query raises, ``x``'s dtype, as ``nn.Linear`` gives)."""
    device_type = x.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def first_order_backward(backward):
    """``backward`` of an autograd Function whose GEMMs are not differentiable again, refusing to
    run where autograd would differentiate it (grad mode on in a backward: create_graph=True) or
    batch it (vmap over autograd.grad, jacobian's vectorize=True: a batched output gradient). In
    place of ``once_differentiable``, which left the result unconnected where the output gradient
    needs no grad (hessian, jvp, hvp: a second derivative of 0, silently)."""
    @functools.wraps(backward)
    def checked(ctx, grad_output: torch.Tensor):
        if torch.is_grad_enabled():
            raise NotImplementedError(_NO_DOUBLE_BACKWARD)
        # (Dynamo cannot trace the legacy check; a compiled backward gets no batched gradient.)
        if functorch_active() or (not torch.compiler.is_compiling() and _is_legacy_batched(grad_output)):
            raise NotImplementedError(NO_FUNCTORCH)
        return backward(ctx, grad_output)
    return checked


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` [rows, cols] with zero rows appended up to a multiple of ``multiple``."""
    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def unpadded_output(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The GEMM's output ``y`` [rows padded, out] as the layer's, with ``x``'s leading dims. Not a
    view of ``y`` (``aten._unsafe_view``, as torch's own linear makes its output): FSDP2 warns of a
    module that returns a view, since an in-place op on one would skip its pre-backward hook."""
    rows = math.prod(x.shape[:-1])
    if y.shape[0] != rows:
        y = y[:rows]
    elif x.dim() == 2:
        return y
    return _unsafe_view(y, (*x.shape[:-1], y.shape[-1]))


def fp8_weight_grad(grad: torch.Tensor, dtype: torch.dtype) -> ScaledTensor:
    """The weight gradient as an E4M3 ScaledTensor of logical ``dtype`` with a current scale
    (docs/architecture.md#fp8linear-dataflow): an amax pass and a quantize pass; a non-finite
    gradient reads as NaN (an E4M3 code cannot hold inf), so GradScaler and the optimizer see it.
    What ``ScaledTensor.from_tensor(grad, E4M3, orig_dtype=dtype)`` makes, without its checks:
    ``grad`` is a GEMM's contiguous output of a high-precision dtype, ``dtype`` the master's."""
    codes, scale_inv, _ = fast.quantize_current(grad, E4M3, 0, True)
    if torch.compiler.is_compiling():  # Dynamo traces the class's constructor, not _make_wrapper_subclass
        return ScaledTensor(codes, scale_inv, dtype)
    return ScaledTensor._wrap(codes, scale_inv, dtype)
