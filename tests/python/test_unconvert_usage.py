"""fp8amp.unconvert as users call it: what the model and the optimizer carried before (param-group
settings, hooks on layers and weights, pending gradients) is still there after, and plain torch
trains on from the same place."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8amp
from ranks import free_port


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16, bias=False), nn.LayerNorm(16)).to(dtype)


def _train(model, opt, steps=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(24, 32, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _converted(level, model, opt):
    if level == "fp8":
        fp8amp.convert(model, optimizer=opt, policy="all")
        return model, opt
    return fp8amp.initialize(model, opt, level, policy="all")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_param_group_settings_of_the_user_survive(level):
    """The plain optimizer took lr, betas, eps, weight_decay and maximize only: a group's own keys
    (a name, a scale an lr schedule reads, a scheduler's max_lr) and foreach were dropped."""
    model = _model()
    base = torch.optim.AdamW([{"params": model[0].parameters(), "name": "first", "lr_scale": 0.5},
                              {"params": [*model[2].parameters(), *model[3].parameters()], "name": "rest",
                               "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3, foreach=False)
    model, opt = fp8amp.initialize(model, base, level, policy="all")
    _train(model, opt)
    model, plain = fp8amp.unconvert(model, opt)
    assert [g["name"] for g in plain.param_groups] == ["first", "rest"]
    assert plain.param_groups[0]["lr_scale"] == 0.5
    assert [g["foreach"] for g in plain.param_groups] == [False, False]
    assert [(g["lr"], g["weight_decay"]) for g in plain.param_groups] == [(1e-3, 1e-2), (1e-2, 0.0)]
    assert all("state_dtypes" not in g for g in plain.param_groups)  # fp8amp's own key
    _train(model, plain, 1)


def test_a_scheduler_repointed_at_the_plain_optimizer_keeps_its_schedule():
    model = _model()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    for _ in range(3):
        _train(model, opt, 1)
        sched.step()
    with pytest.warns(UserWarning, match="lr scheduler was built on the optimizer passed in"):
        model, plain = fp8amp.unconvert(model, opt)
    sched.optimizer = plain
    ref = torch.optim.lr_scheduler.OneCycleLR(torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1e-2),
                                              max_lr=1e-2, total_steps=10)
    for _ in range(3):
        ref.optimizer.step()
        ref.step()
    for _ in range(3):
        _train(model, plain, 1)
        sched.step()
        ref.optimizer.step()
        ref.step()
        assert plain.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_hooks_on_layers_and_weights_survive(level):
    model = _model()
    model, opt = _converted(level, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append("pre"))
    model[0].register_forward_hook(lambda m, args, out: seen.append("forward"))
    handle = model[0].register_forward_hook(lambda m, args, out: seen.append("removed"))
    model[2].register_full_backward_hook(lambda m, grad_in, grad_out: seen.append("backward"))
    model[2].weight.register_hook(lambda g: seen.append("grad"))
    model[2].weight.register_post_accumulate_grad_hook(lambda p: seen.append("accumulated"))
    model, plain = fp8amp.unconvert(model, opt)
    handle.remove()  # a handle taken before still removes its hook
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
    _train(model, plain, 1)
    assert sorted(seen) == ["accumulated", "backward", "forward", "grad", "pre"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_pending_gradient_is_kept(level, dtype):
    """A master's gradient (an FP8 ScaledTensor) was dropped: the new weight had none, so the step
    that followed left every Linear weight where it was."""
    model = _model(dtype)
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level, policy="all")
    model(torch.randn(8, 32).to(dtype)).float().square().mean().backward()
    grads = [m.weight.grad.dequantize().to(dtype) for m in (model[0], model[2])]
    model, plain = fp8amp.unconvert(model, opt)
    for layer, grad in zip((model[0], model[2]), grads):
        assert type(layer.weight.grad) is torch.Tensor and layer.weight.grad.dtype == dtype
        assert torch.equal(layer.weight.grad, grad)
    before = model[2].weight.detach().clone()
    plain.step()
    assert not torch.equal(model[2].weight, before)


def test_plain_training_goes_on_as_torch_from_the_same_state():
    model = _model()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), "O2",
                                   policy="all")
    _train(model, opt)
    model, plain = fp8amp.unconvert(model, opt)
    ref = _model()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt.load_state_dict(copy.deepcopy(plain.state_dict()))
    _train(model, plain, 2, seed=5)
    _train(ref, ref_opt, 2, seed=5)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


def test_hooks_on_the_optimizer_move_to_the_plain_one():
    """Step and state-dict hooks on fp8amp's optimizer (an EMA update, logging) were dropped, as
    initialize carries them over to the optimizer it returns."""
    model = _model()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", policy="all")
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    handle = opt.register_step_post_hook(lambda o, args, kwargs: seen.append("removed"))
    opt.register_state_dict_post_hook(lambda o, state: seen.append("state_dict"))
    _train(model, opt, 1)
    model, plain = fp8amp.unconvert(model, opt)
    handle.remove()
    seen.clear()
    _train(model, plain, 1)
    plain.state_dict()
    assert seen == ["pre", "post", "state_dict"]
    assert not any(hasattr(h, "__self__") for h in plain._optimizer_step_post_hooks.values())  # no fp8amp hook


@pytest.mark.parametrize("caller", ["initialize", "unconvert"])
def test_an_optimizer_already_replaced_is_refused_naming_the_one_to_pass(caller):
    """The optimizer that initialize replaced came back from unconvert as it was (its step raised
    later, naming initialize); the one unconvert replaced was refused as "not in model"."""
    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8amp.initialize(model, base, "O2", policy="all")
    _train(model, opt, 1)
    retired = base
    if caller == "unconvert":
        model, _ = fp8amp.unconvert(model, opt)
        retired = opt
    with pytest.raises(ValueError, match=f"fp8amp.{caller} already replaced this optimizer.*pass the optimizer"):
        fp8amp.unconvert(model, retired)


def test_a_submodule_with_the_whole_models_optimizer_says_what_works():
    model = nn.Sequential(_model(), nn.Linear(16, 16))
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", policy="all")
    types = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"not in model.*fp8amp.unconvert\(whole_model, optimizer\)"):
        fp8amp.unconvert(model[0], opt)
    assert [type(m) for m in model.modules()] == types  # nothing changed


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_hooks_registered_before_convert_survive_the_round_trip(level):
    """convert made a fresh Fp8Linear (the Linear's forward and backward hooks dropped) and
    initialize a new master parameter (the weight's gradient hooks dropped), silently."""
    model = _model()
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append("forward"))
    model[2].register_full_backward_hook(lambda m, grad_in, grad_out: seen.append("backward"))
    model[2].weight.register_hook(lambda g: seen.append("grad"))
    model[2].weight.register_post_accumulate_grad_hook(lambda p: seen.append("accumulated"))
    model, opt = _converted(level, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _train(model, opt, 1)
    assert sorted(seen) == ["accumulated", "backward", "forward", "grad"]
    seen.clear()
    model, plain = fp8amp.unconvert(model, opt)
    _train(model, plain, 1)
    assert sorted(seen) == ["accumulated", "backward", "forward", "grad"]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_attributes_set_on_a_weight_survive_the_round_trip(level):
    """A flag set on a weight (read by code that groups params by it) was lost when initialize
    replaced the weight by its master, and again when unconvert replaced the master."""
    model = _model()
    model[2].weight.no_decay = True
    model, opt = _converted(level, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert getattr(model[2].weight, "no_decay", None) is True
    assert not hasattr(model[0].weight, "no_decay")
    model, _ = fp8amp.unconvert(model, opt)
    assert getattr(model[2].weight, "no_decay", None) is True
    assert not any(name.startswith("_") for name in vars(model[2].weight))  # no master internals


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_gradient_hook_that_scales_the_gradient_applies_to_the_master(level):
    model = _model()
    model[2].weight.register_hook(lambda g: g * 0.0)
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0), level,
                                   policy="all")
    before = model[2].weight.dequantize().clone()
    _train(model, opt, 1)
    assert torch.equal(model[2].weight.dequantize(), before)  # zero gradient, no weight decay: unchanged


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_a_ddp_wrapped_model_is_refused_before_anything_changes(level):
    """The next forward failed inside torch ("!tensors.empty() INTERNAL ASSERT FAILED at
    reducer.cpp": DDP broadcasts the buffers it listed when it wrapped the model, and the scaling
    buffers were gone), and at O1/O2 its reducer held the replaced masters."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        plain = nn.parallel.DistributedDataParallel(_model())
        assert fp8amp.unconvert(plain) is plain  # nothing to unconvert
        model = _model()
        model, opt = _converted(level, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        ddp = nn.parallel.DistributedDataParallel(model)
        _train(ddp, opt, 1)
        with pytest.raises(ValueError, match=r"DistributedDataParallel.*fp8amp.unconvert\(ddp.module, optimizer\)"):
            fp8amp.unconvert(ddp, opt)
        assert isinstance(model[0], fp8amp.Fp8Linear)
        model, opt = fp8amp.unconvert(ddp.module, opt)
        ddp = nn.parallel.DistributedDataParallel(model)
        assert type(ddp.module[0]) is nn.Linear
        _train(ddp, opt, 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("caller", ["initialize", "unconvert"])
def test_a_reduce_on_plateau_scheduler_left_on_the_replaced_optimizer_is_warned_about(caller):
    """ReduceLROnPlateau marks nothing on its optimizer (no initial_lr, no wrapped step), so the
    one built on the optimizer fp8amp replaced went on lowering that one's lr, silently."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if caller == "initialize":
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        model, new = fp8amp.initialize(model, opt, "O2", policy="all")
    else:
        model, opt = fp8amp.initialize(model, opt, "O2", policy="all")
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        model, new = fp8amp.unconvert(model, opt)
    sched.step(1.0)
    with pytest.warns(UserWarning, match=f"fp8amp.{caller} replaced this optimizer.*scheduler.optimizer = "):
        sched.step(2.0)
    sched.optimizer = new  # what the warning says: the schedule goes on on the returned optimizer
    sched.step(3.0)
    assert new.param_groups[0]["lr"] == pytest.approx(1e-3)


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_the_roots_report_follows_an_unconvert_of_a_submodule(level):
    """unconvert(model.block) cannot reach the report the root keeps, which went on naming the
    block's layers as converted; conversion_report(model) now marks them as made plain again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 64), nn.GELU()), nn.Linear(64, 16))
    model, opt = _converted(level, model, torch.optim.AdamW(model.parameters()))
    assert [d.name for d in fp8amp.conversion_report(model).converted] == ["0.0", "1"]
    if level == "fp8":
        fp8amp.unconvert(model[0])
    else:
        with pytest.warns(UserWarning, match="master weight"):
            fp8amp.unconvert(model[0])
    report = fp8amp.conversion_report(model)
    assert [d.name for d in report.converted] == ["1"]
    (gone,) = report.skipped
    assert gone.name == "0.0" and "unconvert" in gone.reason
    assert "1 of 2 Linear layers converted" in str(report)
    assert fp8amp.conversion_report(model) is report  # one report, kept up to date in place


def test_a_report_keeps_layers_whose_names_a_wrapper_changed():
    """A converted layer whose name no longer resolves (a wrapper put around its parent renames the
    path) is not claimed to be unconverted."""
    model = fp8amp.convert(nn.Sequential(nn.Sequential(nn.Linear(32, 64))), policy="all")
    model[0] = nn.Sequential(model[0])  # now at "0.0.0"
    assert [d.name for d in fp8amp.conversion_report(model).converted] == ["0.0"]
