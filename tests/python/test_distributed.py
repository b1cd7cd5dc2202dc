"""FP8 gradient all-reduce (fp8amp.distributed, docs/distributed.md#design): 1, 2 and 3 processes on CPU with gloo,
and 1 and 2 processes on as many GPUs with NCCL (rank r on cuda:r; marked gpu, skipped with fewer GPUs).

Each setup spawns its processes once (a module fixture); the workers run every scenario and hand
back their inputs and outputs (on the CPU); the tests below check them against the exact float64
mean (the derived bounds) and, bit for bit, against reference_mean (the algorithm written out
plainly, in one process). The scenarios are the same on both backends, except for method "native": gloo cannot reduce
float8, so there it must raise and NCCL's float8 SUM is emulated; NCCL runs its own. On CUDA one
more scenario checks the ordering of the side stream against the compute stream.

The exact mean, its derived bound (method "all_to_all") and the plain reference algorithm are in
comm_reference.py. An O2 gradient (ScaledTensor) is re-quantized once more when DDP copies the
mean back: its bound adds one E4M3 rounding at the tensor's fresh scale.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fp8amp
from cast_reference import assert_bits_equal
from comm_reference import (E4M3, E5M2, FMAX, U, ETA, U32, synth, FakeBucket, pow2_scale, bound_all_to_all,
                            native_fmax, headroom_worst, shard_pieces, emulated_native, reference_mean)
from ranks import free_port
from fp8amp import comm_layout
from fp8amp import distributed as fd

SIZES = (37, 1, 200, 5, 64)  # 307 elements: not a multiple of 2 or 3
CHUNKS = 3  # pipelined chunks of SIZES' bucket: [0, 128), [128, 256), [256, 307), cutting gradients 2 and 4
DDP_STEPS = 3
# A kernel spinning this many GPU clock cycles (about half a second on an H200) keeps the compute
# stream busy far longer than the host needs to queue a whole reduction.
SLEEP_CYCLES = 10**9
# A rank that fails leaves the others waiting in a collective: give up after this, not NCCL's 10 min.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=2)


# ----------------------------------------------------------------------------- data


def mlp(dtype=torch.float32, o2=False) -> nn.Module:
    """Odd sizes (not multiples of 2 or 3); for O2, two Linears FP8 can take (multiples of 16) and
    one it cannot (5 outputs), so the model has FP8 and float32 gradients."""
    torch.manual_seed(0)
    if o2:
        return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16), nn.GELU(), nn.Linear(16, 5)).to(dtype)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5)).to(dtype)


def batch(step: int, rank: int, dtype=torch.float32, o2=False) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16 if o2 else 6, 32 if o2 else 7, generator=g).to(dtype)


# ----------------------------------------------------------------------------- the workers


def run_hook(flat, sizes, state, device):
    fut = fd.fp8_allreduce_hook(state, FakeBucket(flat.to(device, copy=True), sizes))
    return fut.wait()


def ddp_run(rank, device, state, dtype=torch.float32, bucket_cap_mb=25.0, inf_rank=None, o2=False):
    """One DDP backward checked against local gradients, then DDP_STEPS steps; returns data."""
    model = mlp(dtype, o2).to(device)
    if o2:
        model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")
        local = fp8amp.initialize(mlp(dtype, o2).to(device), None, "O2", policy="all")[0]
        local.load_state_dict(model.state_dict())
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        local = mlp(dtype).to(device)
    x0 = batch(0, rank, dtype, o2).to(device)
    if inf_rank == rank:
        x0[0, 0] = float("inf")
    local(x0).float().pow(2).mean().backward()
    local_grads = [p.grad.dequantize() if isinstance(p.grad, fp8amp.ScaledTensor) else p.grad.clone()
                   for p in local.parameters()]
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(state, fd.fp8_allreduce_hook)
    out = {"local": local_grads, "grads": [], "types": []}
    for step in range(DDP_STEPS):
        x = x0 if step == 0 else batch(step, rank, dtype, o2).to(device)
        ddp(x).float().pow(2).mean().backward()
        if step == 0:
            for p in model.parameters():
                out["types"].append(type(p.grad).__name__)
                out["grads"].append(p.grad.dequantize() if isinstance(p.grad, fp8amp.ScaledTensor) else p.grad.clone())
            if inf_rank is not None:
                return out
        opt.step()
        opt.zero_grad()
    out["params"] = [p.dequantize() if isinstance(p, fp8amp.ScaledTensor) else p.detach().clone()
                     for p in model.parameters()]
    return out


def native_runs(rank, world, device) -> dict:
    """Method "native" in both formats: the gradients of SIZES, and the headroom's worst case."""
    out = {}
    for fmt in (E4M3, E5M2):
        state = fd.FP8CommState(fmt=fmt, method="native")
        out["native", fmt] = run_hook(synth(rank, SIZES, torch.float32), SIZES, state, device)
        out["native_worst", fmt] = run_hook(headroom_worst(rank, world, fmt), (9,), state, device)
    return out


def emulated_native_runs(rank, backend, device) -> dict:
    """Method "native" with the emulated FP8 SUM, whose result reference_mean knows bit for bit, in
    both formats for float32 and bfloat16 buckets (on NCCL too: its own SUM need not round as the
    emulation does)."""
    out = {}
    with emulated_native(backend):
        for fmt in (E4M3, E5M2):
            for dtype in (torch.float32, torch.bfloat16):
                state = fd.FP8CommState(fmt=fmt, method="native")
                out["native_emulated", fmt, dtype] = run_hook(synth(rank, SIZES, dtype), SIZES, state, device)
                state = fd.FP8CommState(fmt=fmt, method="native", pipeline_chunks=CHUNKS)
                out["native_emulated_chunked", fmt, dtype] = run_hook(synth(rank, SIZES, dtype), SIZES, state, device)
    return out


def stream_order_run(rank, device) -> dict:
    """CUDA only: the hook and all_reduce_grads called while the compute stream is still busy (a
    spinning kernel, then the write of their input), their results used on the compute stream at
    once; then again on an idle GPU, as the reference. A side stream that did not wait for the
    compute stream would read the input before it is written, and a result used without waiting
    for the side stream would be read before it is written: either differs from the reference. The
    busy call goes first and its data (seeds 2, 3) appears nowhere else, so a result read too early
    cannot find the right bytes in a reused memory block. Also records whether each busy call
    returned to the host while the GPU was still busy (no host synchronization)."""
    compute = torch.cuda.current_stream(device)
    state = fd.FP8CommState(method="all_to_all")  # the bound the test checks
    x = synth(rank, SIZES, torch.float32, seed=2).to(device)
    bucket = torch.zeros_like(x)
    model = mlp().to(device)
    params = list(model.parameters())
    numels = [p.numel() for p in params]
    grads = synth(rank, numels, torch.float32, seed=3).to(device).split(numels)
    for p in params:
        p.grad = torch.zeros_like(p)

    def hook():
        bucket.copy_(x)
        return fd.fp8_allreduce_hook(state, FakeBucket(bucket, SIZES)).wait().clone()

    def all_reduce_grads():
        for p, g in zip(params, grads):
            p.grad.copy_(g.view_as(p))
        fd.all_reduce_grads(model, state)
        return [p.grad.clone() for p in params]

    # The first all_reduce_grads of a layout checks once, with a host read, that every rank holds
    # the same gradients: done here, on zeros, so that the busy calls show the steady state.
    fd.all_reduce_grads(model, state)
    out = {}
    for name, call in (("hook", hook), ("grads", all_reduce_grads)):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(SLEEP_CYCLES)
        out[name + "_busy"] = call()
        out[name + "_returned_early"] = not compute.query()
        torch.cuda.synchronize(device)
        out[name + "_idle"] = call()
    return out


def to_cpu(obj):
    """``obj`` with every tensor moved to the CPU (what the Manager can hand to the test process)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def worker(rank: int, world: int, backend: str, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    res = {}
    try:
        for fmt in (E4M3, E5M2):
            for dtype in (torch.float32, torch.bfloat16):
                state = fd.FP8CommState(fmt=fmt, method="all_to_all")
                res["hook", fmt, dtype] = run_hook(synth(rank, SIZES, dtype), SIZES, state, device)
        for fmt, dtype in ((E4M3, torch.float32), (E5M2, torch.bfloat16)):
            state = fd.FP8CommState(fmt=fmt, method="all_to_all", pipeline_chunks=CHUNKS)
            res["chunked", fmt, dtype] = run_hook(synth(rank, SIZES, dtype), SIZES, state, device)
        for key, where, value in (("chunked_inf", 20, float("inf")), ("chunked_nan", 300, float("nan"))):
            bad = synth(rank, SIZES, torch.float32)
            if rank == world - 1:
                bad[where] = value  # in the first chunk, then in the last
            res[key] = run_hook(bad, SIZES, fd.FP8CommState(method="all_to_all", pipeline_chunks=CHUNKS), device)
        res["auto"] = run_hook(synth(rank, SIZES, torch.float32), SIZES, None, device)  # the default state
        state = fd.FP8CommState(method="all_to_all")
        res["one_gradient"] = run_hook(synth(rank, (301,), torch.float32), (301,), state, device)
        res["tiny"] = run_hook(synth(rank, (1,), torch.float32, seed=1), (1,), state, device)  # fewer elements than ranks
        res["zeros"] = run_hook(torch.zeros(11), (4, 7), state, device)
        bad = synth(rank, SIZES, torch.float32)
        if rank == world - 1:
            bad[40] = float("inf")
        res["inf"] = run_hook(bad, SIZES, state, device)
        bad = synth(rank, SIZES, torch.float32)
        if rank == 0:
            bad[250] = float("nan")
        res["nan"] = run_hook(bad, SIZES, state, device)
        if backend == "gloo":
            # gloo cannot reduce float8, so "native" must raise; then emulated, to check the scales.
            try:
                run_hook(synth(rank, SIZES, torch.float32), SIZES, fd.FP8CommState(method="native"), device)
            except ValueError as e:
                res["native_error"] = str(e)
            with emulated_native(backend):
                res.update(native_runs(rank, world, device))
        else:
            try:
                res.update(native_runs(rank, world, device))  # NCCL's own float8 SUM
                # A group made without naming a backend (init_process_group() under torchrun) has one
                # backend per device type; "native" must find NCCL for CUDA tensors.
                per_device = dist.new_group(backend="cpu:gloo,cuda:nccl")
                res["native_per_device_group"] = run_hook(synth(rank, SIZES, torch.float32), SIZES,
                                                          fd.FP8CommState(per_device, method="native"), device)
            except ValueError as e:  # a torch or NCCL build without float8 reductions
                res["native_error"] = str(e)
        res.update(emulated_native_runs(rank, backend, device))
        if device.type == "cuda":
            res["streams"] = stream_order_run(rank, device)
        # DDP
        # DDP, with all_to_all, whose bound the tests know ("auto" picks native on NCCL)
        a2a = dict(method="all_to_all")
        res["ddp"] = ddp_run(rank, device, fd.FP8CommState(**a2a))
        res["ddp_buckets"] = ddp_run(rank, device, fd.FP8CommState(**a2a), bucket_cap_mb=1e-4)  # a bucket a parameter
        res["ddp_bf16"] = ddp_run(rank, device, fd.FP8CommState(**a2a), dtype=torch.bfloat16)
        res["ddp_inf"] = ddp_run(rank, device, fd.FP8CommState(), inf_rank=world - 1)
        res["ddp_o2"] = ddp_run(rank, device, fd.FP8CommState(**a2a), o2=True)
        # Without DDP: plain and O2 models.
        for name, o2 in (("manual", False), ("manual_o2", True)):
            model = mlp(o2=o2).to(device)
            if o2:
                model = fp8amp.initialize(model, None, "O2", policy="all")[0]
            model(batch(0, rank, o2=o2).to(device)).pow(2).mean().backward()
            local = [p.grad.dequantize() if isinstance(p.grad, fp8amp.ScaledTensor) else p.grad.clone()
                     for p in model.parameters()]
            fd.all_reduce_grads(model, fd.FP8CommState(method="all_to_all"), bucket_cap_mb=25.0 if not o2 else 1e-4)
            res[name] = {"local": local, "types": [type(p.grad).__name__ for p in model.parameters()],
                         "grads": [p.grad.dequantize() if isinstance(p.grad, fp8amp.ScaledTensor) else p.grad.clone()
                                   for p in model.parameters()]}
        errors = {}
        for name, call in {
            "ddp_model": lambda: fd.all_reduce_grads(nn.parallel.DistributedDataParallel(mlp().to(device))),
            "float64": lambda: run_hook(torch.zeros(4, dtype=torch.float64), (4,), fd.FP8CommState(), device),
            "cap": lambda: fd.all_reduce_grads(mlp(), bucket_cap_mb=0),
            "state": lambda: fd.all_reduce_grads(mlp(), state="fp8"),
            "hook_state": lambda: run_hook(torch.zeros(4), (4,), {"fmt": E4M3}, device),
        }.items():
            try:
                call()
            except (TypeError, ValueError) as e:
                errors[name] = (type(e).__name__, str(e))
        res["errors"] = errors
        results[rank] = to_cpu(res)
    finally:
        dist.destroy_process_group()


class Run(NamedTuple):
    world: int
    backend: str
    results: list  # per rank: the worker's dict of results


GPUS = torch.cuda.device_count()


@pytest.fixture(scope="module", params=[
    pytest.param((1, "gloo"), id="world1"),
    pytest.param((2, "gloo"), id="world2"),
    pytest.param((3, "gloo"), id="world3"),
    pytest.param((1, "nccl"), id="nccl1", marks=[  # one GPU: the CUDA streams and NCCL's async works
        pytest.mark.gpu,
        pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU for NCCL")]),
    pytest.param((2, "nccl"), id="nccl2", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for NCCL; {GPUS} visible")]),
])
def run(request):
    world, backend = request.param
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(world, backend, port, results), nprocs=world, join=True)
        return Run(world, backend, [dict(results[r]) for r in range(world)])


def same_on_all_ranks(res, key):
    for r in res[1:]:
        a, b = res[0][key], r[key]
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), key


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hook_within_derived_bound(run, fmt, dtype):
    world, _, res = run
    key = ("hook", fmt, dtype)
    xs = [synth(r, SIZES, dtype).double() for r in range(world)]
    m, bound = bound_all_to_all(xs, SIZES, fmt, shard_pieces(SIZES, world))
    for r in res:
        out = r[key]
        assert out.dtype == dtype and out.shape == (sum(SIZES),)
        err = (out.double() - m).abs()
        assert (err <= bound).all(), (err - bound).max()
    same_on_all_ranks(res, key)
    # It is FP8 on the wire, not a float32 all-reduce: most elements are rounded.
    assert ((res[0][key].double() - m).abs() > 1e-4 * m.abs()).float().mean() > 0.5


def test_hook_single_gradient_and_fewer_elements_than_ranks(run):
    world, _, res = run
    for key, sizes, seed in (("one_gradient", (301,), 0), ("tiny", (1,), 1)):
        xs = [synth(r, sizes, torch.float32, seed=seed) for r in range(world)]
        m, bound = bound_all_to_all([x.double() for x in xs], sizes, E4M3, shard_pieces(sizes, world))
        expected = reference_mean(xs, sizes, E4M3, "all_to_all")
        for r in res:
            assert ((r[key].double() - m).abs() <= bound).all(), key
            assert_bits_equal(r[key], expected)
        same_on_all_ranks(res, key)


@pytest.mark.parametrize("method", fd.METHODS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hook_equals_plain_reference_bit_for_bit(run, method, fmt, dtype):
    """The hook's fused local work (multi-tensor ops into preallocated views, the rank-order sum in
    place) gives the very bits of reference_mean, the algorithm written out plainly; "native" with
    the emulated FP8 SUM, whose rounding the reference knows. (The division by N is an IEEE
    division in the comm kernels on both devices, as the reference's on the CPU.)"""
    world, _, res = run
    key = ("hook", fmt, dtype) if method == "all_to_all" else ("native_emulated", fmt, dtype)
    expected = reference_mean([synth(r, SIZES, dtype) for r in range(world)], SIZES, fmt, method)
    for r in res:
        assert_bits_equal(r[key], expected)


@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.float32), (E5M2, torch.bfloat16)], ids=["e4m3-fp32", "e5m2-bf16"])
def test_pipelined_chunks_equal_plain_reference_bit_for_bit(run, fmt, dtype):
    """A bucket reduced in pipelined chunks (each chunk's collective overlapping the next chunk's
    local work): "all_to_all" gives the bits of the reference with each chunk cut into its own
    shards, "native" the very bits of the unchunked reduction (its scales stay the gradients')."""
    world, _, res = run
    xs = [synth(r, SIZES, dtype) for r in range(world)]
    bounds = comm_layout.chunk_bounds(sum(SIZES), CHUNKS, "all_to_all")
    chunks = list(zip(bounds[:-1], bounds[1:]))
    assert chunks == [(0, 128), (128, 256), (256, 307)]
    expected = reference_mean(xs, SIZES, fmt, "all_to_all", chunks)
    m, bound = bound_all_to_all([x.double() for x in xs], SIZES, fmt, shard_pieces(SIZES, world, chunks))
    for r in res:
        assert_bits_equal(r["chunked", fmt, dtype], expected)
        assert ((r["chunked", fmt, dtype].double() - m).abs() <= bound).all()
        assert_bits_equal(r["native_emulated_chunked", fmt, dtype], reference_mean(xs, SIZES, fmt, "native"))


@pytest.mark.parametrize("key", ["chunked_inf", "chunked_nan"])
def test_pipelined_chunks_one_non_finite_makes_the_whole_bucket_nan(run, key):
    _, _, res = run
    for r in res:
        assert r[key].isnan().all(), key  # every chunk, on every rank


def test_auto_picks_native_on_nccl_up_to_two_ranks_else_all_to_all(run):
    """The default method: on NCCL with at most 2 ranks the bits of "native" (its float8 SUM),
    elsewhere those of "all_to_all"."""
    world, backend, res = run
    if backend == "nccl" and world <= fd.AUTO_NATIVE_MAX_RANKS and "native_error" not in res[0]:
        expected = [r["native", E4M3] for r in res]
    else:
        expected = [r["hook", E4M3, torch.float32] for r in res]
    for r, e in zip(res, expected):
        assert_bits_equal(r["auto"], e)


def test_zero_gradients_stay_zero(run):
    _, _, res = run
    for r in res:
        assert torch.equal(r["zeros"], torch.zeros(11))


@pytest.mark.parametrize("key", ["inf", "nan"])
def test_one_rank_non_finite_makes_every_rank_nan(run, key):
    _, _, res = run
    for r in res:
        assert r[key].isnan().all(), key  # the whole bucket, on every rank


def test_native_without_float8_reduction_raises_naming_methods(run):
    """gloo cannot reduce float8, so method "native" must raise, naming the methods; so must a torch
    or NCCL build that refuses float8 all_reduce."""
    _, backend, res = run
    if backend == "nccl" and "native_error" not in res[0]:
        pytest.skip("this torch and NCCL reduce float8: test_native_headroom_prevents_overflow_of_fp8_partial_sums "
                    "checks the result")
    for r in res:
        msg = r["native_error"]
        assert "'all_to_all'" in msg and "'native'" in msg
        if backend == "gloo":
            assert "'gloo'" in msg and "nccl" in msg


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_native_headroom_prevents_overflow_of_fp8_partial_sums(run, fmt):
    """NCCL's float8 SUM (gloo: emulated, FP8 partial sums, overflow -> NaN): every rank at the
    headroom's limit with the same sign must not overflow (a saturated sum would break the bound),
    and the result is within the native bound: one FP8 rounding of each contribution at the
    headroom scale s, N - 1 roundings of partial sums, the FP32 division."""
    world, backend, res = run
    if backend == "nccl" and "native_error" in res[0]:
        pytest.skip(f"this torch or NCCL refuses float8 all_reduce: {res[0]['native_error']}")
    u, eta = U[fmt], ETA[fmt]
    worst = torch.stack([headroom_worst(r, world, fmt).double() for r in range(world)])
    for key, x, sizes in ((("native_worst", fmt), worst, (9,)),
                          (("native", fmt), torch.stack([synth(r, SIZES, torch.float32).double() for r in range(world)]),
                           SIZES)):
        m = x.mean(0)
        s = torch.empty_like(m)
        o = 0
        for c in sizes:
            s[o:o + c] = pow2_scale(x[:, o:o + c].abs().max(), native_fmax(fmt, world))
            o += c
        q = (x.abs() * s * (1 + u) + eta).sum(0)  # sum over ranks of the codes' magnitudes
        err_codes = (u * x.abs() * s + eta).sum(0) + (world - 1) * (u * q * (1 + u) ** (world - 2) + eta)
        bound = err_codes / (s * world) + U32 * (m.abs() + err_codes / (s * world))
        for r in res:
            out = r[key].double()
            assert not out.isnan().any(), key
            assert ((out - m).abs() <= bound).all(), key
        same_on_all_ranks(res, key)


def test_native_finds_nccl_in_a_group_with_a_backend_per_device(run):
    _, backend, res = run
    if backend != "nccl" or "native_error" in res[0]:
        pytest.skip("NCCL's float8 SUM: the nccl2 setup, on a torch and NCCL that reduce float8")
    for r in res:
        assert torch.equal(r["native_per_device_group"], r["native", E4M3])  # same data, same NCCL sum


def test_cuda_side_stream_ordered_with_compute_stream(run):
    """The reduction waits for the compute stream's pending work, the compute stream for the
    reduction's result, and the host for neither (stream_order_run)."""
    world, backend, res = run
    if backend != "nccl":
        pytest.skip("CUDA streams: the nccl2 setup")
    xs = [synth(r, SIZES, torch.float32, seed=2).double() for r in range(world)]
    m, bound = bound_all_to_all(xs, SIZES, E4M3, shard_pieces(SIZES, world))
    for r in res:
        streams = r["streams"]
        assert streams["hook_returned_early"] and streams["grads_returned_early"]
        assert ((streams["hook_idle"].double() - m).abs() <= bound).all()
        assert torch.equal(streams["hook_busy"], streams["hook_idle"])
        for busy, idle in zip(streams["grads_busy"], streams["grads_idle"]):
            assert torch.equal(busy, idle)


def exact_mean_and_bound(res, key, o2=False):
    """Per parameter: (mean, bound) from every rank's local gradients (the piece scale t bounded
    from the whole gradient, since DDP's bucket order decides the shard cut). A bfloat16 bucket needs
    no extra term: FP8 values are bfloat16 values."""
    out = []
    n_params = len(res[0][key]["local"])
    for i in range(n_params):
        xs = [r[key]["local"][i].double().reshape(-1) for r in res]
        m, bound = bound_all_to_all(xs, (xs[0].numel(),), E4M3, [(0, xs[0].numel())])
        if o2 and res[0][key]["types"][i] == "ScaledTensor":  # the copy back re-quantizes (E4M3, fresh scale)
            big = m.abs() + bound
            bound = bound + U[E4M3] * big + ETA[E4M3] / pow2_scale(big.max(), FMAX[E4M3])
        out.append((m, bound))
    return out


@pytest.mark.parametrize("key", ["ddp", "ddp_buckets", "ddp_bf16", "ddp_o2", "manual", "manual_o2"])
def test_gradients_are_the_mean_within_bound(run, key):
    world, _, res = run
    o2 = key.endswith("o2")
    if o2:
        types = res[0][key]["types"]
        assert types.count("ScaledTensor") == 2, types  # the two Linear weights have FP8 gradients
    for i, (m, bound) in enumerate(exact_mean_and_bound(res, key, o2=o2)):
        for r in res:
            g = r[key]["grads"][i].double().reshape(-1)
            assert ((g - m).abs() <= bound).all(), (key, i, ((g - m).abs() - bound).max())
        for r in res[1:]:
            assert torch.equal(r[key]["grads"][i], res[0][key]["grads"][i]), (key, i)


@pytest.mark.parametrize("key", ["ddp", "ddp_buckets", "ddp_bf16", "ddp_o2"])
def test_ddp_replicas_identical_after_steps(run, key):
    world, _, res = run
    initial = [p.detach() for p in mlp(res[0][key]["params"][0].dtype, key.endswith("o2")).parameters()]
    for i, p in enumerate(res[0][key]["params"]):
        for r in res[1:]:
            assert torch.equal(r[key]["params"][i], p), (key, i)
    assert not torch.equal(res[0][key]["params"][0].float(), initial[0].float())  # it trained


def test_ddp_rank_with_inf_makes_all_gradients_nan(run):
    _, _, res = run
    for r in res:
        for g in r["ddp_inf"]["grads"]:
            assert g.isnan().all()


def test_errors_in_workers(run):
    _, _, res = run
    errors = res[0]["errors"]
    assert errors["ddp_model"][0] == "ValueError" and "fp8_allreduce_hook" in errors["ddp_model"][1]
    assert errors["float64"][0] == "ValueError" and "torch.float64" in errors["float64"][1]
    assert "torch.float32" in errors["float64"][1] and "torch.bfloat16" in errors["float64"][1]
    assert errors["cap"][0] == "ValueError" and "bucket_cap_mb" in errors["cap"][1]
    assert errors["state"][0] == "TypeError" and "FP8CommState" in errors["state"][1]
    assert errors["hook_state"][0] == "TypeError" and "FP8CommState" in errors["hook_state"][1]


@pytest.mark.parametrize("chunks", [0, -1, 2.0, True, "4"])
def test_pipeline_chunks_must_be_none_or_a_positive_int(chunks):
    with pytest.raises(ValueError, match=r"pipeline_chunks must be None \(automatic\) or an int >= 1; got"):
        fd.FP8CommState(pipeline_chunks=chunks)


@pytest.mark.parametrize("n, chunks, method, count", [
    (307, 3, "native", 3), (1, 8, "native", 1), (100, 8, "all_to_all", 2), (2**24, None, "native", 1),
    (2**25 - 1, None, "native", 1), (2**25, None, "native", 2), (2**27, None, "native", 8),
    (2**29 + 5, None, "native", 8), (10**6, 1, "native", 1), (2**27, None, "all_to_all", 2),
    (2**29, None, "all_to_all", 8)])
def test_chunk_bounds_cover_the_bucket_aligned(n, chunks, method, count):
    bounds = comm_layout.chunk_bounds(n, chunks, method)
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) - 1 == count
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert all(b % comm_layout.CHUNK_ALIGN == 0 for b in bounds[1:-1])
    if chunks is None:
        assert all(b - a >= comm_layout.PIPELINE_MIN_CHUNK[method] for a, b in zip(bounds[:-2], bounds[1:-1]))


def test_state_argument_errors():
    with pytest.raises(ValueError, match=r"fmt must be one of torch.float8_e4m3fn, torch.float8_e5m2"):
        fd.FP8CommState(fmt=torch.float16)
    with pytest.raises(ValueError, match=r"method must be one of 'auto', 'all_to_all', 'native'; got 'ring'"):
        fd.FP8CommState(method="ring")
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        fd.FP8CommState(process_group="world")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        fd.all_reduce_grads("model")
    with pytest.raises(ValueError, match="method must be one of 'all_to_all', 'native', 'all_reduce'"):
        fd.wire_bytes((100,), 2, "ring")
    for numels, world in (((100,), 0), ((100, -5), 2)):  # they returned 0 bytes
        with pytest.raises(ValueError, match=r"wire_bytes: numels must be >= 0 and world >= 1"):
            fd.wire_bytes(numels, world, "native")
    with pytest.raises(TypeError, match=r"wire_bytes: numels must be integers .* and world an integer"):
        fd.wire_bytes((1.5,), 2, "native")
    assert fd.wire_bytes((torch.tensor(100).numpy().item(), 0), torch.tensor(2).item(), "native") == 104


@pytest.mark.parametrize("world", [2, 3, 8])
def test_layout_covers_every_element_once(world):
    sizes = (37, 1, 200, 5, 64)
    layout = comm_layout.make_layout(sizes, world)
    assert layout.L == math.ceil(sum(sizes) / world)
    covered = []
    for k in range(world):
        for a, b, i in layout.pieces[k]:
            o, c = layout.segments[i]
            assert o <= k * layout.L + a < k * layout.L + b <= o + c
            covered.extend(range(k * layout.L + a, k * layout.L + b))
    assert covered == list(range(sum(sizes)))


def test_wire_bytes_half_of_bf16():
    n, world = 2**29, 2
    fp8 = fd.wire_bytes((n,), world, "all_to_all")
    bf16 = fd.wire_bytes((n,), world, "all_reduce", torch.bfloat16)
    assert bf16 == n * 2 and fd.wire_bytes((n,), world, "all_reduce", torch.float32) == n * 4
    assert n <= fp8 <= n + 64 and fd.wire_bytes((n,), world, "native") == n + 4
