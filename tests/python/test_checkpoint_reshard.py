"""Reshardable O2 checkpoints (docs/distributed.md#checkpoints): a torch.distributed.checkpoint
(DCP) of an O2 model and fp8amp's optimizer under FSDP2, saved on N gloo processes, loads on M != N
processes and into one process without torch.distributed, and back.

Every run trains on the same global batch of 6 rows (each rank takes its share), saves after
``SAVED`` steps with torch's ``get_state_dict`` and goes on for one step, the never-interrupted
reference. A load on another layout must restore, bit for bit: the FP16 masters' real values, the
steps, every scaling buffer; the E4M3 copy of each master shard is a fresh cast of its real values;
Adam's moments keep their real values but where a value falls below its format's normal range at
the new shard's scale (then it rounds there: the bound is half a subnormal step). The first forward
after the load gives the uninterrupted run's outputs bit for bit, and one step later the weights
agree with it within 2^-10 of the learning rate (the gradients' float32 sums run in another order,
and a moment's subnormal may round at another scale). Each rank's loss is its part of the global
mean and FSDP2 sums the ranks' gradients, so that the output gradients, and their delayed scales,
do not depend on the rank count.

One module fixture runs: 2 ranks (train, save, continue), one process (load that, save it again),
3 ranks (load the 2-rank checkpoint; train their own, save, continue), 2 ranks (load the 3-rank one
and the one-process one). The same on 2 GPUs with NCCL (marked gpu): 2 -> 2 bit for bit, 2 -> one
process -> 2.
"""

from __future__ import annotations

import pytest
import torch

import fp8amp
from fp8amp.master_weight import MasterWeight
from fp8amp.scaled_tensor import _quantize_current
from ranks import run_on_ranks
from test_fsdp import O3_LR, make_model, shard

SAVED = 2  # steps before the checkpoint
ROWS = 6  # the global batch: 3 rows a rank on 2 ranks, 2 on 3, 6 in one process

# Half the step of the smallest subnormal, relative to the scale (real = code / scale): E4M3's
# subnormals step by 2^-9, FP16's by 2^-24. A re-quantized moment value is exact unless it is
# below the normal range at its new scale (E4M3 2^-6, FP16 2^-14); then it rounds by at most this.
HALF_SUBNORMAL = {"exp_avg": 2.0 ** -10, "exp_avg_sq": 2.0 ** -25}
NORMAL_MIN = {"exp_avg": 2.0 ** -6, "exp_avg_sq": 2.0 ** -14}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 32, generator=g), torch.randn(ROWS, 16, generator=g)


def rows_of(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def build(distributed: bool, device: str):
    """An O2 model on ``device`` (sharded over all ranks when ``distributed``), fp8amp's O2 AdamW
    and the scaling hooks (the amax reduction issued before each step, the update after it)."""
    # One process: float32 weight gradients, as FSDP2 reduce-scatters them (not initialize's E4M3 ones).
    model, _ = fp8amp.initialize(make_model().to(device), None, "O2", policy="all", weight_grad="fp32")
    if distributed:
        from torch.distributed.fsdp import FSDPModule

        shard(model, device_type=torch.device(device).type)
        for module in model.modules():  # sum the ranks' gradients: each rank's loss is its part of the mean
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    optimizer = fp8amp.optim.AdamW(model.parameters(), lr=O3_LR, state_dtypes="O2")
    fp8amp.register_scaling_hooks(model, optimizer)
    return model, optimizer


def step(model, optimizer, step_index: int, rank: int, world: int, device: str) -> torch.Tensor:
    """One step on this rank's rows of the global batch (its part of the global mean squared
    error, so that the output gradients do not depend on the rank count); its forward's outputs."""
    x, target = (rows_of(t, rank, world).to(device) for t in global_batch(step_index))
    out = model(x)
    ((out - target).square().sum() / target.new_tensor(ROWS * 16.0)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.detach().cpu()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor's real values on the CPU (a DTensor gathered, a ScaledTensor dequantized)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return (t.dequantize() if isinstance(t, fp8amp.ScaledTensor) else t.detach()).to("cpu", copy=True)


def snapshot(model, optimizer) -> dict:
    """Every restored quantity as a whole plain tensor: parameters' real values, each param's
    step and moments' real values, the scaling buffers."""
    from fp8amp.optim_state import real_sharded_moments

    out = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        state = real_sharded_moments(optimizer.state[p])
        out[f"step.{name}"] = full(state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            if not hasattr(value, "full_tensor") and f"{key}_scale_inv" in state:  # one process: codes
                value = fp8amp.ScaledTensor(value, state[f"{key}_scale_inv"])
            out[f"{key}.{name}"] = full(value)
    out.update({f"buffer.{n}": b.to("cpu", copy=True) for n, b in model.named_buffers() if "scaling" in n})
    return out


def moment_scales(model, optimizer) -> dict:
    """Each param's moments' scales on this rank (its shard's), to bound the re-quantization."""
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            scale = state[f"{key}_scale"]
            out[f"{key}.{name}"] = (scale.to_local() if hasattr(scale, "to_local") else scale).to("cpu", copy=True)
    return out


def copies_are_fresh_casts(model) -> bool:
    """Whether each master (shard) with an E4M3 copy holds the one a cast of its real values gives
    (FSDP2's padded shards have none: the sharded forward casts the shards in its all-gather)."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if isinstance(local, MasterWeight) and local.numel() and local.fp8_copy is not None:
            codes, scale_inv, _ = _quantize_current(local.dequantize(torch.float32), torch.float8_e4m3fn, 0)
            copy, _, copy_scale_inv = local.fp8_copy
            if not (torch.equal(copy.view(torch.uint8), codes.view(torch.uint8))
                    and torch.equal(copy_scale_inv, scale_inv)):
                return False
    return True


def save(model, optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def load(model, optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    checkpoint = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(checkpoint, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"])


def train_save_continue(rank: int, world: int, path: str, distributed: bool = True, device: str = "cpu") -> dict:
    """SAVED steps, a checkpoint at ``path``, one more step: the reference."""
    model, optimizer = build(distributed, device)
    for s in range(SAVED):
        step(model, optimizer, s, rank, world, device)
    save(model, optimizer, path)
    saved = snapshot(model, optimizer)
    out = step(model, optimizer, SAVED, rank, world, device)
    return dict(saved=saved, out=out, after=snapshot(model, optimizer))


def load_continue(rank: int, world: int, path: str, distributed: bool = True, save_to: str | None = None,
                  device: str = "cpu") -> dict:
    """A fresh model and optimizer loaded from ``path`` (and saved again to ``save_to``), then one step."""
    model, optimizer = build(distributed, device)
    load(model, optimizer, path)
    loaded, scales, fresh = snapshot(model, optimizer), moment_scales(model, optimizer), copies_are_fresh_casts(model)
    if save_to is not None:
        save(model, optimizer, save_to)
    out = step(model, optimizer, SAVED, rank, world, device)
    return dict(loaded=loaded, scales=scales, fresh_copies=fresh, out=out, after=snapshot(model, optimizer))


def on_three(rank: int, path2: str, path3: str) -> dict:
    return dict(from2=load_continue(rank, 3, path2), own=train_save_continue(rank, 3, path3))


def on_two(rank: int, path3: str, path1: str) -> dict:
    return dict(from3=load_continue(rank, 2, path3), from1=load_continue(rank, 2, path1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    paths = {n: str(root / f"saved_on_{n}") for n in ("2", "3", "1", "1_again")}
    two = run_on_ranks(train_save_continue, 2, 2, paths["2"])
    # One process without torch.distributed: load the 2-rank checkpoint, save it again.
    one = load_continue(0, 1, paths["2"], distributed=False, save_to=paths["1"])
    three = run_on_ranks(on_three, 3, paths["2"], paths["3"])
    back = run_on_ranks(on_two, 2, paths["3"], paths["1"])
    return dict(two=two, one=one, three=three, back=back)


def check_restored(saved: dict, loaded: dict, scales_by_rank: list[dict], world: int) -> float:
    """Bit for bit but for the moments' values below the normal range at their new scale; returns
    the largest moment error relative to its tensor's amax."""
    assert saved.keys() == loaded.keys()
    worst = 0.0
    for name, value in saved.items():
        got = loaded[name]
        kind = name.partition(".")[0]
        if kind not in HALF_SUBNORMAL:
            assert torch.equal(got, value), name
            continue
        # Each row's scale: that of the shard it is on now (FSDP2 splits rows as torch.chunk does).
        scale = torch.cat([s[name].expand(len(rows)) for s, rows in zip(scales_by_rank, value.chunk(world))])
        scale = scale.reshape(-1, *([1] * (value.dim() - 1)))
        error = (got - value).abs()
        normal = value.abs() * scale >= NORMAL_MIN[kind]
        assert torch.equal(got[normal], value[normal]), name
        assert bool((error * scale <= HALF_SUBNORMAL[kind]).all()), name
        if value.abs().max() > 0:
            worst = max(worst, float(error.max() / value.abs().max()))
    return worst


def check_continues(reference: list[dict], resumed: list[dict], exact_forward: bool = True) -> None:
    """The restored model's next forward and step against the never-interrupted run's. On GPUs
    (``exact_forward=False``) cuBLASLt may round a GEMM of other row counts otherwise."""
    outs, reference_outs = torch.cat([r["out"] for r in resumed]), torch.cat([r["out"] for r in reference])
    if exact_forward:
        assert torch.equal(outs, reference_outs)
    else:
        torch.testing.assert_close(outs, reference_outs, rtol=1e-2, atol=1e-4)
    ref, got = reference[0]["after"], resumed[0]["after"]
    for name, value in ref.items():
        if name.startswith("param."):
            # One Adam step moves a weight by about lr; the runs part by the odd rounding (measured:
            # 0 but for one element of one bias, by 2^-32; the bound is 2^-10 lr).
            atol = O3_LR * (2.0 ** -10 if exact_forward else 2.0 ** -3)
            torch.testing.assert_close(got[name], value, rtol=0, atol=atol, msg=name)
        elif "input_scaling" in name and exact_forward:  # the same rows through the same weights: the same amaxes
            assert torch.equal(got[name], value), name
    for r in resumed[1:]:  # the ranks agree
        for name, value in resumed[0]["after"].items():
            assert torch.equal(r["after"][name], value), name


def test_two_ranks_to_three(runs):
    two, three = runs["two"], [r["from2"] for r in runs["three"]]
    for r in three:
        check_restored(two[0]["saved"], r["loaded"], [t["scales"] for t in three], 3)
        assert r["fresh_copies"]
    check_continues(two, three)


def test_three_ranks_to_two(runs):
    three, two = [r["own"] for r in runs["three"]], [r["from3"] for r in runs["back"]]
    for r in two:
        check_restored(three[0]["saved"], r["loaded"], [t["scales"] for t in two], 2)
        assert r["fresh_copies"]
    check_continues(three, two)


def test_two_ranks_to_one_process_and_back(runs):
    two, one, back = runs["two"], runs["one"], [r["from1"] for r in runs["back"]]
    check_restored(two[0]["saved"], one["loaded"], [one["scales"]], 1)
    assert one["fresh_copies"]
    check_continues(two, [one])
    for r in back:  # saved again by the one process, loaded on 2 ranks
        check_restored(one["loaded"], r["loaded"], [t["scales"] for t in back], 2)
        assert r["fresh_copies"]
    check_continues(two, back)


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")
def test_checkpoints_on_two_gpus(tmp_path):
    """The gloo tests' runs with NCCL on 2 GPUs: save on 2, resume on 2 (bit for bit: the same
    layout and kernels), load in one process on GPU 0 (no torch.distributed), save there, and load
    that on 2 again; the restored states are checked as on the CPU."""
    paths = {n: str(tmp_path / f"saved_on_{n}") for n in ("2", "1")}
    two = run_on_ranks(train_save_continue, 2, 2, paths["2"], True, "cuda", backend="nccl")
    again = run_on_ranks(load_continue, 2, 2, paths["2"], True, None, "cuda", backend="nccl")
    for r, reference in zip(again, two):
        check_restored(reference["saved"], r["loaded"], [t["scales"] for t in again], 2)
        assert torch.equal(r["out"], reference["out"])
        for name, value in reference["after"].items():
            assert torch.equal(r["after"][name], value), name
    one = load_continue(0, 1, paths["2"], distributed=False, save_to=paths["1"], device="cuda")
    check_restored(two[0]["saved"], one["loaded"], [one["scales"]], 1)
    assert one["fresh_copies"]
    check_continues(two, [one], exact_forward=False)
    back = run_on_ranks(load_continue, 2, 2, paths["1"], True, None, "cuda", backend="nccl")
    for r in back:
        check_restored(one["loaded"], r["loaded"], [t["scales"] for t in back], 2)
        assert r["fresh_copies"]
    check_continues(two, back, exact_forward=False)
