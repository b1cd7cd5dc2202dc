"""fp8amp: FP8 automatic mixed-precision training for PyTorch, with a C++/CUDA core."""

from ._library import ops
from .cast import (
    amax,
    cast_transpose,
    cast_transpose_dbias,
    compute_scale,
    dequantize,
    multi_amax,
    multi_dequantize,
    multi_quantize,
    multi_update_delayed_scaling,
    quantize,
    quantize_current,
    update_delayed_scaling,
)
from .formats import E4M3, E4M3_MAX, E5M2, E5M2_MAX, FP16, FP16_MAX, format_max
from .scaling import ScalingRecipe, ScalingState
from .accumulate import scaled_accumulate
from .scaled_tensor import ScaledTensor
from .linear import Fp8Linear
from .convert import ConversionReport, LayerDecision, conversion_report, convert, update_scaling
from .initialize import OPT_LEVELS, initialize
from .saved_activations import ACTIVATION_FORMATS, save_activations_in_fp8
from .report import NumericsReport, TensorStats, numerics_report
from . import distributed, fsdp, gemm, optim

__all__ = [
    "ops",
    "E4M3",
    "E5M2",
    "FP16",
    "E4M3_MAX",
    "E5M2_MAX",
    "FP16_MAX",
    "format_max",
    "quantize",
    "quantize_current",
    "cast_transpose",
    "cast_transpose_dbias",
    "dequantize",
    "amax",
    "multi_amax",
    "multi_quantize",
    "multi_dequantize",
    "compute_scale",
    "update_delayed_scaling",
    "multi_update_delayed_scaling",
    "scaled_accumulate",
    "ScalingRecipe",
    "ScalingState",
    "ScaledTensor",
    "Fp8Linear",
    "convert",
    "conversion_report",
    "ConversionReport",
    "LayerDecision",
    "update_scaling",
    "initialize",
    "OPT_LEVELS",
    "save_activations_in_fp8",
    "ACTIVATION_FORMATS",
    "numerics_report",
    "NumericsReport",
    "TensorStats",
    "distributed",
    "fsdp",
    "gemm",
    "optim",
]
__version__ = "0.1.0"
