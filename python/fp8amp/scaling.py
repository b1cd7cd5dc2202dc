"""Delayed scaling with current-scaling warm-up (docs/numerics.md#numerics), as module state.

A :class:`ScalingState` holds, for n tensors quantized into one format, an amax history, the
scale pair and a warm-up counter, all as registered buffers: they are saved in the module's
``state_dict`` (a resumed run keeps its warm-up and history) and follow ``.to(device)``.

Per training step: quantize each tensor through the state (its amax is recorded in the same
pass), then, after the optimizer step, call :meth:`ScalingState.update` once. A tensor uses
current scaling (the scale from this step's own amax) while its counter is below the history
length H, that is for its first H steps that record an amax and again for H such steps after a
non-finite amax; after that it uses the delayed scale, made from the max of its last H amaxes.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from .formats import E4M3, SCALED_FORMATS, check_dtype, type_name
from .ops import fast
from .ops._args import _input

__all__ = ["ScalingRecipe", "ScalingState", "carry_in_metadata", "fresh_scaling_if_missing", "update_states",
           "max_over_ranks"]

# Scale exponents live in [-126, 126]; a larger margin changes nothing.
_MAX_MARGIN = 126


@dataclass(frozen=True)
class ScalingRecipe:
    """How scales are made from amaxes.

    Attributes:
        history_len: H, the number of steps whose amaxes make a delayed scale; also the number of
            warm-up steps with current scaling.
        margin: extra headroom: the scale is divided by ``2^margin``.
        pow2_scale: True: ``scale = 2^(floor(log2(fmax / amax)) - margin)`` (MS-AMP, exact
            ``scale_inv``); False: ``scale = fmax / amax / 2^margin`` (Transformer Engine).
    """

    history_len: int = 16
    margin: int = 0
    pow2_scale: bool = True

    def __post_init__(self) -> None:
        for name in ("history_len", "margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ScalingRecipe: {name} must be a Python int (int(x) converts), got {type_name(value)}")
        if self.history_len < 1:
            raise ValueError(f"ScalingRecipe: history_len must be >= 1, got {self.history_len}")
        if not 0 <= self.margin <= _MAX_MARGIN:
            raise ValueError(f"ScalingRecipe: margin must be in [0, {_MAX_MARGIN}], got {self.margin}")
        if not isinstance(self.pow2_scale, bool):
            raise TypeError(f"ScalingRecipe: pow2_scale must be a Python bool (True or False), got "
                            f"{type_name(self.pow2_scale)}")


class ScalingState(torch.nn.Module):
    """Delayed-scaling state of ``num_tensors`` tensors quantized into ``dtype``.

    Buffers (float32 unless said otherwise; they keep their dtypes under ``module.half()`` and
    the like, and move with ``.to(device)``):

    - ``amax_history`` ``[n, H]``: row i holds tensor i's amaxes, this step's in column 0.
    - ``scale`` ``[n]`` (init 1): the delayed scale, multiplying high precision into ``dtype``.
    - ``scale_inv`` ``[n]`` (init 1): ``1 / scale``.
    - ``counter`` int32 ``[n]`` (init 0): steps that recorded an amax (> 0) since the start or the
      last non-finite amax, capped at H; tensor i warms up (current scaling) while ``counter[i] < H``.

    With several data-parallel ranks :func:`fp8amp.update_scaling` MAX-reduces this step's amaxes
    over a process group before the update (:mod:`fp8amp.amax_sync`); :meth:`update` alone does not.
    """

    #: Whether :func:`fp8amp.update_scaling` MAX-reduces this state's amaxes across ranks.
    amax_reduction: bool = True
    #: Scaling updates run eagerly in this process, of any state (on the class): how
    #: :mod:`fp8amp.scaling_hooks` tells that nothing updates a model's scaling between two steps.
    updates_run: int = 0
    #: ``updates_run`` at this state's last eager update (0: none): how that hook tells which model's
    #: scaling was updated (another model's update says nothing of this one).
    updated_at: int = 0
    #: The group it reduces over; None: the default group, when one is initialized with > 1 rank.
    amax_reduction_group: Optional[dist.ProcessGroup] = None
    #: The qualified name of the layer it scales, as :func:`fp8amp.convert` named it (None: a layer made by
    #: hand): the ranks of a reduction must hold the same layers, not only the same shapes (pipeline stages).
    layer_name: Optional[str] = None

    def __init__(
        self,
        num_tensors: int,
        dtype: torch.dtype = E4M3,
        recipe: ScalingRecipe | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(num_tensors, bool) or not isinstance(num_tensors, int):
            raise TypeError(f"ScalingState: num_tensors must be an int, got {type(num_tensors).__name__}")
        if num_tensors < 1:
            raise ValueError(f"ScalingState: num_tensors must be >= 1, got {num_tensors}")
        recipe = ScalingRecipe() if recipe is None else recipe
        if not isinstance(recipe, ScalingRecipe):
            raise TypeError(f"ScalingState: recipe must be a ScalingRecipe, got {type(recipe).__name__}")
        self.num_tensors = num_tensors
        self.dtype = check_dtype(dtype, tuple(SCALED_FORMATS), "dtype", "ScalingState")
        self.fmax = SCALED_FORMATS[dtype]
        self.recipe = recipe
        n, h = num_tensors, recipe.history_len
        self.register_buffer("amax_history", torch.zeros(n, h, dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("scale_inv", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("counter", torch.zeros(n, dtype=torch.int32, device=device))
        # A counter that is always in warm-up: current scaling on every call (weights).
        self.register_buffer("_always_current", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)

    def _buffers_of(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scale, amax, counter)`` of tensor ``index``: its rows of ``scale``, ``amax_history`` and
        ``counter`` (the buffers themselves for a state of one tensor, every Fp8Linear's)."""
        if type(index) is not int or not 0 <= index < self.num_tensors:
            if isinstance(index, bool) or not isinstance(index, int):
                raise TypeError(f"ScalingState: index must be an int, got {type(index).__name__}")
            raise ValueError(f"ScalingState: index must be in [0, {self.num_tensors}), got {index}")
        buffers = self._buffers
        scale, amax, counter = buffers["scale"], buffers["amax_history"], buffers["counter"]
        if self.num_tensors == 1:
            return scale, amax, counter
        row = slice(index, index + 1)
        return scale[row], amax[row], counter[row]

    def _delayed(self, op, name: str, x: torch.Tensor, index: int, record: bool):
        """x through one cast op as tensor ``index`` (delayed scaling; current during warm-up). The
        recipe and dtype were checked when the state was made, so the op is called unchecked.
        Without ``record`` the op folds x's amax into a scratch row, so the history is left alone
        (and a warm-up scale comes from x's amax alone)."""
        scale, amax, counter = self._buffers_for(x, index)
        if not record:
            amax = torch.zeros_like(amax)
        r = self.recipe
        return op(_input(x, "x", name), scale, amax, self.dtype, counter, r.history_len, r.margin, r.pow2_scale)

    def _buffers_for(self, x: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_buffers_of` for a cast of ``x``, refusing a state still on the meta device while
        ``x`` is not (the op said only "got scale on meta and x on cpu")."""
        buffers = self._buffers_of(index)
        if buffers[0].is_meta and not x.is_meta:
            raise RuntimeError(
                f"ScalingState: this scaling state (an Fp8Linear's input_scaling, weight_scaling or "
                f"grad_output_scaling) is on the meta device but x is on {x.device}: the model was built on meta and "
                "its weights were materialized without it. Call .to_empty(device=...) on the state (or on the layer "
                "before its weights are set: a state made from meta restarts its warm-up), or load its buffers "
                "(load_state_dict of a checkpoint that holds them; load_state_dict(..., assign=True) of the layer's "
                "weights makes missing ones where the weight is)")
        return buffers

    def quantize(self, x: torch.Tensor, index: int = 0, *, record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantizes ``x`` as tensor ``index`` of this state; records its amax (unless ``record`` is
        False: then the history is left as it is).

        Returns ``(out, scale_inv)``, ``scale_inv`` float32 ``[1]`` being 1 / the scale used.
        """
        return self._delayed(fast.quantize, "quantize", x, index, record)

    def cast_transpose(self, x: torch.Tensor, index: int = 0, *,
                       record: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantizes ``x`` ``[..., N]`` as tensor ``index`` and transposes it; records its amax
        (``record`` as in :meth:`quantize`).

        Returns ``(out, out_t, scale_inv)``: ``out`` of ``x``'s shape, ``out_t`` ``[N, M]``.
        """
        return self._delayed(fast.cast_transpose, "cast_transpose", x, index, record)

    def cast_transpose_dbias(
        self, x: torch.Tensor, index: int = 0, *, record: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like :meth:`cast_transpose`, also returning the column sums of ``x`` (float32 ``[N]``,
        :func:`fp8amp.ops.cast_transpose_dbias`): ``(out, out_t, scale_inv, dbias)``."""
        return self._delayed(fast.cast_transpose_dbias, "cast_transpose_dbias", x, index, record)

    def cast_transpose_current(
        self, x: torch.Tensor, index: int = 0, *, record: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like :meth:`cast_transpose`, with current scaling on every call: the scale comes from
        ``x``'s own amax (kept in column 0 of row ``index``'s history, which this resets first;
        the stored scale is the fallback for an all-zero or non-finite ``x``). For weights.
        Without ``record`` the amax goes to a scratch row and the history is left as it is (also
        what lets a state made under ``torch.inference_mode()`` cast outside it)."""
        scale, amax, _ = self._buffers_for(x, index)
        x = _input(x, "x", "cast_transpose")
        if record:
            amax.select(1, 0).zero_()
        else:
            amax = torch.zeros_like(amax)
        r = self.recipe
        return fast.cast_transpose(x, scale, amax, self.dtype, self._buffers["_always_current"], 1, r.margin,
                                   r.pow2_scale)

    def quantize_shard(self, shard: torch.Tensor, group, index: int = 0, *,
                       record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantizes one rank's shard of a tensor sharded over the process group ``group`` with the
        scale :meth:`cast_transpose_current` gives the whole tensor: the shards' amaxes are
        all-reduced (MAX) into column 0 of row ``index``'s history first (a scratch row without
        ``record``), so every rank uses the same scale and the gathered codes equal a cast of the
        whole tensor. Returns ``(codes, scale_inv)``. A NaN amax is all-reduced as +inf (a
        reduction's MAX need not propagate NaN): every rank then keeps the stored scale, as the
        whole tensor's cast would."""
        scale, amax, _ = self._buffers_of(index)
        shard = _input(shard, "shard", "quantize_shard")
        if record:
            amax.select(1, 0).zero_()
        else:
            amax = torch.zeros_like(amax)
        amax_now = amax.select(1, 0)
        fast.amax(shard, amax_now, None, 0)
        max_over_ranks(amax_now, group)
        r = self.recipe
        return fast.quantize(shard, scale, amax, self.dtype, self._buffers["_always_current"], 1, r.margin,
                             r.pow2_scale)

    def update(self) -> None:
        """The delayed update of all n tensors, after the optimizer step: new scales from the
        amax windows, counters advanced (or reset by a non-finite amax), histories rolled."""
        r = self.recipe
        b = self._buffers
        _count_update((self,))
        fast.update_delayed_scaling(b["amax_history"], b["scale"], b["scale_inv"], b["counter"], self.fmax, r.margin,
                                    r.pow2_scale)

    def __getstate__(self) -> dict:
        # A copy or a load counts its own updates (another process's count would read as updates).
        state = super().__getstate__()
        state.pop("updated_at", None)
        return state

    def reset(self) -> None:
        """Back to the initial state: empty histories, unit scales, warm-up from the start."""
        with torch.no_grad():
            self.amax_history.zero_()
            self.scale.fill_(1.0)
            self.scale_inv.fill_(1.0)
            self.counter.zero_()
            self._always_current.zero_()  # constant; zeroed again for buffers made by to_empty()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        # A checkpoint with no scaling state at all (taken before the model was converted to FP8)
        # reports the buffers as missing, as torch does, unless the load runs under
        # fresh_scaling_if_missing(): then this state restarts its warm-up. A state dict that
        # carries them in its metadata instead (carry_in_metadata) gives them from there.
        if not any(prefix + name in state_dict for name in _SAVED_BUFFERS):
            carried = local_metadata.get(METADATA_KEY)
            if carried is not None:
                self.check_saved(carried, prefix)
                with torch.no_grad():
                    for name, value in carried.items():
                        self._buffers[name].copy_(value)
                self._restart_saturating()
                return
            if _fresh_if_missing.get():
                self.reset()
                return
        saved = {name: state_dict[prefix + name] for name in self._buffers if prefix + name in state_dict}
        self.check_saved(saved, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)
        if 0 < len(saved) < len(_SAVED_BUFFERS):
            # Some of the buffers (strict=False): they need not fit the ones kept (a warmed-up
            # counter beside scale 1); the warm-up's current scaling is right whatever they hold.
            with torch.no_grad():
                self.counter.zero_()
        self._restart_saturating()
        buffers = self._buffers
        if buffers["_always_current"].is_meta and not buffers["scale"].is_meta:
            # load_state_dict(..., assign=True) into a state made on the meta device: the checkpoint
            # brought the persistent buffers; the non-persistent constant is made where they are.
            buffers["_always_current"] = torch.zeros(1, dtype=torch.int32, device=buffers["scale"].device)

    def _restart_saturating(self) -> None:
        """Restarts the warm-up of each loaded tensor whose scale would saturate amaxes of its own
        history: one made for a format of a larger range (a checkpoint whose output gradients were
        E5M2 loaded under an E4M3 ``grad_format``, 128x too large), which the first delayed cast
        would have clipped. A run's own scale never does: it came from a window holding columns 1:.
        (Factor 2: a ``pow2_scale=False`` quotient may round up.)"""
        history = self._buffers["amax_history"]
        if history.shape[1] > 1:
            with torch.no_grad():
                over = self._buffers["scale"] * history[:, 1:].amax(1) > 2 * self.fmax
                self._buffers["counter"].masked_fill_(over, 0)

    def check_saved(self, saved: dict, prefix: str = "") -> None:
        """Refuses buffers of a checkpoint (``saved``: buffer name -> tensor) that no run of this state
        saves, before any loads: a scale or scale_inv that is not a finite positive number (the
        casts would give NaN or 0, and at FP8 compute the optimizer would step every weight into
        NaN), a counter outside [0, H], a negative amax or a non-finite one outside column 0 (this
        step's, which a forward that met an inf leaves until the next update resets the counter),
        and a history of another length H. One host read per buffer, at load time only."""
        h = self.recipe.history_len
        for name, value in saved.items():
            buffer = self._buffers.get(name)
            if buffer is None or not isinstance(value, torch.Tensor) or value.is_meta:
                continue
            if value.shape != buffer.shape:
                if name == "amax_history" and value.dim() == 2 and value.shape[0] == buffer.shape[0]:
                    raise ValueError(
                        f"ScalingState.load_state_dict: {prefix}amax_history has a history of {value.shape[1]} steps, "
                        f"this state's recipe {h} (history_len): convert with the checkpoint's history_len "
                        f"(fp8amp.Recipe(..., history_len={value.shape[1]})), or leave this state's keys out of the "
                        "state dict and load it inside fp8amp.fresh_scaling_if_missing() to restart its warm-up")
                continue  # torch reports the size mismatch
            if name in ("scale", "scale_inv"):
                bad = ("inf or NaN" if not bool(value.isfinite().all())
                       else "0 or a negative value" if bool((value <= 0).any()) else None)
                rule = "a scale is a finite positive number"
            elif name == "counter":
                bad = "a value out of range" if not bool(((value >= 0) & (value <= h)).all()) else None
                rule = f"a warm-up counter is in [0, {h}] (the history_len)"
            elif name == "amax_history":
                old = ~value[:, 1:].isfinite()
                bad = ("a negative value" if bool((value < 0).any())
                       else f"inf or NaN in column {1 + int(old.any(0).nonzero()[0])}" if bool(old.any()) else None)
                rule = "an amax is not negative, and only column 0 (this step's) may be inf or NaN"
            else:
                continue
            if bad is not None:
                raise ValueError(
                    f"ScalingState.load_state_dict: {prefix}{name} holds {bad}; {rule}, so the checkpoint is "
                    "corrupt. To restart this state's warm-up instead, leave its keys out of the state dict and "
                    "load it inside fp8amp.fresh_scaling_if_missing()")

    def _apply(self, fn, recurse=True):
        # module.half(), .bfloat16(), .to(dtype) must not cast the state (the ops take float32
        # and int32 only): a buffer whose dtype fn would change only follows fn's device.
        def move_only(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(moved.device)

        from_meta = self._buffers["scale"].is_meta
        out = super()._apply(move_only, recurse)
        if from_meta and not self._buffers["scale"].is_meta:
            # module.to_empty(): buffers made from the meta device hold uninitialized memory (a
            # model's reset_parameters() or init_weights() rarely knows of them); a state made on
            # meta had no values to keep, so it starts from the initial state, as a new one does.
            self.reset()
        return out

    def extra_repr(self) -> str:
        r = self.recipe
        return (
            f"num_tensors={self.num_tensors}, dtype={self.dtype}, history_len={r.history_len}, "
            f"margin={r.margin}, pow2_scale={r.pow2_scale}"
        )


#: The buffers a ScalingState saves in its state dict.
_SAVED_BUFFERS = ("amax_history", "scale", "scale_inv", "counter")

#: The key of a module's metadata in a state dict under which :func:`carry_in_metadata` puts a
#: ScalingState's buffers.
METADATA_KEY = "fp8amp_scaling"


def max_over_ranks(amax: torch.Tensor, group, async_op: bool = False):
    """MAX all-reduce of the amaxes ``amax`` in place over ``group``, NaN sent as inf (a MAX reduction
    need not propagate NaN: gloo's does not); the work with ``async_op``."""
    amax.nan_to_num_(nan=float("inf"), posinf=float("inf"))
    return dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group, async_op=async_op)


def carry_in_metadata(state_dict: dict, scaling: dict[str, torch.Tensor]) -> None:
    """Puts ``scaling`` (ScalingState buffers by state-dict key, taken out of ``state_dict``'s keys)
    into ``state_dict``'s per-module metadata (``state_dict._metadata``, which ``torch.save`` keeps):
    a model without those ScalingStates (unconverted) loads the state dict strictly and ignores
    them, and a converted one's states load them from there. A plain dict has no metadata: nothing
    is carried."""
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    for key, value in scaling.items():
        module, _, buffer = key.rpartition(".")
        metadata.setdefault(module, {}).setdefault(METADATA_KEY, {})[buffer] = value


_fresh_if_missing: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8amp_fresh_scaling", default=False)


@contextlib.contextmanager
def fresh_scaling_if_missing():
    """Inside it, ``load_state_dict`` of a model with FP8 scaling states accepts a state dict that
    lacks a state entirely (a checkpoint of the unconverted model, an ``nn.Linear``'s): that state
    restarts from its warm-up (:meth:`ScalingState.reset`) and is not reported in
    ``missing_keys``, so ``strict=True`` still checks every other key. Outside it such a load
    lists the scaling buffers as missing (``strict=True`` raises). A state dict holding some of a
    state's buffers loads them either way (the absent ones are missing), and that state restarts
    its warm-up (its counter is set to 0)."""
    token = _fresh_if_missing.set(True)
    try:
        yield
    finally:
        _fresh_if_missing.reset(token)


def _count_update(states: Iterable[ScalingState]) -> None:
    if not torch.compiler.is_compiling():  # (torch 2.11's Dynamo cannot trace a class attribute's write)
        ScalingState.updates_run += 1
        for state in states:
            state.__dict__["updated_at"] = ScalingState.updates_run  # (not Module.__setattr__: slow)


def update_states(states: Iterable[ScalingState]) -> None:
    """:meth:`ScalingState.update` of many states (each once), in one launch for each device,
    format and recipe among them instead of one a state: what :func:`fp8amp.update_scaling` runs
    after every optimizer step for all the Fp8Linears of a model."""
    states = {id(st): st for st in states}.values()
    _count_update(states)
    groups: dict[tuple, list[dict]] = {}
    for state in states:
        r, buffers = state.recipe, state._buffers  # (not state.amax_history: Module.__getattr__ is slow)
        groups.setdefault((buffers["amax_history"].device, state.fmax, r.margin, r.pow2_scale), []).append(buffers)
    for (_, fmax, margin, pow2_scale), buffers in groups.items():
        fast.multi_update_delayed_scaling([b["amax_history"] for b in buffers], [b["scale"] for b in buffers],
                                          [b["scale_inv"] for b in buffers], [b["counter"] for b in buffers],
                                          fmax, margin, pow2_scale)
