"""fp8amp's optimizer over longer runs, next to ``torch.optim.AdamW`` / ``Adam`` step for step: the
update of every element at every step (param groups, schedules, weight decay on masters and on
norms, biases and embeddings), the step counts, resumes bit for bit, and step counts set by hand.

Tolerances, from the precision of each state:

- The update of one step, given the same p, m, v and gradient: m and v are torch's at O1 (the
  op's element math is torch's), within half a unit of their format at O2 (E4M3 m: 2^-4
  relative; FP16 v: 2^-11). The new master is torch's float32 result rounded to its FP16 codes:
  half an FP16 unit of the result (times the master's power-of-two scale), plus float32
  cancellation noise where p and the update nearly cancel (2^-20 of the update: the op's fma
  denominator against torch's divide and add). Plain params: 2^-20 relative.
- Whole runs compare with plain torch on the unconverted model: FP8 GEMMs, FP16 masters and (O2)
  E4M3 moments, so the loss curve within a few %.
- A resume (state dicts saved at step k, loaded into a fresh ``initialize``) equals the run that
  was not interrupted, bit for bit.
"""

import copy
import io
import statistics

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp.block_scaled_tensor import BlockScaledTensor
from fp8amp.scaled_tensor import ScaledTensor

LEVELS = ["O1", "O2"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 16))


class _Embedded(nn.Module):
    """The MLP after an embedding of a token read from the input: an embedding's rows get grads."""

    def __init__(self):
        super().__init__()
        self.net = _model()
        self.emb = nn.Embedding(8, 32)

    def forward(self, x):
        return self.net(x + self.emb((x[:, 0].abs() * 3).long().clamp(max=7)))


def _batches(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(32, 16, generator=gen) / 6
    out = []
    for _ in range(steps):
        x = torch.randn(32, 32, generator=gen)
        out.append((x, torch.tanh(x @ target)))
    return out


def _train(model, optimizer, batches, scheduler=None, frozen=None, start=0):
    """Trains on ``batches`` (numbered from ``start``); ``frozen(i)``: the module frozen at step i."""
    losses = []
    for i, (x, y) in enumerate(batches, start):
        if frozen is not None:
            for module, off in frozen(i):
                module.requires_grad_(not off)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _real(t):
    return t.dequantize(torch.float32) if isinstance(t, (ScaledTensor, BlockScaledTensor)) else t.float()


def _moment(state, key):
    scale_inv = state.get(f"{key}_scale_inv")
    return state[key].float() if scale_inv is None else state[key].float() * scale_inv


def _half_fp16_unit(values, scale_inv):
    """Half an FP16 unit at each of ``values`` (real values of a master with ``scale_inv``)."""
    codes = (values / scale_inv).abs().clamp_min(2.0 ** -14)  # (subnormals: the unit of 2^-14)
    return torch.exp2(torch.floor(torch.log2(codes)) - 11) * scale_inv


def _groups(model):
    """Decayed matrices, no-decay norms and biases (another lr, betas and eps), the embedding."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() == 2 and "emb" not in n], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-2,
             "betas": (0.8, 0.95), "eps": 1e-6},
            {"params": model.emb.parameters(), "weight_decay": 0.5, "lr": 5e-3}]


@pytest.mark.parametrize("cls", ["AdamW", "Adam"])
@pytest.mark.parametrize("level", LEVELS)
def test_every_step_is_torchs_step_from_the_same_state(level, cls):
    """At every step of a run with param groups and OneCycleLR (lr and betas change every step),
    fp8amp's update of each param equals torch's from the same p, m, v, step count and grad,
    within the rounding of the stored formats (module docstring): weight decay (decoupled, or L2
    for Adam) on masters, norms, biases and the embedding, bias correction from the count."""
    model = _Embedded()
    model, optimizer = fp8amp.initialize(model, getattr(torch.optim, cls)(_groups(model), lr=3e-3), level,
                                         policy="all")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, [3e-3, 1e-2, 5e-3], total_steps=60)
    for x, y in _batches(60):
        nn.functional.mse_loss(model(x), y).backward()
        expected = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                twin = nn.Parameter(_real(p.detach()).clone())
                twin.grad = _real(p.grad).clone()
                reference = getattr(torch.optim, cls)(
                    [twin], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                    weight_decay=group["weight_decay"], foreach=False)
                state = optimizer.state[p]
                if state:
                    reference.state[twin] = {"step": state["step"].clone(),
                                             **{key: _moment(state, key).clone() for key in ("exp_avg", "exp_avg_sq")}}
                reference.step()
                expected.append((p, _real(p.detach()), twin.detach(), reference.state[twin]))
        optimizer.step()
        for p, before, want, want_state in expected:
            got, state = _real(p.detach()), optimizer.state[p]
            cancellation = 2.0 ** -20 * (want - before).abs()
            if isinstance(p, ScaledTensor):
                tolerance = _half_fp16_unit(want, p.scale_inv) * 1.001 + cancellation
            else:
                tolerance = 2.0 ** -20 * want.abs().clamp_min(1e-3) + cancellation
            assert bool(((got - want).abs() <= tolerance).all())
            assert float(state["step"]) == float(want_state["step"])
            for key, unit in (("exp_avg", 2.0 ** -4), ("exp_avg_sq", 2.0 ** -11)):
                error = (_moment(state, key) - want_state[key]).abs().max() / want_state[key].abs().max()
                assert float(error) <= (0.0 if level == "O1" else unit)
        optimizer.zero_grad()
        scheduler.step()


@pytest.mark.parametrize("level", LEVELS)
def test_a_long_run_tracks_torch_and_counts_each_params_steps(level):
    """300 steps with a cosine schedule, one layer frozen for 100 of them: the loss tracks plain
    torch's AdamW on the unconverted model within a few %, and each param's step count is torch's
    (a frozen layer's grads are None: it does not step, as in torch)."""
    batches = _batches(300)
    plain = _model()
    model = _model()
    frozen = lambda i: [(m[3], 100 <= i < 200)]  # noqa: E731
    runs = []
    for m, converted in ((plain, False), (model, True)):
        optimizer = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
        if converted:
            m, optimizer = fp8amp.initialize(m, optimizer, level, policy="all")
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 300)
        runs.append((m, optimizer, _train(m, optimizer, batches, scheduler, frozen)))
    (plain, reference, want), (model, optimizer, got) = runs
    for a, b in zip((want[:20], want[140:160], want[-30:]), (got[:20], got[140:160], got[-30:])):
        assert abs(statistics.mean(b) / statistics.mean(a) - 1) < 0.06
    assert [float(optimizer.state[p]["step"]) for p in model.parameters()] == \
        [float(reference.state[p]["step"]) for p in plain.parameters()] == [300.0] * 4 + [200.0] * 2 + [300.0] * 2


def _built(level, rounding):
    model = nn.ModuleDict({"body": _model(), "head": nn.Linear(16, 16)})
    optimizer = torch.optim.AdamW(model["body"].parameters(), lr=3e-3, weight_decay=0.1)
    return fp8amp.initialize(model, optimizer, level, policy="all", master_rounding=rounding)


def _resumable_run(model, optimizer, batches, start=0):
    """A run with warm-up and linear decay (set by hand: torch's schedulers take no group added
    later) whose head is added as a param group at step 30 (another lr, betas, no decay) and whose
    middle layer is frozen for steps 40 to 79."""
    for i, (x, y) in enumerate(batches, start):
        optimizer.param_groups[0]["lr"] = 3e-3 * min(1, (i + 1) / 10) * (1 - i / 120)
        if i == 30:
            optimizer.add_param_group({"params": model["head"].parameters(), "lr": 1e-2, "weight_decay": 0.0,
                                       "betas": (0.5, 0.9)})
        model["body"][3].requires_grad_(not 40 <= i < 80)
        out = model["body"](x)
        nn.functional.mse_loss(model["head"](out) if i >= 30 else out, y).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("k", [20, 60])
def test_a_resume_at_any_step_is_the_uninterrupted_run_bit_for_bit(level, rounding, k):
    """State dicts of the model and the optimizer saved at step k (before the group
    is added, or with it, mid-freeze: params with other step counts) and loaded into a fresh
    ``initialize``: the next steps give the uninterrupted run's weights, moments and counts bit for
    bit."""
    batches = _batches(120)
    whole = _built(level, rounding)
    _resumable_run(*whole, batches)
    first = _built(level, rounding)
    _resumable_run(*first, batches[:k])
    buffer = io.BytesIO()
    torch.save([part.state_dict() for part in first], buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _built(level, rounding)
    if k > 30:  # the optimizer that saved had the head's group
        resumed[1].add_param_group({"params": resumed[0]["head"].parameters(), "lr": 1e-2, "weight_decay": 0.0,
                                    "betas": (0.5, 0.9)})
    for part, state in zip(resumed, saved):
        part.load_state_dict(state)
    _resumable_run(*resumed, batches[k:], start=k)
    for p, q in zip(whole[0].parameters(), resumed[0].parameters()):
        assert torch.equal(_real(p.detach()), _real(q.detach()))
        a, b = whole[1].state[p], resumed[1].state[q]
        assert float(a["step"]) == float(b["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_moment(a, key), _moment(b, key))


@pytest.mark.parametrize("count", ["int", "float", "int64 tensor", "float64 tensor"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_step_count_set_by_hand_steps_as_torch(level, count):
    """A reset of the step count by hand (a warm restart: ``state["step"] = torch.tensor(0)``,
    which torch's AdamW steps, or a Python number) failed at the next step: with an
    AttributeError ('int' object has no attribute '_version'), or inside the fused op
    ("fp8amp.adam_step: step_counts[1] has unsupported dtype Long"). The count is now taken as
    float32, as load_state_dict takes a saved one, and the run goes on as torch's with a float32
    tensor count from there."""
    batches = _batches(40)
    plain, model = _model(), _model()
    reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
                                         level, policy="all")
    value = {"int": 0, "float": 0.0, "int64 tensor": torch.tensor(0),
             "float64 tensor": torch.tensor(0.0, dtype=torch.float64)}[count]
    losses = []
    for m, opt, reset in ((plain, reference, torch.tensor(0.0)), (model, optimizer, value)):
        _train(m, opt, batches[:20])
        for state in opt.state.values():
            state["step"] = reset.clone() if isinstance(reset, torch.Tensor) else reset
        losses.append(statistics.mean(_train(m, opt, batches[20:], start=20)))
    for p, q in zip(model.parameters(), plain.parameters()):
        state = optimizer.state[p]
        assert (state["step"].dtype, float(state["step"])) == (torch.float32, 20.0)
        assert torch.equal(state["step"], reference.state[q]["step"])
    assert abs(losses[1] / losses[0] - 1) < 0.06


@pytest.mark.parametrize("level", LEVELS)
def test_a_torch_state_dict_with_tensor_lr_and_betas_loads_and_steps_as_torch(level):
    """torch's AdamW takes ``lr`` and ``betas`` as tensors (for compiled or capturable steps) and
    saves them so: loading such a state dict (a run moved onto fp8amp) was refused with
    "fp8amp.optim.AdamW: lr must be a Python float, got Tensor", naming nothing about the state dict.
    Its groups now load with their values as Python floats (``initial_lr`` too, from which a
    scheduler built afterwards starts), and the run goes on as torch's."""
    batches = _batches(60)
    plain = _model()
    reference = torch.optim.AdamW(plain.parameters(), lr=torch.tensor(3e-3), weight_decay=0.1,
                                  betas=(torch.tensor(0.9), torch.tensor(0.99)))
    torch.optim.lr_scheduler.LinearLR(reference, 1.0, 0.1, total_iters=60)  # (sets initial_lr, a tensor)
    _train(plain, reference, batches[:20])
    saved = copy.deepcopy(reference.state_dict())  # (torch's holds the live tensors)
    model = _model()
    model.load_state_dict(plain.state_dict())
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), level, policy="all")
    optimizer.load_state_dict(saved)
    group, saved_group = optimizer.param_groups[0], saved["param_groups"][0]
    assert (group["lr"], group["initial_lr"], group["betas"]) == (
        float(saved_group["lr"]), float(saved_group["initial_lr"]), tuple(map(float, saved_group["betas"])))
    losses = []
    for m, opt in ((plain, reference), (model, optimizer)):
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 40)  # (from initial_lr)
        losses.append(statistics.mean(_train(m, opt, batches[20:], scheduler, start=20)))
    assert abs(losses[1] / losses[0] - 1) < 0.06
    assert optimizer.param_groups[0]["lr"] == pytest.approx(float(reference.param_groups[0]["lr"]))
    assert {float(state["step"]) for state in optimizer.state.values()} == {60.0}


@pytest.mark.parametrize("level", LEVELS)
def test_a_state_dict_loaded_in_memory_shares_no_step_count_with_the_optimizer_that_saved_it(level):
    """A state dict handed over in memory (a run forked into two, each continuing from step 20;
    a run moved from torch's AdamW compared with the torch run going on): the loaded optimizer's
    step counts were the saved dict's tensors, which are the saving optimizer's live counts, so
    each step of either advanced both (moments are copied at load): the fork's bias corrections
    came from 100 steps after 60. Each count is now the loaded optimizer's own; both runs equal
    the one that was not forked, bit for bit."""
    batches = _batches(60)
    runs = []
    for _ in range(3):
        model = _model()
        runs.append(fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), level, policy="all"))
    (whole, whole_opt), (first, first_opt), (fork, fork_opt) = runs
    _train(whole, whole_opt, batches)
    _train(first, first_opt, batches[:20])
    fork.load_state_dict(first.state_dict())
    fork_opt.load_state_dict(first_opt.state_dict())
    for model, optimizer in ((first, first_opt), (fork, fork_opt)):
        _train(model, optimizer, batches[20:], start=20)
        assert [float(optimizer.state[p]["step"]) for p in model.parameters()] == [60.0] * 8
        for p, q in zip(whole.parameters(), model.parameters()):
            assert torch.equal(_real(p.detach()), _real(q.detach()))
