"""FSDP2 (``fully_shard``) as users combine it with the rest of PyTorch: 2 processes on CPU with gloo.

``fully_shard(..., shard_placement_fn=...)`` returning ``Shard(1)`` for an O1/O2 master made each
rank's shard a column view of the master (a ``DequantizedView``): fp8amp's AdamW took it as a plain
float32 param without a word, and the first forward failed with an error that blamed
``load_state_dict(assign=True)`` and the like. Masters shard by rows only: both now say so and
name the fix (``Shard(0)`` for the masters).
"""

import datetime

import torch
import torch.distributed as dist
from torch import nn

import fp8amp
from ranks import run_on_ranks

WORLD = 2
TIMEOUT = datetime.timedelta(seconds=20)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def error_of(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def column_sharded_master_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model, _ = fp8amp.initialize(make_model(), None, "O2", policy="all")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    columns = lambda p: Shard(1) if p.ndim == 2 else Shard(0)  # noqa: E731
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh, shard_placement_fn=columns)
    fully_shard(model, mesh=mesh, shard_placement_fn=columns)
    x = torch.randn(4, 32)
    return {"optimizer": error_of(lambda: fp8amp.optim.AdamW(model.parameters(), state_dtypes="O2")),
            "forward": error_of(lambda: model(x))}


def test_a_master_sharded_by_columns_is_refused_by_name():
    for r in run_on_ranks(column_sharded_master_rank, WORLD, timeout=TIMEOUT):
        assert r["optimizer"].startswith("ValueError: fp8amp.optim.AdamW: param 0 of group 0 is a shard of an "
                                         "FP16 master along dim 1"), r["optimizer"]
        assert "Shard(0)" in r["optimizer"], r["optimizer"]
        assert r["forward"].startswith("RuntimeError: Fp8Linear:"), r["forward"]
        assert "shard_placement_fn" in r["forward"] and "Shard(0)" in r["forward"], r["forward"]
