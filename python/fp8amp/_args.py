"""Argument checks shared by the op wrappers: TypeErrors that name the op and the argument."""

from __future__ import annotations

import torch


def _tensor(value: object, arg: str, op: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"fp8amp.{op}: {arg} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _input(value: object, arg: str, op: str) -> torch.Tensor:
    """A tensor the op only reads, made contiguous."""
    return _tensor(value, arg, op).contiguous()


def _optional_input(value: object, arg: str, op: str) -> torch.Tensor | None:
    return None if value is None else _input(value, arg, op)


def _inputs(values: object, arg: str, op: str) -> list[torch.Tensor]:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"fp8amp.{op}: {arg} must be a list or tuple of tensors, got {type(values).__name__}")
    return [_input(v, f"{arg}[{i}]", op) for i, v in enumerate(values)]


def _int(value: object, arg: str, op: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"fp8amp.{op}: {arg} must be an int, got {type(value).__name__}")
    return value


def _bool(value: object, arg: str, op: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"fp8amp.{op}: {arg} must be a bool, got {type(value).__name__}")
    return value


def _float(value: object, arg: str, op: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"fp8amp.{op}: {arg} must be a float, got {type(value).__name__}")
    return float(value)
