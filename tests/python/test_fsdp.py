"""FSDP2 (``fully_shard``): 2 or 3 processes on CPU with gloo (FP8 emulation); one GPU: test_fsdp_one_gpu.py.

FP8 compute (``fp8amp.convert`` before ``fully_shard``, the optimizer built after it) trains as one
process does on both ranks' batches. With ``fp8amp.fsdp.enable_fp8_all_gather`` the weights travel
as E4M3 codes and training is bit for bit what the high-precision all-gather gives (3 ranks: the
uneven shards of a 16-row weight, padded). O1/O2 (``initialize`` without an optimizer, then
``fully_shard``, then fp8amp's AdamW) shard the FP16 masters and the optimizer states and train as
one process does, up to the shards' own master scales. An optimizer that ``initialize`` built
before ``fully_shard`` (it holds the replaced masters) is refused by name at the first forward, as
is a master replaced by ``load_state_dict(assign=True)``, in one process; ``fully_shard`` before
``initialize`` is refused, and fp8amp's optimizer built by hand before ``fully_shard`` warns.
"""

import io
import warnings

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import Fp8Linear, ScaledTensor
from fp8amp.fsdp import Fp8AllGatherWeight, enable_fp8_all_gather
from ranks import run_on_ranks

WORLD_SIZE = 2
STEPS = 4
LR = 1e-2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with the same amax on every rank (one element at 4, the rest inside +-3.9), so that
    both ranks' current scales equal the one process's over both batches."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 32, generator=g).clamp(-3.9, 3.9)
    x[0, 0] = 4.0
    return x, torch.randn(16, 16, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (model(x) - target).square().mean()


def shard(model: nn.Module, param_dtype: torch.dtype | None = None, device_type: str = "cpu") -> None:
    """fully_shard each Linear, then the model, over all ranks on ``device_type`` (FSDP2's default
    mesh is on the GPU wherever there is one, also for gloo processes)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def fp8_compute_rank(rank: int) -> dict:
    model = fp8amp.convert(make_model(), policy="all")
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        loss_of(model, *batch(step, rank)).backward()
        optimizer.step()
        optimizer.zero_grad()
        fp8amp.update_scaling(model)
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def test_fp8_compute_under_fully_shard_trains_as_one_process():
    ranks = run_on_ranks(fp8_compute_rank, WORLD_SIZE)
    # One process: both ranks' batches as micro-batches of one step (FSDP2 averages the gradients).
    model = fp8amp.convert(make_model(), policy="all")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        for rank in range(WORLD_SIZE):
            (loss_of(model, *batch(step, rank)) / WORLD_SIZE).backward()
        optimizer.step()
        optimizer.zero_grad()
        fp8amp.update_scaling(model)
    initial = dict(make_model().named_parameters())
    assert set(ranks[0]) == set(initial) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, reference in model.named_parameters():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        torch.testing.assert_close(ranks[0][name], reference.detach(), msg=name)
        assert not torch.equal(ranks[0][name], initial[name].detach()), name  # it trained


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps=range(STEPS),
                batch_of=batch) -> torch.Tensor:
    """The steps on this rank's batches (``batch_of(step, rank)``), each followed by the scaling
    update; the losses."""
    optimizer.register_step_post_hook(lambda *_: fp8amp.update_scaling(model))
    losses = []
    for step in steps:
        loss = loss_of(model, *batch_of(step, rank))
        loss.backward()
        losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses)


def all_gather_rank(rank: int, fp8_all_gather: bool, param_dtype: torch.dtype | None = None,
                    compiled: bool = False) -> dict:
    """STEPS steps under fully_shard (the model compiled or not); what the Linears' eager forwards
    saw as their weight, the losses, and the parameters and buffers (the scaling states) at the end."""
    model = fp8amp.convert(make_model(), policy="all")
    if fp8_all_gather:
        assert enable_fp8_all_gather(model) == 2
        assert enable_fp8_all_gather(model) == 0  # already wrapped: left as they are
    shard(model, param_dtype)
    if compiled:
        model.compile()
    seen = []
    for module in [] if compiled else model.modules():
        if isinstance(module, Fp8Linear):
            module.register_forward_pre_hook(lambda m, _: seen.append(
                (type(m.weight).__name__, m.weight.storage_format if isinstance(m.weight, ScaledTensor) else m.weight.dtype,
                 tuple(m.weight.shape))))
    losses = train_steps(model, torch.optim.AdamW(model.parameters(), lr=LR), rank)
    local_types = {name: type(p.to_local()).__name__ for name, p in model.named_parameters()}
    params = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return dict(seen=seen, losses=losses, params=params, buffers=buffers, local_types=local_types)


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_all_gather_trains_bit_for_bit_as_the_high_precision_one(world):
    fp8 = run_on_ranks(all_gather_rank, world, True)
    plain = run_on_ranks(all_gather_rank, world, False)
    for rank in range(world):
        a, b = fp8[rank], plain[rank]
        # The forwards saw the gathered E4M3 codes, at the weights' full shapes (so the hooks ran).
        assert {s[:2] for s in a["seen"]} == {("ScaledTensor", torch.float8_e4m3fn)}, a["seen"]
        assert {s[:2] for s in b["seen"]} == {("Parameter", torch.float32)}, b["seen"]
        assert [s[2] for s in a["seen"]] == [s[2] for s in b["seen"]] == [(64, 32), (16, 64)] * STEPS
        assert a["local_types"] == {"0.weight": "Fp8AllGatherWeight", "0.bias": "Tensor",
                                    "2.weight": "Fp8AllGatherWeight", "2.bias": "Tensor"}, a["local_types"]
        assert torch.equal(a["losses"], b["losses"]), rank
        for kind in ("params", "buffers"):
            assert a[kind].keys() == b[kind].keys()
            for name in a[kind]:
                assert type(a[kind][name]) is torch.Tensor, name
                assert torch.equal(a[kind][name], b[kind][name]), (rank, kind, name)
    assert not torch.equal(fp8[0]["params"]["0.weight"], make_model()[0].weight.detach())  # it trained


def test_fp8_all_gather_compiled():
    """torch.compile of the sharded model: the same bits with the FP8 and the high-precision
    all-gather (the wrapper carries no metadata for Dynamo to guard on)."""
    fp8 = run_on_ranks(all_gather_rank, 2, True, None, True)
    plain = run_on_ranks(all_gather_rank, 2, False, None, True)
    for a, b in zip(fp8, plain):
        assert a["local_types"]["0.weight"] == "Fp8AllGatherWeight"
        assert torch.equal(a["losses"], b["losses"])
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), name


def test_fp8_all_gather_with_a_bf16_param_dtype():
    """MixedPrecisionPolicy(param_dtype=bfloat16): the high-precision all-gather rounds each weight
    to bf16 before the layer's E4M3 cast, the FP8 one casts the float32 shard directly (one
    rounding, not two), so the two differ by a rounding here and there; the gathered weight is
    E4M3 with the bf16 logical dtype, and the gradients come back in bf16."""
    fp8 = run_on_ranks(all_gather_rank, 2, True, torch.bfloat16)
    plain = run_on_ranks(all_gather_rank, 2, False, torch.bfloat16)
    for a, b in zip(fp8, plain):
        assert {s[:2] for s in a["seen"]} == {("ScaledTensor", torch.float8_e4m3fn)}
        assert {s[:2] for s in b["seen"]} == {("Parameter", torch.bfloat16)}
        torch.testing.assert_close(a["losses"], b["losses"], rtol=2e-2, atol=0)
        for name, value in a["params"].items():
            assert value.dtype == torch.float32  # the sharded parameters stay float32
            # Adam moves a weight by at most ~lr a step, whatever its gradient: the runs may part by 2 lr a step.
            torch.testing.assert_close(value, b["params"][name], rtol=0, atol=2 * LR * STEPS)


def quantize_shard_rank(rank: int, weight: torch.Tensor) -> tuple:
    state = fp8amp.ScalingState(1, fp8amp.E4M3)
    shard = weight.chunk(2)[rank]
    codes, scale_inv = state.quantize_shard(shard, None)  # None: the default group, both ranks
    return codes.view(torch.uint8), scale_inv, state.amax_history[0, 0].clone()


@pytest.mark.parametrize("case", ["finite", "nan", "zeros"])
def test_quantize_shard_equals_the_whole_tensors_cast(case):
    """Each rank's codes and scale_inv are those of cast_transpose_current of the whole tensor,
    also when one shard holds a NaN (both ranks keep the stored scale) or all is zero."""
    weight = (torch.randn(32, 16, generator=torch.Generator().manual_seed(3)) * 5).clamp(-29, 29)
    weight[0, 0] = 30.0  # the amax, in rank 0's shard: scale 2^floor(log2(448 / 30)) = 8
    if case == "nan":
        weight[20, 3] = float("nan")  # in rank 1's shard
    elif case == "zeros":
        weight.zero_()
    ranks = run_on_ranks(quantize_shard_rank, 2, weight)
    whole, _, whole_scale_inv = fp8amp.ScalingState(1, fp8amp.E4M3).cast_transpose_current(weight)
    assert torch.equal(torch.cat([codes for codes, _, _ in ranks]), whole.view(torch.uint8))
    expected = {"finite": 0.125, "nan": 1.0, "zeros": 1.0}[case]  # a NaN or zero amax: the stored scale, 1
    for _, scale_inv, amax in ranks:
        assert torch.equal(scale_inv, whole_scale_inv) and scale_inv.item() == expected
    if case == "finite":
        assert ranks[0][2].item() == ranks[1][2].item() == 30.0  # the whole tensor's amax on both ranks


def test_enable_fp8_all_gather_errors():
    with pytest.raises(TypeError, match=r"enable_fp8_all_gather: model must be an nn.Module, got list"):
        enable_fp8_all_gather([])
    model = make_model()
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), "O2")
    with pytest.raises(ValueError, match=r"0 holds an O1/O2 FP16 master.*all-gathers in E4M3 without this call"):
        enable_fp8_all_gather(model)
    with pytest.raises(TypeError, match=r"tensor must be a plain torch.Tensor, got str"):
        Fp8AllGatherWeight("w")
    with pytest.raises(TypeError, match=r"tensor must be a plain torch.Tensor, got Fp8AllGatherWeight"):
        Fp8AllGatherWeight(Fp8AllGatherWeight(torch.zeros(2)))


def test_fp8_all_gather_weight_is_its_tensor_outside_fsdp():
    """Without fully_shard the wrapped weight trains, saves and loads as the plain one."""
    reference = fp8amp.convert(make_model(), policy="all")
    model = fp8amp.convert(make_model(), policy="all")
    enable_fp8_all_gather(model)
    for m in (reference, model):
        optimizer = torch.optim.AdamW(m.parameters(), lr=LR)
        loss_of(m, *batch(0, 0)).backward()
        optimizer.step()
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    buffer = io.BytesIO()
    torch.save(state, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()))
    assert type(loaded["0.weight"]) is torch.Tensor and torch.equal(loaded["0.weight"], reference[0].weight.detach())
    plain = make_model()
    plain.load_state_dict({k: v for k, v in loaded.items() if "scaling" not in k})
    assert torch.equal(plain[0].weight, reference[0].weight)


O3_LR = 1e-3  # small: Adam's first steps move each weight by ~lr whatever its gradient's size


def o2_rank(rank: int, level: str) -> dict:
    """O1/O2 under FSDP2: initialize without an optimizer, fully_shard, then fp8amp's AdamW."""
    model, _ = fp8amp.initialize(make_model(), None, level, policy="all")
    shard(model)
    optimizer = fp8amp.optim.AdamW(model.parameters(), lr=O3_LR, state_dtypes=level)
    losses = train_steps(model, optimizer, rank)
    shard_types = {name: type(p.to_local()).__name__ for name, p in model.named_parameters()}
    state = optimizer.state[model[0].weight]
    return dict(losses=losses, shard_types=shard_types,
                states=(state["exp_avg"].dtype, state["exp_avg_sq"].dtype, tuple(state["exp_avg"].to_local().shape),
                        type(state["exp_avg"]).__name__, tuple(state.get("exp_avg_sq_scale", torch.ones(1)).shape)),
                params={name: p.full_tensor().detach() for name, p in model.named_parameters()})


@pytest.mark.parametrize("level, world", [("O1", 2), ("O2", 2), ("O2", 3)])  # 3: uneven, padded shards
def test_o1_o2_under_fully_shard_train_as_one_process(level, world):
    """The FP16 masters and the optimizer states are sharded (each shard of a master with its own
    scale), the weights are all-gathered in E4M3, the gradients reduce-scattered in float32: the
    result is one process's O1/O2 run on both ranks' batches up to the masters' FP16 rounding at
    other scales, which Adam may turn into up to 2 lr of difference a step (lr small here)."""
    ranks = run_on_ranks(o2_rank, world, level)
    reference = make_model()
    model, optimizer = fp8amp.initialize(reference, torch.optim.AdamW(reference.parameters(), lr=O3_LR), level,
                                         policy="all", weight_grad="fp32")
    losses = []
    for step in range(STEPS):
        for rank in range(world):
            loss = loss_of(model, *batch(step, rank)) / world
            loss.backward()
            if rank == 0:
                losses.append(loss.detach() * world)
        optimizer.step()
        optimizer.zero_grad()
    m_dtype, v_dtype = fp8amp.optim.STATE_DTYPES[level]
    for r in ranks:
        assert r["shard_types"] == {"0.weight": "MasterWeight", "0.bias": "Tensor", "2.weight": "MasterWeight",
                                    "2.bias": "Tensor"}, r["shard_types"]
        assert r["states"][:2] == (m_dtype, v_dtype)
        assert r["states"][2] in {(-(-64 // world), 32), (64 - (world - 1) * -(-64 // world), 32)}  # its rows
        # DTensors sharded as the param (so DCP saves every rank's), O2's scales one value a shard
        assert r["states"][3] == "DTensor" and r["states"][4] == ((world,) if level == "O2" else (1,))
        for name, value in model.named_parameters():
            real = value.dequantize() if isinstance(value, ScaledTensor) else value.detach()
            torch.testing.assert_close(r["params"][name], real, rtol=0, atol=2 * O3_LR * STEPS, msg=name)
    torch.testing.assert_close(ranks[0]["losses"], torch.stack(losses), rtol=1e-2, atol=0)
    for r in ranks[1:]:
        for name, value in ranks[0]["params"].items():
            assert torch.equal(value, r["params"][name]), name
    assert (ranks[0]["params"]["0.weight"] - make_model()[0].weight.detach()).abs().max() > O3_LR  # it trained


def sharded_model(mode: str) -> nn.Module:
    """O2 masters, or FP8 compute with the E4M3 all-gather, under fully_shard."""
    if mode == "O2":
        model, _ = fp8amp.initialize(make_model(), None, "O2", policy="all")
    else:
        model = fp8amp.convert(make_model(), policy="all")
        enable_fp8_all_gather(model)
    shard(model)
    return model


def checkpoint_rank(rank: int, mode: str, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    def real(v):  # the full tensor's real values
        full = v.full_tensor().detach() if hasattr(v, "full_tensor") else v
        return full.dequantize() if isinstance(full, ScaledTensor) else full

    model = sharded_model(mode)
    optimizer = (fp8amp.optim.AdamW(model.parameters(), lr=O3_LR, state_dtypes="O2") if mode == "O2"
                 else torch.optim.AdamW(model.parameters(), lr=O3_LR))
    train_steps(model, optimizer, rank)
    dcp.save(model.state_dict(), checkpoint_id=path)
    saved = {name: real(v) for name, v in model.state_dict().items()}
    fresh = sharded_model(mode)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    loaded = {name: real(v) for name, v in fresh.state_dict().items()}
    return dict(saved=saved, loaded=loaded, local=type(fresh[0].weight.to_local()).__name__)


@pytest.mark.parametrize("mode", ["O2", "fp8-all-gather"])
def test_distributed_checkpoint_round_trip(mode, tmp_path):
    """torch.distributed.checkpoint saves the sharded weights (MasterWeight shards, or the
    wrapped FP8-compute weights) and loads them into a fresh sharded model: the same real values.
    The scaling buffers are replicated and saved once; update_scaling keeps them identical on
    every rank (fp8amp.amax_sync), so every rank loads back its own."""
    for r in run_on_ranks(checkpoint_rank, WORLD_SIZE, mode, str(tmp_path)):
        assert r["local"] == ("MasterWeight" if mode == "O2" else "Fp8AllGatherWeight")
        assert any("grad_output_scaling" in name for name in r["saved"])
        for name, value in r["saved"].items():
            assert torch.equal(r["loaded"][name], value), name


def resume_rank(rank: int, path: str, how: str) -> dict:
    """O2 under FSDP2: STEPS steps at once, and the same steps with a checkpoint halfway, loaded
    into a fresh sharded model and optimizer: every rank's own state dicts through torch.save
    (``how="torch.save"``), or a distributed checkpoint of both (``"dcp"``: torch's
    get_state_dict / set_state_dict, as torchtitan saves)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def o2_optimizer(model):
        return fp8amp.optim.AdamW(model.parameters(), lr=O3_LR, state_dtypes="O2")

    model = sharded_model("O2")
    straight = train_steps(model, o2_optimizer(model), rank)
    final = {name: p.full_tensor().detach() for name, p in model.named_parameters()}

    half = STEPS // 2
    model = sharded_model("O2")
    optimizer = o2_optimizer(model)
    first = train_steps(model, optimizer, rank, range(half))
    if how == "torch.save":
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{path}/rank{rank}.pt")
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    model = sharded_model("O2")
    optimizer = o2_optimizer(model)
    if how == "torch.save":
        checkpoint = torch.load(f"{path}/rank{rank}.pt", weights_only=False)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        checkpoint = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(checkpoint, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"])
    second = train_steps(model, optimizer, rank, range(half, STEPS))
    resumed = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    return dict(straight=straight, resumed=torch.cat([first, second]), final=final, resumed_final=resumed)


@pytest.mark.parametrize("how, world", [("torch.save", 2), ("torch.save", 3), ("dcp", 2), ("dcp", 3)])
def test_o2_under_fully_shard_resumes_bit_for_bit(how, world, tmp_path):
    """The masters' shards (codes and scale), the optimizer's sharded states and each rank's scaling
    buffers saved halfway and loaded into a fresh sharded model continue the run bit for bit
    (3 ranks: an uneven, padded last shard)."""
    for r in run_on_ranks(resume_rank, world, str(tmp_path), how):
        assert torch.equal(r["straight"], r["resumed"])
        for name, value in r["final"].items():
            assert torch.equal(r["resumed_final"][name], value), name


def stale_optimizer_rank(rank: int) -> str:
    model = make_model()
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), "O2")
    shard(model)
    try:
        loss_of(model, *batch(0, rank))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_o2_sharded_after_its_optimizer_was_built_is_refused_by_name():
    """initialize(model, optimizer) then fully_shard: that optimizer holds the unsharded masters,
    which FSDP2 replaced, so it would train nothing; the first forward says so and what to do."""
    for message in run_on_ranks(stale_optimizer_rank, WORLD_SIZE):
        assert "fully_shard (FSDP2) sharded this layer's FP16 master after fp8amp.initialize built the" in message
        assert "fp8amp.initialize(model, opt_level=...) without an optimizer" in message, message


def wrong_order_rank(rank: int) -> dict:
    """The two other wrong orders: fully_shard before initialize (convert would find no plain
    nn.Linear: FSDP2 made each an FSDPLinear), and fp8amp's optimizer built by hand before
    fully_shard (it holds the unsharded masters, which get no gradient)."""
    out = {}
    model = make_model()
    shard(model)
    try:
        fp8amp.initialize(model, None, "O2", policy="all")
        out["shard_first"] = "no error"
    except ValueError as e:
        out["shard_first"] = str(e)
    model, _ = fp8amp.initialize(make_model(), None, "O2", policy="all")
    optimizer = fp8amp.optim.AdamW(model.parameters(), lr=LR, state_dtypes="O2")
    shard(model)
    loss_of(model, *batch(0, rank)).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    out["optimizer_first"] = [str(w.message) for w in caught]
    return out


def test_the_other_wrong_orders_with_fully_shard_are_said():
    """Both trained nothing without a word before 2026-12-06."""
    for r in run_on_ranks(wrong_order_rank, WORLD_SIZE):
        assert "fp8amp.convert: 0 is already sharded" in r["shard_first"], r
        assert "before fully_shard" in r["shard_first"]
        assert any("none of its 4 parameter(s) has a gradient" in m for m in r["optimizer_first"]), r


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_replaced_master_is_refused_at_forward(level):
    model = make_model()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), level)
    x, target = batch(0, 0)
    loss_of(model, x, target).backward()  # the masters are in place: it runs
    plain = {k: v.clone() for k, v in model.state_dict().items()}  # real values, plain tensors
    model.load_state_dict(plain, assign=True)
    with pytest.raises(RuntimeError, match=r"weight is\s+now a Parameter of torch.float32.*assign=True"):
        model(x)
