"""The argument lists of :class:`fp8amp.optim.Adam`'s fused op calls, kept from step to step.

The optimizer steps each cohort of params (one param group, device and step count) in one
``adam_step`` call whose lists name, per param, its codes (or values), its moments and their
scales, its scale, its E4M3 copy and its step count. Those are the same tensor objects from one
step to the next, and building the lists was most of the optimizer's host time (about 15 us a
param on a CPU), so :class:`CallLists` builds them once per cohort and the optimizer reuses them
while :meth:`CallLists.still_for` finds unchanged what they were built from: the identity of
every state tensor (a state replaced, loaded, moved to another device, a param's first state)
and of every param's inner tensors (a master's codes, scale, E4M3 copy: ``drop_fp8_copy`` /
``attach_fp8_copy``; a shard's local tensor) and every param's dtype. What is new every step is
read every step: the grads and the contiguous float32 copies of bfloat16/float16 and of
non-contiguous (channels_last) params. A master keeps no scale, only its ``scale_inv``: the op
derives the old scale from it and writes the new scale_inv. Hyperparameters are the group's, read
at every call.

The op's own checks of those tensors are kept too: :meth:`CallLists.step` steps a
``fast.AdamPlan`` (the core checks every buffer but the grads once, when the plan is made), which
refuses to step once a tensor it holds has other storage, shape or dtype (a ``.data`` swap, a
resize: the identities ``still_for`` compares do not change then), and is then made again. A
cohort with such params, whose float32 copies are new every step, a cohort with a tensor subclass
among its buffers or grads (an ``Fp8AllGatherWeight``: the op's dispatch hands the kernel the
tensor it wraps, the plan would get the wrapper), and a step that Dynamo traces or that runs under
a ``TorchDispatchMode`` (which sees ops, not the plan's method) call the op itself.
"""

from __future__ import annotations

import itertools
from operator import attrgetter

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed: no DTensor params
    DTensor = ()

from .block_scaled_tensor import BLOCK_TILE, BlockScaledTensor
from .formats import FP16
from .master_weight import MasterWeight
from .ops import fast, multi_amax
from .optim_state import MOMENT_KEYS
from .scaled_tensor import ScaledTensor

__all__ = ["CallLists", "fused_form", "local", "master_rounding", "MASTER_ROUNDINGS", "or_empty", "salted_seed",
           "SCALE_KEYS", "shard_coordinates"]

#: The accepted ``master_rounding`` of a param group (docs/numerics.md#stochastic-rounding).
MASTER_ROUNDINGS = ("nearest", "stochastic")

#: The state keys of the moments' scales, in the op's order of its scale lists.
SCALE_KEYS = tuple(k for _, scale_key, scale_inv_key in MOMENT_KEYS for k in (scale_key, scale_inv_key))
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the types whose storage is their own (no wrapper)
_DTYPE = attrgetter("dtype")
_INNER = attrgetter("_data", "_scale_inv")
_COPY = attrgetter("_fp8", "_fp8_scale", "_fp8_scale_inv")


def local(t):
    """This rank's shard of a DTensor (an FSDP2 parameter or gradient), or t itself. The fused op
    works shard by shard: Adam is element-wise, and each shard of an O1/O2 master has its own
    scale."""
    return t._local_tensor if isinstance(t, DTensor) else t


def or_empty(entries: list) -> list:
    """The op's per-param optional lists: empty when no param of the call has the entry."""
    return [] if all(e is None for e in entries) else entries


def nonfinite_flag(grads: list[torch.Tensor], grad_scale_invs: list, device: torch.device) -> torch.Tensor:
    """float32 [1] on ``device``: 1 where some grad is non-finite, else 0, with no host sync; one
    amax pass per grad dtype. An FP8 grad (one with an entry in ``grad_scale_invs``: empty, or one
    tensor or None per grad) is judged by its scale_inv: fp8amp's FP8 gradients carry a non-finite
    scale_inv when any element is non-finite (``ScaledTensor.from_tensor(nan_if_nonfinite=True)``,
    the block casts, ``scaled_accumulate``, an unscale by inf), so checking it costs no pass over
    the codes."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g, scale_inv in zip(grads, grad_scale_invs or itertools.repeat(None)):
        t = g if scale_inv is None else scale_inv
        by_dtype.setdefault(t.dtype, []).append(t)
    amaxes = []
    for ts in by_dtype.values():
        amax = torch.zeros(len(ts), dtype=torch.float32, device=device)
        multi_amax(ts, amax)
        amaxes.append(amax)
    return torch.cat(amaxes).isfinite().logical_not().any().reshape(1).float()


def fused_form(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as the fused step takes it: a block gradient (128 x 128 block scales) as itself
    (the step reads each block's scale), unless its columns are not a multiple of 128, which the
    step's block indexing needs (the blockwise recipe makes none such): then its float32 real values.
    A ScaledTensor of FP16 codes (``p.grad = p.new_zeros(...)`` of a master, which is a master) as
    its real values: the step takes FP8 codes or plain grads."""
    if isinstance(grad, BlockScaledTensor) and grad.shape[1] % BLOCK_TILE[1]:
        return grad.dequantize(torch.float32)
    if isinstance(grad, ScaledTensor) and grad.codes.dtype == FP16:
        return grad.dequantize()
    return grad


def _kept_amax(p: torch.Tensor) -> torch.Tensor | None:
    """A master's kept amax for the op (MasterWeight.kept_amax), None for other params. While
    Dynamo traces, only one an eager step made: one made there would be a fake tensor."""
    if not isinstance(p, MasterWeight):
        return None
    return p._kept_holder().tensor if torch.compiler.is_compiling() else p.kept_amax()


def _state_ids(states: list[dict]) -> tuple:
    return tuple(map(id, itertools.chain.from_iterable(map(dict.values, states))))


def master_rounding(group: dict, name: str, salts: tuple[int, ...] = ()) -> tuple[bool, int]:
    """``(stochastic, seed)`` of an op call over params of ``group``: whether its float16 masters
    round stochastically, and the call's seed, the group's ``rounding_seed`` with ``salts`` (the
    group's index, the position of the call's first param in it, its :func:`shard_coordinates`)
    mixed in by :func:`salted_seed`. ValueError for a rounding or seed the op cannot take, naming
    what it accepts."""
    rounding, seed = group.get("master_rounding", "nearest"), group.get("rounding_seed", 0)
    if not isinstance(rounding, str) or rounding not in MASTER_ROUNDINGS:
        raise ValueError(f"{name}: master_rounding must be one of {', '.join(map(repr, MASTER_ROUNDINGS))}; "
                         f"got {rounding!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64:
        raise ValueError(f"{name}: rounding_seed must be an int in [-2**63, 2**64); got {seed!r}")
    return rounding == "stochastic", salted_seed(seed, salts)


def salted_seed(seed: int, salts: tuple[int, ...]) -> int:
    """``seed`` with ``salts`` mixed in, as the op's int64. The op tells a call's tensors apart by
    their position in the call; the salts keep two calls of a step from drawing the same bits."""
    seed %= 2**64
    for salt in salts:
        seed = (seed * 0x9E3779B97F4A7C15 + salt + 1) % 2**64
    return seed - 2**64 if seed >= 2**63 else seed


def shard_coordinates(p: torch.Tensor) -> tuple[int, ...]:
    """Where a sharded (DTensor) param's local shard lies: its mesh coordinates along the mesh dims
    that shard it; () for a plain tensor. Salted into the rounding seed (:func:`master_rounding`),
    they give each shard its own random bits (the op numbers a shard's elements from 0, so equal
    local positions of two shards would draw the same), while replicas (DDP, HSDP's replicate dim)
    draw the same bits and stay identical."""
    if not isinstance(p, DTensor):
        return ()
    coordinate = p.device_mesh.get_coordinate() or ()
    return tuple(c for c, placement in zip(coordinate, p.placements) if placement.is_shard())


def _widened_positions(params: list[torch.Tensor]) -> list[int]:
    """The positions of the plain params that step through a contiguous float32 copy: bfloat16/
    float16 ones, and non-contiguous ones (channels_last conv weights; the moments are contiguous)."""
    return [i for i, p in enumerate(params) if not isinstance(p, ScaledTensor)
            and (p.dtype != torch.float32 or not p.is_contiguous())]


class CallLists:
    """The lists of one cohort's ``adam_step`` call that stay from step to step (see the module
    docstring), built from the params ``sharded`` and their ``states``."""

    def __init__(self, sharded: list[torch.Tensor], states: list[dict], name: str) -> None:
        self.sharded = sharded
        self.params = params = [local(p) for p in sharded]
        for p in params:
            if isinstance(p, ScaledTensor) and not p.is_contiguous():
                raise ValueError(f"{name}: params must be contiguous (param of shape {tuple(p.shape)} is not)")
        #: positions of the sharded (DTensor) params, whose local tensors may be replaced
        self.sharded_positions = [i for i, p in enumerate(sharded) if p is not params[i]]
        self.dtypes = tuple(map(_DTYPE, params))
        self.state_ids = _state_ids(states)
        self.scale_lists = [or_empty([local(s.get(key)) for s in states]) for key in SCALE_KEYS]
        #: the ScaledTensor params (masters)
        self.masters = [p for p in params if isinstance(p, ScaledTensor)]
        self.widened_positions = _widened_positions(params)
        self.data = [p.codes if isinstance(p, ScaledTensor) else p for p in params]
        self.param_scale_invs = or_empty([p.scale_inv if isinstance(p, ScaledTensor) else None for p in params])
        copies = [p.fp8_copy if isinstance(p, MasterWeight) else None for p in params]
        self.copy_lists = [or_empty([c and c[i] for c in copies]) for i in range(3)]  # codes, scale, scale_inv
        # the masters' kept amaxes; one Dynamo traces is not made (it would be a fake tensor)
        self.kept_amaxes = or_empty([_kept_amax(p) for p in params])
        #: the masters whose kept amax the op takes, made current before each step
        self.kept_masters = [p for p, a in zip(params, self.kept_amaxes) if a is not None]
        self.inner_ids = self._inner_ids()
        # what the op writes in place behind autograd's back, whose version counters each step
        # bumps, as torch's in-place updates do: the params (a DTensor's local shard has a counter
        # of its own) and the masters' tensors a compiled Fp8Linear saves for its backward
        # (MasterWeight.fp8_operands; the graph checks their counters, fp8amp.linear)
        self.written = [*sharded, *(params[i] for i in self.sharded_positions),
                        *(t for p in self.masters if isinstance(p, MasterWeight) and p.fp8_copy is not None
                          for t in p.fp8_operands()[3])]
        self.exp_avgs = [local(s["exp_avg"]) for s in states]
        self.exp_avg_sqs = [local(s["exp_avg_sq"]) for s in states]
        self.steps = steps = [s["step"] for s in states]
        # t comes from the first param's count (the cohort's counts are equal); the op increments
        # that one as step_tensor and the others as step_counts
        self.step_tensor = steps[0].view(1)
        self.step_counts = or_empty([None, *steps[1:]])
        self._plan = None
        self._plannable = all(type(t) in _PLAIN for t in itertools.chain(
            self.data, self.exp_avgs, self.exp_avg_sqs, self.param_scale_invs, *self.scale_lists,
            *self.copy_lists, self.step_counts, self.kept_amaxes) if t is not None)

    def _inner_ids(self) -> tuple:
        inner = []
        for p in self.masters:
            inner.extend(_INNER(p))
            if isinstance(p, MasterWeight):
                inner.extend(_COPY(p))
                inner.append(p._kept_holder().tensor)
        return tuple(map(id, inner))

    def still_for(self, sharded: list[torch.Tensor], states: list[dict]) -> bool:
        """Whether these lists are still those of a call over ``sharded`` (the params these lists
        were built for: the caller keys them by the params' ids) with ``states``, their states
        now: the same local shards, dtypes, masters' inner tensors and state tensors. A param
        that is the same object is of the same type, so only these can change."""
        params = self.params
        return (all(sharded[i]._local_tensor is params[i] for i in self.sharded_positions)
                and tuple(map(_DTYPE, params)) == self.dtypes
                and self._inner_ids() == self.inner_ids
                and _state_ids(states) == self.state_ids)

    def step(self, grads: list, grad_scale_invs: list, hyper: tuple, found_inf: torch.Tensor | None) -> None:
        """One ``adam_step`` over these lists with this step's ``grads`` and ``grad_scale_invs``
        (empty, or one tensor or None per param), ``hyper``: ``(lr, beta1, beta2, eps,
        weight_decay, adamw, maximize, stochastic_rounding, rounding_seed)``, and the skip flag
        ``found_inf`` (None: the op's own)."""
        data, widened = self._step_data()
        for p in self.kept_masters:
            p.kept_amax()  # made current if the master was written past the op table
        if torch.compiler.is_compiling():
            self._traced_step(data, grads, grad_scale_invs, hyper, found_inf)
        elif (widened or not self._plannable or not all(type(g) in _PLAIN for g in grads)
              or _get_current_dispatch_mode()):
            self._op_step(None, data, grads, grad_scale_invs, hyper, self.step_tensor, self.step_counts, found_inf)
        else:
            widened = self._plan_step(data, grads, grad_scale_invs, hyper, found_inf)
        for p, wide in widened:
            p.copy_(wide)
        torch.autograd.graph.increment_version(self.written)
        if not torch.compiler.is_compiling():
            for p in self.kept_masters:
                p._kept.stepped(p)

    def _op_step(self, positions, data, grads, grad_scale_invs, hyper, step_tensor, step_counts, found_inf) -> None:
        """The op over the params at ``positions`` (None: all; ``step_counts``: theirs)."""
        def pick(entries: list) -> list:
            if positions is None or not entries:
                return entries
            return or_empty([entries[i] for i in positions])

        lr, beta1, beta2, eps, weight_decay, adamw, maximize, stochastic, seed = hyper
        if positions is not None:  # (one of several calls: salted by its first param's position)
            seed = salted_seed(seed, (positions[0],))
        fast.adam_step(pick(data), pick(grads), pick(self.exp_avgs), pick(self.exp_avg_sqs), [],
                       pick(self.param_scale_invs), pick(grad_scale_invs), *map(pick, self.scale_lists),
                       *map(pick, self.copy_lists), step_counts, pick(self.kept_amaxes), lr=lr, beta1=beta1,
                       beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw, maximize=maximize,
                       step_tensor=step_tensor, found_inf=found_inf, stochastic_rounding=stochastic,
                       rounding_seed=seed)

    def _traced_step(self, data, grads, grad_scale_invs, hyper, found_inf) -> None:
        """The step as Dynamo traces it: op calls whose written lists hold no None (torch's
        functionalization of a mutable list with a None entry fails under Inductor, torch 2.11 to
        2.15 at least), one per pattern of the params' optional buffers (masters and plain params
        apart). Each call takes t from its own copy of the first count and advances its params'
        counts; with several calls, a skip flag set first from every grad skips them together."""
        patterns: dict[tuple, list[int]] = {}
        for i in range(len(data)):
            key = tuple(bool(entries) and entries[i] is not None
                        for entries in (self.param_scale_invs, *self.scale_lists, *self.copy_lists, self.kept_amaxes))
            patterns.setdefault(key, []).append(i)
        if len(patterns) > 1 and found_inf is None:
            found_inf = nonfinite_flag(grads, grad_scale_invs, data[0].device)
        # each call's copy of the count made before any call advances it (a copy of the count
        # itself: its view step_tensor would be a second, aliased input, which torch refuses)
        firsts = [self.steps[0].clone().reshape(1) for _ in patterns]
        for positions, first in zip(patterns.values(), firsts):
            self._op_step(positions, data, grads, grad_scale_invs, hyper, first, [self.steps[i] for i in positions],
                          found_inf)

    def _plan_step(self, data, grads, grad_scale_invs, hyper, found_inf) -> list:
        """The step through the kept plan; returns the (param, float32 copy) pairs to round back
        (none, unless the plan is remade for a param that is no longer contiguous)."""
        args = (grads, grad_scale_invs, *hyper[:7], 0, self.step_tensor, found_inf, 0, *hyper[7:])
        if self._plan is not None and self._plan.step(*args) is not None:
            return []
        # Made, or a buffer changed since (its storage, dtype or sizes). A param whose layout
        # changed (model.to(memory_format=...) after the first step) steps through a contiguous
        # float32 copy from now on, as one made so before the first step does.
        self.widened_positions = _widened_positions(self.params)
        if self.widened_positions:
            self._plan = None  # (it held the params' old storage)
            data, widened = self._step_data()
            self._op_step(None, data, grads, grad_scale_invs, hyper, self.step_tensor, self.step_counts, found_inf)
            return widened
        self._plan = fast.AdamPlan(data, self.exp_avgs, self.exp_avg_sqs, [], self.param_scale_invs,
                                   *self.scale_lists, *self.copy_lists, self.step_counts, self.kept_amaxes)
        self._plan.step(*args)
        return []

    def _step_data(self) -> tuple[list, list]:
        """This step's ``(data, widened)``: ``widened`` the (param, float32 copy) pairs to round
        back after the call."""
        if not self.widened_positions:
            return self.data, []
        data, widened = list(self.data), []
        for i in self.widened_positions:
            wide = self.params[i].to(torch.float32, memory_format=torch.contiguous_format)
            widened.append((self.params[i], wide))
            data[i] = wide
        return data, widened
