"""The FP8 GEMM (cuBLASLt on CUDA, a reference on CPU): typed wrappers over ``torch.ops.fp8amp``.

``gemm(a, b, ...)`` computes ``(a * a_scale_inv) @ (b * b_scale_inv).T (+ bias)`` with FP32
accumulation: ``a`` ``[M, K]`` and ``b`` ``[N, K]`` both K-major, the only layout cuBLASLt's FP8
GEMMs take on Hopper, which is ``y = x·Wᵀ`` of a Linear. K, N and the row strides must be
multiples of 16. See ``include/fp8amp/gemm.h`` for the exact rules and numerics.
"""

from __future__ import annotations

import torch

from . import fast
from ._args import _bool, _dtype, _input, _optional_input, _tensor

__all__ = ["gemm", "gemm_accumulate", "bias_dtype", "set_gemm_autotune", "gemm_autotune_enabled",
           "gemm_autotune_stats"]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bias_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The bias dtype cuBLASLt's FP8 GEMM takes for an output dtype: float16 for float16 output,
    bfloat16 otherwise."""
    out_dtype = _dtype(out_dtype, _OUT_DTYPES, "out_dtype", "bias_dtype")
    return torch.float16 if out_dtype == torch.float16 else torch.bfloat16


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """Returns ``[M, N]`` ``out_dtype``: ``(a·a_scale_inv) @ (b·b_scale_inv).T (+ bias)``.

    ``a`` ``[M, K]`` and ``b`` ``[N, K]`` are float8 (E4M3×E4M3, E4M3×E5M2 or E5M2×E4M3);
    the scales are float32 ``[1]``; ``bias`` ``[N]`` of :func:`bias_dtype` (out_dtype).
    ``fast_accum`` trades accuracy for speed (forward GEMMs only, docs/numerics.md#numerics).
    """
    op = "gemm"
    return fast.gemm(
        _input(a, "a", op),
        _input(b, "b", op),
        _input(a_scale_inv, "a_scale_inv", op),
        _input(b_scale_inv, "b_scale_inv", op),
        _dtype(out_dtype, _OUT_DTYPES, "out_dtype", op),
        _optional_input(bias, "bias", op),
        _bool(fast_accum, "fast_accum", op),
    )


def gemm_accumulate(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> None:
    """``out += (a·a_scale_inv) @ (b·b_scale_inv).T (+ bias)`` in place (cuBLASLt beta = 1).

    With a 16-bit ``out`` the product and the sum are each rounded once (cuBLASLt's epilogue);
    accumulate in float32 where that matters (weight gradients).
    """
    op = "gemm_accumulate"
    fast.gemm_accumulate(
        _input(a, "a", op),
        _input(b, "b", op),
        _input(a_scale_inv, "a_scale_inv", op),
        _input(b_scale_inv, "b_scale_inv", op),
        _tensor(out, "out", op),
        _optional_input(bias, "bias", op),
        _bool(fast_accum, "fast_accum", op),
    )


def set_gemm_autotune(enabled: bool) -> None:
    """Turns autotuning of the CUDA GEMMs' cuBLASLt algorithm on or off, process-wide (off by
    default), like ``torch.backends.cudnn.benchmark``: the per-tensor GEMMs and the tile-scaled
    ones (rowwise, blockwise, mxfp8) alike.

    Off, each GEMM problem (device, shape, strides, dtypes, bias, flags, alignments) runs the first
    algorithm of cuBLASLt's heuristic, as ``torch._scaled_mm`` does. On, each problem first seen
    while it is on spreads its first 24 calls over the heuristic's first 8 algorithms, times them
    with CUDA events on the calls' own stream (read back later, never a host synchronization), and
    then keeps the fastest (the heuristic's first unless another is 1 % faster) for the rest of the
    process. On the 1B GPT's GEMMs the heuristic's first choice was up to 11 % slower than the best
    of its first 8 (docs/benchmarks.md). All algorithms compute the same product, but their sums
    run in different orders, so results can differ in the last bits between algorithms and, since
    timing decides, between runs. Calls during CUDA graph capture are never timed."""
    fast.set_gemm_autotune(_bool(enabled, "enabled", "set_gemm_autotune"))


def gemm_autotune_enabled() -> bool:
    """Whether :func:`set_gemm_autotune` is on."""
    return bool(fast.gemm_autotune())


def gemm_autotune_stats() -> dict[str, int]:
    """Problems seen with autotuning on: ``tuning`` (still timing their candidates), ``tuned``
    (decided) and ``changed`` (decided on another algorithm than the heuristic's first)."""
    tuning, tuned, changed = fast.gemm_autotune_stats()
    return {"tuning": tuning, "tuned": tuned, "changed": changed}
