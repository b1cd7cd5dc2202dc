"""fp8amp: FP8 automatic mixed-precision training for PyTorch, with a C++/CUDA core.

The top level is the training API. The low-level ops (casts, the FP8 GEMM, the fused Adam step)
live in :mod:`fp8amp.ops`.
"""

import warnings as _warnings

from . import ops
from .formats import E4M3, E4M3_MAX, E5M2, E5M2_MAX, FP16, FP16_MAX, format_max
from .scaling import ScalingRecipe, ScalingState, fresh_scaling_if_missing
from .recipes import RECIPES, Recipe
from .scaled_tensor import ScaledTensor
from . import scaled_tensor_ops  # noqa: F401 (fills ScaledTensor.OP_TABLE)
from .master_weight import MasterWeight
from .block_scaled_tensor import BlockScaledTensor
from .linear import Fp8Conv1D, Fp8Linear
from .convert import (ConversionReport, LayerDecision, conversion_report, convert, register_scaling_hooks,
                      update_scaling)
from .initialize import OPT_LEVELS, initialize, initialize_optimizer
from .unconvert import unconvert
from .saved_activations import ACTIVATION_FORMATS, save_activations_in_fp8
from .report import NumericsReport, TensorStats, numerics_report
from . import amax_sync, distributed, fsdp, optim

__all__ = [
    "initialize",
    "initialize_optimizer",
    "OPT_LEVELS",
    "unconvert",
    "convert",
    "conversion_report",
    "ConversionReport",
    "LayerDecision",
    "update_scaling",
    "register_scaling_hooks",
    "Fp8Linear",
    "Fp8Conv1D",
    "ScaledTensor",
    "MasterWeight",
    "BlockScaledTensor",
    "Recipe",
    "RECIPES",
    "ScalingRecipe",
    "ScalingState",
    "fresh_scaling_if_missing",
    "E4M3",
    "E5M2",
    "FP16",
    "E4M3_MAX",
    "E5M2_MAX",
    "FP16_MAX",
    "format_max",
    "optim",
    "save_activations_in_fp8",
    "ACTIVATION_FORMATS",
    "numerics_report",
    "NumericsReport",
    "TensorStats",
    "amax_sync",
    "distributed",
    "fsdp",
    "ops",
]
__version__ = "0.1.0"

# The low-level ops were top-level names before 0.2; kept for one release (the tile ops came later).
_MOVED_TO_OPS = frozenset(ops.__all__) - {"fast", "gemm", "quantize_tiles", "dequantize_tiles"}


def __getattr__(name: str):
    if name == "gemm":  # the old module, with its old names
        import importlib

        return importlib.import_module(".gemm", __name__)
    if name in ("cast", "accumulate"):  # old modules whose functions fp8amp.ops now holds
        _warnings.warn(f"fp8amp.{name} moved to fp8amp.ops; the old name goes in the next release",
                       DeprecationWarning, stacklevel=2)
        return ops
    if name in _MOVED_TO_OPS:
        _warnings.warn(f"fp8amp.{name} moved to fp8amp.ops.{name}; the old name goes in the next release",
                       DeprecationWarning, stacklevel=2)
        return getattr(ops, name)
    raise AttributeError(f"module 'fp8amp' has no attribute {name!r}")
