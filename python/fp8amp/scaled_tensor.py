"""``ScaledTensor``: a per-tensor-scaled low-precision tensor that *is* a ``torch.Tensor`` (docs/o1_o2.md#optimization-levels, docs/numerics.md#numerics).

A ``ScaledTensor`` stores ``_data`` (float16, float8_e4m3fn or float8_e5m2, contiguous) and
``_scale_inv`` (float32 ``[1]``, same device) and stands for ``real = _data * _scale_inv``. To
PyTorch it is a tensor of a high-precision *logical* dtype (float32 by default; bfloat16 / float16
allowed) with ``_data``'s shape, strides and device: it can be a parameter, a ``.grad``, a buffer,
an optimizer state, and it can be traced by ``torch.compile`` (``__tensor_flatten__`` /
``__tensor_unflatten__``). It is the representation of FP16-with-scale master weights and FP8 E4M3
weight gradients (issue 4). MS-AMP's ``ScalingTensor`` is not a ``torch.Tensor``, which breaks
GradScaler, clip_grad_norm_, DDP, FSDP2 and compile; this one is.

What each aten op does to a ScaledTensor is its op table's business: :mod:`fp8amp.scaled_tensor_ops`.

``x.float()`` / ``x.to(torch.float32)`` on a ScaledTensor whose logical dtype is already float32
return ``x`` itself, as for any float32 tensor (``aten::to`` short-circuits before dispatch); call
:meth:`ScaledTensor.dequantize` for a plain tensor. ScaledTensor is not differentiable: it is a
storage type for weights, gradients and optimizer states, not an autograd activation.

Serialization: ``torch.save`` / ``torch.load`` (``weights_only=True`` included: the class is
registered as a safe global) round-trip a ScaledTensor bit for bit (codes, scale, logical dtype).
Module state dicts: :class:`~fp8amp.Fp8Linear` saves a ScaledTensor weight as its real values
(a plain tensor of the logical dtype), so a checkpoint of a converted model loads into an
unconverted one; loading into a ScaledTensor parameter re-quantizes through ``copy_``. The real
values survive that round trip exactly (codes times a power-of-two scale), so a resumed run steps
from the same values.
"""

from __future__ import annotations


import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map_only

from . import ops
from .formats import E4M3, HIGH_PRECISION_DTYPES, SCALED_FORMATS, check_dtype
from .scaling import ScalingState

__all__ = ["ScaledTensor", "OP_TABLE", "pre_all_gather", "post_all_gather"]

#: aten op -> handler(func, args, kwargs): the ops ScaledTensor keeps in the subclass or does in
#: place (filled by fp8amp.scaled_tensor_ops); a handler may return NotImplemented to decline.
OP_TABLE: dict = {}

aten = torch.ops.aten

_STORAGE_FORMATS = tuple(SCALED_FORMATS)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _quantize_current(x: torch.Tensor, fmt: torch.dtype, margin: int,
                      nan_if_nonfinite: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling with the pow2 rule: (codes, scale_inv [1], amax [1]); on x's device, no host
    sync; one op (ops.quantize_current). A non-finite x gives a NaN scale_inv by default: every
    write into a ScaledTensor (from_tensor, copy_, its E4M3 copy) makes it read NaN rather than
    saturate (docs/numerics.md#non-finite-values)."""
    if x.dtype not in HIGH_PRECISION_DTYPES:
        x = x.to(torch.float32)
    return ops.quantize_current(x, fmt, margin=margin, nan_if_nonfinite=nan_if_nonfinite)


def _written_args(func, args, kwargs):
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


class ScaledTensor(torch.Tensor):
    """A tensor whose real values are ``_data * _scale_inv`` (per-tensor scale, docs/numerics.md#numerics).

    Args:
        data: the codes, float16 / float8_e4m3fn / float8_e5m2, contiguous.
        scale_inv: float32 ``[1]`` on ``data``'s device.
        dtype: the logical (outer) dtype: float32 (default), bfloat16 or float16.
        requires_grad: of the wrapper (for parameters).
        fp8_copy: optional ``(codes, scale, scale_inv)``: an E4M3 copy of the real values (codes of
            ``data``'s shape, float32 ``[1]`` scales) that FP8 GEMMs read; see :meth:`attach_fp8_copy`.

    Build one from real values with :meth:`from_tensor`.
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _fp8: torch.Tensor | None
    _fp8_scale: torch.Tensor | None
    _fp8_scale_inv: torch.Tensor | None
    _base_rows: "ScaledTensor | None"

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                requires_grad: bool = False, fp8_copy: tuple | None = None):
        where = "fp8amp.ScaledTensor"
        if not isinstance(data, torch.Tensor) or isinstance(data, ScaledTensor):
            raise TypeError(f"{where}: data must be a plain torch.Tensor, got {type(data).__name__}")
        if not isinstance(scale_inv, torch.Tensor) or isinstance(scale_inv, ScaledTensor):
            raise TypeError(f"{where}: scale_inv must be a plain torch.Tensor, got {type(scale_inv).__name__}")
        check_dtype(data.dtype, _STORAGE_FORMATS, "data.dtype", where)
        check_dtype(dtype, HIGH_PRECISION_DTYPES, "dtype", where)
        if not data.is_contiguous():
            raise ValueError(f"{where}: data must be contiguous")
        if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != (1,):
            raise ValueError(f"{where}: scale_inv must be float32 of shape [1], got {scale_inv.dtype} "
                             f"{list(scale_inv.shape)}")
        if scale_inv.device != data.device:
            raise ValueError(f"{where}: scale_inv must be on data's device {data.device}, got {scale_inv.device}")
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=0, dtype=dtype, device=data.device,
            layout=data.layout, requires_grad=requires_grad)
        self._data = data
        self._scale_inv = scale_inv
        self._fp8, self._fp8_scale, self._fp8_scale_inv = fp8_copy if fp8_copy is not None else (None, None, None)
        self._base_rows = None  # the ScaledTensor this is a row view of part of (sharing its scale)
        if self._fp8 is not None and (self._fp8.dtype != E4M3 or self._fp8.shape != data.shape
                                      or self._fp8.device != data.device):
            raise ValueError(f"{where}: fp8_copy codes must be float8_e4m3fn of data's shape and device")
        return self

    # Outputs of plain ops must stay plain: no automatic re-wrapping by __torch_function__.
    __torch_function__ = torch._C._disabled_torch_function_impl

    # ------------------------------------------------------------------ construction / conversion

    @classmethod
    def from_tensor(cls, x: torch.Tensor, dtype: torch.dtype = torch.float16, *, margin: int = 0,
                    orig_dtype: torch.dtype | None = None, nan_if_nonfinite: bool = True) -> "ScaledTensor":
        """Quantizes ``x`` into ``dtype`` (FP16, E4M3 or E5M2) with current scaling.

        ``scale = 2^(floor(log2(fmax / amax(x))) - margin)`` (1 when amax is 0 or not finite), all
        on ``x``'s device without a host sync. The logical dtype is ``orig_dtype``, by default
        ``x.dtype`` when that is float32/bfloat16/float16, else float32. ``x`` is read, not tracked
        by autograd. Non-finite values (docs/numerics.md#non-finite-values): if ``x`` holds an inf
        or NaN, ``scale_inv`` becomes NaN, so every real value reads NaN (E4M3 has no inf, and
        saturated codes would hide the overflow from GradScaler, the optimizer and the loss).
        ``nan_if_nonfinite=False`` saturates instead (``[1, inf]`` reads ``[1, 448]`` in E4M3):
        an explicit choice, never a default.
        """
        where = "fp8amp.ScaledTensor.from_tensor"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
        check_dtype(dtype, _STORAGE_FORMATS, "dtype", where)
        if isinstance(x, ScaledTensor):
            x = x.dequantize()
        if orig_dtype is None:
            orig_dtype = x.dtype if x.dtype in HIGH_PRECISION_DTYPES else torch.float32
        if x.dtype.is_complex:
            raise ValueError(f"{where}: x must be real, got {x.dtype}")
        data, scale_inv, _ = _quantize_current(x.detach(), dtype, margin, nan_if_nonfinite)
        return cls(data, scale_inv, orig_dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The real values ``_data * _scale_inv`` as a plain tensor of ``dtype`` (default: the logical
        dtype), via :func:`fp8amp.ops.dequantize`."""
        return ops.dequantize(self._data, self._scale_inv, self.dtype if dtype is None else dtype)

    to_tensor = dequantize

    # ------------------------------------------------------------------ the E4M3 copy (O1/O2 masters)

    def attach_fp8_copy(self) -> "ScaledTensor":
        """Gives this tensor (an FP16 master weight) an E4M3 copy of its real values, which
        :class:`~fp8amp.Fp8Linear` reads instead of casting the weight in every forward; returns self.

        The copy is kept current by every write: the fp8amp optimizer rewrites it in its fused step,
        and ``copy_``, ``add_``, ``mul_``, ``div_`` and ``zero_`` on this tensor re-cast it. It holds
        ``quantize(real * scale)`` with ``scale = 2^floor(log2(448 / amax(real)))`` (E4M3, margin 0;
        an amax of 0 keeps scale 1), exactly what a fresh cast of the real values gives. It costs
        1 byte per element, and moves, detaches, clones and serializes with the tensor.
        """
        if self._fp8 is None:
            codes, scale_inv, _ = _quantize_current(self.dequantize(torch.float32), E4M3, 0)
            self._fp8, self._fp8_scale_inv = codes, scale_inv
            self._fp8_scale = scale_inv.reciprocal()  # exact: a power of two
        else:
            self._refresh_fp8_copy()
        return self

    def drop_fp8_copy(self) -> "ScaledTensor":
        """Frees the E4M3 copy (Fp8Linear then casts the weight in each forward); returns self."""
        self._fp8 = self._fp8_scale = self._fp8_scale_inv = None
        return self

    def _refresh_fp8_copy(self) -> None:
        if self._fp8 is None:
            return
        codes, scale_inv, _ = _quantize_current(self.dequantize(torch.float32), E4M3, 0)
        self._fp8.copy_(codes)
        self._fp8_scale_inv.copy_(scale_inv)
        torch.reciprocal(scale_inv, out=self._fp8_scale)

    def share_memory_(self):
        """Refused: torch shares a tensor's storage between processes, and a ScaledTensor is a
        wrapper without one of its own (sharing it crashed the process)."""
        raise RuntimeError(
            "fp8amp.ScaledTensor: share_memory_() is not supported (an O1/O2 master or an FP8 gradient is a "
            "wrapper of codes and a scale, with no storage of its own to share); train with several "
            "processes through torch.distributed (DDP, FSDP2: docs/distributed.md), or share a model "
            "converted for FP8 compute only (fp8amp.convert), whose weights are plain tensors")

    @property
    def codes(self) -> torch.Tensor:
        """The stored codes (read them; write through the tensor's own ops)."""
        return self._data

    @property
    def scale_inv(self) -> torch.Tensor:
        """float32 ``[1]``: what the codes multiply by to give the real values."""
        return self._scale_inv

    def fp8_operands(self) -> tuple | None:
        """What an FP8 GEMM reads for this weight: ``(codes, codes_t, scale_inv, transpose_from)``.

        With an E4M3 copy (an O1/O2 master): the copy's codes, ``codes_t`` None and
        ``transpose_from = (codes, scale_inv, copy_scale)`` of the master, from which the backward
        casts the transpose (bit-identical to the copy's). An E4M3 tensor (FSDP2's gathered
        weight): its codes and their transpose, ``transpose_from`` None. Otherwise None: the
        caller casts the real values."""
        if self._fp8 is not None:
            return self._fp8, None, self._fp8_scale_inv, (self._data, self._scale_inv, self._fp8_scale)
        if self._data.dtype == E4M3:
            return self._data, self._data.t().contiguous(), self._scale_inv, None
        return None

    @property
    def fp8_copy(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(codes, scale, scale_inv)`` of the E4M3 copy, or None."""
        return None if self._fp8 is None else (self._fp8, self._fp8_scale, self._fp8_scale_inv)

    def _fp8_copy_with(self, fn) -> tuple | None:
        """The copy's three tensors mapped by fn (detach, clone, a device move...), or None."""
        copy = self.fp8_copy
        return None if copy is None else tuple(fn(t) for t in copy)

    @property
    def storage_format(self) -> torch.dtype:
        """The dtype of the codes: float16, float8_e4m3fn or float8_e5m2."""
        return self._data.dtype

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105 (host sync: printing only)
        real = self.dequantize()
        # Under torch.compile the inner tensors are fake: no value to read (Inductor prints graph
        # inputs, and an .item() there fails the whole compilation).
        scale_inv = self._scale_inv
        shown = scale_inv if is_fake(scale_inv) or scale_inv.is_meta else scale_inv.item()
        return f"ScaledTensor({real!r}, format={self._data.dtype}, scale_inv={shown!r})"

    # ------------------------------------------------------------------ FSDP2 (fp8amp.fsdp)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2's all-gather extension for an O1/O2 master sharded by ``fully_shard``: this rank's
        shard of real values goes out as E4M3 codes with the whole weight's scale (fp8amp.fsdp)."""
        return pre_all_gather(self.dequantize(torch.float32), mesh, outer_size, module)

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
        return ScaledTensor(inner_tensors["_data"], inner_tensors["_scale_inv"], dtype, fp8_copy=copy)

    # ------------------------------------------------------------------ pickling

    def __getstate__(self):
        # pickle.loads (not torch.load) of a float8 tensor fails in torch (its storage has no typed
        # class: "UntypedStorage has no attribute 'dtype'"), which broke pickle, multiprocessing
        # and copy-by-pickle of O1/O2 models. FP8 codes travel as uint8 views of the same bytes.
        state = dict(self.__dict__)
        fp8 = {k: v.dtype for k, v in state.items() if isinstance(v, torch.Tensor) and v.dtype in _FP8_DTYPES}
        for k in fp8:
            state[k] = state[k].view(torch.uint8)
        state["_fp8_dtypes"] = fp8
        return state

    def __setstate__(self, state):
        state = dict(state)
        for k, dtype in state.pop("_fp8_dtypes", {}).items():
            state[k] = state[k].view(dtype)
        self.__dict__.update(state)

    # ------------------------------------------------------------------ dispatch

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = OP_TABLE.get(func)
        if handler is not None:
            result = handler(func, args, kwargs)
            if result is not NotImplemented:
                return result
        for v in _written_args(func, args, kwargs):
            if isinstance(v, ScaledTensor):
                raise NotImplementedError(
                    f"fp8amp.ScaledTensor: in-place op {func} is not supported on a ScaledTensor (it would "
                    f"lose the scaled representation); supported in place: copy_, add_, mul_/div_ by a scalar, zero_. "
                    f"Dequantize, compute, then copy_ the result back.")
        args, kwargs = tree_map_only(ScaledTensor, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------- FSDP2 all-gather in E4M3
# Shared by O1/O2 masters (the hooks above) and fp8amp.fsdp.Fp8AllGatherWeight.


def pre_all_gather(shard: torch.Tensor, mesh, outer_size: torch.Size, module: nn.Module) -> tuple:
    """FSDP2's fsdp_pre_all_gather for the weight of ``module`` (an Fp8Linear, whose
    ``weight_scaling`` gives the scale): this rank's shard (real values) as E4M3 codes with the
    whole weight's scale, padded to the first rank's shard size, and that scale's inverse."""
    if not isinstance(getattr(module, "weight_scaling", None), ScalingState):
        raise TypeError(f"fp8amp.fsdp: an FP8 all-gather weight must be the weight of an Fp8Linear, not of a "
                        f"{type(module).__name__}")
    if mesh.ndim != 1:
        raise NotImplementedError(f"fp8amp.fsdp: the FP8 all-gather needs a 1-D shard mesh, got {mesh.ndim}-D {mesh}")
    codes, scale_inv = module.weight_scaling.quantize_shard(shard, mesh.get_group())
    codes = codes.view(torch.uint8)
    # An uneven split: every rank sends the first rank's (padded) shard size; zero codes pad.
    padded_rows = -(-outer_size[0] // mesh.size())
    if codes.size(0) < padded_rows:
        codes = torch.nn.functional.pad(codes, (0, 0) * (codes.dim() - 1) + (0, padded_rows - codes.size(0)))
    return (codes,), scale_inv


def post_all_gather(all_gather_outputs, scale_inv: torch.Tensor, param_dtype: torch.dtype, out=None):
    """FSDP2's fsdp_post_all_gather: the gathered codes as an E4M3 ScaledTensor of the logical
    dtype ``param_dtype``, which Fp8Linear's GEMMs read as they are."""
    (data,) = all_gather_outputs
    if out is not None:  # later all-gathers: the codes arrived in the same buffer; the scale is new
        out._scale_inv = scale_inv  # not copy_: the forward saved the old one for its backward
        return None
    return ScaledTensor(data.view(E4M3), scale_inv, param_dtype), (data,)


torch.serialization.add_safe_globals([ScaledTensor])
