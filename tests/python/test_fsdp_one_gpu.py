"""FSDP2 (``fully_shard``) on one GPU, with a one-rank NCCL group (the 2-rank runs need a second
GPU; test_fsdp.py runs them on CPU processes with gloo): FP8 compute's E4M3 all-gather through the
CUDA kernels and cuBLASLt, bit for bit as with the high-precision all-gather; O1/O2 with their
masters sharded and the FP8 reduce-scatter installed, bit for bit as the unsharded model (with one
rank a shard is the whole tensor, and FSDP2 copies the gradient instead of reduce-scattering it).
"""

import pytest
import torch

import fp8amp
from fp8amp import ScaledTensor
from fp8amp.fsdp import enable_fp8_all_gather, enable_fp8_reduce_scatter
from ranks import run_on_ranks
from test_fsdp import LR, O3_LR, STEPS, batch, loss_of, make_model, shard, train_steps


@pytest.mark.gpu
def test_fp8_all_gather_on_cuda():
    """One CUDA rank with NCCL (the 2-rank runs need a second GPU): the gathered E4M3 weight through
    the CUDA kernels and cuBLASLt, bit for bit as with the high-precision all-gather."""
    import torch.distributed as dist
    from ranks import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        runs = []
        for fp8_all_gather in (True, False):
            model = fp8amp.convert(make_model().cuda(), policy="all")
            if fp8_all_gather:
                enable_fp8_all_gather(model)
            shard(model, device_type="cuda")
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = []
            for step in range(STEPS):
                x, target = (t.cuda() for t in batch(step, 0))
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_of(model, x, target)
                loss.backward()
                losses.append(loss.detach())
                optimizer.step()
                optimizer.zero_grad()
                fp8amp.update_scaling(model)
            runs.append((torch.stack(losses), {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
                         type(model[0].weight.to_local()).__name__))
    finally:
        dist.destroy_process_group()
    (fp8_losses, fp8_params, local_type), (losses, params, _) = runs
    assert local_type == "Fp8AllGatherWeight"
    assert torch.equal(fp8_losses, losses)
    for name, value in params.items():
        assert torch.equal(fp8_params[name], value), name


def o1_o2_cuda_rank(rank: int, level: str) -> dict:
    """One CUDA rank: O1/O2 under fully_shard with the FP8 reduce-scatter installed, and the same
    model unsharded (float32 weight gradients, as FSDP2's reduce-scatter gives the optimizer)."""
    device = torch.device("cuda", rank)

    def cuda_batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.to(device) for t in batch(step, r))

    model, _ = fp8amp.initialize(make_model().to(device), None, level, policy="all")
    shard(model, device_type="cuda")
    installed = enable_fp8_reduce_scatter(model)  # (torch's FSDP2 has set_custom_reduce_scatter)
    optimizer = fp8amp.optim.AdamW(model.parameters(), lr=O3_LR, state_dtypes=level)
    sharded_losses = train_steps(model, optimizer, rank, batch_of=cuda_batch)
    reference = make_model().to(device)
    reference, reference_optimizer = fp8amp.initialize(
        reference, torch.optim.AdamW(reference.parameters(), lr=O3_LR), level, policy="all", weight_grad="fp32")
    losses = []
    for step in range(STEPS):  # (initialize's hooks update the scaling after each step)
        loss = loss_of(reference, *cuda_batch(step, rank))
        loss.backward()
        losses.append(loss.detach())
        reference_optimizer.step()
        reference_optimizer.zero_grad()

    def real(p):
        return (p.dequantize() if isinstance(p, ScaledTensor) else p.detach()).cpu()
    return dict(installed=installed, local_types={n: type(p.to_local()).__name__ for n, p in model.named_parameters()},
                sharded=(sharded_losses.cpu(), {n: real(p.full_tensor()) for n, p in model.named_parameters()}),
                reference=(torch.stack(losses).cpu(), {n: real(p) for n, p in reference.named_parameters()}))


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_o1_o2_under_fully_shard_on_one_gpu_train_as_unsharded(level):
    """O1/O2 under FSDP2 on a GPU (one NCCL rank: the 2-rank runs need a second GPU): the masters'
    E4M3 all-gather, the sharded fused step on CUDA and the scaling update give the unsharded
    model's losses and weights bit for bit (one shard is the whole tensor, with its scale)."""
    (r,) = run_on_ranks(o1_o2_cuda_rank, 1, level, backend="nccl")
    assert r["installed"] == 3  # the two Linears and the model
    assert r["local_types"] == {"0.weight": "MasterWeight", "0.bias": "Tensor", "2.weight": "MasterWeight",
                                "2.bias": "Tensor"}
    (sharded_losses, sharded), (losses, params) = r["sharded"], r["reference"]
    assert torch.equal(sharded_losses, losses)
    for name, value in params.items():
        assert torch.equal(sharded[name], value), name
    assert (params["0.weight"] - make_model()[0].weight.detach()).abs().max() > O3_LR  # it trained
