"""``numerics_report``: how well each FP8 cast of a model's Fp8Linears represents its tensor.

Recorded over the steps run inside the ``with`` block (eager code; see below), per Fp8Linear and
per tensor it quantizes:

- ``input`` (E4M3, delayed scaling), ``weight`` (E4M3: the forward GEMM's operand against the
  weight's real values, the FP16 master's at O1/O2), ``grad_output`` (E5M2, delayed scaling) and
  ``weight_grad`` (E4M3, current scaling; O1/O2 only, where the weight gradient is FP8).
- ``saturated``: the fraction of finite elements whose scaled magnitude exceeded the format's max
  and was clipped to it. Delayed scaling takes its scale from earlier steps' amaxes, so a tensor
  that outgrows its history saturates; anything above 0 is lost range.
- ``underflow``: the fraction of finite non-zero elements that became zero.
- ``sqnr_db``: signal-to-quantization-noise ratio, ``10 log10(sum x^2 / sum (x - dq(q(x)))^2)``
  over finite elements (inf when exact). E4M3's rounding alone gives about 31 dB on normal-like
  data, E5M2's about 25 dB; much less means range is lost at one end.
- ``nonfinite`` (elements), ``amax`` (over finite elements), ``scale`` (the last one used) and
  ``warming_up`` (delayed states still on current scaling).

Under the rowwise and blockwise recipes (docs/tiles.md#recipes) each element is judged against
its own tile's scale, so ``saturated`` and ``underflow`` count per tile; ``scale`` is then the
smallest tile scale of the last call (the outliers' tile), and ``warming_up`` is empty (every tile
is current-scaled).

Statistics are summed on the device as the steps run and read back once, when the block exits.
They cost a few passes over every recorded tensor (float32 copies included), so the report is a
diagnostic to run for a step or two, not to leave on.

Every cast counts, so activation checkpointing's recomputed forward adds a second call of the same
cast (the fractions and the SQNR do not change; ``calls`` and ``numel`` double).

Only eager code records: inside code that ``torch.compile`` compiled nothing is recorded (and
nothing is traced for it, so compiled graphs are unchanged). Run the steps to inspect on the
uncompiled model; :attr:`NumericsReport.note` says when nothing was recorded.

Example::

    with fp8amp.numerics_report(model) as report:
        loss = model(x, y)
        loss.backward()
    print(report)                 # a table, worst SQNR first
    report.rows                   # list[TensorStats]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from . import cast_recorder
from .formats import format_max
from .linear import Fp8Linear

__all__ = ["NumericsReport", "TensorStats", "numerics_report"]

ROLES = ("input", "weight", "grad_output", "weight_grad")

# Accumulator slots (float64 on the tensor's device).
_NUMEL, _NONZERO, _UNDERFLOW, _SATURATED, _NONFINITE, _SIGNAL, _NOISE, _AMAX = range(8)

@dataclass(frozen=True)
class TensorStats:
    """One tensor of one Fp8Linear, summed over the recorded steps (see the module docstring)."""

    layer: str
    role: str
    fmt: torch.dtype
    calls: int
    numel: int
    amax: float
    scale: float
    saturated: float
    underflow: float
    nonfinite: int
    sqnr_db: float
    warming_up: Optional[bool]


class NumericsReport:
    """Context manager returned by :func:`numerics_report`; holds :attr:`rows` after it exits."""

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"numerics_report: model must be an nn.Module, got {type(model).__name__}")
        self._model = model
        self._layers: list[tuple[str, nn.Module]] = []
        self._layer_of_state: dict[int, str] = {}  # id of an input or output-gradient ScalingState
        self._sums: dict[tuple[str, str], torch.Tensor] = {}
        self._last: dict[tuple[str, str], tuple[torch.dtype, torch.Tensor, int]] = {}
        self.rows: list[TensorStats] = []
        self.note = ""

    def __enter__(self) -> "NumericsReport":
        # The model as it is now (converted or not); a report can be entered again, and starts afresh.
        self._layers = [(name, m) for name, m in self._model.named_modules() if isinstance(m, Fp8Linear)]
        self._layer_of_state = {}
        for name, m in self._layers:
            self._layer_of_state[id(m.input_scaling)] = name
            self._layer_of_state[id(m.grad_output_scaling)] = name
        self._sums.clear()
        self._last.clear()
        self.rows = []
        self.note = ""
        cast_recorder.start(self)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        cast_recorder.stop()
        if exc_type is None:  # an error inside the block propagates as it is, no report
            self._finish()

    def record(self, state: nn.Module, role: str, x: torch.Tensor, codes: torch.Tensor,
                scale_inv: torch.Tensor) -> None:
        layer = self._layer_of_state.get(id(state))
        if layer is None:  # an Fp8Linear outside the reported model
            return
        key = (layer, role)
        with torch.no_grad():
            stats = _quantization_stats(x, codes, scale_inv)
            total = self._sums.get(key)
            if total is None:
                self._sums[key] = stats
            else:
                total[:_AMAX] += stats[:_AMAX]
                total[_AMAX] = torch.maximum(total[_AMAX], stats[_AMAX])
            calls = self._last[key][2] + 1 if key in self._last else 1
            # One scale, or (tile scales spread over the elements) the smallest of them; none (NaN)
            # for an empty tensor's.
            largest_scale_inv = (scale_inv.detach().amax() if scale_inv.numel() else
                                 torch.full((), math.nan, device=scale_inv.device))
            self._last[key] = (codes.dtype, largest_scale_inv, calls)

    def _finish(self) -> None:
        if not self._sums:
            self.note = ("no FP8 casts were recorded: the model has no Fp8Linear" if not self._layers else
                         "no FP8 casts were recorded: run the steps eagerly inside the block (compiled code "
                         "does not record)")
            return
        keys = list(self._sums)
        states = {}
        for name, m in self._layers:
            if not m.recipe.tiled:  # the tiled recipes' states are unused
                states[(name, "input")] = m.input_scaling
                states[(name, "grad_output")] = m.grad_output_scaling
        device = self._sums[keys[0]].device
        nan = torch.tensor(math.nan, dtype=torch.float64, device=device)

        def warm_flag(key) -> torch.Tensor:  # 1 while warming up, 0 after, NaN for current scaling
            state = states.get(key)
            if state is None:
                return nan
            return (state.counter < state.recipe.history_len).any().to(device, torch.float64)

        # Everything in one [keys, 10] tensor, read back once (the report's only host sync).
        table = torch.stack([
            torch.cat([self._sums[k].to(device), self._last[k][1].to(device, torch.float64).reshape(1),
                       warm_flag(k).reshape(1)])
            for k in keys
        ]).tolist()
        order = {name: i for i, (name, _) in enumerate(self._layers)}
        rows = []
        for key, s in zip(keys, table):
            fmt, _, calls = self._last[key]
            scale_inv, warm = s[_AMAX + 1], s[_AMAX + 2]
            finite = s[_NUMEL] - s[_NONFINITE]
            rows.append(TensorStats(
                layer=key[0], role=key[1], fmt=fmt, calls=calls, numel=int(s[_NUMEL]), amax=s[_AMAX],
                scale=1.0 / scale_inv if scale_inv else math.inf,
                saturated=s[_SATURATED] / finite if finite else 0.0,
                underflow=s[_UNDERFLOW] / s[_NONZERO] if s[_NONZERO] else 0.0,
                nonfinite=int(s[_NONFINITE]), sqnr_db=_sqnr_db(s[_SIGNAL], s[_NOISE]),
                warming_up=None if math.isnan(warm) else bool(warm)))
        rows.sort(key=lambda r: (order[r.layer], ROLES.index(r.role)))
        self.rows = rows

    def worst(self, n: int = 10) -> list[TensorStats]:
        """The n rows with the lowest SQNR (non-finite ones first); n a non-negative int."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"NumericsReport.worst: n must be a non-negative int (how many rows), got {n!r}")
        return sorted(self.rows, key=lambda r: (r.nonfinite == 0, r.sqnr_db))[:n]

    def __str__(self) -> str:
        if not self.rows:
            return f"numerics_report: {self.note or 'nothing recorded yet'}"
        columns = ("layer", "tensor", "format", "calls", "amax", "scale", "saturated", "underflow", "SQNR dB",
                   "non-finite", "warm-up")
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for r in self.worst(len(self.rows)):
            warm = "" if r.warming_up is None else ("yes" if r.warming_up else "no")
            lines.append(
                f"| {r.layer or '<model>'} | {r.role} | {str(r.fmt).replace('torch.', '')} | {r.calls} | {r.amax:.4g} | "
                f"{r.scale:.4g} | {100 * r.saturated:.3g} % | {100 * r.underflow:.3g} % | {r.sqnr_db:.1f} | "
                f"{r.nonfinite} | {warm} |")
        return "\n".join(lines)


def numerics_report(model: nn.Module) -> NumericsReport:
    """A context manager that records, for every Fp8Linear of ``model``, how each of its FP8 casts
    represents its tensor while the block runs (saturation, underflow, SQNR: see
    :mod:`fp8amp.report`). Eager code only; the statistics are read back when the block exits."""
    return NumericsReport(model)


def _quantization_stats(x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float64 [8]: numel, non-zero, underflow, saturated, non-finite, signal, noise, amax."""
    xf = x.detach().float()
    finite = torch.isfinite(xf)
    magnitude = torch.where(finite, xf.abs(), 0.0)
    nonzero = finite & (xf != 0)
    decoded = codes.float()
    error = torch.where(finite, xf - decoded * scale_inv.float(), 0.0)
    zero = torch.zeros((), dtype=torch.float64, device=xf.device)
    return torch.stack([
        zero + xf.numel(),
        nonzero.sum().double(),
        (nonzero & (decoded == 0)).sum().double(),
        (magnitude / scale_inv.float() > format_max(codes.dtype)).sum().double(),
        (~finite).sum().double(),
        magnitude.double().square().sum(),
        error.double().square().sum(),
        magnitude.max().double() if xf.numel() else zero,
    ])


def _sqnr_db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0 or math.isnan(noise):
        return math.nan if math.isnan(noise) else -math.inf
    return 10.0 * math.log10(signal / noise)
