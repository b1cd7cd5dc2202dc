"""How many micro-batches an FP8 gradient has summed since it was zeroed, and the warning when that
number grows past where rounding the running sum to FP8 loses the later ones.

Autograd sums a parameter's micro-batch gradients into ``param.grad`` in place. An FP8 gradient
(``ScaledTensor``, ``BlockScaledTensor``) rounds each sum to its format, three mantissa bits for
E4M3: once the sum is about 2^4 times one micro-batch's gradient, a new one falls near half a unit
of the sum and is partly lost (docs/o1_o2.md#limits-today measures it). The count lives on the
gradient tensor; a ``zero_`` (``zero_grad(set_to_none=False)``) restarts it, a new gradient starts
at 0."""

from __future__ import annotations

import warnings

import torch

__all__ = ["LONG_ACCUMULATION", "count_accumulation", "reset_accumulation"]

#: The micro-batches summed into one FP8 gradient at which fp8amp warns: measured on gradients of one
#: direction, the relative error is 0.09 for 1 to 4 micro-batches, 0.13 for 16, 0.36 for 32, 0.67 for 64.
LONG_ACCUMULATION = 16

_WARNING = (
    "fp8amp: an FP8 weight gradient has now summed {n} micro-batches since it was zeroed. Each sum is "
    "rounded to its FP8 format (3 mantissa bits for E4M3), so with many micro-batches the later ones are "
    "partly lost (measured on gradients of one direction: relative error 0.09 with 1-4 micro-batches, "
    "0.13 with 16, 0.36 with 32, 0.67 with 64). For long accumulation, initialize(..., weight_grad='fp32') "
    "keeps plain gradients (4 bytes an element instead of 1), or use fewer, larger micro-batches "
    "(docs/o1_o2.md#limits-today)")


def count_accumulation(grad: torch.Tensor) -> None:
    """One more micro-batch summed into ``grad``; warns (once per place, as warnings do) when the sum
    reaches LONG_ACCUMULATION micro-batches. Under torch.compile's tracing this runs once, at trace time."""
    summed = getattr(grad, "_micro_batches", 1) + 1
    grad._micro_batches = summed
    if summed == LONG_ACCUMULATION:
        warnings.warn(_WARNING.format(n=summed), UserWarning, stacklevel=2)


def reset_accumulation(grad: torch.Tensor) -> None:
    """``grad`` was zeroed: the next gradient summed into it is its first micro-batch again."""
    grad._micro_batches = 0
