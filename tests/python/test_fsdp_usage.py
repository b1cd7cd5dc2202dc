"""FSDP2 (``fully_shard``) as users combine it with the rest of PyTorch: 2 processes on CPU with gloo.

``fully_shard(..., shard_placement_fn=...)`` returning ``Shard(1)`` for an O1/O2 master made each
rank's shard a column view of the master (a ``DequantizedView``): fp8amp's AdamW took it as a plain
float32 param without a word, and the first forward failed with an error that blamed
``load_state_dict(assign=True)`` and the like. Masters shard by rows only: both now say so and
name the fix (``Shard(0)`` for the masters).
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8amp
from ranks import error_of, run_on_ranks

WORLD = 2
TIMEOUT = datetime.timedelta(seconds=20)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


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


def eval_rank(rank: int, mode: str) -> dict:
    """Two training steps under fully_shard, then eval forwards: every buffer before and after them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mode == "fp8":
        model = fp8amp.convert(make_model(), policy="all")
        fp8amp.fsdp.enable_fp8_all_gather(model)
    else:
        model, _ = fp8amp.initialize(make_model(), None, mode, policy="all")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-2) if mode == "fp8"
                 else fp8amp.optim.AdamW(model.parameters(), lr=1e-2, state_dtypes=mode))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(8, 32, generator=gen)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        fp8amp.update_scaling(model)
    before = {name: b.clone() for name, b in model.named_buffers()}
    model.eval()
    x = torch.randn(8, 32, generator=gen) * 100  # amaxes far from training's
    with torch.no_grad():
        out = model(x)
    with torch.inference_mode():
        model(x)
    changed = [name for name, b in model.named_buffers() if not torch.equal(b, before[name])]
    return {"changed": changed, "finite": bool(out.isfinite().all())}


@pytest.mark.parametrize("mode", ["fp8", "O1", "O2"])
def test_eval_forwards_under_fully_shard_leave_every_scaling_buffer(mode):
    """docs/numerics.md: only training forwards write the histories. FSDP2's E4M3 all-gather (FP8
    compute with enable_fp8_all_gather, O1/O2 masters) wrote the weight's amax into its history in
    eval forwards too, so a checkpoint saved after validation differed from one saved without it."""
    for result in run_on_ranks(eval_rank, WORLD, mode):
        assert result == {"changed": [], "finite": True}
