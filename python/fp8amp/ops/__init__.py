"""The op layer: typed, checked wrappers over the core's operators, and the only Python code that
calls ``torch.ops.fp8amp``.

Each wrapper checks Python types (TypeError) and dtype arguments (ValueError naming the accepted
values), makes read-only inputs contiguous and leaves value checks to the core (ValueError naming
the argument). None reads device values on the host, so all of them trace under
``torch.compile(fullgraph=True)`` and never sync. fp8amp's own hot loops call
:mod:`fp8amp.ops.fast` (the overloads resolved once, unchecked) with arguments checked where they
entered fp8amp. The modules mirror the core's op families: cast, scaling, gemm (and gemm_tiles), accumulate, optim,
tiles (and mx: MXFP8's block casts and GEMM), comm.
"""

from . import fast
from ._accumulate import scaled_accumulate
from ._comm import comm_quantize, comm_sum_shards
from ._cast import (amax, amax_of, cast_transpose, cast_transpose_dbias, cast_transpose_rescaled, dequantize,
                    multi_amax, multi_dequantize, multi_quantize, quantize, quantize_current)
from ._gemm import bias_dtype, gemm, gemm_accumulate, gemm_autotune_enabled, gemm_autotune_stats, set_gemm_autotune
from ._gemm_tiles import gemm_tiles
from ._mx import cast_transpose_mx, dequantize_mx, e8m0_to_float, gemm_mx, quantize_mx
from ._optim import adam_step
from ._scaling import compute_scale, multi_update_delayed_scaling, update_delayed_scaling
from ._tiles import cast_transpose_tiles, dequantize_tiles, multi_norm_tiles, quantize_tiles, scaled_accumulate_tiles

__all__ = [
    "quantize",
    "quantize_current",
    "cast_transpose",
    "cast_transpose_dbias",
    "cast_transpose_rescaled",
    "dequantize",
    "amax",
    "amax_of",
    "multi_amax",
    "multi_quantize",
    "multi_dequantize",
    "compute_scale",
    "update_delayed_scaling",
    "multi_update_delayed_scaling",
    "gemm",
    "gemm_accumulate",
    "bias_dtype",
    "set_gemm_autotune",
    "gemm_autotune_enabled",
    "gemm_autotune_stats",
    "gemm_tiles",
    "scaled_accumulate",
    "adam_step",
    "quantize_tiles",
    "dequantize_tiles",
    "cast_transpose_tiles",
    "scaled_accumulate_tiles",
    "multi_norm_tiles",
    "quantize_mx",
    "dequantize_mx",
    "cast_transpose_mx",
    "gemm_mx",
    "e8m0_to_float",
    "comm_quantize",
    "comm_sum_shards",
    "fast",
]
