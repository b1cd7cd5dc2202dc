"""What the rank-consistent delayed scaling tests share (test_amax_sync.py,
test_amax_sync_failures.py): the model, the ranks' batches (amaxes 10^2 apart per rank), the loss, a
snapshot of the scaling buffers, and the spawn of a file's worker on 2 or 3 processes on CPU with
gloo (each file's module fixture, once a world size)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn

from ranks import run_on_ranks

STEPS = 3
LR = 1e-3
# The world sizes: the params of each file's module fixture.
WORLDS = [pytest.param(2, id="world2"), pytest.param(3, id="world3")]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's inputs and loss weights are 100^r times rank 0's: very different input and
    output-gradient amaxes on every rank."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g) * 100.0 ** rank, torch.randn(16, 16, generator=g) * 100.0 ** rank


def loss_of(model: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (model(x) * weight).mean()


def scaling_buffers(model: nn.Module) -> dict:
    return {name: b.detach().clone() for name, b in model.named_buffers() if "scaling" in name}


class Run(NamedTuple):
    world: int
    results: list


def spawn(worker, world: int) -> Run:
    """``worker(rank, world)`` (a module-level function returning a dict: it is pickled by name) on
    ``world`` processes joined by a gloo process group; every rank's dict, in rank order."""
    return Run(world, run_on_ranks(worker, world, world))
