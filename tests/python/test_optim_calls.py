"""fp8amp.optim's step machinery (fp8amp.optim_calls): the op calls' lists kept from step to step
against lists rebuilt every step, bit for bit through every change they depend on; the version
counters a step bumps; a wrapped param stepped as the tensor it wraps; and the step compiled by
Dynamo and by Inductor against the eager one."""

from __future__ import annotations

import copy

import pytest
import torch

import fp8amp
from test_optim import E4M3, bits, groups, loss_of, same


def o2_twins():
    """Two identical O2 models with their fp8amp optimizers: the middle Linear an Fp8Linear (an FP16
    master with an E4M3 copy), the others plain."""
    twins = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 4))
        twins.append(fp8amp.initialize(model, torch.optim.AdamW(groups(model)), "O2", policy="all"))
    assert isinstance(twins[0][0][2].weight, fp8amp.MasterWeight)
    return twins


def all_bits(model, opt):
    """A copy of every stored bit: params (a master's codes, scale and E4M3 copy), then every state
    tensor."""
    out = []
    for p in [p for g in opt.param_groups for p in g["params"]]:
        if isinstance(p, fp8amp.MasterWeight):
            out += [bits(p.codes), bits(p.scale_inv)] + [bits(t) for t in p.fp8_copy]
        else:
            out.append(bits(p))
        out += [bits(v) for v in opt.state[p].values()]
    return [b.clone() for b in out]


def test_kept_call_lists_follow_every_change_of_params_states_and_groups():
    """The optimizer that keeps its calls' lists across steps against one that rebuilds them every
    step, bit for bit, through every change the lists depend on: hyperparameters, a cohort split
    (a param without grad), a new param group (of a bfloat16 param, stepped through float32), a
    state tensor replaced, a master's E4M3 copy dropped and attached anew, load_state_dict, a
    param's and a state's storage swapped under the same tensor object."""
    (kept_model, kept), (fresh_model, fresh) = twins = o2_twins()
    saved = {}

    def step(n, change=lambda model, opt: None):
        for model, opt in twins:
            change(model, opt)
            loss_of(model, n).backward()
            if opt is fresh:
                opt._call_lists.clear()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert same(all_bits(*twins[0]), all_bits(*twins[1])), f"step {n}"
        assert kept._call_lists  # kept for the next step

    step(0)
    step(1, lambda model, opt: saved.setdefault(id(opt), copy.deepcopy(opt.state_dict())))
    step(2, lambda model, opt: opt.param_groups[0].update(lr=1e-2, betas=(0.8, 0.99)))
    before = all_bits(*twins[0])
    biases = [bits(p).clone() for p in kept.param_groups[1]["params"]]
    step(3, lambda model, opt: opt.param_groups[1].update(lr=0.0))  # the biases must not move
    assert not same(before, all_bits(*twins[0]))
    assert same(biases, [bits(p) for p in kept.param_groups[1]["params"]])
    step(4, lambda model, opt: model[4].weight.requires_grad_(False))  # two cohorts from now on
    step(5, lambda model, opt: model[4].weight.requires_grad_(True))

    def add_group(model, opt):
        torch.manual_seed(7)
        extra = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
        model.register_parameter("extra", extra)
        model.register_forward_hook(lambda m, args, out: out + m.extra.float())
        opt.add_param_group(dict(params=[extra], lr=1e-2))
    step(6, add_group)

    def replace_state(model, opt):
        state = opt.state[model[2].weight]
        state["exp_avg_sq"] = state["exp_avg_sq"].clone()
    step(7, replace_state)
    step(8, lambda model, opt: model[2].weight.drop_fp8_copy().attach_fp8_copy())
    # the copy the forward reads now is the new one: the step must have rewritten it
    master = kept_model[2].weight
    assert torch.equal(bits(master.fp8_copy[0]), bits(fp8amp.ScaledTensor.from_tensor(master.dequantize(), E4M3).codes))

    def load(model, opt):
        state = saved[id(opt)]
        opt.load_state_dict({**state, "param_groups": state["param_groups"] + [opt.state_dict()["param_groups"][2]]})
    step(9, load)
    step(10)

    def swap_storage(model, opt):  # the same tensor objects, other storage: the op's kept plan is stale
        model[0].weight.data = model[0].weight.data.clone()
        opt.state[model[4].weight]["exp_avg"].data = opt.state[model[4].weight]["exp_avg"].data.clone()
    step(11, swap_storage)
    step(12)


def test_a_step_bumps_the_version_counter_of_every_param():
    """The op rewrites the params (a master: its codes) in place, unseen by autograd: the step says
    so, as torch's optimizers do, so that a graph that saved a param before the step fails loudly
    instead of using changed values."""
    (model, opt), _ = o2_twins()
    params = list(model.parameters())
    assert any(isinstance(p, fp8amp.ScaledTensor) for p in params)
    loss = loss_of(model, 0)
    loss.backward(retain_graph=True)
    before = [p._version for p in params]
    opt.step()
    assert all(p._version > v for p, v in zip(params, before))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_wrapped_param_steps_as_the_tensor_it_wraps():
    """A cohort holding a tensor subclass (FSDP2's FP8 all-gather weight wraps the weight it is)
    steps through the op, whose dispatch hands the kernel the wrapped tensor, not through a kept
    plan: the same bits as the plain weights, step after step."""
    from fp8amp.fsdp import Fp8AllGatherWeight, enable_fp8_all_gather

    twins = []
    for wrap in (True, False):
        torch.manual_seed(0)
        model = fp8amp.convert(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                                   torch.nn.Tanh(), torch.nn.Linear(32, 4)), policy="all")
        if wrap:
            assert enable_fp8_all_gather(model) == 1  # the middle Linear (FP8 takes no 8 or 4 features)
        twins.append((model, fp8amp.optim.AdamW(model.parameters(), lr=1e-2, state_dtypes="O2")))
    assert isinstance(twins[0][0][2].weight, Fp8AllGatherWeight)
    before = twins[1][0][2].weight.detach().clone()
    for n in range(3):
        for model, opt in twins:
            loss_of(model, n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        (wrapped, _), (plain, _) = twins
        for a, b in zip(wrapped.parameters(), plain.parameters()):
            a = a._tensor if isinstance(a, Fp8AllGatherWeight) else a
            assert torch.equal(a.detach(), b.detach()), f"step {n}"
    assert not torch.equal(twins[1][0][2].weight.detach(), before)


def test_a_compiled_step_equals_the_eager_one():
    """``torch.compile(optimizer.step)``: Dynamo traces the step (the op, which it sees, where
    eager steps use a kept plan); the same bits as eager, step after step."""
    twins = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        twins.append((model, fp8amp.optim.AdamW(model.parameters(), lr=1e-2, state_dtypes="O2")))
    (eager_model, eager), (compiled_model, compiled) = twins
    torch._dynamo.reset()
    compiled_step = torch.compile(compiled.step, backend="eager")
    for n in range(3):
        for model, step in ((eager_model, eager.step), (compiled_model, compiled_step)):
            loss_of(model, n).backward()
            step()
            model.zero_grad(set_to_none=True)
        assert same(all_bits(*twins[0]), all_bits(*twins[1])), f"step {n}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("converted", [False, True], ids=["plain", "initialized-O2"])
def test_an_inductor_compiled_step_equals_the_eager_one(converted, device):
    """``torch.compile(optimizer.step)`` through Inductor, whose functionalization of the op's
    written lists fails on a None entry (a master beside a plain param, the params' step counts):
    the traced step splits its call so that no written list holds None. The same bits as eager
    over three steps, with a param without a grad at one of them (its count lags), every param's
    step count that of torch's optimizers, and a step with a NaN grad skipped whole."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    twins = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                    torch.nn.Linear(32, 16)).to(device)
        optimizer = fp8amp.optim.AdamW(model.parameters(), lr=1e-2, state_dtypes="O2")
        if converted:
            model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2",
                                                 policy="all")
        twins.append((model, optimizer))
    (eager_model, eager), (compiled_model, compiled) = twins
    if converted:
        assert any(isinstance(p, fp8amp.MasterWeight) for p in compiled.param_groups[0]["params"])
    torch._dynamo.reset()
    compiled_step = torch.compile(compiled.step)
    for n in range(4):
        if n == 2:  # a NaN in one plain param's grad skips every param, masters too (one call
            # in eager, split calls sharing a skip flag when traced)
            before = all_bits(*twins[1])
            compiled_model(torch.randn(16, 16, device=device)).float().pow(2).mean().backward()
            compiled_model[1].weight.grad[3] = float("nan")
            compiled_step()
            compiled_model.zero_grad(set_to_none=True)
            assert same(all_bits(*twins[1]), before)
            continue
        for model, step in ((eager_model, eager.step), (compiled_model, compiled_step)):
            torch.manual_seed(n)
            model(torch.randn(16, 16, device=device)).float().pow(2).mean().backward()
            if n == 3:
                model[1].bias.grad = None
            step()
            model.zero_grad(set_to_none=True)
        assert same(all_bits(*twins[0]), all_bits(*twins[1])), f"step {n}"
    counts = [compiled.state[p]["step"].item() for p in compiled.param_groups[0]["params"]]
    assert counts == [2.0 if p is compiled_model[1].bias else 3.0 for p in compiled.param_groups[0]["params"]]
