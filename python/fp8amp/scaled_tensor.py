"""``ScaledTensor``: a per-tensor-scaled low-precision tensor that *is* a ``torch.Tensor`` (docs/o1_o2.md#optimization-levels, docs/numerics.md#numerics).

A ``ScaledTensor`` stores ``_data`` (float16, float8_e4m3fn or float8_e5m2, contiguous) and
``_scale_inv`` (float32 ``[1]``, same device) and stands for ``real = _data * _scale_inv``. To
PyTorch it is a tensor of a high-precision *logical* dtype (float32 by default; bfloat16 / float16
allowed) with ``_data``'s shape, strides and device: it can be a parameter, a ``.grad``, a buffer,
an optimizer state, and it can be traced by ``torch.compile`` (``__tensor_flatten__`` /
``__tensor_unflatten__``). It represents the FP8 E4M3 weight gradients and the O2 optimizer
states; the O1/O2 master weights are its subclass :class:`~fp8amp.MasterWeight`
(:mod:`fp8amp.master_weight`), which adds the E4M3 copy the FP8 GEMMs read and the FSDP2 hooks.
MS-AMP's ``ScalingTensor`` is not a ``torch.Tensor``, which breaks GradScaler, clip_grad_norm_,
DDP, FSDP2 and compile; this one is.

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
from torch._subclasses.fake_tensor import is_fake

from . import ops
from .dequantized_view import RealValuesMixin, view_of
from .wrapper_ops import is_view_op, make_wrapper, run_on_values, written_instances
from .formats import E4M3, HIGH_PRECISION_DTYPES, SCALED_FORMATS, check_dtype

__all__ = ["ScaledTensor", "OP_TABLE"]

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


def norms_from_codes(tensors: list, tile: tuple[int, int] | None, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The 2-norms of the real values of scaled tensors (anything with ``codes``, ``scale_inv``,
    ``dtype``: ScaledTensors with ``tile`` None, BlockScaledTensors with their blocks), each a 0-d
    tensor of ``dtype`` (default: the tensor's logical dtype): one :func:`fp8amp.ops.multi_norm_tiles`
    call per device and code dtype, which reads every code once (clip_grad_norm_'s norms of FP8
    gradients)."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.codes.device, t.codes.dtype), []).append(i)
    norms: list = [None] * len(tensors)
    for members in groups.values():
        values = ops.multi_norm_tiles([tensors[i].codes for i in members], [tensors[i].scale_inv for i in members],
                                      tile)
        converted: dict[torch.dtype, tuple] = {}  # the float32 norms in each result dtype asked for
        for k, i in enumerate(members):
            out_dtype = dtype or tensors[i].dtype
            if out_dtype not in converted:
                converted[out_dtype] = values.to(out_dtype).unbind()
            norms[i] = converted[out_dtype][k]
    return norms


class WrapperTensorMixin(RealValuesMixin):
    """What fp8amp's tensor subclasses (ScaledTensor, BlockScaledTensor) do alike as wrappers of
    inner tensors with no storage of their own: pickling, ``.data`` assignment, item assignment,
    ``numpy`` (which torch refuses for any subclass) of the real values, and with them what
    :class:`RealValuesMixin` does for any tensor without storage."""

    # pickle.loads (not torch.load) of a float8 tensor fails in torch (its storage has no typed
    # class: "UntypedStorage has no attribute 'dtype'"), which broke pickle, multiprocessing and
    # copy-by-pickle of O1/O2 models and of FP8 gradients. FP8 inner tensors travel as uint8
    # views of the same bytes.
    def __getstate__(self):
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
        base = state.get("_base_rows")
        if base is not None and base._data.untyped_storage().data_ptr() != state["_data"].untyped_storage().data_ptr():
            # A row view unpickled apart from its base's codes (pickle copies each storage; torch.save
            # keeps them shared): no longer a view, so a write must not look for its rows there.
            state["_base_rows"] = None
        self.__dict__.update(state)

    @property
    def data(self):
        """A detached alias, as for any tensor."""
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value):
        # torch's own setter replaces only the wrapper's empty storage: the values stayed (so
        # vector_to_parameters and `p.data = x` left O1/O2 masters unchanged, silently).
        name = type(self).__name__
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"fp8amp.{name}: .data must be set to a tensor, got {type(value).__name__}")
        if value.shape != self.shape:
            raise ValueError(f"fp8amp.{name}: .data = x writes x's values into this tensor, which keeps its shape "
                             f"{list(self.shape)}; got x of shape {list(value.shape)}")
        with torch.no_grad():
            self.copy_(value)

    def _real_values(self) -> torch.Tensor:
        return self.dequantize()

    def numpy(self, *, force: bool = False):
        """The real values as a NumPy array (a copy: the codes are not the values). As for a plain
        tensor, a tensor that requires grad needs ``force=True`` (or ``.detach()`` first)."""
        if self.requires_grad and not force:
            raise RuntimeError(f"fp8amp.{type(self).__name__}: can't call numpy() on a tensor that requires grad; "
                               "use .detach().numpy() (or numpy(force=True))")
        return self.dequantize().detach().cpu().numpy()

    def __setitem__(self, index, value) -> None:
        # A plain tensor's item assignment writes through a view of it; views of these wrappers
        # other than whole rows are dequantized copies, so `x[:, j] = v` (and every index of a
        # block-scaled tensor) was lost, silently. The real values with the assignment are written
        # back as copy_ writes them: one rounding into the format with fresh scales.
        if torch.is_grad_enabled() and self.requires_grad:
            raise RuntimeError(f"fp8amp.{type(self).__name__}: x[index] = value on a tensor that requires grad is an "
                               "in-place operation on a leaf; do it under torch.no_grad()")
        real = self.dequantize(torch.float32)
        real[index] = value
        with torch.no_grad():
            self.copy_(real)


class ScaledTensor(WrapperTensorMixin, torch.Tensor):
    """A tensor whose real values are ``_data * _scale_inv`` (per-tensor scale, docs/numerics.md#numerics).

    Args:
        data: the codes, float16 / float8_e4m3fn / float8_e5m2, contiguous.
        scale_inv: float32 ``[1]`` on ``data``'s device.
        dtype: the logical (outer) dtype: float32 (default), bfloat16 or float16.
        requires_grad: of the wrapper (for parameters).

    Build one from real values with :meth:`from_tensor`.
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _base_rows: "ScaledTensor | None"

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                requires_grad: bool = False):
        where = f"fp8amp.{cls.__name__}"
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
        return cls._wrap(data, scale_inv, dtype, requires_grad)

    @classmethod
    def _wrap(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
              requires_grad: bool = False) -> "ScaledTensor":
        """A ``cls`` over ``data`` and ``scale_inv`` without the checks of ``__new__``: for fp8amp's
        own constructions, whose inner tensors are valid by how they were made (a detach, a view,
        a cast op's outputs). Autograd detaches every new gradient, so this runs for every FP8
        weight gradient of every step: host time in the hot loop."""
        self = make_wrapper(cls, data, strides=data.stride(), storage_offset=0, dtype=dtype, device=data.device,
                            layout=data.layout, requires_grad=requires_grad)
        self._data = data
        self._scale_inv = scale_inv
        self._base_rows = None  # the ScaledTensor this is a row view of part of (sharing its scale)
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
        ``nan_if_nonfinite=False`` instead takes scale 1 for such an ``x`` (the scale rule's choice
        for a non-finite amax): only the non-finite elements read NaN (``[1, inf]`` reads
        ``[1, NaN]``); finite values beyond the format's max saturate.
        """
        where = "fp8amp.ScaledTensor.from_tensor"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
        check_dtype(dtype, _STORAGE_FORMATS, "dtype", where)
        if isinstance(x, WrapperTensorMixin):  # a ScaledTensor or BlockScaledTensor: its real values
            orig_dtype = orig_dtype or x.dtype
            x = x.dequantize(torch.float32)  # not in its logical dtype, which would round twice
        if orig_dtype is None:
            orig_dtype = x.dtype if x.dtype in HIGH_PRECISION_DTYPES else torch.float32
        if x.dtype.is_complex:
            raise ValueError(f"{where}: x must be real, got {x.dtype}")
        data, scale_inv, _ = _quantize_current(x.detach(), dtype, margin, nan_if_nonfinite)
        return cls(data, scale_inv, orig_dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The real values ``_data * _scale_inv`` as a plain tensor of ``dtype`` (default: the logical
        dtype; float64 holds the float32 values exactly), via :func:`fp8amp.ops.dequantize`."""
        if dtype == torch.float64:
            return self.dequantize(torch.float32).to(torch.float64)
        return ops.dequantize(self._data, self._scale_inv, self.dtype if dtype is None else dtype)

    to_tensor = dequantize

    # ------------------------------------------------------------------ hooks of subclasses

    def _rewrap(self, data_fn, scale_fn) -> "ScaledTensor":
        """A tensor of this type over ``data_fn(codes)`` and ``scale_fn(scale_inv)``: what detach,
        clone, views and device moves make (a subclass maps what else it holds the same way). Each
        fn keeps dtype, contiguity and device alike for both, so the checks of ``__new__`` hold."""
        return ScaledTensor._wrap(data_fn(self._data), scale_fn(self._scale_inv), self.dtype)

    def _after_write(self, source: "ScaledTensor | None" = None) -> None:
        """Called after every in-place write of the codes or the scale (``source``: the tensor
        copied bit for bit, if that was the write); a subclass refreshes what it derives from them."""

    @property
    def codes(self) -> torch.Tensor:
        """The stored codes (read them; write through the tensor's own ops)."""
        return self._data

    @property
    def scale_inv(self) -> torch.Tensor:
        """float32 ``[1]``: what the codes multiply by to give the real values (read it; write
        through the tensor's own ops, which keep what is derived from it current)."""
        return self._scale_inv

    def fp8_operands(self) -> tuple | None:
        """What an FP8 GEMM reads for this tensor as a weight: ``(codes, codes_t, scale_inv,
        transpose_from)``. An E4M3 tensor (FSDP2's gathered weight): its codes and their
        transpose, ``transpose_from`` None. Otherwise None: the caller casts the real values
        (:class:`~fp8amp.MasterWeight` answers with its E4M3 copy)."""
        if self._data.dtype == E4M3:
            return self._data, self._data.t().contiguous(), self._scale_inv, None
        return None

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

    # ------------------------------------------------------------------ torch.compile support

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return ScaledTensor(inner_tensors["_data"], inner_tensors["_scale_inv"], ctx)

    # ------------------------------------------------------------------ dispatch

    # Never a frame of its own for Dynamo: a backward run eagerly from compiled code (loss.backward()
    # in a compiled train step) calls this under Dynamo's frame hook, whose trace of _wrap crashed on
    # the half-built wrapper. AOTAutograd's traces still run it. About 0.15 µs a call.
    @classmethod
    @torch.compiler.disable
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = OP_TABLE.get(func)
        if handler is not None:
            result = handler(func, args, kwargs)
            if result is not NotImplemented:
                return result
        written = written_instances(func, args, kwargs, ScaledTensor)
        # An op that writes into ScaledTensors (clamp_, sub_, masked_fill_, normal_, out=...): on
        # their real values in float32, each result written back as copy_ writes it (one rounding
        # into the storage format with a fresh scale; through a row view, into the whole tensor).
        out = run_on_values(func, args, kwargs, ScaledTensor, written, lambda t: t.dequantize(torch.float32),
                            lambda t, value: OP_TABLE[aten.copy_.default](aten.copy_.default, (t, value), {}))
        if not written and args and isinstance(args[0], ScaledTensor) and is_view_op(func):
            return view_of(out, args[0], func, args, kwargs)  # a view with no codes view (dequantized_view.py)
        return out


torch.serialization.add_safe_globals([ScaledTensor])
