"""The aten op table of :class:`~fp8amp.ScaledTensor`: one handler per op it keeps in the subclass
or does in place; every other op sees the tensor dequantized.

Semantics of ops (``__torch_dispatch__``):

* Kept in the subclass (no data pass unless stated):
  ``detach``, ``alias``, ``view`` (contiguous reshape; shares ``_data`` storage *and* the
  ``_scale_inv`` tensor, so in-place ops through the view reach the base, as for any view),
  ``clone`` (copies both), ``_to_copy`` that only changes the device (``.to(device)``, ``.cpu()``,
  ``.cuda()``: moves both inner tensors; the codes are not touched); row views (slicing or
  ``split``/``chunk``/``narrow`` along dim 0, step 1, ``x[i]``, ``unbind``): views of the codes at
  the tensor's scale (sharing ``_scale_inv``); ``new_zeros``: zeros at a copy of the tensor's
  scale, ``new_empty`` uninitialized codes. (FSDP2 shards an O1/O2 master with these:
  fp8amp.fsdp; DCP's async staging copies one through ``new_empty``.)
* In place, supported:
  ``copy_(plain)``: re-quantizes ``src`` into the storage format with a fresh current scale
  (amax -> pow2 scale -> quantize, no host sync; an inf or NaN in ``src`` makes ``_scale_inv``
  NaN, so the whole tensor reads NaN instead of saturating); ``copy_(ScaledTensor)`` of the same storage
  format and shape: copies ``_data`` and ``_scale_inv`` bit for bit (another format: re-quantizes
  its real values). Into a row view, which shares its scale with the rest of the tensor, ``copy_``
  writes ``src``'s real values into the whole tensor's and re-quantizes the whole tensor with a
  fresh scale (the other rows' values are kept exactly unless the new amax is larger);
  ``mul_(s)`` / ``div_(s)`` with ``s`` a Python number or a 0-dim real tensor (e.g. the clip
  coefficient of ``clip_grad_norm_``): O(1), only ``_scale_inv`` changes, the codes are untouched
  (what MS-AMP does for unscale and world-size averaging). ``_scale_inv * s`` is computed in float32,
  so it is exact when ``s`` is a power of two (and nothing under/overflows); otherwise the new
  ``_scale_inv`` is rounded once (a Python float is first rounded to float32 by PyTorch's scalar
  handling, a second rounding), i.e. a relative error of at most ~2^-23 on every real value, shared
  by all elements, and ``_scale_inv`` stops being a power of two until the next re-quantize.
  Unlike a plain FP16 tensor, a large ``s`` cannot overflow the codes;
  ``zero_``: zeroes ``_data`` and resets ``_scale_inv`` to 1 (so an inf/NaN scale cannot make 0*inf);
  ``fill_(v)``: ``copy_`` of ``v`` everywhere (item assignment ``x[index] = v``, of any index, is
  ``WrapperTensorMixin.__setitem__``: the real values with the assignment, copied back);
  ``add_(other, alpha=a)`` with ``other`` of the same shape and device (a ScaledTensor or a plain
  real tensor; float64 and integer values are taken in float32, as torch's float32 ``add_``
  does): one fused dequantize-add-requantize
  (:func:`fp8amp.ops.scaled_accumulate`, a fresh current scale from the sums' amax; a non-finite sum
  makes ``_scale_inv`` NaN so the whole tensor reads NaN). It is how autograd accumulates FP8
  weight gradients across micro-batches (``param.grad += new_grad``);
  ``_foreach_mul_`` / ``_foreach_div_`` / ``_foreach_zero_`` over lists that contain ScaledTensors
  (the plain tensors in one call of the aten op; by one scalar, the ScaledTensors' ``_scale_inv``
  in one foreach call too; else element by element, through the above);
  ``_amp_foreach_non_finite_check_and_unscale_`` (``torch.amp.GradScaler.unscale_``): a non-finite
  check of the real values (one read pass, no host sync) and an unscale through ``_scale_inv``.
* In place through a row view of part of a tensor (``x[0:2].mul_(2)``, ``x[i].zero_()``): the
  view's scale is the whole tensor's, so ``mul_``, ``div_``, ``zero_``,
  ``add_`` and ``fill_`` compute the view's new real values and write them as ``copy_`` does,
  never by changing the shared ``_scale_inv``.
* Norms from the codes: ``linalg.vector_norm`` over all elements and ``_foreach_norm`` (what
  ``clip_grad_norm_(..., foreach=True)`` calls) compute ``||codes|| * |scale_inv|`` (any order
  but 0) with no dequantized copy: the 2-norm by :func:`fp8amp.ops.multi_norm_tiles` (one call
  for a list, each code read once), other orders from each tensor's codes widened to FP16.
* Any other op that writes into a ScaledTensor (``sub_``, ``clamp_``, ``lerp_``, ``masked_fill_``,
  ``normal_``, ``_foreach_clamp_min_``, ``out=`` ...) runs on its real values in float32 and writes
  the result back as ``copy_`` does (``wrapper_ops.run_on_values``): one rounding into the
  storage format with a fresh scale. In-place ops that change the shape or layout (``t_``,
  ``unsqueeze_``, ``resize_`` ...) raise ``NotImplementedError`` naming the op.
* Every other op: ScaledTensor arguments are dequantized to their logical dtype and the op runs on
  plain tensors, returning plain tensors: printing, arithmetic, comparisons, norms over some
  dimensions, ``isinf`` / ``isnan``, ``.to(other dtype)``, ``.double()``... Views other than those
  above (``t()``, ``transpose``, column slices, steps) are ``DequantizedView`` (dequantized_view.py):
  reads dequantize, and an in-place op through one writes into the ScaledTensor (of a tensor
  that requires grad, in grad mode, and in compiled code, a dequantized copy).
"""

from __future__ import annotations

import numbers

import torch
from torch._prims_common import make_contiguous_strides_for

from . import ops
from .accumulation import count_accumulation, reset_accumulation
from .formats import HIGH_PRECISION_DTYPES
from .ops import scaled_accumulate
from .scaled_tensor import OP_TABLE, ScaledTensor, WrapperTensorMixin, _quantize_current, norms_from_codes

aten = torch.ops.aten


def _is_scalar(s: object) -> bool:
    if isinstance(s, bool):
        return False
    if isinstance(s, numbers.Real):
        return True
    return (isinstance(s, torch.Tensor) and not isinstance(s, ScaledTensor) and s.dim() == 0
            and not s.dtype.is_complex and s.dtype != torch.bool)



def _same(t: torch.Tensor) -> torch.Tensor:
    return t


# ---------------------------------------------------------------------- special cases


def _alias(func, args, kwargs):
    """detach and alias: the same op on each inner tensor."""
    (x,) = args
    out = x._rewrap(func, func)
    out._base_rows = x._base_rows
    return out


def _detach(func, args, kwargs):
    """_alias for detach, which autograd applies to every new gradient (each FP8 weight gradient, a
    step): the inner tensors' ``detach`` method runs the same op without the Python call of the
    op overload."""
    (x,) = args
    out = x._rewrap(_detach_inner, _detach_inner)
    out._base_rows = x._base_rows
    return out


_detach_inner = torch.Tensor.detach


def _clone(func, args, kwargs):
    x = args[0]
    fmt = kwargs.get("memory_format", None)
    if fmt not in (None, torch.preserve_format, torch.contiguous_format):
        return NotImplemented
    return x._rewrap(torch.clone, torch.clone)


def _view(func, args, kwargs):
    x, size = args
    out = x._rewrap(lambda t: t.view(size), _same)
    out._base_rows = x._base_rows
    return out


def _as_strided(func, args, kwargs):
    """A contiguous view from the tensor's first element (what FSDP2 makes of a gathered
    parameter): a row view; any other striding dequantizes (the fallback)."""
    x, size, stride = args[:3]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if offset not in (None, 0) or tuple(stride) != tuple(make_contiguous_strides_for(size)):
        return NotImplemented

    return _row_view(x, lambda t: t.as_strided(size, stride, t.storage_offset()))  # from t's first element


def _row_view(x: "ScaledTensor", fn) -> "ScaledTensor":
    """fn (a view of whole rows, contiguous) of the codes (and of what a subclass derives from them),
    sharing the scales; unless it covers all of x, it remembers the tensor it is part of (see _copy_)."""
    view = x._rewrap(fn, _same)
    view._base_rows = x._base_rows if x._base_rows is not None or view.shape == x.shape else x
    return view


def _split(func, args, kwargs):
    x, size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if dim != 0 or size <= 0:
        return NotImplemented  # torch's own op (and its error for a size of 0)
    starts = range(0, x.shape[0], size) if x.shape[0] else [0]  # split of no rows: one empty part
    return [_row_view(x, lambda t, i=i: t[i : i + size]) for i in starts]


def _slice(func, args, kwargs):
    x = args[0]
    defaults = (0, None, None, 1)  # aten.slice's dim, start, end, step
    dim, start, end, step = tuple(args[1:]) + defaults[len(args) - 1 :]
    if dim != 0 or step != 1 or kwargs:
        return NotImplemented
    return _row_view(x, lambda t: t[start:end])


def _select(func, args, kwargs):
    """``x[i]``: a row view (a write through it must reach x, as ``x[i].zero_()`` does on a plain
    tensor)."""
    x, dim, index = args
    if dim not in (0, -x.dim()) or kwargs:
        return NotImplemented
    return _row_view(x, lambda t: t.select(0, index))


def _unbind(func, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if dim not in (0, -x.dim()) or x.dim() == 0:
        return NotImplemented
    return [_row_view(x, lambda t, i=i: t.select(0, i)) for i in range(x.shape[0])]


def _write_rows(x: "ScaledTensor", real: torch.Tensor) -> "ScaledTensor":
    """An in-place op on a row view of part of a tensor, whose scale is the whole tensor's: the
    view's new real values ``real``, written as ``copy_`` writes into a row view. (Scaling or
    resetting the shared ``_scale_inv`` would change the other rows too.)"""
    return _copy_(aten.copy_.default, (x, real), {})


def _new_zeros(func, args, kwargs):
    """Zeros of another shape with this tensor's scale, of its type (FSDP2's padded shard of a
    master; a master's E4M3 copy is not made for them)."""
    return _new_of_type(torch.zeros, args, kwargs)


def _new_empty(func, args, kwargs):
    """Uninitialized codes of another shape, of this tensor's type: DCP's async staging copies a
    tensor with no storage of its own as its new_empty() with its attributes (codes, scale) set on
    it; a plain tensor kept uninitialized memory, which the checkpoint saved."""
    return _new_of_type(torch.empty, args, kwargs)


def _new_of_type(make, args, kwargs):
    x, size = args[0], args[1]
    if set(kwargs) - {"device", "dtype", "layout", "pin_memory"} or kwargs.get("dtype") not in (None, x.dtype):
        return NotImplemented
    device = kwargs.get("device") or x.device
    return type(x)(make(size, dtype=x._data.dtype, device=device), x._scale_inv.clone().to(device), x.dtype)


def _to_copy(func, args, kwargs):
    x = args[0]
    kw = dict(kwargs)
    device = kw.pop("device", None)
    dtype = kw.pop("dtype", None)
    layout = kw.pop("layout", None)
    kw.pop("non_blocking", None)
    kw.pop("pin_memory", None)
    memory_format = kw.pop("memory_format", None)
    if (kw or dtype not in (None, x.dtype) or layout not in (None, torch.strided)
            or memory_format not in (None, torch.preserve_format, torch.contiguous_format)):
        return NotImplemented  # a dtype change: the dequantizing fallback gives a plain tensor
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=kwargs.get("non_blocking", False))

    return x._rewrap(move, move)


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, ScaledTensor):
        return NotImplemented  # plain destination: dequantize src, ordinary copy_
    base = dst._base_rows
    if base is not None:
        # The scale is the whole tensor's: write the rows into its real values and re-quantize it
        # all with a fresh scale. The other rows keep their values exactly unless the new amax
        # is larger (then they round at the coarser scale, as any per-tensor-scaled write does).
        src_real = src.dequantize(torch.float32) if isinstance(src, WrapperTensorMixin) else src
        real = base.dequantize(torch.float32)
        offset = dst._data.storage_offset() - base._data.storage_offset()  # (row views share the storage)
        real.view(-1)[offset : offset + dst.numel()].copy_(
            src_real.to(device=dst.device, dtype=torch.float32).expand(dst.shape).reshape(-1))
        _copy_(func, (base, real), {})
        return dst
    if isinstance(src, ScaledTensor) and src._data.dtype == dst._data.dtype and src.shape == dst.shape:
        dst._data.copy_(src._data)
        dst._scale_inv.copy_(src._scale_inv)
        dst._after_write(src)
        return dst
    if isinstance(src, WrapperTensorMixin):  # a ScaledTensor or BlockScaledTensor
        src = src.dequantize(torch.float32)  # not in its logical dtype: that would round twice
    if not isinstance(src, torch.Tensor):
        return NotImplemented
    src = src.to(device=dst.device).expand(dst.shape)
    if src.dtype not in HIGH_PRECISION_DTYPES:
        src = src.to(dst.dtype)
    # A non-finite src makes the whole tensor read NaN, never saturate (docs/numerics.md#non-finite-values).
    data, scale_inv, _ = _quantize_current(src, dst._data.dtype, 0)
    dst._data.copy_(data)
    dst._scale_inv.copy_(scale_inv)
    dst._after_write()
    return dst


def _scale_op(func, args, kwargs):
    x, s = args[0], args[1]
    if not isinstance(x, ScaledTensor) or kwargs or not _is_scalar(s):
        return NotImplemented  # e.g. div_ with rounding_mode, or by a full tensor: raises below
    if isinstance(s, torch.Tensor):
        s = s.to(device=x.device, dtype=torch.float32)
    multiply = func in (aten.mul_.Tensor, aten.mul_.Scalar)
    if x._base_rows is not None:
        real = x.dequantize(torch.float32)
        return _write_rows(x, real.mul_(s) if multiply else real.div_(s))
    if multiply:
        x._scale_inv.mul_(s)
    else:
        x._scale_inv.div_(s)
    x._after_write()
    return x


def _add_(func, args, kwargs):
    dst, src = args[0], args[1]
    alpha = kwargs.get("alpha", 1)
    if (not isinstance(dst, ScaledTensor) or not isinstance(src, torch.Tensor) or src.shape != dst.shape
            or set(kwargs) - {"alpha"} or isinstance(alpha, torch.Tensor)):
        return NotImplemented  # broadcasting, a tensor alpha: raises below
    if src.device != dst.device:
        raise ValueError(f"ScaledTensor.add_: other must be on this tensor's device ({dst.device}), got {src.device}")
    if src.dtype.is_complex:
        raise TypeError(f"ScaledTensor.add_: other must be real, got {src.dtype}")
    if dst._base_rows is not None:
        other = src.dequantize(torch.float32) if isinstance(src, ScaledTensor) else src.float()
        return _write_rows(dst, dst.dequantize(torch.float32).add_(other, alpha=alpha))
    if isinstance(src, ScaledTensor):
        codes, scale_inv = src._data, src._scale_inv
    else:
        # As torch's float32 add_ of a float64 or integer tensor: the values, in the sums' float32.
        codes, scale_inv = (src if src.dtype in HIGH_PRECISION_DTYPES else src.float()).contiguous(), None
    scaled_accumulate(dst._data, dst._scale_inv, codes, scale_inv, alpha=float(alpha))
    dst._after_write()
    count_accumulation(dst)
    return dst


def _norms_of(xs: list["ScaledTensor"], ord, dtype) -> list[torch.Tensor]:
    """||codes * scale_inv||_ord = ||codes||_ord * |scale_inv| for any ord but 0 (a count), from the
    codes with no dequantized copy: the 2-norm (clip_grad_norm_'s) by one multi_norm_tiles call
    per device and code dtype (1 byte read an element for FP8 codes); any other ord widens one
    tensor's codes to FP16 at a time (2 bytes an element; accumulated in float32)."""
    if ord == 2:
        return norms_from_codes(xs, None, dtype)
    norms = []
    for x in xs:
        codes = x._data
        if codes.dtype != torch.float16:  # FP8 codes are FP16 values exactly; our kernel widens them fast
            codes = ops.dequantize(codes, torch.ones(1, dtype=torch.float32, device=codes.device), torch.float16)
        norm = torch.linalg.vector_norm(codes, ord, dtype=torch.float32) * x._scale_inv.abs().reshape(())
        norms.append(norm.to(dtype or x.dtype))
    return norms


def _vector_norm(func, args, kwargs):
    x = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if not isinstance(x, ScaledTensor) or ord == 0 or dim is not None or keepdim:
        return NotImplemented
    return _norms_of([x], ord, kwargs.get("dtype"))[0]


def _foreach_norm(func, args, kwargs):
    tensors = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    if ord == 0 or not any(isinstance(t, ScaledTensor) for t in tensors):
        return NotImplemented
    plain = [t for t in tensors if not isinstance(t, ScaledTensor)]
    plain_norms = iter(func(plain, ord, dtype) if plain else [])
    scaled_norms = iter(_norms_of([t for t in tensors if isinstance(t, ScaledTensor)], ord, dtype))
    return [next(scaled_norms) if isinstance(t, ScaledTensor) else next(plain_norms) for t in tensors]


def _zero_(func, args, kwargs):
    (x,) = args
    if x._base_rows is not None:
        return _write_rows(x, torch.zeros(x.shape, device=x.device))
    x._data.zero_()
    x._scale_inv.fill_(1.0)
    x._after_write()
    reset_accumulation(x)
    return x


def _fill_(func, args, kwargs):
    """``fill_(v)``: ``copy_`` of ``v`` everywhere, a fresh current scale."""
    x, value = args
    if not isinstance(x, ScaledTensor) or kwargs or not _is_scalar(value):
        return NotImplemented
    return _copy_(aten.copy_.default, (x, torch.as_tensor(value, dtype=torch.float32, device=x.device)), {})


def _foreach(method):
    """_foreach_mul_ / _foreach_div_ / _foreach_zero_ over a list holding ScaledTensors. The plain
    tensors go to the aten op in one call (one fused launch, not one a tensor: clip_grad_norm_'s
    scaling of every gradient); the ScaledTensors scale their scale_inv, all of them in one
    foreach call when the factor is one scalar, else one at a time."""
    def handler(func, args, kwargs):
        tensors = args[0]
        if not any(isinstance(t, ScaledTensor) for t in tensors):
            return NotImplemented
        scaled = [t for t in tensors if isinstance(t, ScaledTensor)]
        plain = [t for t in tensors if not isinstance(t, ScaledTensor)]
        if method == "zero_":
            if plain:
                func(plain)
            for t in scaled:
                t.zero_()
            return None
        other = args[1] if len(args) > 1 else kwargs.get("scalar", kwargs.get("scalars", kwargs.get("other")))
        if isinstance(other, (list, tuple)):
            pairs = list(zip(tensors, other, strict=True))
            if plain:
                func(plain, [s for t, s in pairs if not isinstance(t, ScaledTensor)])
            for t, s in pairs:
                if isinstance(t, ScaledTensor):
                    getattr(t, method)(s)
            return None
        if plain:
            func(plain, other)
        devices = {t.device for t in scaled}
        if not _is_scalar(other) or len(devices) != 1 or any(t._base_rows is not None for t in scaled):
            for t in scaled:
                getattr(t, method)(other)  # raises for a factor that is not a scalar
            return None
        if isinstance(other, torch.Tensor):
            other = other.to(device=devices.pop(), dtype=torch.float32)
        scale_invs = [t._scale_inv for t in scaled]
        (torch._foreach_mul_ if method == "mul_" else torch._foreach_div_)(scale_invs, other)
        for t in scaled:
            t._after_write()
        return None
    return handler


def _amp_unscale(func, args, kwargs):
    """GradScaler's ``_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``:
    plain grads go to the aten op; a ScaledTensor grad is checked on its real values (one read pass,
    no host sync) and unscaled through ``_scale_inv`` only."""
    grads, found_inf, inv_scale = args
    scaled = [g for g in grads if isinstance(g, ScaledTensor)]
    plain = [g for g in grads if not isinstance(g, ScaledTensor)]
    if plain:
        func(plain, found_inf, inv_scale)
    for g in scaled:
        bad = torch.isfinite(g.dequantize(torch.float32)).all().logical_not().to(found_inf.dtype).reshape(found_inf.shape)
        found_inf.copy_(torch.maximum(found_inf, bad))
        if g._base_rows is not None:
            g.mul_(inv_scale.reshape(()))
        else:
            g._scale_inv.mul_(inv_scale)
    return None


OP_TABLE.update({
    aten._amp_foreach_non_finite_check_and_unscale_.default: _amp_unscale,
    aten.detach.default: _detach,
    aten.alias.default: _alias,
    aten.clone.default: _clone,
    aten.view.default: _view,
    aten.as_strided.default: _as_strided,
    aten.split.Tensor: _split,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.unbind.int: _unbind,
    aten.fill_.Scalar: _fill_,
    aten.fill_.Tensor: _fill_,
    aten.new_zeros.default: _new_zeros,
    aten.new_empty.default: _new_empty,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.mul_.Tensor: _scale_op,
    aten.mul_.Scalar: _scale_op,
    aten.div_.Tensor: _scale_op,
    aten.div_.Scalar: _scale_op,
    aten.zero_.default: _zero_,
    aten.add_.Tensor: _add_,
    aten.linalg_vector_norm.default: _vector_norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten._foreach_mul_.Scalar: _foreach("mul_"),
    aten._foreach_mul_.Tensor: _foreach("mul_"),
    aten._foreach_mul_.ScalarList: _foreach("mul_"),
    aten._foreach_div_.Scalar: _foreach("div_"),
    aten._foreach_div_.Tensor: _foreach("div_"),
    aten._foreach_div_.ScalarList: _foreach("div_"),
    aten._foreach_zero_.default: _foreach("zero_"),
})
