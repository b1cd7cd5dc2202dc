"""The seeded five-layer MLP (32 -> 64 -> 32 -> 16) and regression batches that the training-loop
tests step with fp8amp and with plain torch (test_training_loops.py,
test_optimizer_patterns_usage.py)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def regression_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen)) for _ in range(n)]
