"""``BlockScaledTensor``: FP8 codes with one float32 scale per 128 x 128 block (docs/tiles.md).

The blockwise recipe's two tensors that live outside a GEMM call: the weight FSDP2 gathers as
blocks (:mod:`fp8amp.tiled_all_gather`), and the O1/O2 weight gradient, accumulated over micro-batches
by :func:`fp8amp.ops.scaled_accumulate_tiles` (one fused dequantize-add-requantize, fresh block
scales, no float32 copy). To torch it is a tensor of its logical dtype: it keeps its type through
what FSDP2 and autograd's gradient accumulation do to it (``detach``, ``alias``, ``clone``, FSDP2's
``as_strided`` to the weight's rows, ``add_``); its norms (``linalg.vector_norm`` over all
elements, ``_foreach_norm``: what ``clip_grad_norm_`` calls) come from the codes and the block
scales, with no dequantized copy; every other op reads its real values
(:meth:`dequantize`) and returns plain tensors (an out-of-place ``add`` too: the exact sum, with
torch's type promotion), and an op that writes into it (``mul_`` of
``clip_grad_norm_``, GradScaler's unscale, ``copy_``, ``zero_``) writes its result back, quantized
with fresh block scales.
"""

from __future__ import annotations

import torch

from . import ops
from .accumulation import count_accumulation, reset_accumulation
from .formats import E4M3, E5M2, HIGH_PRECISION_DTYPES
from .recipes import BLOCK
from .dequantized_view import view_of
from .scaled_tensor import WrapperTensorMixin, norms_from_codes
from .wrapper_ops import is_view_op, make_wrapper, run_on_values, written_instances

__all__ = ["BlockScaledTensor"]

_aten = torch.ops.aten
BLOCK_TILE = (BLOCK, BLOCK)


class BlockScaledTensor(WrapperTensorMixin, torch.Tensor):
    """Real values ``codes * scale_inv[block]`` of logical dtype ``dtype``: ``codes`` E4M3 or
    E5M2 ``[rows, cols]``, ``scale_inv`` float32 ``[ceil(rows / 128), ceil(cols / 128)]``, as
    :func:`fp8amp.ops.quantize_tiles` with tile (128, 128) gives them.

    Build one from real values with :meth:`from_tensor`."""

    _codes: torch.Tensor
    _scale_inv: torch.Tensor

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        if codes.dim() != 2 or codes.dtype not in (E4M3, E5M2) or scale_inv.dtype != torch.float32 or tuple(
                scale_inv.shape) != (-(-codes.shape[0] // BLOCK), -(-codes.shape[1] // BLOCK)):
            raise ValueError(f"fp8amp.BlockScaledTensor: codes must be float8_e4m3fn or float8_e5m2 [rows, cols] and "
                             f"scale_inv float32 [ceil(rows / {BLOCK}), ceil(cols / {BLOCK})]; got {codes.dtype} "
                             f"{list(codes.shape)} and {scale_inv.dtype} {list(scale_inv.shape)}")
        self = make_wrapper(cls, codes, dtype=dtype, device=codes.device)
        self._codes, self._scale_inv = codes, scale_inv
        return self

    @classmethod
    def from_tensor(cls, x: torch.Tensor, fmt: torch.dtype = E4M3, dtype: torch.dtype | None = None):
        """``x`` [rows, cols] quantized with one current power-of-two scale per 128 x 128 block (a
        block holding an inf or NaN reads NaN); logical dtype ``dtype`` (default ``x.dtype``, or
        float32 for another real dtype, whose values are rounded to float32 first, as
        :meth:`ScaledTensor.from_tensor` does)."""
        where = "fp8amp.BlockScaledTensor.from_tensor"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"{where}: x must be 2-D [rows, cols], got shape {list(x.shape)}")
        if isinstance(x, WrapperTensorMixin):  # a ScaledTensor or BlockScaledTensor: its real values
            dtype = dtype or x.dtype
            x = x.dequantize(torch.float32)  # not in its logical dtype, which would round twice
        if x.dtype not in HIGH_PRECISION_DTYPES:
            if not x.dtype.is_floating_point:
                raise ValueError(f"{where}: x must be a real floating-point tensor, got {x.dtype}")
            x = x.to(torch.float32)
        if fmt not in (E4M3, E5M2):
            raise ValueError(f"{where}: fmt must be torch.float8_e4m3fn or torch.float8_e5m2; got {fmt!r}")
        if dtype is not None and dtype not in HIGH_PRECISION_DTYPES:
            raise ValueError(f"{where}: dtype must be None or one of {', '.join(map(str, HIGH_PRECISION_DTYPES))}; "
                             f"got {dtype!r}")
        codes, scale_inv = ops.quantize_tiles(x, fmt, BLOCK_TILE)
        return cls(codes, scale_inv, dtype or x.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"BlockScaledTensor(shape={list(self.shape)}, codes={self._codes.dtype}, dtype={self.dtype}, "
                f"blocks={list(self._scale_inv.shape)})")

    @property
    def codes(self) -> torch.Tensor:
        return self._codes

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._scale_inv

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The real values, a plain tensor of ``dtype`` (default: the logical dtype; float64 holds
        the float32 values exactly)."""
        if dtype == torch.float64:
            return self.dequantize(torch.float32).to(torch.float64)
        return ops.dequantize_tiles(self._codes, self._scale_inv, BLOCK_TILE, dtype or self.dtype)

    def block_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes, scale_inv, codes_t, scale_inv_t)`` as the blockwise cast of a weight gives
        them: a 128 x 128 block of the transpose holds one block of W, so the transpose is the
        codes transposed with their scales transposed (copies: FSDP2 frees the gathered buffers
        after the forward and gathers them again for the backward)."""
        return self._codes, self._scale_inv, self._codes.t().contiguous(), self._scale_inv.t().contiguous().clone()

    def _accumulate(self, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        update = update.dequantize(torch.float32) if isinstance(update, BlockScaledTensor) else update
        return ops.scaled_accumulate_tiles(self._codes, self._scale_inv, update, BLOCK_TILE)

    def _write(self, real: torch.Tensor) -> None:
        reset_accumulation(self)  # new values (zero_grad's zero_ among the writes): no micro-batches summed
        codes, scale_inv = ops.quantize_tiles(real, self._codes.dtype, BLOCK_TILE)
        self._codes.copy_(codes)
        self._scale_inv.copy_(scale_inv)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A scalar factor (clip_grad_norm_'s, an optimizer's) scales the block scales; the codes
        # stay: exact up to float32 rounding of the scales, and no dequantize-requantize round trip.
        if func in _FOREACH_MULS_IN_PLACE and not kwargs and _scalar_factor(args[1]):
            blocks = [t for t in args[0] if isinstance(t, BlockScaledTensor)]
            others = [t for t in args[0] if not isinstance(t, BlockScaledTensor)]
            torch._foreach_mul_([t._scale_inv for t in blocks], args[1])
            if others:
                torch._foreach_mul_(others, args[1])
            return None
        if func is _aten._foreach_norm.Scalar:
            return _foreach_norm(func, *args, **kwargs)
        self = args[0] if args and isinstance(args[0], BlockScaledTensor) else None
        if self is not None:
            if func is _aten.linalg_vector_norm.default:
                norm = _norm_from_blocks(self, *args[1:], **kwargs)
                if norm is not None:
                    return norm
            if func in (_aten.detach.default, _aten.alias.default):
                return BlockScaledTensor(self._codes, self._scale_inv, self.dtype)
            if func is _aten.clone.default:
                return BlockScaledTensor(self._codes.clone(), self._scale_inv.clone(), self.dtype)
            if func is _aten.as_strided.default and (rows := _leading_rows(self, *args[1:], **kwargs)) is not None:
                return BlockScaledTensor(self._codes[:rows], self._scale_inv[: -(-rows // BLOCK)], self.dtype)
            if func in _MULS_IN_PLACE and not kwargs and _scalar_factor(args[1]):
                self._scale_inv.mul_(args[1])
                return self
            if func is _aten.copy_.default and isinstance(args[1], WrapperTensorMixin) and args[1].shape == self.shape:
                # Another scaled tensor's real values, read in float32 (its logical dtype would round twice).
                self._write(args[1].dequantize(torch.float32).to(self._codes.device))
                return self
            # Gradient accumulation (autograd's AccumulateGrad, grad += new): the fused
            # dequantize-add-requantize. In place only: an out-of-place sum is the real values'
            # (exact, with torch's type promotion), as ScaledTensor's is.
            if func is _aten.add_.Tensor and kwargs.get("alpha", 1) == 1 and len(args) == 2 \
                    and isinstance(args[1], torch.Tensor) and args[1].shape == self.shape \
                    and args[1].dtype in HIGH_PRECISION_DTYPES:  # what the fused op takes (float64 does not)
                codes, scale_inv = self._accumulate(args[1])
                self._codes.copy_(codes)
                self._scale_inv.copy_(scale_inv)
                count_accumulation(self)
                return self
        written = written_instances(func, args, kwargs, BlockScaledTensor)
        out = run_on_values(func, args, kwargs, BlockScaledTensor, written, BlockScaledTensor.dequantize,
                            BlockScaledTensor._write)
        if not written and self is not None and is_view_op(func):
            return view_of(out, self, func, args, kwargs)  # it keeps no views (dequantized_view.py)
        return out

    def __tensor_flatten__(self):
        return ["_codes", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return BlockScaledTensor(inner_tensors["_codes"], inner_tensors["_scale_inv"], dtype)


_MULS_IN_PLACE = (_aten.mul_.Tensor, _aten.mul_.Scalar)
_FOREACH_MULS_IN_PLACE = (_aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar)


def _scalar_factor(factor) -> bool:
    """Whether ``factor`` multiplies every element by one value: a number, or a one-element plain tensor."""
    if isinstance(factor, torch.Tensor):
        return factor.numel() == 1 and not isinstance(factor, BlockScaledTensor) and factor.is_floating_point()
    return isinstance(factor, (int, float)) and not isinstance(factor, bool)


def _norm_from_blocks(t: BlockScaledTensor, ord=2, dim=None, keepdim=False, *, dtype=None) -> torch.Tensor | None:
    """The ``ord``-norm of all of ``t``'s real values from its codes and block scales; None where
    :func:`_norms_from_blocks` does not apply (a ``dim`` or ``keepdim``)."""
    if dim is not None or keepdim:
        return None
    return _norms_from_blocks([t], ord, dtype)[0]


def _norms_from_blocks(ts: list[BlockScaledTensor], ord, dtype) -> list[torch.Tensor | None]:
    """The ``ord``-norms of the real values of BlockScaledTensors, with no dequantized copy: the
    2-norm (clip_grad_norm_'s) of all of them by one :func:`fp8amp.ops.multi_norm_tiles` call (per
    device and code dtype); another ord (but 0, a count) as the norm of the blocks' norms, each
    the norm of its codes (read as FP16, which holds every FP8 value exactly; float32 sums) times
    its |scale_inv|, where the blocks tile the tensor (rows and cols multiples of 128). Equal to the
    norm of the dequantized values up to the sums' rounding. None for each tensor where neither applies."""
    if ord == 2:
        return norms_from_codes(ts, BLOCK_TILE, dtype)
    norms: list[torch.Tensor | None] = []
    for t in ts:
        rows, cols = t._codes.shape
        if ord == 0 or rows % BLOCK or cols % BLOCK:
            norms.append(None)
            continue
        codes = ops.dequantize(t._codes, torch.ones(1, device=t.device), torch.float16)
        blocks = codes.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        per_block = torch.linalg.vector_norm(blocks, ord, dim=(1, 3), dtype=torch.float32)
        norms.append(torch.linalg.vector_norm(per_block * t._scale_inv.abs(), ord).to(dtype or t.dtype))
    return norms


def _foreach_norm(func, tensors, ord=2, dtype=None):
    """``_foreach_norm`` with the BlockScaledTensors' norms from their blocks, the others' by ``func``."""
    blocks = [i for i, t in enumerate(tensors) if isinstance(t, BlockScaledTensor)]
    norms = dict(zip(blocks, _norms_from_blocks([tensors[i] for i in blocks], ord, dtype)))
    others = [t.dequantize() if isinstance(t, BlockScaledTensor) else t
              for i, t in enumerate(tensors) if norms.get(i) is None]
    other_norms = iter(func(others, ord, dtype) if others else [])
    return [next(other_norms) if norms.get(i) is None else norms[i] for i in range(len(tensors))]


def _leading_rows(t: BlockScaledTensor, size, stride, storage_offset=0):
    """The row count of an ``as_strided`` that keeps the first rows of ``t`` (FSDP2's view of the
    gathered, padded weight at the weight's size); None for any other."""
    rows, cols = t._codes.shape
    if storage_offset == 0 and len(size) == 2 and size[1] == cols and size[0] <= rows and tuple(stride) == (cols, 1):
        return size[0]
    return None


torch.serialization.add_safe_globals([BlockScaledTensor])
