"""Checkpoints as users save and load them (2026-12-06): model and optimizer state dicts of every
level into the same or another level, recipe or plain model, and what is refused when the
checkpoint does not fit. Each case is compared with what plain torch does for the same load."""

import copy

import pytest
import torch
from torch import nn

import fp8amp


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.LayerNorm(32))


def _setup(level, groups, seed=0):
    """A model at ``level`` ("plain": unconverted, torch's AdamW) and its optimizer, whose param
    groups ``groups(model)`` makes."""
    model = _model(seed)
    optimizer = torch.optim.AdamW(groups(model), lr=1e-2)
    if level == "plain":
        return model, optimizer
    return fp8amp.initialize(model, optimizer, level, policy="all")


def _train(model, optimizer, steps):
    for i in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 32, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        optimizer.step()


def _two_groups(model):
    return [{"params": list(model[0].parameters()) + list(model[3].parameters())},
            {"params": list(model[2].parameters()), "lr": 1e-3}]


@pytest.mark.parametrize("groups, message", [
    (lambda model: [{"params": list(model.parameters())}], r"this optimizer 1 param group \(6 params\)"),
    (lambda model: _two_groups(model)[::-1], r"this optimizer 2 param groups \(2, 4 params\)"),
], ids=["one_group", "groups_swapped"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_state_dict_of_other_param_groups_is_refused_naming_the_groups(level, groups, message):
    """A state dict saved with other param groups than the optimizer's: torch's AdamW says that
    the groups differ; fp8amp's said that a param's saved moment had another shape, "a state dict
    of another model", when the model was the same (its moments were matched to the wrong params)."""
    model, optimizer = _setup(level, _two_groups)
    _train(model, optimizer, 2)
    saved = optimizer.state_dict()
    with pytest.raises(ValueError, match="parameter group"):  # plain torch
        _setup("plain", groups)[1].load_state_dict(copy.deepcopy(saved))
    _, fresh = _setup(level, groups, seed=1)
    with pytest.raises(ValueError, match=r"fp8amp.optim.AdamW.load_state_dict: the state dict has 2 param groups "
                                         r"\(4, 2 params\), " + message):
        fresh.load_state_dict(copy.deepcopy(saved))
    assert not fresh.state  # nothing loaded


def _state_bits(optimizer):
    return [(key, value.float()) for state in optimizer.state.values() for key, value in sorted(state.items())]


@pytest.mark.parametrize("saved_level", ["plain", "O1", "O2"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_refused_corrupt_state_dict_leaves_the_optimizer_as_it_was(level, saved_level):
    """A NaN moment of the fourth param is refused (a corrupt checkpoint), but it was refused after
    torch had loaded every state: the optimizer kept the corrupt state dict, the params after the
    fourth unconverted (float32 moments at O2, scaled ones at O1), and a run that went on (a resume
    that falls back to a fresh optimizer state) had every later step skipped, or failed inside the
    op ("exp_avg_scales[4] must be None: its exp_avg is float32")."""
    model, optimizer = _setup(saved_level, lambda model: model.parameters())
    _train(model, optimizer, 2)
    corrupt = optimizer.state_dict()
    moment = corrupt["state"][3]["exp_avg"]
    (moment.scale_inv if isinstance(moment, fp8amp.ScaledTensor) else moment)[0] = float("nan")
    runs = [_setup(level, lambda model: model.parameters(), seed=1) for _ in range(2)]
    for run in runs:
        _train(*run, 2)
    before = _state_bits(runs[0][1])
    with pytest.raises(ValueError, match="param 3 of group 0: state 'exp_avg' holds inf or NaN"):
        runs[0][1].load_state_dict(corrupt)
    after = _state_bits(runs[0][1])
    assert [k for k, _ in after] == [k for k, _ in before]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after, before))
    for run in runs:
        _train(*run, 2)
    for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert torch.equal(p.detach().float(), q.detach().float())  # trains as if the load had not been tried


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_loading_into_an_optimizer_over_meta_params_says_to_build_it_after_materializing(level):
    """A model and optimizer made on the meta device (a big model's init), the checkpoint loaded
    into the optimizer: it failed inside the finiteness check with torch's "Tensor.item() cannot
    be called on meta tensors". to_empty() replaces the params (the masters too), so the optimizer
    must be built after it; the order that works resumes the run."""
    model, optimizer = _setup(level, lambda model: model.parameters())
    _train(model, optimizer, 2)
    saved_model, saved_optimizer = copy.deepcopy((model.state_dict(), optimizer.state_dict()))  # (as saved)
    with torch.device("meta"):
        meta, meta_optimizer = _setup(level, lambda model: model.parameters(), seed=1)
    with pytest.raises(ValueError, match=r"param 0 of group 0 is on the meta device.*after model.to_empty"):
        meta_optimizer.load_state_dict(saved_optimizer)
    with torch.device("meta"):
        meta = _model(1)
    meta.to_empty(device="cpu")
    meta.load_state_dict(saved_model, strict=False)  # the weights (the plain model has no scaling buffers)
    resumed, resumed_optimizer = fp8amp.initialize(meta, torch.optim.AdamW(meta.parameters()), level, policy="all")
    resumed.load_state_dict(saved_model)  # the scaling buffers
    resumed_optimizer.load_state_dict(saved_optimizer)
    for run in ((model, optimizer), (resumed, resumed_optimizer)):
        _train(*run, 2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p.detach().float(), q.detach().float())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_async_distributed_checkpoint_resumes_bit_for_bit(level, tmp_path):
    """dcp.async_save (torchtitan's async checkpointing) stages the state dict on the CPU first: a
    tensor with no storage of its own (data_ptr() 0), as an O2 moment is, was staged as
    new_empty(), a plain float32 tensor of uninitialized memory. The checkpoint held garbage
    moments: refused at load as corrupt ("holds inf or NaN", "a negative value"), or loaded when
    they happened to be finite. Resumed from it, the run goes on as the uninterrupted one."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    straight, straight_optimizer = _setup(level, lambda model: model.parameters())
    for _ in range(2):
        _train(straight, straight_optimizer, 2)
    model, optimizer = _setup(level, lambda model: model.parameters())
    _train(model, optimizer, 2)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp_path)).result()
    _train(model, optimizer, 2)  # the live state moves on after the save

    resumed, resumed_optimizer = _setup(level, lambda model: model.parameters(), seed=1)
    model_state, optimizer_state = get_state_dict(resumed, resumed_optimizer)
    checkpoint = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(checkpoint, checkpoint_id=str(tmp_path))
    set_state_dict(resumed, resumed_optimizer, model_state_dict=checkpoint["model"],
                   optim_state_dict=checkpoint["optimizer"])
    _train(resumed, resumed_optimizer, 2)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p.detach().float(), q.detach().float())


def _o3_async_round_trip(rank: int, world: int, path: str) -> list[str]:
    """On each rank: an O3 (O2 under FSDP2) model and optimizer trained, saved with dcp.async_save,
    trained on, then a new pair loaded from the checkpoint; what differs from the saved state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from test_checkpoint_reshard import build, snapshot, step

    model, optimizer = build(True, "cpu")
    for i in range(2):
        step(model, optimizer, i, rank, world, "cpu")
    saved = snapshot(model, optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path).result()
    step(model, optimizer, 2, rank, world, "cpu")
    model, optimizer = build(True, "cpu")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    checkpoint = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(checkpoint, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"])
    loaded = snapshot(model, optimizer)
    return [key for key, value in saved.items() if not torch.equal(value, loaded[key])]


def test_async_distributed_checkpoint_of_sharded_masters_keeps_them(tmp_path):
    """Under FSDP2 each master is a DTensor whose local shard is a MasterWeight, which DCP's async
    staging copied as new_empty() too: the checkpoint held uninitialized memory for every Linear
    weight (the optimizer's sharded moments, float32 DTensors, were saved)."""
    pytest.importorskip("torch.distributed.fsdp")
    from ranks import run_on_ranks

    assert run_on_ranks(_o3_async_round_trip, 2, 2, str(tmp_path)) == [[], []]
