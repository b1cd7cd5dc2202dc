"""Argument checks shared by the op wrappers: TypeErrors that name the op and the argument.

They sit on the hot path of every Fp8Linear step, so each accepts a good value with one
``isinstance`` (or one tuple membership test) and builds its message only when it raises.
"""

from __future__ import annotations

import torch

from ..formats import check_dtype

_Tensor = torch.Tensor


def _type_error(op: str, arg: str, what: str, value: object) -> TypeError:
    return TypeError(f"fp8amp.ops.{op}: {arg} must be {what}, got {type(value).__name__}")


def _tensor(value: object, arg: str, op: str) -> torch.Tensor:
    if isinstance(value, _Tensor):
        return value
    raise _type_error(op, arg, "a torch.Tensor", value)


def _input(value: object, arg: str, op: str) -> torch.Tensor:
    """A tensor the op only reads, made contiguous."""
    if isinstance(value, _Tensor):
        return value.contiguous()
    raise _type_error(op, arg, "a torch.Tensor", value)


def has_row_runs(x: torch.Tensor) -> bool:
    """Whether x's elements, in some order of its dims, are runs of equal length at one stride (the
    core's fp8amp::row_runs, tensor.h): contiguous tensors, permutations of them, slices of a
    matrix's columns such as SDPA's q, k, v, runs of one element (a column). Order-free reductions
    read these in place. (Integer steps only, no sort of tuples: Dynamo traces this inside
    compiled graphs.)"""
    if x.numel() == 0:
        return True
    dims = [[stride, n] for stride, n in zip(x.stride(), x.shape) if n != 1]

    def extent_from(stride: int) -> int:
        """Takes out of `dims` the dims that continue a run starting at `stride`; its end."""
        extent, grown = stride, True
        while grown:
            grown = False
            for d in dims:
                if d[0] == extent:
                    extent, grown = extent * d[1], True
                    dims.remove(d)
                    break
        return extent

    cols = extent_from(1)  # 1 where no dim has stride 1: runs of one element
    if not dims:
        return True
    row_stride = min(d[0] for d in dims)
    if row_stride < cols:
        return False  # the runs would overlap
    extent_from(row_stride)
    return not dims


def _reduction_input(value: object, arg: str, op: str) -> torch.Tensor:
    """A tensor an order-free reduction reads: as it is where it has row runs, else made contiguous."""
    if isinstance(value, _Tensor):
        return value if has_row_runs(value) else value.contiguous()
    raise _type_error(op, arg, "a torch.Tensor", value)


def _optional_input(value: object, arg: str, op: str) -> torch.Tensor | None:
    if value is None:
        return None
    if isinstance(value, _Tensor):
        return value.contiguous()
    raise _type_error(op, arg, "a torch.Tensor", value)


def _inputs(values: object, arg: str, op: str) -> list[torch.Tensor]:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"fp8amp.ops.{op}: {arg} must be a list or tuple of tensors, got {type(values).__name__}")
    return [_input(v, f"{arg}[{i}]", op) for i, v in enumerate(values)]


def _tensors(values: object, arg: str, op: str) -> list[torch.Tensor]:
    """A list of tensors the op writes in place, passed as they are; the core checks the rest."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"fp8amp.ops.{op}: {arg} must be a list or tuple of tensors, got {type(values).__name__}")
    return [_tensor(v, f"{arg}[{i}]", op) for i, v in enumerate(values)]


def _optional_tensors(values: object, arg: str, op: str) -> list:
    """A list of tensors or Nones (one per tensor of the call, or empty for none), passed as they are."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"fp8amp.ops.{op}: {arg} must be a list or tuple of tensors or None, got "
                        f"{type(values).__name__}")
    return [v if v is None else _tensor(v, f"{arg}[{i}]", op) for i, v in enumerate(values)]


def _outputs(values: object, dtype: torch.dtype, arg: str, op: str) -> list[torch.Tensor]:
    """Tensors of ``dtype`` the op writes in place, as a list: passed as they are (a contiguous copy
    would not receive the write); the core checks their count, shapes, devices and layout."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"fp8amp.ops.{op}: {arg} must be a list or tuple of tensors, got {type(values).__name__}")
    for i, v in enumerate(values):
        if _tensor(v, f"{arg}[{i}]", op).dtype != dtype:
            raise ValueError(f"fp8amp.ops.{op}: {arg}[{i}] must be {dtype} (the dtype argument), got {v.dtype}")
    return list(values)


def _int(value: object, arg: str, op: str) -> int:
    if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _type_error(op, arg, "an int", value)


def _bool(value: object, arg: str, op: str) -> bool:
    if value is True or value is False:
        return value
    raise _type_error(op, arg, "a bool", value)


def _float(value: object, arg: str, op: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(op, arg, "a float", value)
    return float(value)


def _dtype(value: object, accepted: tuple, arg: str, op: str) -> torch.dtype:
    """``value`` if it is one of the ``accepted`` dtypes; otherwise the TypeError / ValueError of
    :func:`fp8amp.formats.check_dtype`, which names the accepted values."""
    if isinstance(value, torch.dtype) and value in accepted:
        return value
    return check_dtype(value, accepted, arg, f"fp8amp.ops.{op}")
