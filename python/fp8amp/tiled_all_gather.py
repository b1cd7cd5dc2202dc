"""FSDP2's all-gather of the weights of tiled-recipe Fp8Linears (docs/distributed.md, "FSDP2").

:func:`fp8amp.master_weight.pre_all_gather` hands a layer under the rowwise or blockwise recipe
to :func:`tiled_pre_all_gather`, which picks by recipe and shard layout:

* ``"blocks"`` (blockwise, and every rank's shard a whole number of 128-row blocks: FSDP2's
  ``ceil(rows / world)`` rows a rank is a multiple of 128): each rank quantizes its own shard with
  its own 128 x 128 block scales (the blocks of the whole weight, since none crosses a shard
  boundary) and FSDP2 moves the E4M3 codes and the float32 block scales. The layer gets a
  :class:`~fp8amp.block_scaled_tensor.BlockScaledTensor`, whose codes and scales are bit for bit
  the blockwise cast of the whole weight, and its GEMMs read them as they are.
* ``"fp16"`` (an O1/O2 master otherwise: rowwise, whose transpose needs per-column scales over
  every rank's rows, or blockwise shards that split a block): each rank rescales its master
  shard's FP16 codes to one scale shared by all ranks (the largest ``scale_inv``, one 4-byte MAX
  all-reduce; a multiplication by a power of two ``<= 1``, exact but for codes that fall below
  FP16's subnormals, ``2^-24`` of the scale) and FSDP2 moves the 2-byte codes. The layer gets an
  FP16 ScaledTensor, which it casts with tile scales as it casts an unsharded master.
* ``"plain"`` (FP8 compute, ``fp8amp.fsdp.enable_fp8_all_gather``, otherwise): the shard in the
  parameter dtype, as FSDP2's own all-gather moves it; the layer casts the gathered weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ops
from .block_scaled_tensor import BLOCK_TILE, BlockScaledTensor
from .formats import E4M3, FP16
from .recipes import BLOCK
from .scaled_tensor import ScaledTensor

__all__ = ["tiled_pre_all_gather", "tiled_post_all_gather", "blocks_align"]


def blocks_align(rows: int, world: int) -> bool:
    """Whether FSDP2's row shards of a ``rows``-row weight on ``world`` ranks (``ceil(rows /
    world)`` rows each, the last ones fewer or none) are whole 128-row blocks."""
    return rows % BLOCK == 0 and -(-rows // world) % BLOCK == 0


# ---------------------------------------------------------------------------- FSDP2's hooks


def _pad_rows(t: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    pad = rows - t.shape[0]
    return torch.nn.functional.pad(t, (0, 0, 0, pad), value=value) if pad > 0 else t


def tiled_pre_all_gather(shard: torch.Tensor, mesh, outer_size: torch.Size, module, param_dtype: torch.dtype):
    """fsdp_pre_all_gather of a tiled-recipe layer's weight (``module.recipe`` rowwise or
    blockwise): ``shard`` is this rank's master shard (a MasterWeight) or plain weight shard.
    Returns ``(all_gather_inputs, metadata)``, every input padded to the first rank's rows."""
    rows, world = outer_size[0], mesh.size()
    shard_rows = -(-rows // world)
    is_master = isinstance(shard, ScaledTensor)  # an O1/O2 MasterWeight
    if module.recipe.kind == "blockwise" and blocks_align(rows, world):
        recipe, cols = module.recipe, outer_size[1]
        if shard.shape[0] == 0:  # a rank beyond the weight's rows: padding only
            codes = torch.zeros(0, cols, dtype=E4M3, device=shard.device)
            scale_inv = torch.ones(0, -(-cols // BLOCK), device=shard.device)
        else:
            source = shard.codes if is_master else shard
            codes, scale_inv = ops.quantize_tiles(source, E4M3, BLOCK_TILE, margin=recipe.margin,
                                                  pow2_scale=recipe.pow2_scale)
            if is_master:  # its codes times a power-of-two scale: the real values' blocks (exact)
                scale_inv = scale_inv * shard.scale_inv
        codes = _pad_rows(codes.view(torch.uint8), shard_rows)
        return (codes, _pad_rows(scale_inv, shard_rows // BLOCK, 1.0)), ("blocks",)
    if is_master:
        scale_inv = shard.scale_inv.clone()
        dist.all_reduce(scale_inv, op=dist.ReduceOp.MAX, group=mesh.get_group())
        ratio = shard.scale_inv / scale_inv  # a power of two, <= 1
        codes = (shard.codes.to(torch.float32) * ratio).to(FP16)
        # In FP16, not viewed as bytes: FSDP2 wants an unevenly sharded weight's inputs in its
        # padded shard's shape (it moves inputs of mixed dtypes as bytes itself).
        return (_pad_rows(codes, shard_rows),), ("fp16", scale_inv)
    return (_pad_rows(shard.to(param_dtype), shard_rows),), ("plain",)


def tiled_post_all_gather(all_gather_outputs, metadata: tuple, param_dtype: torch.dtype, out=None):
    """fsdp_post_all_gather for :func:`tiled_pre_all_gather`'s metadata."""
    kind = metadata[0]
    if out is not None:  # later all-gathers: the codes and scales arrived in the same buffers
        if kind == "fp16":
            out._scale_inv = metadata[1]  # not copy_: the forward saved the old one for its backward
        return None
    if kind == "blocks":
        codes, scale_inv = all_gather_outputs
        return BlockScaledTensor(codes.view(E4M3), scale_inv, param_dtype), (codes, scale_inv)
    (data,) = all_gather_outputs
    if kind == "fp16":
        return ScaledTensor(data.view(FP16), metadata[1], param_dtype), (data,)
    return data, (data,)
