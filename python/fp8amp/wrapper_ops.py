"""What the dispatch of fp8amp's tensor subclasses (ScaledTensor, BlockScaledTensor) shares for
the ops they have no handler of their own for: which arguments an op writes, whether it returns
a view, and running an op on their real values with its writes put back.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch.utils._pytree import tree_map_only

__all__ = ["make_wrapper", "written_args", "written_instances", "is_view_op", "returns_view",
           "refuse_metadata_in_place", "refuse_collective", "refuse_scatter_of_chunks", "run_on_values"]


def make_wrapper(cls: type, like: torch.Tensor, base: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """``torch.Tensor._make_wrapper_subclass(cls, like.shape, **kwargs)``, an inference tensor only
    when ``base`` (by default ``like``), what it wraps or views, is one: under
    ``torch.inference_mode`` a view or detach of a normal tensor is a normal tensor, which torch
    gives its base's version counter (an inference wrapper refuses it)."""
    if (not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()
            and not (like if base is None else base).is_inference()):
        with torch.inference_mode(False):
            return torch.Tensor._make_wrapper_subclass(cls, like.shape, **kwargs)
    return torch.Tensor._make_wrapper_subclass(cls, like.shape, **kwargs)


def written_args(func, args, kwargs) -> list:
    """The argument values the op's schema marks as written (Tensor(a!) / Tensor(a!)[])."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.name in kwargs:
            out.append(kwargs[arg.name])
        elif not arg.kwarg_only and i < len(args):
            out.append(args[i])
    flat = []
    for v in out:
        flat.extend(v if isinstance(v, (list, tuple)) else [v])
    return flat


def written_instances(func, args, kwargs, cls: type) -> list:
    """The instances of ``cls`` among the op's written arguments, each once, in argument order."""
    return list({id(t): t for t in written_args(func, args, kwargs) if isinstance(t, cls)}.values())


# Views that frameworks make of whole buffers (FSDP2's as_strided), whose results go on to their
# own machinery (collectives read storage): left plain copies.
_FRAMEWORK_VIEWS = frozenset({"as_strided"})


def returns_view(target: object) -> bool:
    """Whether the op's schema says its first output is a view of an input (transpose, slice,
    detach...); False for a target without a schema (a Python function in an FX graph)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def is_view_op(func) -> bool:
    """Whether the op returns views of its first argument (transpose, slice, select, split...),
    framework views aside."""
    return returns_view(func) and func.overloadpacket.__name__ not in _FRAMEWORK_VIEWS


# In-place ops that change a tensor's metadata (shape, strides, storage, autograd), not its values.
_METADATA_IN_PLACE = frozenset({"as_strided_", "detach_", "requires_grad_", "resize_", "resize_as_", "set_",
                                "squeeze_", "swapaxes_", "swapdims_", "t_", "transpose_", "unsqueeze_"})


def refuse_metadata_in_place(func, name: str) -> None:
    """The subclasses' codes fix their shape and layout: in-place ops that would change them are
    refused, naming the op."""
    if func.overloadpacket.__name__ in _METADATA_IN_PLACE:
        raise NotImplementedError(f"fp8amp.{name}: in-place op {func} is not supported on a {name} (its shape and "
                                  "layout are its codes'); make a plain tensor with .dequantize() first")


def refuse_collective(func, name: str) -> None:
    """A ``torch.distributed`` collective or point-to-point op (c10d) on one of the subclasses (or a
    view of one): its schema marks nothing written and its work would run on a dequantized copy, so
    a broadcast into a master (distribute_tensor's Replicate too) changed nothing."""
    if func.namespace == "c10d":
        raise NotImplementedError(
            f"fp8amp.{name}: torch.distributed collective {func} cannot run on a {name} (an O1/O2 master, an FP8 "
            "gradient or a view of one: codes and a scale, no plain buffer), its result would be lost; run it on a "
            "plain copy (t.dequantize()) and copy_ the result back under torch.no_grad(). DDP, FSDP2 (fully_shard) "
            "and fp8amp.distributed.all_reduce_grads(model) take these tensors; tensor parallelism "
            "(parallelize_module, distribute_tensor) of fp8amp layers does not "
            "(docs/distributed.md#tensor-and-pipeline-parallelism)")


# Where DTensor's Shard placement scatters a tensor's chunks from one rank (distribute_tensor).
_SHARD_SCATTER = ("torch.distributed.tensor.placement_types", "_shard_tensor")


def refuse_scatter_of_chunks(func, name: str) -> None:
    """``distribute_tensor(t, mesh, [Shard(d)])`` scatters ``t``'s chunks, a list of lists that torch
    does not dispatch to the subclass: gloo read the wrappers' empty storage and aborted the process.
    The ``empty_like`` of the first chunk, made on every rank of the mesh before the scatter, is the
    last op that reaches fp8amp: refused there (one frame walk, for that op only)."""
    if func is not torch.ops.aten.empty_like.default:
        return
    frame = sys._getframe(1)
    for _ in range(6):  # the subclass's dispatch, Dynamo's disable wrapper, then torch's caller
        if frame is None:
            return
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == _SHARD_SCATTER:
            raise NotImplementedError(
                f"fp8amp.{name}: distribute_tensor(t, mesh, [Shard(...)]) of a {name} (an O1/O2 master or an FP8 "
                "gradient: codes and a scale, no plain buffer) is not supported: torch scatters its chunks from a "
                "buffer it does not have. Shard the module with fully_shard (FSDP2), which shards O1/O2 masters; "
                "for a DTensor of the values, distribute t.dequantize(). Tensor parallelism of fp8amp layers is "
                "not supported (docs/distributed.md#tensor-and-pipeline-parallelism)")
        frame = frame.f_back


def run_on_values(func, args, kwargs, cls: type, written: list, written_values: Callable,
                  write: Callable) -> object:
    """``func`` run on plain tensors: each instance of ``cls`` it writes (``written``, each once)
    as ``written_values(t)``, every other one dequantized at its logical dtype. Each written value
    then goes back into its tensor by ``write(t, value)``, and a result that is a written value is
    returned as its tensor (an in-place op returns its argument). Ops that would change a written
    tensor's shape or layout are refused, before anything is written."""
    name = cls.__name__
    refuse_collective(func, name)
    refuse_scatter_of_chunks(func, name)
    if written:
        refuse_metadata_in_place(func, name)
    values = {id(t): written_values(t) for t in written}

    def unwrap(t):
        if id(t) not in values:
            values[id(t)] = t.dequantize()
        return values[id(t)]

    out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))
    if not written:
        return out
    for t in written:
        value = values[id(t)]
        if value.shape != t.shape:  # an out= of another shape: torch resized the plain copy
            raise NotImplementedError(f"fp8amp.{name}: {func} would change the shape of a {name} from "
                                      f"{list(t.shape)} to {list(value.shape)}; its shape is its codes'")
    for t in written:
        write(t, values[id(t)])
    back = {id(values[id(t)]): t for t in written}
    return tree_map_only(torch.Tensor, lambda v: back.get(id(v), v), out)
