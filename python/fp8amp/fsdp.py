"""FP8 weight all-gather under FSDP2 (``fully_shard``) for FP8 compute (:func:`fp8amp.convert`).

FSDP2 all-gathers each sharded weight before its layer runs, in the parameter's dtype (float32, or
``MixedPrecisionPolicy.param_dtype``), and an :class:`~fp8amp.Fp8Linear` then casts the whole
weight to E4M3. :func:`enable_fp8_all_gather` moves the cast before the all-gather: each rank
quantizes its own shard and the all-gather moves 1-byte codes (a quarter of float32's bytes, half
of bf16's). All ranks use one scale, the one the whole weight's cast would use: each shard's amax
is all-reduced (MAX) over the shard group first, one 4-byte all-reduce a weight. So the gathered
codes are exactly those of the cast of the whole weight, and training is bit for bit what it is
with the high-precision all-gather (tests/python/test_fsdp.py).

It works through FSDP2's all-gather extension: the weight parameter becomes an
:class:`Fp8AllGatherWeight`, a ``torch.Tensor`` subclass that holds the weight itself (the
parameter that FSDP2 shards, the optimizer updates and checkpoints save) and defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``. The gathered weight is an E4M3
:class:`~fp8amp.ScaledTensor` that the layer's forward takes as it is.

O1/O2 masters (:class:`~fp8amp.MasterWeight`) take the same all-gather through MasterWeight's own
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: both kinds of weight share
:func:`fp8amp.master_weight.pre_all_gather` and :func:`~fp8amp.master_weight.post_all_gather`
(docs/distributed.md, "FSDP2").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from .linear import Fp8Linear
from .master_weight import post_all_gather, pre_all_gather
from .scaled_tensor import ScaledTensor

__all__ = ["Fp8AllGatherWeight", "enable_fp8_all_gather"]

_aten = torch.ops.aten

# The ops whose results stay Fp8AllGatherWeights: those FSDP2 makes the sharded parameter with
# (chunking, padding into a new buffer, views, device and dtype moves, detach). Any other op's result
# is a plain tensor: optimizer states, gradients, norms.
_PRESERVED = {
    _aten.detach.default, _aten.view.default, _aten._unsafe_view.default, _aten.as_strided.default,
    _aten.slice.Tensor, _aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default,
    _aten.narrow.default, _aten.new_zeros.default, _aten.new_empty.default, _aten.empty_like.default,
    _aten.clone.default, _aten.copy_.default, _aten._to_copy.default, _aten._pin_memory.default,
    _aten.alias.default,
}


class Fp8AllGatherWeight(torch.Tensor):
    """A Linear weight whose FSDP2 all-gather moves E4M3 codes; in every other respect the
    high-precision tensor it wraps (``_tensor``), which ops see, the optimizer updates in place and
    checkpoints save.

    The all-gather's cast uses the ``weight_scaling`` state (recipe and buffers) of the
    :class:`~fp8amp.Fp8Linear` that owns the parameter, which FSDP2 passes to the hook, as the
    layer's own cast would; the tensor holds nothing else (so ``torch.compile`` sees a plain
    wrapper).

    Args:
        tensor: the weight (a plain floating-point tensor).
    """

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor) or isinstance(tensor, (Fp8AllGatherWeight, ScaledTensor)):
            raise TypeError(f"fp8amp.fsdp.Fp8AllGatherWeight: tensor must be a plain torch.Tensor, got "
                            f"{type(tensor).__name__}")
        self = torch.Tensor._make_wrapper_subclass(
            cls, tensor.shape, strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            device=tensor.device, layout=tensor.layout, requires_grad=tensor.requires_grad)
        self._tensor = tensor
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"Fp8AllGatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(Fp8AllGatherWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        return tree_map_only(torch.Tensor, Fp8AllGatherWeight, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner_tensors["_tensor"])

    def __reduce_ex__(self, protocol):
        # torch.save / pickling (checkpoints, spawning): the plain weight.
        return self._tensor.__reduce_ex__(protocol)

    # FSDP2's all-gather extension (torch.distributed.fsdp, "fsdp_pre_all_gather").

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return pre_all_gather(self._tensor, mesh, outer_size, module)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return post_all_gather(all_gather_outputs, metadata, param_dtype, out)


def enable_fp8_all_gather(model: nn.Module) -> int:
    """Makes the weight of every :class:`~fp8amp.Fp8Linear` of ``model`` an
    :class:`Fp8AllGatherWeight`, so that FSDP2 all-gathers it in E4M3; returns how many.

    Call it after :func:`fp8amp.convert` and before ``fully_shard``, and build the optimizer after
    ``fully_shard``, as FSDP2 asks. Weights that are already wrapped are left as they are.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: an Fp8Linear holds an O1/O2 FP16 master (``fp8amp.initialize``): masters are
            all-gathered in E4M3 without this call.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_fp8_all_gather: model must be an nn.Module, got {type(model).__name__}")
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Linear) or isinstance(module.weight, Fp8AllGatherWeight):
            continue
        if module.master is not None or isinstance(module.weight, ScaledTensor):
            raise ValueError(
                f"enable_fp8_all_gather: {name or 'model'} holds an O1/O2 FP16 master weight (fp8amp.initialize), "
                "which fully_shard all-gathers in E4M3 without this call; it is for FP8 compute (fp8amp.convert)")
        weight = module.weight
        module.weight = nn.Parameter(Fp8AllGatherWeight(weight.data), requires_grad=weight.requires_grad)
        count += 1
    return count
