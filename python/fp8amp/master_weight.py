"""``MasterWeight``: the O1/O2 master of an Fp8Linear weight (docs/o1_o2.md#optimization-levels).

A :class:`~fp8amp.ScaledTensor` of FP16 codes and a per-tensor scale (2 bytes per element) that
also owns an E4M3 copy of its real values, the operand the FP8 GEMMs read, and the hooks by which
FSDP2 all-gathers it in E4M3. :func:`fp8amp.initialize` makes one of each Fp8Linear weight; the
fp8amp optimizer rewrites codes, scale and copy in its fused step, and every other write (the
in-place ops of the op table) re-casts the copy. Views, detach, clone and device moves keep the
type and map the copy with the codes.

It also carries its kept amax, the largest magnitude of its real values, which spares the fused
optimizer step a read of the master (docs/o1_o2.md#optimizer): computed when first asked for,
written by the optimizer's step and refreshed by every other write of the whole master; shared
with its aliases.
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .formats import E4M3, FP16
from .scaled_tensor import ScaledTensor, _quantize_current
from .scaling import ScalingState
from .tiled_all_gather import tiled_post_all_gather, tiled_pre_all_gather

__all__ = ["MasterWeight", "pre_all_gather", "post_all_gather"]


class _KeptAmax:
    """The kept amax of a master and of its aliases (detach, views share one; a clone or a device
    move gets its own): float32 ``[1]``, the largest magnitude of the master's real values, which
    the fused optimizer step reads and writes (include/fp8amp/optim.h, "Kept master amax"); made
    when first asked for. NaN (unknown: the next step reads the master) only after a write of part
    of the master."""

    __slots__ = ("tensor", "version")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.version: int | None = None  # the master's version counter when the value was last made

    def get(self, master: "MasterWeight") -> torch.Tensor:
        """The tensor, made or made current first: a write the op table did not see (one that
        torch.compile traced, which writes the inner tensors back and bumps the master's version
        counter) shows in that counter."""
        if self.tensor is None:
            self.tensor = _real_amax(master)
            self.version = master._version
        elif self.version != master._version and not torch.compiler.is_compiling():
            self.refresh(master)
        return self.tensor

    def refresh(self, master: "MasterWeight", amax: torch.Tensor | None = None) -> None:
        """After a write of the whole master (``amax``: its real values' amax, if at hand)."""
        if self.tensor is not None:
            self.tensor.copy_(_real_amax(master) if amax is None else amax)
            self.version = master._version  # (an op-table write bumps it after: one more refresh)

    def stepped(self, master: "MasterWeight") -> None:
        """After the optimizer's fused step wrote the master and this value (and bumped its counter)."""
        self.version = master._version

    def forget(self) -> None:
        """After a write of part of it: unknown."""
        if self.tensor is not None:
            self.tensor.fill_(float("nan"))


def _real_amax(master: ScaledTensor) -> torch.Tensor:
    """float32 [1]: max |real value| (NaN if one is NaN; 0 for no element), as the optimizer's
    commit computes it (the stored values' amax: the largest code times the power-of-two scale_inv)."""
    return ops.amax_of(master.dequantize(torch.float32))


class MasterWeight(ScaledTensor):
    """An FP16 ScaledTensor master weight with an optional E4M3 copy of its real values.

    Args:
        data: the FP16 codes, contiguous.
        scale_inv: float32 ``[1]`` on ``data``'s device.
        dtype: the logical dtype: float32 (default), bfloat16 or float16.
        requires_grad: of the wrapper (for parameters).
        fp8_copy: optional ``(codes, scale, scale_inv)`` of the E4M3 copy: codes of ``data``'s
            shape and device, float32 ``[1]`` scales. :meth:`from_tensor` attaches one.

    ``MasterWeight(tensor, requires_grad=...)``, without ``scale_inv``, is the parameter of a
    master as ``nn.Parameter(tensor, requires_grad)`` makes one: of ``tensor`` itself if it is a
    master, else of the master of its real values (:meth:`from_tensor`). That is how accelerate's
    ``set_module_tensor_to_device`` rebuilds a parameter in its class when it offloads or loads one
    (``cpu_offload``, ``disk_offload``, ``dispatch_model``).
    """

    _fp8: torch.Tensor | None
    _fp8_scale: torch.Tensor | None
    _fp8_scale_inv: torch.Tensor | None
    _kept: _KeptAmax | None = None  # None only on a master unpickled (see __getstate__) until first needed

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                requires_grad: bool = False, fp8_copy: tuple | None = None):
        if scale_inv is None:
            master = data if isinstance(data, MasterWeight) else cls.from_tensor(data, orig_dtype=data.dtype)
            return nn.Parameter(master, requires_grad)
        self = ScaledTensor.__new__(cls, data, scale_inv, dtype, requires_grad)
        if data.dtype != FP16:
            raise ValueError(f"fp8amp.MasterWeight: data must hold float16 codes, got {data.dtype}")
        self._fp8, self._fp8_scale, self._fp8_scale_inv = fp8_copy if fp8_copy is not None else (None, None, None)
        if self._fp8 is not None and (self._fp8.dtype != E4M3 or self._fp8.shape != data.shape
                                      or self._fp8.device != data.device):
            raise ValueError("fp8amp.MasterWeight: fp8_copy codes must be float8_e4m3fn of data's shape and device")
        return self

    @classmethod
    def _wrap(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
              requires_grad: bool = False) -> "MasterWeight":
        self = super()._wrap(data, scale_inv, dtype, requires_grad)
        self._kept = _KeptAmax()
        return self

    @classmethod
    def from_tensor(cls, x: torch.Tensor, dtype: torch.dtype = FP16, *, margin: int = 0,
                    orig_dtype: torch.dtype | None = None, nan_if_nonfinite: bool = True) -> "MasterWeight":
        """The master of real values ``x``: FP16 codes with a current scale (as
        :meth:`ScaledTensor.from_tensor`), with the E4M3 copy attached."""
        if dtype != FP16:
            raise ValueError(f"fp8amp.MasterWeight.from_tensor: dtype must be torch.float16 (a master holds "
                             f"FP16 codes), got {dtype}")
        master = super().from_tensor(x, FP16, margin=margin, orig_dtype=orig_dtype, nan_if_nonfinite=nan_if_nonfinite)
        return master.attach_fp8_copy()

    # ------------------------------------------------------------------ the E4M3 copy

    def attach_fp8_copy(self) -> "MasterWeight":
        """Gives this master an E4M3 copy of its real values, which :class:`~fp8amp.Fp8Linear`
        reads instead of casting the weight in every forward; returns self.

        The copy holds ``quantize(real * scale)`` with ``scale = 2^floor(log2(448 / amax(real)))``
        (E4M3, margin 0; an amax of 0 keeps scale 1), exactly what a fresh cast of the real values
        gives. It costs 1 byte per element, and moves, detaches, clones and serializes with the tensor.
        """
        if self._fp8 is None:
            codes, scale_inv, _ = _quantize_current(self.dequantize(torch.float32), E4M3, 0)
            self._fp8, self._fp8_scale_inv = codes, scale_inv
            self._fp8_scale = scale_inv.reciprocal()  # exact: a power of two
        else:
            self._after_write()
        return self

    def drop_fp8_copy(self) -> "MasterWeight":
        """Frees the E4M3 copy (Fp8Linear then casts the weight in each forward); returns self."""
        self._fp8 = self._fp8_scale = self._fp8_scale_inv = None
        return self

    @property
    def fp8_copy(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(codes, scale, scale_inv)`` of the E4M3 copy, or None."""
        return None if self._fp8 is None else (self._fp8, self._fp8_scale, self._fp8_scale_inv)

    def fp8_operands(self) -> tuple | None:
        """With the E4M3 copy: ``(copy codes, None, copy scale_inv, transpose_from)``, where
        ``transpose_from = (codes, scale_inv, copy scale)`` of the master is what the backward
        casts the transpose from (bit-identical to the copy's). Without: None (the caller casts)."""
        if self._fp8 is None:
            return None
        return self._fp8, None, self._fp8_scale_inv, (self._data, self._scale_inv, self._fp8_scale)

    def kept_amax(self) -> torch.Tensor:
        """float32 ``[1]`` on the master's device: the largest magnitude of its real values (NaN:
        unknown, after a write of part of the master). The optimizer's fused step reads and writes
        it (include/fp8amp/optim.h, "Kept master amax"); computed at the first call."""
        return self._kept_holder().get(self)

    def _kept_holder(self) -> _KeptAmax:
        if self._kept is None:
            self._kept = _KeptAmax()
        return self._kept

    def __getstate__(self) -> dict:
        # the kept amax travels as its tensor (weights_only loads allow no other class), which a
        # torch.save keeps shared with the aliases saved beside the master, as the codes are
        state = super().__getstate__()
        state["_kept"] = self.kept_amax()
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        kept = _KeptAmax()
        kept.tensor = state.pop("_kept", None)  # None: pickled before the kept amax, computed when asked
        super().__setstate__(state)
        self._kept = kept

    def _rewrap(self, data_fn, scale_fn) -> "MasterWeight":
        out = MasterWeight._wrap(data_fn(self._data), scale_fn(self._scale_inv), self.dtype)
        if torch._C._is_alias_of(out._data, self._data):  # detach, views: a write through it writes this
            out._kept = self._kept_holder()
        if self._fp8 is None:
            out._fp8 = out._fp8_scale = out._fp8_scale_inv = None
        else:
            out._fp8, out._fp8_scale, out._fp8_scale_inv = (data_fn(self._fp8), scale_fn(self._fp8_scale),
                                                            scale_fn(self._fp8_scale_inv))
        return out

    def _after_write(self, source: ScaledTensor | None = None) -> None:
        kept = self._kept
        # Unknown after a write of rows of a master. (A write torch.compile traces reaches a master
        # rebuilt from the inner tensors, not this kept amax: the version counter tells, see get.)
        if kept is not None and self._base_rows is not None:
            kept.forget()
            kept = None
        amax = None  # the real values' amax, where re-casting the copy computes it
        if self._fp8 is not None:
            # Written under __torch_dispatch__, where torch bumps no inner tensor's version counter:
            # those a compiled Fp8Linear's backward saved must say so (fp8amp.linear).
            torch.autograd.graph.increment_version(self.fp8_operands()[3])
            if isinstance(source, MasterWeight) and source._fp8 is not None:
                for mine, theirs in zip(self.fp8_copy, source.fp8_copy):
                    mine.copy_(theirs)
            else:
                codes, scale_inv, amax = _quantize_current(self.dequantize(torch.float32), E4M3, 0)
                self._fp8.copy_(codes)
                self._fp8_scale_inv.copy_(scale_inv)
                torch.reciprocal(scale_inv, out=self._fp8_scale)
        if kept is not None:
            kept.refresh(self, amax)

    # ------------------------------------------------------------------ FSDP2 (fp8amp.fsdp)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2's all-gather extension for a master sharded by ``fully_shard``: this rank's shard
        of real values goes out as E4M3 codes with the whole weight's scale (fp8amp.fsdp)."""
        return pre_all_gather(self, mesh, outer_size, module, mp_policy.param_dtype or self.dtype)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return post_all_gather(all_gather_outputs, metadata, param_dtype, out)

    # ------------------------------------------------------------------ torch.compile support

    def __tensor_flatten__(self):
        names = ["_data", "_scale_inv"]
        if self._fp8 is not None:
            names += ["_fp8", "_fp8_scale", "_fp8_scale_inv"]
        return names, (self.dtype, self._fp8 is not None)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        dtype, has_copy = ctx
        copy = (inner_tensors["_fp8"], inner_tensors["_fp8_scale"], inner_tensors["_fp8_scale_inv"]) if has_copy else None
        return MasterWeight(inner_tensors["_data"], inner_tensors["_scale_inv"], dtype, fp8_copy=copy)


# ---------------------------------------------------------------------- FSDP2 all-gather in E4M3
# Shared by masters (the hooks above) and fp8amp.fsdp.Fp8AllGatherWeight.


def pre_all_gather(shard: torch.Tensor, mesh, outer_size: torch.Size, module: nn.Module,
                   param_dtype: torch.dtype) -> tuple:
    """FSDP2's fsdp_pre_all_gather for the weight of ``module`` (an Fp8Linear, whose
    ``weight_scaling`` gives the scale): this rank's shard (a plain tensor or a master) as E4M3
    codes with the whole weight's scale, padded to the first rank's shard size, and that scale's
    inverse; the amax goes into the weight's history only in ``train()`` mode outside inference
    mode (or with ``record_amax_outside_training``). Under the tiled recipes:
    :func:`fp8amp.tiled_all_gather.tiled_pre_all_gather`."""
    if not isinstance(getattr(module, "weight_scaling", None), ScalingState):
        raise TypeError(f"fp8amp.fsdp: an FP8 all-gather weight must be the weight of an Fp8Linear, not of a "
                        f"{type(module).__name__}")
    if mesh.ndim != 1:
        raise NotImplementedError(f"fp8amp.fsdp: the FP8 all-gather needs a 1-D shard mesh, got {mesh.ndim}-D {mesh}")
    if module.recipe.tiled:
        return tiled_pre_all_gather(shard, mesh, outer_size, module, param_dtype)
    if isinstance(shard, ScaledTensor):
        shard = shard.dequantize(torch.float32)
    # FSDP2 gathers under no_grad, hiding the caller's grad mode: the layer's mode decides here.
    record = module.record_amax_outside_training or (module.training and not torch.is_inference_mode_enabled())
    codes, scale_inv = module.weight_scaling.quantize_shard(shard, mesh.get_group(), record=record)
    codes = codes.view(torch.uint8)
    # An uneven split: every rank sends the first rank's (padded) shard size; zero codes pad.
    padded_rows = -(-outer_size[0] // mesh.size())
    if codes.size(0) < padded_rows:
        codes = torch.nn.functional.pad(codes, (0, 0) * (codes.dim() - 1) + (0, padded_rows - codes.size(0)))
    return (codes,), scale_inv


def post_all_gather(all_gather_outputs, scale_inv, param_dtype: torch.dtype, out=None):
    """FSDP2's fsdp_post_all_gather: the gathered codes as an E4M3 ScaledTensor of the logical
    dtype ``param_dtype``, which Fp8Linear's GEMMs read as they are (a tiled recipe's metadata, a
    tuple: :func:`fp8amp.tiled_all_gather.tiled_post_all_gather`)."""
    if isinstance(scale_inv, tuple):
        return tiled_post_all_gather(all_gather_outputs, scale_inv, param_dtype, out)
    (data,) = all_gather_outputs
    if out is not None:  # later all-gathers: the codes arrived in the same buffer; the scale is new
        out._scale_inv = scale_inv  # not copy_: the forward saved the old one for its backward
        return None
    return ScaledTensor(data.view(E4M3), scale_inv, param_dtype), (data,)


torch.serialization.add_safe_globals([MasterWeight])
