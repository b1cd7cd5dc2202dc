"""What the FP8 gradient all-reduce tests share (test_distributed.py: the hook on a bucket;
test_distributed_models.py: DDP and all_reduce_grads on models): the model, the hook called on a
FakeBucket, and the setups each file's module fixture spawns once: 1, 2 and 3 processes on CPU with
gloo (and 4, for the hook alone: FOUR_RANKS), and 1 and 2 processes on as many GPUs with NCCL (rank
r on cuda:r; marked gpu, skipped with fewer GPUs). The workers hand back their results on the CPU."""

from __future__ import annotations

import datetime
from typing import NamedTuple

import pytest
import torch
from torch import nn

from comm_reference import FakeBucket
from fp8amp import distributed as fd
from ranks import run_on_ranks

# A rank that fails leaves the others waiting in a collective: give up after this, not NCCL's 10 min.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=2)
GPUS = torch.cuda.device_count()
# (world, backend): the params of each file's module fixture.
SETUPS = [
    pytest.param((1, "gloo"), id="world1"),
    pytest.param((2, "gloo"), id="world2"),
    pytest.param((3, "gloo"), id="world3"),
    pytest.param((1, "nccl"), id="nccl1", marks=[  # one GPU: the CUDA streams and NCCL's async works
        pytest.mark.gpu,
        pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU for NCCL")]),
    pytest.param((2, "nccl"), id="nccl2", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for NCCL; {GPUS} visible")]),
]


# The hook's own tests (test_distributed.py) also run on 4 gloo processes.
FOUR_RANKS = pytest.param((4, "gloo"), id="world4")


class Run(NamedTuple):
    world: int
    backend: str
    results: list  # per rank: the worker's dict of results


def mlp(dtype=torch.float32, o2=False) -> nn.Module:
    """Odd sizes (not multiples of 2 or 3); for O2, two Linears FP8 can take (multiples of 16) and
    one it cannot (5 outputs), so the model has FP8 and float32 gradients."""
    torch.manual_seed(0)
    if o2:
        return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16), nn.GELU(), nn.Linear(16, 5)).to(dtype)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5)).to(dtype)


def run_hook(flat, sizes, state, device):
    fut = fd.fp8_allreduce_hook(state, FakeBucket(flat.to(device, copy=True), sizes))
    return fut.wait()


def to_cpu(obj):
    """``obj`` with every tensor moved to the CPU (what the Manager can hand to the test process)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def _on_device(rank: int, scenarios, world: int, backend: str) -> dict:
    """One rank: ``scenarios(rank, world, backend, device)`` on its device (cuda:rank with NCCL),
    the tensors of what it returns moved to the CPU."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    return to_cpu(scenarios(rank, world, backend, device))


def spawn(scenarios, world: int, backend: str) -> Run:
    """``scenarios`` (a module-level function returning a dict: it is pickled by name) on ``world``
    processes joined by ``backend``, each on its device; every rank's dict, in rank order."""
    return Run(world, backend, run_on_ranks(_on_device, world, scenarios, world, backend, backend=backend,
                                            timeout=COLLECTIVE_TIMEOUT))
