"""Deprecated: the FP8 GEMM and its autotuning moved to :mod:`fp8amp.ops` (kept for one release)."""

import warnings

from .ops import bias_dtype, gemm, gemm_accumulate
from .ops import gemm_autotune_enabled as autotune_enabled
from .ops import gemm_autotune_stats as autotune_stats
from .ops import set_gemm_autotune as set_autotune

__all__ = ["gemm", "gemm_accumulate", "bias_dtype", "set_autotune", "autotune_enabled", "autotune_stats"]

warnings.warn("fp8amp.gemm moved to fp8amp.ops (set_autotune is fp8amp.ops.set_gemm_autotune, autotune_enabled "
              "gemm_autotune_enabled, autotune_stats gemm_autotune_stats); the old module goes in the next release",
              DeprecationWarning, stacklevel=2)
