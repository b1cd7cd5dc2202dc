"""Rank-consistent delayed scaling (fp8amp.amax_sync) when something goes wrong: 2 and 3 processes on
CPU with gloo. An inf in one rank's output gradient (O2 under DDP with the FP8 hook) skips the step
on every rank alike; an optimizer step that raises after its pre-hook issued the amax reduction (O2
under DDP) leaves no stale reduction, bit for bit as a run that took no step there; bad input (a
group the rank is not in, wrong types, two groups, models or gradients that differ between ranks)
is a clear error on every rank, none left hanging. Each world size spawns its processes once (a
module fixture) and runs every scenario there. The agreement of the ranks in training is in
test_amax_sync.py; the model, the batches and the spawn in amax_sync_ranks.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8amp
from amax_sync_ranks import LR, STEPS, WORLDS, batch, loss_of, make_model, scaling_buffers, spawn
from fp8amp import amax_sync
from fp8amp import distributed as fd


def non_finite_gradient_run(rank: int, world: int) -> dict:
    """O2 under DDP with the FP8 hook; at step 1 the last rank's loss weights hold an inf, so its
    output gradients (amax inf) and weight gradients are non-finite. The state after each step:
    parameters, optimizer states and scaling buffers."""
    model = make_model()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), "O2", policy="all")
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(fd.FP8CommState(), fd.fp8_allreduce_hook)
    after = []
    for step in range(STEPS):
        x, weight = batch(step, rank)
        if step == 1 and rank == world - 1:
            weight[3, 5] = float("inf")
        loss_of(ddp, x, weight).backward()
        optimizer.step()
        optimizer.zero_grad()
        states = {(i, k): v.dequantize() if isinstance(v, fp8amp.ScaledTensor) else v.clone()
                  for i, st in enumerate(optimizer.state.values()) for k, v in st.items() if torch.is_tensor(v)}
        after.append(dict(params={n: p.dequantize() if isinstance(p, fp8amp.ScaledTensor) else p.detach().clone()
                                  for n, p in model.named_parameters()},
                          optimizer=states, buffers=scaling_buffers(model)))
    return after


class StepFailure(RuntimeError):
    """What the failing optimizer step raises."""


def failed_step_run(rank: int, failing: bool, manual_update: bool) -> list[dict]:
    """O2 under DDP with initialize's optimizer hooks (the amax reduction issued before each step,
    applied after it), STEPS + 1 steps. At step 1 the optimizer step raises after the reduction
    was issued (``failing``) or is not taken (the reference); the loop drops that step's gradients
    either way. With ``manual_update`` step 2 takes no optimizer step either and calls
    update_scaling by hand (a loop that skips a step). The scaling buffers and parameters after
    each step."""
    model = make_model()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), "O2", policy="all")
    armed = [False]

    def fail_once(*_):
        if armed[0]:
            armed[0] = False
            raise StepFailure("the step failed")

    optimizer.register_step_pre_hook(fail_once)  # after initialize's, which has issued the reduction
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    after = []
    for step in range(STEPS + 1):
        loss_of(ddp, *batch(step, rank)).backward()
        if step == 1 and failing:
            armed[0] = True
            try:
                optimizer.step()
            except StepFailure:
                pass
            assert not armed[0]
        elif step == 2 and manual_update:
            fp8amp.update_scaling(model)
        elif step != 1:
            optimizer.step()
        optimizer.zero_grad()
        after.append(dict(buffers=scaling_buffers(model),
                          params={n: p.dequantize() if isinstance(p, fp8amp.ScaledTensor) else p.detach().clone()
                                  for n, p in model.named_parameters()}))
    return after


def errors_run(rank: int, world: int) -> dict:
    """Bad input, each on every rank; the messages (each raised on every rank, so none hangs)."""
    errors = {}

    def catch(name, call):
        try:
            call()
        except (TypeError, ValueError) as e:
            errors[name] = (type(e).__name__, str(e))

    model = fp8amp.convert(make_model(), policy="all")
    loss_of(model, *batch(0, rank)).backward()
    only_rank0 = dist.new_group([0])  # every rank must call new_group
    catch("not_a_member", lambda: amax_sync.set_amax_reduction(model, only_rank0))
    catch("comm_not_a_member", lambda: fd.FP8CommState(only_rank0))
    amax_sync.set_amax_reduction(model)  # rank 0, a member, had set it: back to the default group
    catch("group_type", lambda: amax_sync.set_amax_reduction(model, "world"))
    catch("enabled_type", lambda: amax_sync.set_amax_reduction(model, enabled=1))
    everyone = dist.new_group(list(range(world)))
    amax_sync.set_amax_reduction(model[0], everyone)  # layer 2 keeps the default group
    catch("two_groups", lambda: fp8amp.update_scaling(model))
    amax_sync.set_amax_reduction(model)
    # A model split over pipeline stages, reduced over the world group: the last rank has a layer more.
    layers = [nn.Linear(32, 32) for _ in range(2 + (rank == world - 1))]
    stage = fp8amp.convert(nn.Sequential(*layers), policy="all")
    catch("different_models", lambda: fp8amp.update_scaling(stage))
    # all_reduce_grads: the last rank's first layer has more outputs; then a gradient missing on rank 0.
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(7, 13 + (rank == world - 1)), nn.GELU(), nn.Linear(13 + (rank == world - 1), 5))
    other(torch.ones(2, 7)).sum().backward()
    catch("grad_shapes", lambda: fd.all_reduce_grads(other))
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5))
    other(torch.ones(2, 7)).sum().backward()
    if rank == 0:
        other[2].bias.grad = None
    catch("grad_missing", lambda: fd.all_reduce_grads(other))
    # The same, agreed: it reduces (and the ranks hold the mean).
    other[2].bias.grad = torch.full((5,), float(rank))
    fd.all_reduce_grads(other)
    errors["agreed_mean"] = other[2].bias.grad.clone()
    return errors


def worker(rank: int, world: int) -> dict:
    """Every scenario of this file on one rank (amax_sync_ranks.spawn runs it in each process)."""
    res = {}
    res["non_finite"] = non_finite_gradient_run(rank, world)
    res["failed_step"] = {(failing, manual): failed_step_run(rank, failing, manual)
                          for failing in (True, False) for manual in (False, True)}
    res["errors"] = errors_run(rank, world)
    return res


@pytest.fixture(scope="module", params=WORLDS)
def run(request):
    return spawn(worker, request.param)


def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(run):
    """An inf in one rank's output gradient: the FP8 all-reduce makes every rank's gradients NaN,
    fp8amp's optimizer skips the step on every rank (parameters and its states as before), the
    inf amax resets that tensor's warm-up on every rank alike (scales kept, finite), and the next
    step trains, the ranks still identical."""
    world, res = run
    for r in res:
        before, skipped, next_step = r["non_finite"]
        for kind in ("params", "optimizer"):
            for key, value in before[kind].items():
                assert torch.equal(skipped[kind][key], value), (kind, key)
                assert torch.isfinite(next_step[kind][key].float()).all(), (kind, key)  # (torch 2.11: no FP8 isfinite)
        assert any(not torch.equal(next_step["params"][k], v) for k, v in before["params"].items())  # it trains again
        for name, value in skipped["buffers"].items():
            assert torch.isfinite(value).all(), name
        assert skipped["buffers"]["2.grad_output_scaling.counter"].tolist() == [0]  # reset by the inf amax
        assert before["buffers"]["2.grad_output_scaling.counter"].tolist() == [1]
    for step in range(STEPS):
        for kind in ("params", "optimizer", "buffers"):
            for key, value in res[0]["non_finite"][step][kind].items():
                for r in res[1:]:
                    assert torch.equal(r["non_finite"][step][kind][key], value), (step, kind, key)


def test_bad_input_is_a_clear_error_on_every_rank(run):
    world, res = run
    for rank, r in enumerate(res):
        errors = r["errors"]
        if rank != 0:
            assert errors["not_a_member"][0] == "ValueError" and "not a member of process_group" in errors["not_a_member"][1]
            assert errors["comm_not_a_member"][0] == "ValueError" and "not a member" in errors["comm_not_a_member"][1]
        else:  # rank 0 is a member: no error
            assert "not_a_member" not in errors and "comm_not_a_member" not in errors
        assert errors["group_type"] == ("TypeError", "fp8amp.amax_sync.set_amax_reduction: process_group must be a "
                                                     "torch.distributed.ProcessGroup or None, got str")
        assert errors["enabled_type"][0] == "TypeError" and "enabled must be a bool" in errors["enabled_type"][1]
        assert errors["two_groups"][0] == "ValueError" and "different process groups" in errors["two_groups"][1]
        assert f"a {world}-rank group" in errors["two_groups"][1] and "default group" in errors["two_groups"][1]
        message = errors["different_models"][1]
        assert errors["different_models"][0] == "ValueError" and "from 4 to 6 scaling states" in message, message
        assert "set_amax_reduction(model, process_group)" in message
        for key in ("grad_shapes", "grad_missing"):
            assert errors[key][0] == "ValueError" and "gradients of different shapes" in errors[key][1], key
        mean = sum(range(world)) / world  # within E4M3's rounding of the mean
        assert torch.allclose(errors["agreed_mean"], torch.full((5,), mean), rtol=2.0 ** -4)


@pytest.mark.parametrize("manual_update", [False, True], ids=["next_step", "manual_update"])
def test_a_step_that_raises_leaves_no_stale_reduction(run, manual_update):
    """The optimizer step raises after its pre-hook issued the amax reduction: the reduction is
    never applied to another step's amaxes. The run goes on exactly as one that took no step
    there (bit for bit: scaling buffers and parameters after every step), whether the next
    reduction is the next step's (its pre-hook discards the stale one) or an update_scaling by
    hand (which would otherwise have applied step 1's maxima over step 2's amaxes); and all ranks
    agree after every step but the failed one (whose amaxes stay unreduced, as without a step)."""
    world, res = run
    for r in res:
        failed, reference = r["failed_step"][(True, manual_update)], r["failed_step"][(False, manual_update)]
        for step in range(STEPS + 1):
            for kind in ("buffers", "params"):
                for name, value in reference[step][kind].items():
                    assert torch.equal(failed[step][kind][name], value), (step, kind, name)
    for step in (0, 2, 3):
        for kind in ("buffers", "params"):
            for name, value in res[0]["failed_step"][(True, manual_update)][step][kind].items():
                for r in res[1:]:
                    assert torch.equal(r["failed_step"][(True, manual_update)][step][kind][name], value), (step, name)
    # The runs trained and their amaxes moved: the comparison could fail.
    first, last = (res[0]["failed_step"][(True, manual_update)][s] for s in (0, STEPS))
    assert not torch.equal(first["buffers"]["0.input_scaling.amax_history"], last["buffers"]["0.input_scaling.amax_history"])
