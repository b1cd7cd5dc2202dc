"""FSDP2 (``fully_shard``) with the tiled recipes, 2 gloo processes on CPU (docs/distributed.md,
"FSDP2"): a Linear 128 -> 256 (2 x 128 rows: each rank's shard one whole 128-row block, gathered
as E4M3 codes with block scales under blockwise) and a Linear 256 -> 128 (64 rows a rank, which
split a block: the fallbacks, plain weights or FP16 master codes). FP8 compute with and without
``enable_fp8_all_gather``, and O2 masters, against one process on both ranks' batches; and stock
DDP over blockwise O2, whose weight gradients are in 128 x 128 blocks; and blockwise under
fully_shard with the model compiled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import ScaledTensor, ops
from fp8amp.fsdp import enable_fp8_all_gather
from fp8amp.block_scaled_tensor import BlockScaledTensor
from fp8amp.tiled_all_gather import blocks_align
from ranks import run_on_ranks
from test_fsdp import O3_LR, loss_of, shard, train_steps

WORLD = 2
STEPS = 3
LR = 1e-2
TILED = ("rowwise", "blockwise", "mxfp8")  # mxfp8 gathers as rowwise does


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    with torch.no_grad():
        model[0].weight[128:] *= 8  # rank 1's block: a scale of its own (a per-tensor cast would not give it)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(32, 128, generator=g), torch.randn(32, 128, generator=g)


def build(recipe: str, mode: str, optimizer_for=None):
    """``mode``: "plain" (FP8 compute, FSDP2's own all-gather), "fp8" (enable_fp8_all_gather) or
    "O2" (masters); unsharded with ``optimizer_for`` given (the one-process reference)."""
    if mode == "O2":
        model = make_model()
        opt = None if optimizer_for is None else torch.optim.AdamW(model.parameters(), lr=O3_LR)
        return fp8amp.initialize(model, opt, "O2", recipe=recipe, policy="all",
                                 **({} if opt is None else {"weight_grad": "fp32"}))
    model = fp8amp.convert(make_model(), recipe=recipe, policy="all")
    if mode == "fp8":
        enable_fp8_all_gather(model)
    return model, None if optimizer_for is None else torch.optim.AdamW(model.parameters(), lr=LR)


def weight_kind(w) -> str:
    if isinstance(w, BlockScaledTensor):
        return "blocks"
    if isinstance(w, ScaledTensor):
        return str(w.storage_format).removeprefix("torch.")
    return "plain"


def sharded_optimizer(model: nn.Module, mode: str) -> torch.optim.Optimizer:
    return (fp8amp.optim.AdamW(model.parameters(), lr=O3_LR, state_dtypes="O2") if mode == "O2"
            else torch.optim.AdamW(model.parameters(), lr=LR))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> torch.Tensor:
    """STEPS steps on this rank's batches, each followed by the scaling update; the losses."""
    return train_steps(model, optimizer, rank, range(STEPS), batch)


def full_params(model: nn.Module) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def tiled_rank(rank: int) -> dict:
    """Every (recipe, mode) under fully_shard on this rank: what the forwards saw as weights,
    the first step's gathered blocks, the losses and the parameters' real values."""
    out = {}
    for recipe in TILED:
        for mode in ("plain", "fp8", "O2"):
            model, _ = build(recipe, mode)
            shard(model)
            optimizer = sharded_optimizer(model, mode)
            seen, blocks = [], []

            def look(m, _):
                seen.append(weight_kind(m.weight))
                if isinstance(m.weight, BlockScaledTensor) and len(blocks) < 1:
                    blocks.append((m.weight._codes.view(torch.uint8).clone(), m.weight._scale_inv.clone()))

            for module in (model[0], model[2]):
                module.register_forward_pre_hook(look)
            losses = train(model, optimizer, rank)
            out[recipe, mode] = dict(seen=seen[:2], blocks=blocks, losses=losses, params=full_params(model))
    return out


def compiled_rank(rank: int, recipe: str) -> dict:
    """Each mode under fully_shard with the model compiled (``model.compile()``, as a user would):
    the losses, the parameters and the scaling buffers after STEPS steps."""
    out = {}
    for mode in ("plain", "fp8", "O2"):
        model, _ = build(recipe, mode)
        shard(model)
        model.compile()
        losses = train(model, sharded_optimizer(model, mode), rank)
        out[mode] = dict(losses=losses, params=full_params(model),
                         buffers={n: b.clone() for n, b in model.named_buffers()},
                         weight_type=type(model[0].weight.to_local()).__name__,
                         frames=torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return out


def one_process(recipe: str, mode: str, world: int = WORLD) -> tuple[torch.Tensor, dict]:
    """The ``world`` ranks' batches as micro-batches of one step, unsharded; the losses [rank, step]."""
    model, optimizer = build(recipe, mode, optimizer_for=True)
    losses = []
    for step in range(STEPS):
        for rank in range(world):
            loss = loss_of(model, *batch(step, rank))
            (loss / world).backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        fp8amp.update_scaling(model)
    real = {n: (p.dequantize() if isinstance(p, ScaledTensor) else p.detach()) for n, p in model.named_parameters()}
    return torch.stack(losses).view(STEPS, world).t(), real


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(tiled_rank, WORLD)


def test_which_all_gather_each_weight_takes():
    assert blocks_align(256, 2) and not blocks_align(128, 2) and blocks_align(384, 3) and not blocks_align(256, 3)
    assert not blocks_align(512, 3) and blocks_align(128, 1) and not blocks_align(192, 1)


@pytest.mark.parametrize("recipe", TILED)
def test_the_gathered_weights(ranks, recipe):
    """Blockwise with the FP8 all-gather or O2: the 256-row weight arrives as 128 x 128 blocks,
    the 128-row one (64 rows a rank split a block) as the plain weight or FP16 master codes;
    rowwise always so (its transpose needs per-column scales over both ranks' rows)."""
    for r in ranks:
        blockwise = recipe == "blockwise"
        assert r[recipe, "plain"]["seen"] == ["plain", "plain"]
        assert r[recipe, "fp8"]["seen"] == ["blocks" if blockwise else "plain", "plain"]
        assert r[recipe, "O2"]["seen"] == ["blocks" if blockwise else "float16", "float16"]


@pytest.mark.parametrize("mode", ["fp8", "O2"])
def test_gathered_blocks_are_the_whole_weights_cast_bit_for_bit(ranks, mode):
    """Each rank quantized its own 128-row shard with its own blocks: the gathered codes and
    scales equal quantize_tiles of the whole weight (the first forward's, before any step)."""
    model, _ = build("blockwise", mode, optimizer_for=True)
    w = model[0].weight
    whole = w.dequantize(torch.float32) if isinstance(w, ScaledTensor) else w.detach()
    codes, scale_inv = ops.quantize_tiles(whole, fp8amp.E4M3, (128, 128))
    for r in ranks:
        (got_codes, got_scale_inv), = r["blockwise", mode]["blocks"]
        assert torch.equal(got_codes, codes.view(torch.uint8)) and torch.equal(got_scale_inv, scale_inv)
        assert got_scale_inv.shape == (2, 1) and not torch.equal(got_scale_inv[0], got_scale_inv[1])


@pytest.mark.parametrize("recipe", TILED)
def test_fp8_compute_trains_as_the_high_precision_all_gather_and_one_process(ranks, recipe):
    """The blocks are the cast the layer makes of the gathered float32 weight: bit for bit the
    same training; and one process's within float32 reordering of the gradient sums."""
    losses, params = one_process(recipe, "plain")
    for rank, r in enumerate(ranks):
        fp8, plain = r[recipe, "fp8"], r[recipe, "plain"]
        assert torch.equal(fp8["losses"], plain["losses"])
        for name, value in plain["params"].items():
            assert torch.equal(fp8["params"][name], value), name
            assert torch.equal(value, ranks[0][recipe, "plain"]["params"][name]), name  # ranks agree
            torch.testing.assert_close(value, params[name], msg=name)
        torch.testing.assert_close(plain["losses"], losses[rank])
    assert not torch.equal(ranks[0][recipe, "fp8"]["params"]["0.weight"], make_model()[0].weight.detach())


def check_o2_as_one_process(ranks: list, recipe: str) -> None:
    losses, params = one_process(recipe, "O2", len(ranks))
    for rank, r in enumerate(ranks):
        o2 = r[recipe, "O2"]
        assert torch.equal(o2["losses"][0], losses[rank, 0])
        torch.testing.assert_close(o2["losses"], losses[rank], rtol=1e-2, atol=0)
        for name, value in o2["params"].items():
            assert torch.equal(value, ranks[0][recipe, "O2"]["params"][name]), name
            torch.testing.assert_close(value, params[name], rtol=0, atol=2 * O3_LR * STEPS, msg=name)
    assert (ranks[0][recipe, "O2"]["params"]["0.weight"] - make_model()[0].weight.detach()).abs().max() > O3_LR


@pytest.mark.parametrize("recipe", TILED)
def test_o2_trains_as_one_process(ranks, recipe):
    """O2 masters sharded, gathered as blocks or FP16 codes: the ranks agree bit for bit, and one
    process's O2 run within Adam's 2 lr a step (the shards' own master scales round the FP16
    masters differently, as for tensorwise in test_fsdp.py); the first loss is the same bits."""
    check_o2_as_one_process(ranks, recipe)


def o2_rank(rank: int) -> dict:
    """The tiled recipes' O2 under fully_shard (as tiled_rank's O2 mode)."""
    out = {}
    for recipe in TILED:
        model, _ = build(recipe, "O2")
        shard(model)
        out[recipe, "O2"] = dict(losses=train(model, sharded_optimizer(model, "O2"), rank), params=full_params(model))
    return out


def test_o2_on_three_ranks_shards_unevenly_and_trains_as_one_process():
    """3 ranks: the weights' 256 and 128 rows split unevenly (86 + 86 + 84, 43 + 43 + 42), so their
    FP16-code all-gathers are padded; FSDP2 wants them in the padded shard's shape (they went as
    bytes, twice as wide: every recipe's first forward failed). As on 2 ranks: the ranks agree
    bit for bit, and one process's run within Adam's 2 lr a step."""
    res = run_on_ranks(o2_rank, 3)
    for recipe in TILED:
        check_o2_as_one_process(res, recipe)


def ddp_rank(rank: int) -> dict:
    """Blockwise O2 under stock DDP: the block gradient DDP all-reduced, this rank's own, and the
    weight after one step."""
    model = make_model()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=O3_LR), "O2", recipe="blockwise",
                                   policy="all")
    local, _ = build("blockwise", "O2")  # the same weights, no DDP
    loss_of(local, *batch(0, rank)).backward()
    ddp = nn.parallel.DistributedDataParallel(model)
    loss_of(ddp, *batch(0, rank)).backward()
    grad = model[0].weight.grad
    result = dict(grad_type=type(grad).__name__, grad=grad.dequantize(), local_grad=local[0].weight.grad.dequantize())
    opt.step()
    return dict(result, weight=model[0].weight.dequantize())


def test_ddp_averages_blockwise_gradients():
    """DDP copies each block gradient into its float32 bucket (its real values), averages there and
    copies the mean back, which writes it with fresh block scales: the mean of the ranks' block
    gradients rounded once more to E4M3 (2^-4 relative, or the subnormal step of its block), the
    replicas identical."""
    res = run_on_ranks(ddp_rank, WORLD)
    assert res[0]["grad_type"] == "BlockScaledTensor"
    mean = (res[0]["local_grad"] + res[1]["local_grad"]) / 2
    block_amax = mean.abs().view(2, 128, 1, 128).amax(dim=(1, 3), keepdim=True)
    step = (2.0 ** -9 * block_amax / 448 * 2).expand(2, 128, 1, 128).reshape(mean.shape)  # within 2x of the scale
    for r in res:
        assert ((r["grad"] - mean).abs() <= mean.abs() * 2.0 ** -4 + step).all()
    assert torch.equal(res[0]["grad"], res[1]["grad"]) and torch.equal(res[0]["weight"], res[1]["weight"])


def test_blockwise_under_fsdp2_and_compile(ranks):
    """fully_shard + torch.compile + blockwise: the FP8 block all-gather trains bit for bit as the
    high-precision one, compiled too; O2's sharded masters gathered as blocks train as eager O2
    does (within the FP8 rounding of Inductor's differently fused float32 around the casts); the
    ranks' parameters and scaling buffers agree bit for bit."""
    res = run_on_ranks(compiled_rank, WORLD, "blockwise")
    for rank, r in enumerate(res):
        assert r["fp8"]["weight_type"] == "Fp8AllGatherWeight" and r["plain"]["weight_type"] == "Tensor"
        assert r["plain"]["frames"] > 0  # Dynamo compiled graphs (a silent fallback to eager would not)
        assert torch.equal(r["fp8"]["losses"], r["plain"]["losses"]), rank
        for name, value in r["plain"]["params"].items():
            assert torch.equal(r["fp8"]["params"][name], value), name
        eager = ranks[rank]["blockwise", "O2"]
        torch.testing.assert_close(r["O2"]["losses"], eager["losses"], rtol=1e-2, atol=0)
        for name, value in r["O2"]["params"].items():
            torch.testing.assert_close(value, eager["params"][name], rtol=0, atol=2 * O3_LR * STEPS, msg=name)
        for mode in ("fp8", "O2"):
            for kind in ("params", "buffers"):
                for name, value in r[mode][kind].items():
                    assert torch.equal(value, res[0][mode][kind][name]), (rank, mode, kind, name)
    assert not torch.equal(res[0]["O2"]["params"]["0.weight"], make_model()[0].weight.detach())
