"""Training-loop features combined with ``fp8amp.initialize`` (and fp8amp's optimizer built
directly): param groups changed mid-run, GradScaler, clipping, accumulation, frozen and unused
parameters, resume. Each case is compared with the same loop on the unconverted model."""

import copy

import pytest
import torch
from torch import nn

import fp8amp
from tiny_mlp import regression_batches, tiny_mlp


def _assert_close(model, plain, rel=0.05, atol=0.01):
    """Parameters within FP8 training's distance of the unconverted model's (in norm)."""
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        p, q = p.detach(), q.detach()
        error = float((p.dequantize() if isinstance(p, fp8amp.ScaledTensor) else p).sub(q).norm())
        assert error <= rel * float(q.norm()) + atol, (name, error, float(q.norm()))


def _train(model, optimizer, batches):
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("how", ["add_param_group", "constructor"])
def test_a_weight_replaced_by_its_master_is_refused_by_the_optimizer(how):
    """Parameters collected before initialize (progressive unfreezing: the head's, to add later)
    hold the Linear weights that the FP16 masters replaced: stepping them trains nothing. They were
    taken silently, and the head never trained."""
    model = tiny_mlp()
    head = list(model[4].parameters())
    optimizer = torch.optim.AdamW(list(model[0].parameters()) + list(model[2].parameters()), lr=1e-2)
    model, optimizer = fp8amp.initialize(model, optimizer, "O2")
    with pytest.raises(ValueError, match="param 0 of group 1 is a Linear weight that fp8amp.initialize replaced"):
        if how == "add_param_group":
            optimizer.add_param_group({"params": head, "lr": 1e-3})
        else:
            fp8amp.optim.AdamW([{"params": list(model[0].parameters())}, {"params": head}], state_dtypes="O2")
    assert len(optimizer.param_groups) == 1
    optimizer.add_param_group({"params": list(model[4].parameters()), "lr": 1e-3})  # the model's own: trains
    before = model[4].weight.dequantize()
    _train(model, optimizer, regression_batches(2))
    assert not torch.equal(before, model[4].weight.dequantize())


@pytest.mark.parametrize("group", [{"params": [nn.Parameter(torch.ones(4, dtype=torch.float64))]},
                                   {"params": [nn.Parameter(torch.ones(4))], "amsgrad": True},
                                   {"params": [nn.Parameter(torch.ones(4))], "lr": torch.tensor(0.1)}])
def test_a_refused_param_group_is_not_added(group):
    """add_param_group raised, but kept the group: every later step then failed inside an op
    (``fp8amp.multi_amax: xs[0] has unsupported dtype Double``), or stepped a group with options
    the optimizer refuses."""
    model = tiny_mlp()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")
    with pytest.raises(ValueError, match="fp8amp.optim.AdamW"):
        optimizer.add_param_group(group)
    assert len(optimizer.param_groups) == 1
    for p in group["params"]:
        p.grad = torch.ones_like(p)
    before = model[0].weight.dequantize()
    _train(model, optimizer, regression_batches(1))
    assert not torch.equal(before, model[0].weight.dequantize())


def test_numpy_hyperparameters_step_as_with_torch():
    """An lr schedule precomputed with numpy (LambdaLR over a float32 array) sets numpy float32
    lrs, which torch's AdamW steps with; fp8amp's refused them at the first step ("lr must be a
    Python float, got float32"), and initialize refused such an lr."""
    np = pytest.importorskip("numpy")
    schedule = np.cos(np.linspace(0, np.pi / 2, 4, dtype=np.float32))
    model = tiny_mlp()
    plain = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=np.float32(1e-3))
                  for m in (model, plain)]
    model, optimizers[0] = fp8amp.initialize(model, optimizers[0], "O2")
    for m, optimizer in zip((model, plain), optimizers):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: schedule[i])
        for batch in regression_batches(3):
            _train(m, optimizer, [batch])
            scheduler.step()
    assert optimizers[0].param_groups[0]["lr"] == optimizers[1].param_groups[0]["lr"]
    assert isinstance(optimizers[0].param_groups[0]["lr"], np.float32)
    _assert_close(model, plain)



def _real(t):
    return t.detach().dequantize() if isinstance(t, fp8amp.ScaledTensor) else t.detach()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_grad_scaler_with_float16_autocast_skips_an_inf_step_and_halves_its_scale(level):
    model = tiny_mlp()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return norm

    batches = regression_batches(3)
    assert all(torch.isfinite(step(x, y)) for x, y in batches[:2])
    params = [_real(p).clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    x, y = batches[2]
    x = x.clone()
    x[0, 0] = float("inf")
    assert not torch.isfinite(step(x, y))
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(a, _real(p)) for a, p in zip(params, model.parameters()))
    for saved, now in zip(state["state"].values(), optimizer.state_dict()["state"].values()):
        assert all(torch.equal(_real(saved[k]), _real(now[k])) for k in saved)


def test_clipping_fp8_gradients_equals_clipping_their_real_values():
    model = tiny_mlp()
    model, _ = fp8amp.initialize(model, None, "O2")
    x, y = regression_batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    saved = [p.grad.detach().clone() for p in model.parameters()]
    assert isinstance(saved[0], fp8amp.ScaledTensor)
    for norm_type in (2.0, float("inf")):
        for foreach in (True, False):
            plain = [torch.zeros_like(_real(g), requires_grad=True) for g in saved]
            for q, g in zip(plain, saved):
                q.grad = _real(g).clone()
            for p, g in zip(model.parameters(), saved):
                p.grad = g.clone()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type, foreach=foreach)
            assert torch.allclose(norm, torch.nn.utils.clip_grad_norm_(plain, 0.05, norm_type, foreach=foreach))
            for p, q in zip(model.parameters(), plain):  # a scale change: exact but for the coefficient's rounding
                assert torch.allclose(_real(p.grad), q.grad, rtol=1e-6, atol=0)
    for p, g in zip(model.parameters(), saved):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3, foreach=True)
    for p, g in zip(model.parameters(), saved):  # clamped, then rounded to E4M3 with a fresh scale
        expected = _real(g).clamp(-1e-3, 1e-3)
        assert torch.allclose(_real(p.grad), expected, rtol=2.0**-4, atol=0)
    model[0].weight.grad = fp8amp.ScaledTensor.from_tensor(torch.full((64, 32), float("nan")), fp8amp.E4M3)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True, error_if_nonfinite=True)


class _Branches(nn.Module):
    """Two branches, one used a step: each branch's params have no gradient in some steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head, self.norm = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16), nn.LayerNorm(32)

    def forward(self, x, branch):
        return self.head(torch.relu(self.norm(self.a(x) if branch else self.b(x))))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_params_without_a_gradient_in_some_steps_step_as_torch(set_to_none):
    model = _Branches()
    plain = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, plain)]
    model, optimizers[0] = fp8amp.initialize(model, optimizers[0], "O2")
    for i, (x, y) in enumerate(regression_batches(6)):
        for m, optimizer in zip((model, plain), optimizers):
            nn.functional.mse_loss(m(x, i % 3 != 0), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    steps = [[float(o.state[p]["step"]) for p in m.parameters()] for m, o in zip((model, plain), optimizers)]
    assert steps[0] == steps[1] and len(set(steps[0])) > 1
    _assert_close(model, plain)


@pytest.mark.parametrize("when", ["before", "after"])
def test_frozen_linear_layers_stay_as_they_are(when):
    model = tiny_mlp()
    freeze = lambda m: (m[0].requires_grad_(False), m[2].weight.requires_grad_(False))  # noqa: E731
    if when == "before":
        freeze(model)
    plain = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (model, plain)]
    model, optimizers[0] = fp8amp.initialize(model, optimizers[0], "O2")
    if when == "after":
        freeze(model), freeze(plain)
    frozen = {name: _real(p).clone() for name, p in model.named_parameters() if not p.requires_grad}
    for m, optimizer in zip((model, plain), optimizers):
        _train(m, optimizer, regression_batches(3))
    assert sorted(frozen) == ["0.bias", "0.weight", "2.weight"]
    assert all(torch.equal(value, _real(model.get_parameter(name))) for name, value in frozen.items())
    _assert_close(model, plain)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_resume_mid_run_continues_bit_for_bit(level, tmp_path):
    """Param groups, an lr scheduler, a GradScaler and params with different step counts (an unused
    branch), saved with torch.save and loaded into a fresh initialize."""

    def build():
        model = _Branches()
        groups = [{"params": [*model.a.parameters(), *model.norm.parameters()], "weight_decay": 0.1},
                  {"params": [*model.b.parameters(), *model.head.parameters()], "lr": 3e-3, "betas": (0.8, 0.95)}]
        model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(groups, lr=1e-2), level)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[1e-2, 3e-3], total_steps=10)
        return model, optimizer, scheduler, torch.amp.GradScaler("cpu", init_scale=2.0**8)

    def run(model, optimizer, scheduler, scaler, batches, first):
        losses = []
        for i, (x, y) in enumerate(batches, first):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x, i % 3 != 0).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scheduler.step()
            losses.append(loss.item())
        return losses

    batches = regression_batches(8)
    straight = build()
    run(*straight, batches[:4], 0)
    torch.save({"model": straight[0].state_dict(), **{k: o.state_dict() for k, o in zip("osg", straight[1:])}},
               tmp_path / "ckpt.pt")
    expected = run(*straight, batches[4:], 4)
    resumed = build()
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed[0].load_state_dict(saved["model"])
    for key, obj in zip("osg", resumed[1:]):
        obj.load_state_dict(saved[key])
    assert run(*resumed, batches[4:], 4) == expected
    for a, b in zip(straight[0].state_dict().values(), resumed[0].state_dict().values()):
        assert torch.equal(a, b)



def test_initialize_after_convert_with_the_same_optimizer_updates_the_scaling():
    """FP8 compute first (convert with the optimizer: its hooks update the scaling), then O2 with
    that optimizer: the retired optimizer, while something held it, stayed registered first for
    every scaling state, so it kept them, and as it never steps again no history rolled (every
    counter stayed 0)."""
    model, direct = tiny_mlp(), tiny_mlp()
    passed = torch.optim.AdamW(model.parameters(), lr=1e-3)  # still held (freed, it lost its states)
    model = fp8amp.convert(model, optimizer=passed)
    model, optimizer = fp8amp.initialize(model, passed, "O2")
    direct, direct_optimizer = fp8amp.initialize(direct, torch.optim.AdamW(direct.parameters(), lr=1e-3), "O2")
    _train(model, optimizer, regression_batches(3))
    _train(direct, direct_optimizer, regression_batches(3))
    assert int(model[0].input_scaling.counter) == 3
    for (name, a), b in zip(model.state_dict().items(), direct.state_dict().values()):
        assert torch.equal(a, b), name



@pytest.mark.parametrize("how", ["initialize", "initialize_optimizer"])
def test_hooks_registered_on_the_optimizer_passed_in_run_on_the_returned_one(how):
    """Step and state-dict hooks registered on the torch optimizer (an EMA update or a weight
    renormalization after each step, in configure_optimizers under Lightning, whose plugin calls
    initialize_optimizer) were dropped without a word when fp8amp rebuilt the optimizer."""
    model = tiny_mlp()
    passed = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls = []
    post = passed.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
    passed.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    passed.register_state_dict_post_hook(lambda o, state: calls.append(("state_dict", o)))
    if how == "initialize":
        model, optimizer = fp8amp.initialize(model, passed, "O2")
    else:
        model, _ = fp8amp.initialize(model, None, "O2")
        passed.param_groups[0]["params"] = list(model.parameters())  # (what the Lightning plugin does)
        optimizer = fp8amp.initialize_optimizer(model, passed, "O2")
    _train(model, optimizer, regression_batches(1))
    optimizer.state_dict()
    assert calls == [("pre", optimizer), ("post", optimizer), ("state_dict", optimizer)]
    post.remove()  # the handles still work
    _train(model, optimizer, regression_batches(1))
    assert [c for c, _ in calls[3:]] == ["pre"]
    assert int(model[0].input_scaling.counter) == 2  # fp8amp's own hooks: once a step


# ------------------------------------------------------------------------------------------ Lightning


def _lightning_loader():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tanh(x[:, :16] * 2)), batch_size=10)


def _fit(module, plugins, **kwargs):
    L = pytest.importorskip("lightning")
    trainer = L.Trainer(max_epochs=2, plugins=plugins, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs)
    trainer.fit(module, _lightning_loader())
    return trainer


def _lightning_module(configure_optimizers, training_step=None):
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
            self.lrs, self.losses = [], []

        def training_step(self, batch, batch_idx):
            if training_step is not None:
                return training_step(self, batch)
            self.lrs.append([g["lr"] for o in self.trainer.optimizers for g in o.param_groups])
            loss = nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return configure_optimizers(self)

    return Module()


@pytest.mark.parametrize("kind", ["SequentialLR", "ChainedScheduler"])
def test_lightning_schedulers_made_of_schedulers_drive_the_fp8amp_optimizer(kind):
    """The plugin pointed the scheduler configure_optimizers returned at fp8amp's optimizer, but not
    the schedulers a SequentialLR / ChainedScheduler holds and steps: they went on changing the lr of
    the torch optimizer the plugin had replaced, and the lr that trained stayed at its first value."""
    pytest.importorskip("lightning")
    from fp8amp.integrations.lightning import Fp8ampPrecision
    sched = torch.optim.lr_scheduler

    def configure_optimizers(module):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        warmup, decay = sched.LinearLR(optimizer, 0.1, total_iters=2), sched.ExponentialLR(optimizer, 0.8)
        scheduler = (sched.SequentialLR(optimizer, [warmup, decay], milestones=[2]) if kind == "SequentialLR"
                     else sched.ChainedScheduler([warmup, decay], optimizer))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    fp8, plain = _lightning_module(configure_optimizers), _lightning_module(configure_optimizers)
    _fit(fp8, [Fp8ampPrecision("O2")])
    _fit(plain, None)
    assert len(fp8.lrs) == 8 and fp8.lrs == plain.lrs


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_lightning_manual_optimization_with_two_optimizers(clip):
    """A GAN-like step: two optimizers (Adam and AdamW) over two parts, toggled, each clipped."""
    pytest.importorskip("lightning")
    from fp8amp.integrations.lightning import Fp8ampPrecision

    def training_step(module, batch):
        first, second = module.optimizers()
        loss = nn.functional.mse_loss(module.net(batch[0]).float(), batch[1])
        for optimizer in (first, second):
            module.toggle_optimizer(optimizer)
            module.manual_backward(loss, retain_graph=optimizer is first)
            module.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm=clip)
            optimizer.step()
            optimizer.zero_grad()
            module.untoggle_optimizer(optimizer)
        module.losses.append(loss.item())

    def configure_optimizers(module):
        module.automatic_optimization = False
        return (torch.optim.Adam(module.net[0].parameters(), lr=1e-2),
                torch.optim.AdamW(module.net[2].parameters(), lr=1e-2))

    fp8, plain = (_lightning_module(configure_optimizers, training_step) for _ in range(2))
    trainer = _fit(fp8, [Fp8ampPrecision("O2")])
    _fit(plain, None)
    assert [type(o) for o in trainer.optimizers] == [fp8amp.optim.Adam, fp8amp.optim.AdamW]
    assert all(float(s["step"]) == 8 for o in trainer.optimizers for s in o.state.values())
    assert int(fp8.net[2].grad_output_scaling.counter) == 8  # updated once a step, by one optimizer
    assert abs(fp8.losses[-1] - plain.losses[-1]) < 0.02 * plain.losses[-1]
    _assert_close(fp8, plain)


# ------------------------------------------------------------------------------------------ Accelerate


def test_accelerate_accumulation_clipping_and_state_round_trip(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    def run(start, checkpoint=None, load=None):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
        model = tiny_mlp()
        model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
        data = torch.utils.data.TensorDataset(*map(torch.cat, zip(*regression_batches(4))))
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, torch.utils.data.DataLoader(data, batch_size=8), scheduler)
        if load:
            accelerator.load_state(load)
            loader = accelerator.skip_first_batches(loader, start)
        losses, norms = [], []
        for i, (x, y) in enumerate(loader, start):
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if checkpoint and i == 3:
                accelerator.save_state(checkpoint)
        return losses, norms, model, optimizer

    losses, norms, model, optimizer = run(0, checkpoint=tmp_path / "state")
    assert len(norms) == 4 and all(0 < n < 10 for n in norms)
    assert all(float(s["step"]) == 4 for s in optimizer.optimizer.state.values())
    resumed, _, model2, _ = run(4, load=tmp_path / "state")
    assert resumed == losses[4:]
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
