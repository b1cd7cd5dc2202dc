"""Rank-consistent delayed scaling: the amaxes of every delayed-scaled tensor MAX-reduced over the
data-parallel group once per step, before the scaling update (docs/distributed.md#rank-consistent-scaling).

:func:`fp8amp.update_scaling` calls :func:`reduce_amaxes` on the input and output-gradient states
of a model's Fp8Linears before it updates them: this step's amaxes (column 0 of every amax
history) are flattened into one float32 tensor, which one asynchronous ``all_reduce(MAX)``
reduces over the group, and the maxima are copied back. Every rank then updates its scales from
the same windows, so all ranks hold bit-identical scaling buffers after every step (by induction:
the other columns, the scales and the counters were identical before), and a rank whose batch
has the largest activations or gradients sets the scale for all. A NaN amax is reduced as +inf
(a MAX reduction need not propagate NaN): every rank then resets that tensor's warm-up together.
:func:`start_amax_reduction` issues the collective early (the optimizer hooks of
:func:`fp8amp.initialize` do, before the step) and :func:`reduce_amaxes` then only waits for it.

A pending reduction is never applied to other amaxes than those it reduced, nor twice: one that
the optimizer's pre-hook issued belongs to that step (``step_bound``), and only the update after
the step (:func:`end_step`, then :func:`reduce_amaxes`) applies it. If the step raises, the
post-hook never runs; the next issue or reduction then waits for the stale collective, discards
it, and reduces the amaxes as they are by then (the failed step's and any recorded since). Every
rank issues the same collectives either way (one per issue or per reduction without a usable
pending one), so a step that raised on some ranks only does not misalign them.

Which group: each :class:`~fp8amp.ScalingState` carries ``amax_reduction`` (on by default) and
``amax_reduction_group`` (``None``: the default group, when one is initialized and has more than
one rank); :func:`set_amax_reduction` sets both on all the states of a model.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook

from .formats import type_name
from .linear import Fp8Linear
from .scaling import ScalingState, max_over_ranks

__all__ = ["set_amax_reduction", "start_amax_reduction", "end_step", "reduce_amaxes", "delayed_states",
           "ranks_agree", "AmaxReductionJoin"]

def set_amax_reduction(model: nn.Module, process_group: Optional[dist.ProcessGroup] = None, *,
                       enabled: bool = True) -> int:
    """Sets how :func:`fp8amp.update_scaling` reduces the amaxes of ``model``'s scaling states:
    over ``process_group`` (``None``: the default group; an explicit group is used even with one
    rank), or not at all (``enabled=False``: each rank's scales follow its own amaxes). Every
    rank of the group must make the same call. Returns the number of states set.

    Raises:
        TypeError: ``model`` is not an nn.Module, ``process_group`` not a ProcessGroup or None,
            ``enabled`` not a bool.
        ValueError: this rank is not a member of ``process_group``.
    """
    where = "fp8amp.amax_sync.set_amax_reduction"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(enabled, bool):
        raise TypeError(f"{where}: enabled must be a bool, got {type_name(enabled)}")
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{where}: this rank ({dist.get_rank()}) is not a member of process_group (dist.new_group "
                         "returned GroupMember.NON_GROUP_MEMBER): pass the data-parallel group this rank belongs to")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{where}: process_group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(process_group).__name__}")
    states = [m for m in model.modules() if isinstance(m, ScalingState)]
    for state in states:
        state.amax_reduction = enabled
        state.amax_reduction_group = process_group
    return len(states)


def _group_of(states: list[ScalingState]) -> tuple[Optional[dist.ProcessGroup], bool]:
    """(the one group of the states that reduce, whether it was named explicitly)."""
    groups = {id(st.amax_reduction_group): st.amax_reduction_group for st in states}
    if len(groups) > 1:
        names = ", ".join("the default group" if g is None else f"a {g.size()}-rank group"
                          for g in groups.values())
        raise ValueError(f"fp8amp.update_scaling: the model's scaling states reduce their amaxes over different "
                         f"process groups ({names}): one step reduces over one group; call "
                         "fp8amp.amax_sync.set_amax_reduction(model, process_group) once for the whole model")
    (group,) = groups.values()
    return group, group is not None


def ranks_agree(layout: tuple, group, device: torch.device) -> tuple[int, int] | None:
    """Whether every rank of ``group`` passes the same ``layout`` (a tuple of ints and floats: what
    each rank is about to reduce): ``None`` if so, else ``(least, most)`` of the ranks' lengths.
    One all-reduce of 4 int64 (a CRC of the layout and its length, MAX of them and of their
    negatives) and one host read: for a first call, not for every step."""
    fingerprint = [len(layout), zlib.crc32(repr(layout).encode())]
    both = torch.tensor(fingerprint + [-v for v in fingerprint], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    most, least = both[:2].tolist(), [-v for v in both[2:].tolist()]
    return None if most == least else (least[0], most[0])


def _check_ranks_agree(group, device: torch.device, states: list[ScalingState]) -> None:
    """The first time these states are reduced over ``group``: all ranks must hold the same
    sequence of states (count, shapes, formats, layer names), or the flat amax vectors would not line
    up, or would line up different layers (a model split over pipeline stages reduced over the world
    group). The first state keeps the proof (the ids of the states and the group), so a rank that
    builds a new model checks again; the check is per rank, so all ranks of a group must build their
    models alike."""
    stamp = (id(group), dist.get_world_size(group), tuple(id(st) for st in states))
    if getattr(states[0], "_amax_reduction_agreed", None) == stamp:
        return
    layout = tuple((st.num_tensors, st.recipe.history_len, st.fmax, st.layer_name) for st in states)
    disagreement = ranks_agree(layout, group, device)
    if disagreement is not None:
        least, most = disagreement
        counts = (f"{least} scaling states on each rank, of other shapes, formats or layer names" if least == most
                  else f"from {least} to {most} scaling states")
        raise ValueError(
            f"fp8amp.update_scaling: the ranks of the amax-reduction group hold different delayed-scaled tensors "
            f"({counts}): every rank of the group must have the same model (is the group the data-parallel one? "
            "with pipeline parallelism pass it to fp8amp.amax_sync.set_amax_reduction(model, process_group)), or "
            "turn the reduction off (enabled=False)")
    states[0]._amax_reduction_agreed = stamp


def delayed_states(model: nn.Module) -> list[ScalingState]:
    """The delayed-scaling states of ``model``'s Fp8Linears (inputs, output gradients), in module
    order: what :func:`fp8amp.update_scaling` reduces and updates. Layers of a tiled recipe
    (rowwise, blockwise: current scaling per tile) have none in use."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8amp.amax_sync.delayed_states: model must be an nn.Module, got {type(model).__name__}")
    # Walked by hand, once a step in the optimizer hooks: model.modules() builds every module's
    # dotted name (and descends into each Fp8Linear's own states), several times this walk's host time.
    states, seen, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        # (None: a child slot set to None, skipped here rather than by a generator a module.) A
        # module reached twice (shared) counts once, where modules() first meets it.
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        if isinstance(m, Fp8Linear):
            if not m.recipe.tiled:
                children = m._modules  # (not m.input_scaling: Module.__getattr__ is slow)
                states += (children["input_scaling"], children["grad_output_scaling"])
            continue
        stack.extend(reversed(m._modules.values()))
    return states


def _reducing(states: Iterable[ScalingState]):
    """(the states that reduce, their group), or None when there is nothing to reduce."""
    if not dist.is_available() or not dist.is_initialized():  # first: no work a step on one process
        return None
    states = [st for st in {id(st): st for st in states}.values() if st.amax_reduction]
    if not states:
        return None
    group, explicit = _group_of(states)
    if not explicit and dist.get_world_size() == 1:
        return None
    return states, group


class _Pending:
    """The collectives issued for one set of states: (work, flat maxima, history columns) per
    device, and whether they belong to an optimizer step that has not ended yet."""

    def __init__(self, ids: tuple, works: list, step_bound: bool) -> None:
        self.ids, self.works, self.step_bound = ids, works, step_bound

    def discard(self) -> None:
        for work, _, _ in self.works:
            work.wait()  # finished (on CUDA: the stream ordered after it), never applied


def _by_device(states: list[ScalingState]) -> dict[torch.device, list[ScalingState]]:
    """The states grouped by device, in the order of the collectives (one per device)."""
    by_device: dict[torch.device, list[ScalingState]] = {}
    for st in states:
        by_device.setdefault(st.amax_history.device, []).append(st)
    return by_device


def _issue(states: list[ScalingState], group, step_bound: bool = False) -> _Pending:
    """Issues one asynchronous all_reduce(MAX) per device."""
    works = []
    for device, device_states in _by_device(states).items():
        _check_ranks_agree(group, device, device_states)
        columns = [st.amax_history[:, 0] for st in device_states]
        flat = torch.cat(columns)
        works.append((max_over_ranks(flat, group, async_op=True), flat, columns))
    return _Pending(tuple(id(st) for st in states), works, step_bound)


def _take_pending(states: list[ScalingState]) -> "_Pending | None":
    """The reduction pending for ``states`` (kept on the first), removed from it."""
    return states[0].__dict__.pop("_pending_amax_reduction", None)


def _checked(states: Iterable[ScalingState], where: str) -> list[ScalingState]:
    """``states`` as a list, refused unless every element is a ScalingState (the public functions;
    fp8amp's optimizer hooks pass lists made by :func:`delayed_states` to the unchecked ones)."""
    try:
        states = list(states)
    except TypeError:
        raise TypeError(f"fp8amp.amax_sync.{where}: states must be an iterable of fp8amp.ScalingState "
                        f"(e.g. delayed_states(model)), got {type(states).__name__}") from None
    for i, st in enumerate(states):
        if not isinstance(st, ScalingState):
            raise TypeError(f"fp8amp.amax_sync.{where}: states must hold fp8amp.ScalingState objects "
                            f"(e.g. delayed_states(model)); element {i} is {type(st).__name__}")
    return states


def start_amax_reduction(states: Iterable[ScalingState], *, step_bound: bool = False) -> int:
    """Issues the reduction of :func:`reduce_amaxes` without waiting for it, so that it runs while
    other work does: call it once all of the step's amaxes are recorded (after the backward; the
    optimizer hook of :func:`fp8amp.initialize` calls it before the step), and
    :func:`reduce_amaxes` (in :func:`fp8amp.update_scaling`) then waits for it and copies the
    maxima back. Amaxes recorded in between (a forward in an optimizer closure) are overwritten.
    A reduction still pending for these states (issued earlier and not applied) is waited for
    and discarded first. ``step_bound=True`` (the optimizer's pre-hook): the reduction belongs to
    the step about to run, and is applied only after :func:`end_step`, which the post-hook calls;
    if the step raises, the next issue or reduction discards it. Returns the number of
    collectives issued. A TypeError refuses ``states`` that are not ScalingStates."""
    if not isinstance(step_bound, bool):
        raise TypeError(f"fp8amp.amax_sync.start_amax_reduction: step_bound must be a bool, got "
                        f"{type_name(step_bound)}")
    return _start_amax_reduction(_checked(states, "start_amax_reduction"), step_bound)


@torch.compiler.disable  # the collective runs eagerly: a compiled region calling it breaks the graph here
def _start_amax_reduction(states: list[ScalingState], step_bound: bool) -> int:
    plan = _reducing(states)
    if plan is None:
        return 0
    states, group = plan
    stale = _take_pending(states)
    if stale is not None:
        stale.discard()
    pending = states[0]._pending_amax_reduction = _issue(states, group, step_bound)
    return len(pending.works)


def end_step(states: Iterable[ScalingState]) -> None:
    """Says that the optimizer step whose pre-hook started the reduction of ``states`` has ended
    (its post-hook, before :func:`fp8amp.update_scaling`): the pending reduction may now be applied."""
    _end_step(_checked(states, "end_step"))


def _end_step(states: list[ScalingState]) -> None:
    plan = _reducing(states)
    pending = None if plan is None else plan[0][0].__dict__.get("_pending_amax_reduction")
    if pending is not None:
        pending.step_bound = False


def reduce_amaxes(states: Iterable[ScalingState]) -> int:
    """MAX-reduces this step's amaxes (column 0 of the histories) of ``states`` over their process
    group, in place: one ``all_reduce`` of one flat float32 tensor per device, asynchronous
    (``wait`` orders the stream, the host does not block on CUDA), or the one
    :func:`start_amax_reduction` issued for the same states (unless it is bound to a step that has
    not ended: then it is discarded and the reduction issued anew). States with ``amax_reduction`` off
    are left alone; with the default group and no initialized process group, or one rank, nothing
    is done. Returns the number of collectives it issued.

    Raises:
        TypeError: ``states`` are not ScalingStates.
        ValueError: the states name different process groups, or the ranks hold different states.
    """
    return _reduce_amaxes(_checked(states, "reduce_amaxes"))


@torch.compiler.disable
def _reduce_amaxes(states: list[ScalingState]) -> int:
    plan = _reducing(states)
    if plan is None:
        return 0
    states, group = plan
    pending = _take_pending(states)
    issued = 0
    if pending is None or pending.ids != tuple(id(st) for st in states) or pending.step_bound:
        if pending is not None:  # for other states, or of a step that raised: stale
            pending.discard()
        pending = _issue(states, group)
        issued = len(pending.works)
    for work, flat, columns in pending.works:
        work.wait()
        torch._foreach_copy_(columns, flat.split([c.numel() for c in columns]))
    return issued


class AmaxReductionJoin(Joinable):
    """Uneven inputs under DDP: ``with Join([ddp, AmaxReductionJoin(model, ddp)]):`` instead of
    ``with ddp.join():``. A rank that has run out of batches shadows DDP's collectives (DDP's own
    join hook) and, with this, the amax reduction of each optimizer step of the ranks still
    training (one all-reduce of zeros: neutral in a MAX), which ``ddp.join()`` alone leaves
    unmatched, so the ranks waited for each other until the collective timeout. When all have
    joined, every rank takes the last joiner's scaling buffers (with ``broadcast_buffers=False``
    DDP leaves them as they were). List ``ddp`` first. The shadowing rank assumes one optimizer
    step per DDP gradient sync of the others (accumulation inside ``ddp.no_sync()`` included).

    Raises:
        TypeError: ``model`` is not an nn.Module or ``ddp`` not a DistributedDataParallel.
        ValueError: it is listed before ``ddp`` in the ``Join``.
    """

    def __init__(self, model: nn.Module, ddp: nn.parallel.DistributedDataParallel) -> None:
        where = "fp8amp.amax_sync.AmaxReductionJoin"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(ddp, nn.parallel.DistributedDataParallel):
            raise TypeError(f"{where}: ddp must be the torch.nn.parallel.DistributedDataParallel wrapping the "
                            f"model, got {type(ddp).__name__}")
        super().__init__()
        self._model, self._ddp = model, ddp

    def join_hook(self, **kwargs) -> JoinHook:
        return _AmaxReductionJoinHook(self._model, self._ddp)

    @property
    def join_device(self) -> torch.device:
        if self._join_config.is_first_joinable:  # (set by Join before it reads this)
            raise ValueError("fp8amp.amax_sync.AmaxReductionJoin: list the DistributedDataParallel first: "
                             "Join([ddp, AmaxReductionJoin(model, ddp)]); DDP's forward tells the joined ranks "
                             "of each iteration only as the first joinable")
        return self._ddp.join_device

    @property
    def join_process_group(self):
        return self._ddp.join_process_group


class _AmaxReductionJoinHook(JoinHook):
    def __init__(self, model: nn.Module, ddp: nn.parallel.DistributedDataParallel) -> None:
        self._model, self._ddp = model, ddp

    def main_hook(self) -> None:
        # DDP's hook, run just before, found whether the other ranks sync gradients this
        # iteration: a step, whose amax reduction this matches, follows only then.
        if not self._ddp.require_forward_param_sync:
            return
        plan = _reducing(delayed_states(self._model))
        if plan is None:
            return
        states, group = plan
        for device, device_states in _by_device(states).items():  # the collectives _issue makes, of zeros
            n = sum(st.amax_history.shape[0] for st in device_states)
            dist.all_reduce(torch.zeros(n, device=device), op=dist.ReduceOp.MAX, group=group)

    def post_hook(self, is_last_joiner: bool) -> None:
        # The ranks that joined early stopped updating their scaling buffers: they take the last
        # joiner's, as DDP's hook does for every buffer only with broadcast_buffers=True.
        plan = _reducing(delayed_states(self._model))
        if plan is None:
            return
        states, group = plan
        device = states[0].amax_history.device
        src = torch.tensor([dist.get_rank() if is_last_joiner else -1], device=device)
        dist.all_reduce(src, op=dist.ReduceOp.MAX, group=group)
        src = int(src.item())
        for st in states:
            for buffer in st.buffers():
                dist.broadcast(buffer, src=src, group=group)
