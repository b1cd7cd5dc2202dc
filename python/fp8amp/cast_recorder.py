"""Where Fp8Linear reports its casts while a :func:`fp8amp.numerics_report` records.

A layer below Fp8Linear, so the layer reports without importing the report (which finds the
model's Fp8Linears and so sits above them). At most one recorder is active at a time.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import nn

__all__ = ["CastRecorder", "start", "stop", "recording", "record"]


class CastRecorder(Protocol):
    def record(self, state: nn.Module, role: str, x: torch.Tensor, codes: torch.Tensor,
               scale_inv: torch.Tensor) -> None: ...


_active: Optional[CastRecorder] = None


def start(recorder: CastRecorder) -> None:
    """Makes ``recorder`` the active one; raises RuntimeError if another is."""
    global _active
    if _active is not None:
        raise RuntimeError("numerics_report: another report is recording; exit it first (they do not nest)")
    _active = recorder


def stop() -> None:
    global _active
    _active = None


def recording() -> bool:
    """Whether a recorder is active here (never inside code being compiled, so Dynamo neither
    traces the statistics nor guards on a recorder's being active)."""
    if torch.compiler.is_compiling():
        return False
    return _active is not None


def record(state: nn.Module, role: str, x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Reports one cast: ``x`` high precision, ``codes`` its FP8 cast (same shape) with
    ``scale_inv``; ``state`` the Fp8Linear's input or output-gradient ScalingState (names the layer)."""
    if _active is not None:
        _active.record(state, role, x, codes, scale_inv)
