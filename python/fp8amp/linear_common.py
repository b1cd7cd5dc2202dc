"""What both of Fp8Linear's autograd Functions share (per-tensor scaling in linear.py, tile
scaling in tiled_linear.py): the output dtype, the padding of the token rows and the output made
from the GEMM's padded rows, and the E4M3 weight gradient of O1/O2."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .formats import E4M3
from .ops import fast
from .scaled_tensor import ScaledTensor

__all__ = ["output_dtype", "pad_rows", "unpadded_output", "fp8_weight_grad"]

_unsafe_view = torch.ops.aten._unsafe_view.default  # the overload itself: no packet lookup a call


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on, else ``x``'s dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


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
