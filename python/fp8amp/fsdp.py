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

:func:`enable_fp8_reduce_scatter` (after ``fully_shard``; not the default) makes FSDP2
reduce-scatter the gradients in FP8 instead of its ``reduce_dtype``: :func:`fp8_reduce_scatter`,
an all-to-all of E4M3 (or E5M2) codes with one shared scale per destination shard, summed in
float32 by each receiving rank (docs/distributed.md, "FP8 reduce-scatter under FSDP2").
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.utils._pytree import tree_map_only

from .comm_amax import shared_amax
from .convert import is_sharded
from .distributed import FORMATS
from .formats import E4M3, HIGH_PRECISION_DTYPES, format_max
from .linear import Fp8Linear
from .master_weight import post_all_gather, pre_all_gather
from .ops import fast
from .scaled_tensor import ScaledTensor
from .wrapper_ops import make_wrapper

__all__ = ["Fp8AllGatherWeight", "enable_fp8_all_gather", "Fp8ReduceScatter", "enable_fp8_reduce_scatter",
           "fp8_reduce_scatter"]

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
        if tensor.dtype not in HIGH_PRECISION_DTYPES:
            raise ValueError(f"fp8amp.fsdp.Fp8AllGatherWeight: tensor must be a weight of one of "
                             f"{', '.join(map(str, HIGH_PRECISION_DTYPES))}; got {tensor.dtype}")
        self = make_wrapper(cls, tensor, strides=tensor.stride(), storage_offset=tensor.storage_offset(),
                            dtype=tensor.dtype, device=tensor.device, layout=tensor.layout,
                            requires_grad=tensor.requires_grad)
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
        # (a move to another dtype, e.g. float64, leaves the weights fp8amp casts: a plain result)
        return tree_map_only(torch.Tensor, lambda t: Fp8AllGatherWeight(t) if t.dtype in HIGH_PRECISION_DTYPES else t,
                             out)

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
        return pre_all_gather(self._tensor, mesh, outer_size, module, mp_policy.param_dtype or self.dtype)

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
            all-gathered in E4M3 without this call; or it is already ``fully_shard``-ed.
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
        if is_sharded(module):  # FSDP2 would fail at its lazy init, inside torch, naming neither
            raise ValueError(
                f"enable_fp8_all_gather: {name or 'model'} is already sharded by fully_shard (its weight is a "
                "DTensor); call enable_fp8_all_gather after fp8amp.convert and before fully_shard")
        weight = module.weight
        module.weight = nn.Parameter(Fp8AllGatherWeight(weight.data), requires_grad=weight.requires_grad)
        count += 1
    return count


# ---------------------------------------------------------------------------- FP8 reduce-scatter


def fp8_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *,
                       fmt: torch.dtype = E4M3, divisor: float = 1.0) -> None:
    """``output`` <- this rank's shard of the sum over ``group`` of ``input``, divided by ``divisor``,
    with FP8 codes on the wire (``dist.reduce_scatter_tensor``'s contract: ``input`` holds N
    consecutive chunks of ``output.numel()`` elements, rank k receives the sum of every rank's
    chunk k).

    1. the amax of each chunk, MAX all-reduced (N floats; NaN sent as inf): every rank quantizes
       chunk k with the same power-of-two scale;
    2. ``fp8amp.ops.comm_quantize`` of the N chunks into one FP8 send buffer;
    3. ``all_to_all_single`` of the codes (1 byte an element; any backend);
    4. ``fp8amp.ops.comm_sum_shards``: the N received copies of this rank's chunk decoded, summed in
       float32 in rank order and divided, written into ``output`` (its dtype: float32, bfloat16 or
       float16).

    Error: one FP8 rounding of each contribution (relative 2^-4 for E4M3, plus the underflow of
    values below the chunk's scale's subnormals) and the float32 sum. A non-finite value anywhere in
    any rank's input makes every rank's whole output NaN. ``input`` and ``output`` of one dtype.
    """
    where = "fp8amp.fsdp.fp8_reduce_scatter"
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or not 0 < divisor < math.inf:
        raise ValueError(f"{where}: divisor must be a positive finite number, got {divisor!r}")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{where}: this rank is not a member of group (dist.new_group returned "
                         "GroupMember.NON_GROUP_MEMBER): pass a group this rank belongs to")
    if fmt not in FORMATS:
        raise ValueError(f"{where}: fmt must be one of {', '.join(map(str, FORMATS))}; got {fmt!r}")
    if input.dtype not in HIGH_PRECISION_DTYPES or output.dtype != input.dtype:
        raise ValueError(f"{where}: input and output must share one dtype of "
                         f"{', '.join(map(str, HIGH_PRECISION_DTYPES))}; got {input.dtype} and {output.dtype}")
    world = dist.get_world_size(group)
    n = output.numel()
    if input.numel() != world * n:
        raise ValueError(f"{where}: input must hold world size ({world}) x output.numel() ({n}) elements; got "
                         f"{input.numel()}")
    if not (input.is_contiguous() and output.is_contiguous()):
        raise ValueError(f"{where}: input and output must be contiguous")
    if n == 0:
        return
    chunks = list(input.view(world, n).unbind(0))
    amax = shared_amax(chunks, group)
    send = torch.empty(world * n, dtype=torch.uint8, device=input.device)
    scale_inv = fast.comm_quantize(chunks, amax, format_max(fmt), send.view(fmt))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    rank = dist.get_rank(group)
    fast.comm_sum_shards(recv.view(fmt).view(world, n), scale_inv[rank:rank + 1], (0, n), float(divisor),
                         output.view(-1))


class Fp8ReduceScatter:
    """FSDP2's reduce-scatter as :func:`fp8_reduce_scatter` (``FSDPModule.set_custom_reduce_scatter``;
    :func:`enable_fp8_reduce_scatter` installs it). It has the methods of torch's ``ReduceScatter``
    comm interface (``allocate`` and the call), which torch does not export publicly.

    FSDP2 passes ``op`` SUM, or AVG (the mean: the default for float32 and bfloat16), after it has
    copied the module's unsharded gradients into ``input`` in its ``reduce_dtype``; other ops
    (``set_gradient_divide_factor`` with a factor other than the world size makes a PREMUL_SUM) are
    refused by name.

    Args:
        fmt: ``fp8amp.E4M3`` (default) or ``fp8amp.E5M2``.
    """

    def __init__(self, fmt: torch.dtype = E4M3) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"fp8amp.fsdp.Fp8ReduceScatter: fmt must be one of {', '.join(map(str, FORMATS))}; "
                             f"got {fmt!r}")
        self.fmt = fmt

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False):
        if op == dist.ReduceOp.SUM:
            divisor = 1.0
        elif op == dist.ReduceOp.AVG:
            divisor = float(dist.get_world_size(group))
        else:
            raise ValueError(f"fp8amp.fsdp.Fp8ReduceScatter: FSDP2 asked for reduce op {op}; the FP8 reduce-scatter "
                             "does SUM and AVG (leave set_gradient_divide_factor unset, or set it to the world size)")
        fp8_reduce_scatter(output_tensor, input_tensor, group, fmt=self.fmt, divisor=divisor)
        return None  # done: the collectives above ran synchronously on the current stream


def enable_fp8_reduce_scatter(model: nn.Module, fmt: torch.dtype = E4M3) -> int:
    """Makes FSDP2 reduce-scatter the gradients of every ``fully_shard``-ed module of ``model`` in FP8
    (:class:`Fp8ReduceScatter`), instead of in its ``reduce_dtype``; returns how many modules.

    Call it after ``fully_shard`` (each block, then the model). Off by default: without it FSDP2
    reduce-scatters in float32 (or ``MixedPrecisionPolicy.reduce_dtype``). It needs a torch whose
    ``FSDPModule`` has ``set_custom_reduce_scatter``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: no module of ``model`` is ``fully_shard``-ed, or ``fmt`` is not E4M3 or E5M2.
        NotImplementedError: this torch's FSDP2 has no ``set_custom_reduce_scatter``.
    """
    where = "fp8amp.fsdp.enable_fp8_reduce_scatter"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    comm = Fp8ReduceScatter(fmt)
    if not hasattr(torch_fsdp.FSDPModule, "set_custom_reduce_scatter"):
        raise NotImplementedError(f"{where}: torch {torch.__version__}'s FSDP2 has no "
                                  "FSDPModule.set_custom_reduce_scatter, through which the FP8 reduce-scatter plugs "
                                  "in; its gradients stay reduce-scattered in reduce_dtype (use a newer torch)")
    sharded = [m for m in model.modules() if isinstance(m, torch_fsdp.FSDPModule)]
    if not sharded:
        raise ValueError(f"{where}: no module of model is fully_shard-ed; call it after fully_shard")
    for module in sharded:
        module.set_custom_reduce_scatter(comm)
    return len(sharded)
