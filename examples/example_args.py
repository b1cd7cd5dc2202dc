"""Argument types and checks the examples share: a bad value ends the run with argparse's usage and
one line naming the argument and what it accepts."""

from __future__ import annotations

import argparse
import math

import torch


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def resolve_device(parser: argparse.ArgumentParser, text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: accepted: cpu, cuda or cuda:N; got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"argument --device: {text!r} needs a CUDA GPU, and torch sees none here; use --device cpu "
                         "(FP8 emulation)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"argument --device: {text!r}: this machine has {torch.cuda.device_count()} GPU(s), "
                         f"accepted: cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device
