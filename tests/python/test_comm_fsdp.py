"""FP8 reduce-scatter (fp8amp.fsdp.fp8_reduce_scatter, enable_fp8_reduce_scatter;
docs/distributed.md#fp8-reduce-scatter-under-fsdp2): gloo processes on CPU; marked gpu, one GPU
with a one-rank NCCL group (the collective's CUDA path against its CPU path) and 2 GPUs with NCCL
(skipped with fewer).

The collective alone: every rank's shard within the derived bound of the exact (float64) sum, SUM
and AVG, float32 and bfloat16, 2, 3 and 4 ranks, zeros, and a NaN or inf on one rank making every
rank's whole shard NaN. Under FSDP2 O2: the reduce-scattered gradients equal the float32
reduce-scatter's within FP8 precision (and are not the same bits: FP8 went on the wire), training
keeps the ranks' weights identical, and gradient accumulation without sync (FSDP2's
``set_requires_gradient_sync(False)``) reduce-scatters once, at the sync micro-batch.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8amp
from fp8amp.fsdp import Fp8ReduceScatter, enable_fp8_reduce_scatter, fp8_reduce_scatter
from cast_reference import assert_bits_equal
from ranks import free_port, run_on_ranks
from test_fsdp import batch, loss_of, make_model, shard

E4M3 = fp8amp.E4M3
U, ETA, U32 = 2.0 ** -4, 2.0 ** -10, 2.0 ** -24
SHARD = 301  # elements of each rank's output: not a multiple of a vector width


def inputs(rank: int, world: int, dtype) -> torch.Tensor:
    """World chunks of SHARD elements; within a chunk, pieces whose magnitudes differ by 10^3."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(world, SHARD, generator=g)
    x[:, :100] *= 1e-3
    return x.reshape(-1).to(dtype)


def collective_rank(rank: int, world: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, op_divisor in (("sum", 1.0), ("avg", float(world))):
            result = torch.empty(SHARD, dtype=dtype)
            fp8_reduce_scatter(result, inputs(rank, world, dtype), fmt=E4M3, divisor=op_divisor)
            out[name, dtype] = result
    zeros = torch.empty(SHARD)
    fp8_reduce_scatter(zeros, torch.zeros(world * SHARD))
    out["zeros"] = zeros
    for bad in (float("nan"), float("inf")):
        x = inputs(rank, world, torch.float32)
        if rank == world - 1:
            x[5] = bad  # in chunk 0 only: still every rank's shard turns NaN
        result = torch.empty(SHARD)
        fp8_reduce_scatter(result, x)
        out["bad", str(bad)] = result
    errors = {}
    for key, call in {
        "shape": lambda: fp8_reduce_scatter(torch.empty(3), torch.empty(5)),
        "dtype": lambda: fp8_reduce_scatter(torch.empty(3), torch.empty(3 * world, dtype=torch.float64)),
        "fmt": lambda: fp8_reduce_scatter(torch.empty(3), torch.empty(3 * world), fmt=torch.float16),
    }.items():
        try:
            call()
        except ValueError as e:
            errors[key] = str(e)
    out["errors"] = errors
    return out


def two_rank_runs(rank: int) -> dict:
    """Everything the 2-rank tests need, in one spawn of the processes."""
    return dict(collective=collective_rank(rank, 2), fsdp=fsdp_runs(rank))


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(two_rank_runs, 2)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["world2", "world3", "world4"])
def collective(request):
    if request.param == 2:
        return 2, [r["collective"] for r in request.getfixturevalue("two_ranks")]
    return request.param, run_on_ranks(collective_rank, request.param, request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["sum", "avg"])
def test_fp8_reduce_scatter_within_the_derived_bound(collective, dtype, name):
    """Per element of rank k's shard, against the exact sum S of every rank's chunk k (divided by
    N for AVG): one E4M3 rounding of each contribution at the chunk's shared scale s (relative u,
    absolute eta / s), the float32 sum in rank order and the division (u32 each), the rounding
    into the output dtype."""
    world, res = collective
    divisor = 1.0 if name == "sum" else float(world)
    xs = torch.stack([inputs(r, world, dtype).double().view(world, SHARD) for r in range(world)])  # [rank, chunk, i]
    for k in range(world):
        exact = xs[:, k].sum(0) / divisor
        amax = xs[:, k].abs().max()
        s = 2.0 ** torch.floor(torch.log2(448.0 / amax))
        e1 = (U * xs[:, k].abs() + ETA / s).sum(0) / divisor
        e2 = U32 * world * ((1 + U) * xs[:, k].abs() + ETA / s).sum(0) / divisor
        out_u = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0
        bound = e1 + e2 + out_u * (exact.abs() + e1 + e2)
        got = res[k][name, dtype].double()
        assert ((got - exact).abs() <= bound).all(), ((got - exact).abs() - bound).max()
        assert ((got - exact).abs() > 1e-6 * exact.abs()).float().mean() > 0.3  # FP8 on the wire, not float32


def test_fp8_reduce_scatter_zeros_non_finite_and_errors(collective):
    world, res = collective
    for r in res:
        assert torch.equal(r["zeros"], torch.zeros(SHARD))
        assert r["bad", "nan"].isnan().all() and r["bad", "inf"].isnan().all()
        assert "input must hold world size" in r["errors"]["shape"]
        assert "input and output must share one dtype" in r["errors"]["dtype"]
        assert "fmt must be one of" in r["errors"]["fmt"]


def fsdp_rank(rank: int, fp8: bool, accumulate: bool, device_type: str = "cpu") -> dict:
    """O2 under FSDP2, its gradients reduce-scattered in FP8 or float32: the sharded gradients of
    the first backward, then a few steps (with accumulate: two micro-batches a step, the first
    without gradient sync)."""
    device = torch.device(device_type, rank if device_type == "cuda" else 0)
    model, _ = fp8amp.initialize(make_model().to(device), None, "O2", policy="all")
    shard(model, device_type=device_type)
    if fp8:
        assert enable_fp8_reduce_scatter(model) == 3  # the two Linears and the model
    optimizer = fp8amp.optim.AdamW(model.parameters(), lr=1e-3, state_dtypes="O2")
    optimizer.register_step_post_hook(lambda *_: fp8amp.update_scaling(model))
    first_grads = None
    for step in range(3):
        micro = ((step, rank + 10), (step, rank)) if accumulate else ((step, rank),)
        for i, (s, r) in enumerate(micro):
            model.set_requires_gradient_sync(i == len(micro) - 1)
            x, target = (t.to(device) for t in batch(s, r))
            loss_of(model, x, target).backward()
        if first_grads is None:
            first_grads = {n: p.grad.to_local().detach().float().cpu().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.full_tensor().detach().float().cpu() for n, p in model.named_parameters()}
    return dict(grads=first_grads, params=params)


def fsdp_runs(rank: int) -> dict:
    return {(fp8, accumulate): fsdp_rank(rank, fp8, accumulate) for fp8 in (True, False) for accumulate in (False, True)}


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "accumulate"])
def test_fsdp2_o2_fp8_reduce_scatter_within_fp8_precision_and_ranks_identical(two_ranks, accumulate):
    fp8 = [r["fsdp"][True, accumulate] for r in two_ranks]
    fp32 = [r["fsdp"][False, accumulate] for r in two_ranks]
    for r8, r32 in zip(fp8, fp32):
        for name, g32 in r32["grads"].items():
            g8 = r8["grads"][name]
            # one E4M3 rounding of each rank's contribution (2 ranks, relative 2^-4 each) against the
            # largest gradient of the shard's chunk, which sets the shared scale
            assert (g8 - g32).abs().max() <= 2 * U * g32.abs().max() + 1e-6, name
            assert not torch.equal(g8, g32), name  # FP8 went on the wire
    for name, value in fp8[0]["params"].items():
        assert torch.equal(value, fp8[1]["params"][name]), name  # the ranks agree bit for bit
        # Adam's steps of lr = 1e-3 each: 3 steps apart at most by 2 lr a step
        assert (value - fp32[0]["params"][name]).abs().max() <= 2 * 1e-3 * 3, name


def test_enable_fp8_reduce_scatter_errors():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        enable_fp8_reduce_scatter("model")
    with pytest.raises(ValueError, match="no module of model is fully_shard-ed"):
        enable_fp8_reduce_scatter(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="fmt must be one of"):
        enable_fp8_reduce_scatter(nn.Linear(2, 2), fmt=torch.float16)


GPUS = torch.cuda.device_count()


def one_cuda_rank(rank: int) -> dict:
    """fp8_reduce_scatter with CUDA tensors on this process's one-rank NCCL group, and with the same
    inputs on the CPU over a one-rank gloo group of the same process; FSDP2's comm object too."""
    gloo = dist.new_group(backend="gloo")
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for divisor in (1.0, 3.0):
            x = inputs(rank, 1, dtype)
            on_gpu = torch.empty(SHARD, dtype=dtype, device="cuda")
            fp8_reduce_scatter(on_gpu, x.cuda(), divisor=divisor)
            on_cpu = torch.empty(SHARD, dtype=dtype)
            fp8_reduce_scatter(on_cpu, x, gloo, divisor=divisor)
            out[dtype, divisor] = (x, on_gpu.cpu(), on_cpu)
    x = inputs(rank, 1, torch.float32)
    x[7] = float("inf")
    on_gpu = torch.empty(SHARD, device="cuda")
    Fp8ReduceScatter()(on_gpu, x.cuda(), dist.group.WORLD, dist.ReduceOp.AVG)
    out["inf"] = on_gpu.cpu()
    return out


@pytest.mark.gpu
def test_fp8_reduce_scatter_on_one_gpu_equals_the_cpu_bit_for_bit():
    """The collective's CUDA path (the comm kernels, NCCL's all-to-all of the codes; with one rank
    FSDP2 itself makes no reduce-scatter call) against its CPU path over gloo: the same bits, FP8
    rounding in both."""
    (res,) = run_on_ranks(one_cuda_rank, 1, backend="nccl")
    for (_, divisor), (x, on_gpu, on_cpu) in ((k, v) for k, v in res.items() if k != "inf"):
        assert_bits_equal(on_gpu, on_cpu, x)
        exact = x.double() / divisor
        assert not torch.equal(on_cpu.double(), exact)  # rounded to FP8 on the way
        assert ((on_cpu.double() - exact).abs() <= U * exact.abs().max() + 2.0 ** -8 * exact.abs()).all()
    assert res["inf"].isnan().all()


def nccl_rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        results[rank] = {fp8: fsdp_rank(rank, fp8, False, "cuda") for fp8 in (True, False)}
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for NCCL; {GPUS} visible")
def test_fsdp2_o2_fp8_reduce_scatter_on_two_gpus():
    """The same on 2 GPUs with NCCL: FSDP2's reduce-scatter stream, the CUDA comm kernels."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(nccl_rank, args=(free_port(), results), nprocs=2, join=True)
        ranks = [results[r] for r in range(2)]
    for r in ranks:
        for name, g32 in r[False]["grads"].items():
            assert (r[True]["grads"][name] - g32).abs().max() <= 2 * U * g32.abs().max() + 1e-6, name
    for name, value in ranks[0][True]["params"].items():
        assert torch.equal(value, ranks[1][True]["params"][name]), name
