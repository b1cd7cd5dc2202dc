"""Fused low-precision Adam / AdamW (docs/o1_o2.md#optimizer) over the core op ``torch.ops.fp8amp.adam_step``.

:class:`Adam` and :class:`AdamW` are ``torch.optim.Optimizer`` subclasses with the API of
``torch.optim.Adam`` / ``AdamW``: param groups, per-group ``lr`` / ``betas`` / ``eps`` /
``weight_decay`` / ``maximize`` read at every step (so lr schedulers work), ``state_dict`` /
``load_state_dict``, ``zero_grad``, ``torch.amp.GradScaler``. Three keywords are added:

``state_dtypes``
    ``"O1"``: ``exp_avg`` and ``exp_avg_sq`` in float32. The element math is torch's
    (``foreach=False``, CPU) operation for operation but for the denominator, one fma
    ``sqrt(v) * (1/sqrt(bc2)) + eps`` instead of a division and an add: m and v are
    bit-identical to torch's, the updates agree to ~2^-21 relative (see
    ``include/fp8amp/optim.h``).
    ``"O2"``: ``exp_avg`` float8_e4m3fn with ``exp_avg_scale`` / ``exp_avg_scale_inv``,
    ``exp_avg_sq`` float16 with ``exp_avg_sq_scale`` / ``exp_avg_sq_scale_inv`` (docs/o1_o2.md#optimization-levels): new
    power-of-two scales are computed on the device from the new amaxes at every step.
    A group's ``state_dtypes`` decides the formats when a param's state is created.

``master_rounding``, ``rounding_seed``
    Per-group options: ``"nearest"`` (default) rounds float16 masters' new values to nearest,
    losing updates below half an FP16 unit (docs/o1_o2.md#limits-today); ``"stochastic"`` keeps
    them on average, drawing from ``rounding_seed`` (an int, default 0), the step and the param's
    place: a run repeats bit for bit (docs/numerics.md#stochastic-rounding).

State per param: ``step`` (float32 0-dim tensor on the param's device, the number of steps
taken, as torch keeps it with ``capturable=True``), ``exp_avg``, ``exp_avg_sq`` and, at O2, the
four float32 ``[1]`` scale tensors. Params are float32, bfloat16 or float16 tensors, or :class:`~fp8amp.ScaledTensor` masters
with float16 codes (what :func:`fp8amp.initialize` makes of Linear weights at O1/O2): the op
updates their codes and scale in place, and also rewrites their E4M3 copy
(:class:`~fp8amp.MasterWeight`'s, what the :class:`~fp8amp.Fp8Linear` forward reads) in the
same pass, so the forward does not re-cast the weight. Grads may be plain
(float32/bfloat16/float16) or E4M3/E5M2 ScaledTensors (the FP8 weight gradients of Fp8Linear at
O1/O2). A bfloat16/float16 param (a model loaded in bf16) steps in float32: a float32 copy
goes through the op and is rounded back into the param once (the op keeps low-precision params
only as FP16 codes with a scale); its m and v follow ``state_dtypes`` as any param's. The
skip rule below judges the float32 values: a finite new value beyond the param's own range (a
float16 param past 65504) rounds back to inf, as torch's own step on that param would make it.

``step()`` never syncs with the host. A step whose grads (or new m, v, params) hold an inf/NaN
is skipped on the device: params, states, scales and ``step`` stay bit-identical. When a step
needs several op calls (several param groups or devices), the grads are first checked in one
amax pass, so a non-finite grad anywhere skips the whole step, as GradScaler would. (A
non-finite m', v' or p' that only the op sees skips the call that meets it and the calls after
it, not the ones before: optim.h's "calls are independent".)

``torch.amp.GradScaler.step(optimizer)`` takes its standard path (this optimizer does not set
``_step_supports_amp_scaling``): it unscales the grads, checks them, and calls ``step()`` only
when they are finite (that check is GradScaler's own host sync).

FSDP2: DTensor parameters and gradients (``fully_shard``) are stepped shard by shard: the op takes
each rank's local shard (a float32 tensor, or a ScaledTensor shard of an O1/O2 master with its own
scale). ``exp_avg`` / ``exp_avg_sq`` are DTensors sharded as the param, each shard's scales a
DTensor of one value a shard: DCP keeps every rank's states (docs/distributed.md, "FSDP2").

CUDA graphs: the step is always what torch calls ``capturable`` (step counts on the device, no
host sync), so ``capturable=True`` is accepted and changes nothing, and the whole training step
can be captured with ``torch.cuda.graph`` (docs/o1_o2.md, "CUDA graphs"). ``lr`` and the other
hyperparameters are Python numbers, so a captured step keeps the values it was captured with.

Not supported (a ``ValueError`` names the argument): ``amsgrad=True``, ``differentiable=True``, a
Tensor ``lr`` or ``betas``, sparse grads. ``foreach`` and ``fused`` are accepted and ignored (one
fused multi-tensor op call a param group).
"""

from __future__ import annotations

import itertools
import numbers
import warnings
from collections import defaultdict

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed: no DTensor params
    DTensor = ()

from .formats import E4M3, FP16
from .master_weight import MasterWeight
from .optim_calls import (SCALE_KEYS as _SCALES, CallLists, fused_form, local as _local, master_rounding,
                          nonfinite_flag, or_empty as _or_empty, shard_coordinates)
from .optim_params import check_params
from .optim_state import (MOMENT_KEYS, ScaledMoment, check_groups, check_moments, complete_groups, convert_state,
                          fp8_states_as_bytes, fp8_states_from_bytes, moments_as_codes, moments_with_scales,
                          load_hooks_outside, one_per_shard, real_sharded_moments, state_dict_hooks_outside)
from .block_scaled_tensor import BlockScaledTensor
from .scaled_tensor import ScaledTensor
from .scaling_hooks import drop_skipped_amaxes

__all__ = ["Adam", "AdamW", "ScaledMoment", "STATE_DTYPES"]

#: The accepted ``state_dtypes``: (exp_avg dtype, exp_avg_sq dtype).
STATE_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "O1": (torch.float32, torch.float32),
    "O2": (E4M3, FP16),
}


class Adam(torch.optim.Optimizer):
    """``torch.optim.Adam`` over the fused fp8amp op; see the module docstring.

    Args:
        params: iterable of float32 parameters or of param-group dicts.
        lr, betas, eps, weight_decay, maximize, decoupled_weight_decay: as ``torch.optim.Adam``
            (Python numbers only).
        amsgrad, differentiable: must be False (refused otherwise).
        foreach, fused, capturable: accepted and ignored (the step is always fused, and always
            capturable: no host sync).
        state_dtypes: ``"O1"`` (float32 moments) or ``"O2"`` (E4M3 m, FP16 v, each with a scale).
        master_rounding, rounding_seed: see the module docstring.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        state_dtypes: str = "O1",
        master_rounding: str = "nearest",
        rounding_seed: int = 0,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay, state_dtypes=state_dtypes,
            master_rounding=master_rounding, rounding_seed=rounding_seed,
        )
        # Host-side knowledge of which params have equal step counts (see _cohort_from_state), by
        # the params' ids (the optimizer holds its params, so their ids stay theirs; a Tensor's own
        # hash is a Python call); set before super().__init__, which calls add_param_group.
        self._cohorts: dict[int, object] = {}
        self._cohort_ids = itertools.count(1)
        # Each param's step count tensor and its version counter when its cohort was last known:
        # a count written from outside since (a state reset by hand) makes it read again.
        self._count_marks: dict[int, tuple[torch.Tensor, int]] = {}
        # The lists of last step's op calls, by the ids of their params (fp8amp.optim_calls).
        self._call_lists: dict[tuple[int, ...], CallLists] = {}
        super().__init__(params, defaults)

    @property
    def _name(self) -> str:
        return f"fp8amp.optim.{type(self).__name__}"

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, then this optimizer's checks (of every group, from a torch.optim too);
        a group they refuse is not added (kept, it failed every later step)."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict, k: int) -> None:
        self._check_options(group)
        check_params(self._name, group["params"], k)

    def _check_options(self, group: dict) -> None:
        for flag in ("amsgrad", "differentiable"):
            if group[flag]:
                raise ValueError(f"{self._name}: {flag}=True is not supported; accepted: {flag}=False")
        if group["state_dtypes"] not in STATE_DTYPES:
            raise ValueError(f"{self._name}: state_dtypes must be one of {', '.join(map(repr, STATE_DTYPES))}; "
                             f"got {group['state_dtypes']!r}")
        master_rounding(group, self._name)
        self._check_hyper(group)

    def _check_hyper(self, group: dict) -> None:
        for key in ("lr", "eps", "weight_decay"):
            value = group[key]  # (a numpy scalar too, as torch takes it: an lr schedule computed with numpy)
            if isinstance(value, torch.Tensor) or isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{self._name}: {key} must be a Python float, got {type(value).__name__}")
            if key == "eps" and not value > 0.0:
                raise ValueError(f"{self._name}: invalid eps: {value} (must be > 0: with eps = 0 an element whose "
                                 "gradients were all 0, as FP8 gradients often are, divides 0 by 0 and every step "
                                 "is skipped; torch makes such weights NaN)")
            if not value >= 0.0:
                raise ValueError(f"{self._name}: invalid {key}: {value} (must be >= 0)")
        betas = group["betas"]
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2  # (numpy scalars too, as for lr)
                or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) for b in betas)):
            raise ValueError(f"{self._name}: betas must be two real numbers (Python or numpy floats), got {betas!r}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{self._name}: invalid betas[{i}]: {b} (must be in [0, 1))")

    # --------------------------------------------------------------------------------------------
    # State

    def _init_state(self, param: torch.Tensor, state: dict, group: dict) -> None:
        p = _local(param)  # a sharded (FSDP2) param: the states of this rank's shard
        m_dtype, v_dtype = STATE_DTYPES[group["state_dtypes"]]
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros(p.shape, dtype=m_dtype, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=v_dtype, device=p.device)
        for (_, scale_key, scale_inv_key), dtype in zip(MOMENT_KEYS, (m_dtype, v_dtype)):
            if dtype != torch.float32:
                for key in (scale_key, scale_inv_key):
                    state[key] = torch.ones(1, dtype=torch.float32, device=p.device)
        if isinstance(param, DTensor):
            # DTensors like the param's, so that a distributed checkpoint saves every rank's shard
            # (a plain tensor would count as replicated: one rank's copy for all). A scale is one
            # value a shard: a DTensor of the shard count (state_dict saves real values instead).
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = DTensor.from_local(state[key], param.device_mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
            for key in _SCALES:
                if key in state:
                    state[key] = one_per_shard(state[key], param)
        self._cohorts[id(param)] = 0  # cohort 0: step count 0
        self._mark_count(param, state["step"])

    def _cohort_from_state(self, p: torch.Tensor) -> object:
        """The cohort of a param whose state was set from outside (unpickling, assignment,
        ``load_state_dict``): its step count (a number or tensor of any dtype becomes the op's float32
        count on the param's device), read from the device once, kept in ``_cohorts``. The op takes t
        from one count per call while torch keeps one per param (a param without a grad does not
        step), so a group's params are stepped in one call per cohort: params stepped by exactly the
        same calls since their counts were last known (usually all params of a group)."""
        count, device = self.state[p]["step"], _local(p).device
        if not (isinstance(count, torch.Tensor) and count.dtype == torch.float32 and count.device == device):
            count = self.state[p]["step"] = torch.tensor(float(count), dtype=torch.float32, device=device)
        key = self._cohorts[id(p)] = ("step", float(count))
        self._mark_count(p, count)
        return key

    def _mark_count(self, p: torch.Tensor, count: torch.Tensor) -> None:
        """Records ``p``'s step count tensor and its version counter, by which ``step`` tells a
        count written from outside since (none in a traced step: the next eager step reads it)."""
        if not torch.compiler.is_compiling():
            self._count_marks[id(p)] = (count, count._version)

    def __getstate__(self) -> dict:
        state = super().__getstate__()  # (O2's float8 codes as bytes: torch cannot pickle.loads them)
        return {**state, "state": fp8_states_as_bytes(state["state"])}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # (also load_state_dict's call, with no bytes to take back)
        for group in self.param_groups:  # (pickled before the rounding options existed)
            group.setdefault("master_rounding", "nearest")
            group.setdefault("rounding_seed", 0)
        fp8_states_from_bytes(self.state)
        self._cohorts = {}
        self._cohort_ids = itertools.count(1)
        self._count_marks = {}
        self._call_lists = {}

    @state_dict_hooks_outside
    def state_dict(self) -> dict:
        """torch's ``state_dict``, with each O2 moment saved as one :class:`ScaledMoment` (its codes
        and its scale together) instead of bare codes beside ``*_scale`` / ``*_scale_inv`` entries:
        a plain ``torch.optim`` optimizer that loads it reads real values (given bare codes, it took
        them for the values, ignoring their scales). Sharded (DTensor) moments are saved as float32
        DTensors of their real values, which a distributed checkpoint can reshard
        (:func:`fp8amp.optim_state.real_sharded_moments`)."""
        saved = super().state_dict()
        saved["state"] = {pid: moments_with_scales(real_sharded_moments(state))
                          for pid, state in saved["state"].items()}
        return saved

    @load_hooks_outside
    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, keeping the state dtypes and values: each saved state tensor
        is taken as saved (torch casts every floating-point state to its param's dtype, which
        rounds for a bfloat16 or float16 param), onto its param's device, ``step`` as float32. Takes what
        :meth:`state_dict` saves (O2 moments as :class:`ScaledMoment`), the older form (codes and
        scale entries), and a plain ``torch.optim`` state dict, converted to this optimizer's
        levels (fp8amp.optim_state). A state dict without ``state`` and ``param_groups``, with param
        groups of other sizes, or with a moment whose shape is not its param's, that holds inf or
        NaN, or another state no Adam saves (fp8amp.optim_state.check_moments), is refused
        (ValueError) before anything is loaded."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            got = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"{self._name}.load_state_dict: state_dict must be a dict with 'state' and "
                             f"'param_groups' (what state_dict() returns); got {got}")
        check_groups(state_dict["param_groups"], self.param_groups, f"{self._name}.load_state_dict")
        state_dict = {**state_dict, "state": {pid: moments_as_codes(state)
                                              for pid, state in state_dict["state"].items()}}
        saved = state_dict["state"]
        state_dict = {**state_dict, "param_groups": complete_groups(state_dict["param_groups"], self.param_groups)}
        for group in state_dict["param_groups"]:
            self._check_options(group)  # before anything is loaded

        def params():  # (saved id, param, group, its name in messages), in the saved order
            ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
            ours = itertools.chain.from_iterable(((p, g, f"param {i} of group {k}") for i, p in enumerate(g["params"]))
                                                 for k, g in enumerate(self.param_groups))
            return zip(ids, ours)

        for pid, (p, _, which) in params():  # also before anything is loaded
            if p.is_meta and pid in saved:  # (its state would be meta tensors, read on the host below)
                raise ValueError(f"{self._name}.load_state_dict: {which} is on the meta device; to_empty() replaces "
                                 "a module's parameters, so build the optimizer (fp8amp.initialize) after "
                                 "model.to_empty(...) and the weights' load, and load its state dict into that one")
            for key in ("exp_avg", "exp_avg_sq"):
                value = saved.get(pid, {}).get(key)
                if isinstance(value, torch.Tensor) and value.shape != p.shape:
                    raise ValueError(f"{self._name}.load_state_dict: {which} has shape {tuple(p.shape)} but its "
                                     f"saved {key!r} {tuple(value.shape)}: a state dict of another model")
            check_moments(saved.get(pid, {}), f"{self._name}.load_state_dict: {which}")
        super().load_state_dict(state_dict)
        self._cohorts = {}
        self._call_lists = {}  # the states are new tensors (CallLists.still_for would tell too)
        for pid, (p, group, which) in params():
            if pid not in saved:
                continue
            state = self.state[p]
            if "step" in state and not isinstance(state["step"], torch.Tensor):  # a Python number
                state["step"] = torch.tensor(float(state["step"]))
            for key, value in saved[pid].items():
                if key == "step":  # any dtype; a copy, as the moments: torch's load keeps the saved (live) count
                    state[key] = state[key].to(dtype=torch.float32, device=p.device, copy=True)
                elif isinstance(value, DTensor):
                    state[key] = state[key].to(dtype=value.dtype, device=p.device)
                elif isinstance(value, torch.Tensor):  # as saved: torch cast it to a 16-bit param's dtype, rounding
                    state[key] = value.to(device=p.device, copy=True)
            convert_state(state, STATE_DTYPES[group["state_dtypes"]], f"{self._name}.load_state_dict: {which}")
            if "step" in state:
                state["step"] = state["step"].reshape(())
                self._cohort_from_state(p)  # one host read per param, at load time only

    # --------------------------------------------------------------------------------------------
    # Step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, after dropping the inf / NaN amaxes of a step skipped without ``step()`` (GradScaler's)."""
        drop_skipped_amaxes(self)
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam/AdamW step over every param with a grad; returns ``closure()``'s loss if given.

        Per param group (and device and cohort, see ``_cohort_from_state``), one call of the fused
        op with the group's current hyperparameters. No host sync. The calls' lists of tensors are
        kept from the step before while they still name the same tensors (fp8amp.optim_calls).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        calls: list[tuple[dict, list[torch.Tensor], list[dict]]] = []  # (group, params, their states)
        cohorts, marks = self._cohorts, self._count_marks
        eager = not torch.compiler.is_compiling()  # (a traced step reads no version counter)
        for k, group in enumerate(self.param_groups):
            self._check_hyper(group)
            parts: dict[tuple, tuple[list[torch.Tensor], list[dict], tuple[int, ...]]] = {}
            for position, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError(f"{self._name}: sparse grads are not supported (param of shape "
                                     f"{tuple(p.shape)}); accepted: dense float32/bfloat16/float16 grads")
                state = self.state[p]
                if not state:
                    self._init_state(p, state, group)
                cohort = cohorts.get(id(p))
                if cohort is None:
                    cohort = self._cohort_from_state(p)
                elif eager:
                    # torch's Adam takes each param's own count: one set by hand (zero_, a new
                    # tensor) would otherwise be stepped with its cohort's count
                    mark, count = marks.get(id(p)), state["step"]
                    if mark is None or mark[0] is not count or mark[1] != count._version:
                        cohort = self._cohort_from_state(p)
                # (the device's index, not the device: an int, where p.device makes an object; no
                # setdefault, whose default lists would be made for every param)
                key = (p.get_device(), cohort, shard_coordinates(p))
                part = parts.get(key)
                if part is None:  # (the group's index, this first param's position and its shard salt its seed)
                    part = parts[key] = ([], [], (k, position, *key[2]))
                part[0].append(p)
                part[1].append(state)
            calls += [(group, *part) for part in parts.values()]
        # (a closure that returned None skipped its batch: Lightning's training_step returning None)
        if not calls and not torch.compiler.is_compiling() and (closure is None or loss is not None):
            self._warn_no_grads()

        found_infs = self._found_infs(calls)
        # (emptied in place: torch 2.11's Dynamo cannot trace setting an attribute of an optimizer)
        kept = dict(self._call_lists)
        self._call_lists.clear()
        for group, params, states, salts in calls:
            key = tuple(map(id, params))
            lists = kept.get(key)
            if lists is None or not lists.still_for(params, states):
                if eager:  # (states changed: a moment set by hand holds real values, as torch's would)
                    for state in states:
                        convert_state(state, STATE_DTYPES[group["state_dtypes"]], f"{self._name}.step")
                lists = CallLists(params, states, self._name)
            self._call_lists[key] = lists
            self._call(group, params, lists, found_infs[params[0].device], salts)
            self._cohorts.update(dict.fromkeys(key, next(self._cohort_ids)))
            if eager:  # (the op advances the counts without bumping their version counters)
                marks.update({id(p): (s["step"], s["step"]._version) for p, s in zip(params, states)})
        return loss

    def _warn_no_grads(self) -> None:
        """A step where no param has a grad steps nothing: legitimate before any backward, but also
        what an optimizer built before fully_shard (or a load with assign=True) replaced the model's
        parameters does at every step, silently. Python's filter shows it once."""
        n = sum(p.requires_grad for group in self.param_groups for p in group["params"])  # frozen: none by design
        if n:
            warnings.warn(f"{self._name}.step: none of its {n} parameter(s) has a gradient, so nothing was stepped. "
                          "If fully_shard (FSDP2) or load_state_dict(..., assign=True) replaced the model's "
                          "parameters after this optimizer was built, it holds tensors the model no longer uses: "
                          "build it after them (docs/distributed.md)", UserWarning, stacklevel=5)

    def _found_infs(self, calls) -> dict[torch.device, torch.Tensor | None]:
        """One float32 [1] skip flag per device, shared by that device's calls. With more than one
        call on a device, it starts as "some grad there is non-finite" (one amax pass), so the whole
        step skips together. A device's only call gets None: the op makes its own zeroed flag, in
        C++ (a ``torch.zeros`` from Python cost the GPU machine's host about 60 us a step)."""
        by_device: dict[torch.device, list[list[torch.Tensor]]] = defaultdict(list)
        for _, params, _, _ in calls:
            by_device[params[0].device].append(params)
        found = {}
        for device, lists in by_device.items():
            if len(lists) == 1:
                found[device] = None
                continue
            grads, scale_invs = [], []
            for p in itertools.chain.from_iterable(lists):
                g = _local(p.grad)
                scaled = isinstance(g, (ScaledTensor, BlockScaledTensor))
                grads.append(g)
                scale_invs.append(g.scale_inv if scaled else None)
            # (NaN codes under a finite scale, from elsewhere, still skip the op call that meets them.)
            found[device] = nonfinite_flag(grads, scale_invs, device)
        return found

    def _call(self, group: dict, sharded: list[torch.Tensor], lists: CallLists, found_inf: torch.Tensor | None,
              salts: tuple[int, ...]) -> None:
        """The fused op over ``sharded`` (the params of one cohort) with their ``lists`` and this
        step's grads. bfloat16/float16 params step through a float32 copy rounded back once (the op
        keeps low-precision params only as FP16 codes with a scale): one rounding per step, as
        torch's fused AdamW does for such params; non-contiguous ones (channels_last conv weights)
        through a contiguous copy, as the op's contiguous moments need."""
        grads, grad_scale_invs = [], [None] * len(sharded)
        for i, q in enumerate(sharded):
            g = q.grad
            if type(g) is not torch.Tensor:  # a shard, an FP8 gradient (plain grads skip the checks)
                g = fused_form(_local(g))
                if isinstance(g, (ScaledTensor, BlockScaledTensor)):
                    grads.append(g.codes)
                    grad_scale_invs[i] = g.scale_inv
                    continue
            grads.append(g.contiguous())
        beta1, beta2 = group["betas"]
        lists.step(grads, _or_empty(grad_scale_invs),
                   (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                    float(group["weight_decay"]), bool(group["decoupled_weight_decay"]), bool(group["maximize"]),
                    *master_rounding(group, self._name, salts)),
                   found_inf)


class AdamW(Adam):
    """``torch.optim.AdamW`` over the fused fp8amp op (decoupled weight decay, default 1e-2);
    see :class:`Adam` and the module docstring."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_dtypes: str = "O1",
        master_rounding: str = "nearest",
        rounding_seed: int = 0,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, state_dtypes=state_dtypes, master_rounding=master_rounding,
                         rounding_seed=rounding_seed)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
