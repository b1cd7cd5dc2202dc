"""fp8amp.distributed on whole models: the FP8 gradient hook registered on DistributedDataParallel
(one bucket, a bucket a parameter, bfloat16, O2) and all_reduce_grads without DDP (plain and O2
models), on test_distributed.py's setups (comm_ranks.py): 1, 2 and 3 processes on CPU with gloo, and
1 and 2 processes on as many GPUs with NCCL (marked gpu, skipped with fewer GPUs). Every rank's
gradients are the exact mean of the ranks' local gradients within the derived bound
(comm_reference.py), the replicas stay identical over steps, an inf on one rank makes every
gradient NaN, and bad arguments raise clear errors (in the workers; in one process those of
FP8CommState and wire_bytes, whose FP8 bytes on the wire are about half of bfloat16's).

An O2 gradient (ScaledTensor) is re-quantized once more when DDP copies the mean back: its bound
adds one E4M3 rounding at the tensor's fresh scale.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8amp
from comm_ranks import SETUPS, mlp, run_hook, spawn
from comm_reference import E4M3, FMAX, U, ETA, pow2_scale, bound_all_to_all, amax_input_dtypes
from fp8amp import distributed as fd

DDP_STEPS = 3


# ----------------------------------------------------------------------------- the workers


def batch(step: int, rank: int, dtype=torch.float32, o2=False) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16 if o2 else 6, 32 if o2 else 7, generator=g).to(dtype)


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
    seen = set()
    for step in range(DDP_STEPS):
        x = x0 if step == 0 else batch(step, rank, dtype, o2).to(device)
        with amax_input_dtypes(seen):
            ddp(x).float().pow(2).mean().backward()
        out["amax_inputs"] = sorted(seen)
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


def worker(rank: int, world: int, backend: str, device: torch.device) -> dict:
    """Every scenario of DDP and all_reduce_grads on one rank (comm_ranks.spawn runs it in each
    process)."""
    res = {}
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
        seen = set()
        with amax_input_dtypes(seen):
            fd.all_reduce_grads(model, fd.FP8CommState(method="all_to_all"), bucket_cap_mb=25.0 if not o2 else 1e-4)
        res[name] = {"local": local, "types": [type(p.grad).__name__ for p in model.parameters()],
                     "amax_inputs": sorted(seen),
                     "grads": [p.grad.dequantize() if isinstance(p.grad, fp8amp.ScaledTensor) else p.grad.clone()
                               for p in model.parameters()]}
    # A layout that changes on one rank only, after a call every rank agreed on (a parameter
    # unused on the last rank in the second step): a ValueError on every rank, not a hang.
    model, state = mlp().to(device), fd.FP8CommState(method="all_to_all")
    for step in range(2):
        model.zero_grad()
        model(batch(step, rank).to(device)).pow(2).mean().backward()
        if step == 1 and rank == world - 1 and world > 1:
            model[2].bias.grad = None
        try:
            fd.all_reduce_grads(model, state)
        except ValueError as e:
            res["layout_changed"] = (step, str(e))
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
    return res


@pytest.fixture(scope="module", params=SETUPS)
def run(request):
    return spawn(worker, *request.param)


# ----------------------------------------------------------------------------- tests


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


@pytest.mark.parametrize("key, expected", [
    ("ddp", ["torch.float32"]), ("ddp_bf16", ["torch.bfloat16"]), ("manual", ["torch.float32"]),
    ("ddp_o2", ["torch.float32", "torch.float8_e4m3fn"]), ("manual_o2", ["torch.float32", "torch.float8_e4m3fn"])])
def test_o2_gradients_amaxes_are_read_from_their_codes(run, key, expected):
    """Under DDP (the hook finds each parameter's FP8 gradient) and all_reduce_grads, the amax pass
    reads an O2 weight gradient's E4M3 codes, the float32 ones (biases, the unconverted Linear) from
    the bucket; a plain model's from the bucket only."""
    _, _, res = run
    for r in res:
        assert r[key]["amax_inputs"] == expected


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


def test_a_layout_that_changes_on_one_rank_is_a_value_error_on_every_rank(run):
    """all_reduce_grads compares the ranks' layouts at every call: a gradient missing on one rank
    in the second step, after a first step every rank agreed on, raises on every rank (it used to
    be checked once per layout, each rank deciding alone: the ranks' collectives no longer lined
    up, an abort on gloo, a hang or mixed data on NCCL)."""
    world, _, res = run
    for r in res:
        if world == 1:
            assert "layout_changed" not in r
        else:
            step, message = r["layout_changed"]
            assert step == 1 and "every rank must have gradients for the same parameters" in message


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


def test_wire_bytes_half_of_bf16():
    n, world = 2**29, 2
    fp8 = fd.wire_bytes((n,), world, "all_to_all")
    bf16 = fd.wire_bytes((n,), world, "all_reduce", torch.bfloat16)
    assert bf16 == n * 2 and fd.wire_bytes((n,), world, "all_reduce", torch.float32) == n * 4
    assert n <= fp8 <= n + 64 and fd.wire_bytes((n,), world, "native", scales_per_chunk=False) == n + 4
    # in its 8 automatic chunks, one amax each (a ring of one float32 on 2 ranks: 4 bytes)
    assert fd.wire_bytes((n,), world, "native") == n + 8 * 4
