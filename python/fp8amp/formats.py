"""The scaled storage formats of fp8amp (docs/numerics.md#numerics) and the high-precision dtypes they come from.

A scaled format stores ``real * scale``; its largest finite magnitude, ``fmax``, is what the
scale rules aim amaxes at. ``E4M3`` has no infinities (NaN is 0x7F/0xFF), ``E5M2`` does; FP16 is
the format of FP16-with-scale master weights and optimizer states.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP16 = torch.float16

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FP16_MAX = 65504.0

#: The formats quantize, cast_transpose and the scaling state write, with their fmax.
SCALED_FORMATS: dict[torch.dtype, float] = {E4M3: E4M3_MAX, E5M2: E5M2_MAX, FP16: FP16_MAX}

#: The dtypes quantize reads and dequantize writes.
HIGH_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def type_name(value: object) -> str:
    """The name of ``value``'s type for error messages, qualified outside the builtins: numpy's
    bool is also named "bool", and "must be a bool, got bool" would say nothing."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def check_dtype(dtype: object, accepted, arg: str, where: str) -> torch.dtype:
    """Returns ``dtype`` if it is one of ``accepted``.

    Raises TypeError when ``dtype`` is not a ``torch.dtype`` and ValueError when it is not
    accepted; both messages name ``where`` (e.g. ``fp8amp.ops.quantize``), the argument and the
    accepted values.
    """
    if isinstance(dtype, torch.dtype) and dtype in accepted:  # the hot path (every Fp8Linear step): no message
        return dtype
    names = ", ".join(str(d) for d in accepted)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: {arg} must be a torch.dtype, one of {names}; got {type(dtype).__name__}")
    raise ValueError(f"{where}: {arg} must be one of {names}; got {dtype}")


def format_max(dtype: torch.dtype) -> float:
    """The largest finite magnitude (fmax) of a scaled format: 448, 57344 or 65504."""
    return SCALED_FORMATS[check_dtype(dtype, tuple(SCALED_FORMATS), "dtype", "fp8amp.format_max")]
