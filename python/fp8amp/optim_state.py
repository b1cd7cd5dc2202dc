"""Loading an optimizer state dict into :class:`fp8amp.optim.Adam` / ``AdamW`` that another
optimizer saved: a plain ``torch.optim.Adam`` / ``AdamW`` (a run moved onto fp8amp, or the
optimizer passed into :func:`fp8amp.initialize`), or fp8amp's at another level.

- Param groups: torch's dict lacks fp8amp's keys (``state_dtypes``); each saved group takes
  them from the optimizer's group of the same index, so the level chosen at construction (by
  ``initialize``) stays. Hyperparameters torch kept as tensors (``lr``, ``betas``, ``initial_lr``
  of a compiled or capturable step) load as Python floats, which fp8amp's groups hold. Then the
  group is checked as a new group would be (``amsgrad=True``...).
- States: moments held without a scale (float32) in a group whose ``state_dtypes`` stores them
  scaled (O2: E4M3 ``exp_avg``, FP16 ``exp_avg_sq``) are quantized into those formats with a
  power-of-two scale from their amax, the rule the optimizer's step uses, and the scale pair is
  added. Scaled moments are kept as saved (the op takes both kinds in one call), but codes of
  another format than the group's (FP16 codes of exp_avg), which go through their real values.
- Every moment must be finite: an inf or NaN (a corrupt checkpoint) is a ``ValueError`` naming
  the param and the state, where the step would otherwise skip every step from then on. So is
  any other state no Adam saves (:func:`check_moments`): an entry missing, a step count that is
  not one whole number >= 0, a moment that is not floating point, codes without a valid scale.
- Sharded (FSDP2, DTensor) moments: :func:`real_sharded_moments` saves each scaled moment as a
  float32 DTensor of its real values, sharded as the param, without its per-shard scales, so that
  ``torch.distributed.checkpoint`` reshards it as any plain state; on load each rank's new shard is
  quantized with a new scale from its own amax (:func:`convert_state`). The codes and scales of a
  same-layout load are not kept as saved; the real values are, and the next step depends on them
  alone (docs/distributed.md#checkpoints).

The optimizer's state-dict hooks run outside torch's methods, on the state dict and the state as
fp8amp's callers see them (:func:`load_hooks_outside`, :func:`state_dict_hooks_outside`).

The saved forms: an O2 moment in a state dict is one :class:`ScaledMoment` (codes and scale);
pickled, FP8 codes travel as uint8 views of their bytes (torch cannot ``pickle.loads`` a float8
tensor), in a state dict and in a pickled optimizer (:func:`fp8_states_as_bytes`).

See docs/o1_o2.md#optimizer ("Loading a state dict").
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import OrderedDict, defaultdict

import torch

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without distributed
    DTensor = Shard = ()

from .ops import dequantize, quantize_current
from .scaled_tensor import ScaledTensor

__all__ = ["check_groups", "check_moments", "complete_groups", "convert_state", "real_sharded_moments", "one_per_shard",
           "MOMENT_KEYS", "ScaledMoment", "moments_with_scales", "moments_as_codes", "fp8_states_as_bytes",
           "fp8_states_from_bytes", "load_hooks_outside", "state_dict_hooks_outside"]

#: Each moment's state key with the keys of its scale and scale_inv (present when it is scaled).
MOMENT_KEYS = (("exp_avg", "exp_avg_scale", "exp_avg_scale_inv"),
               ("exp_avg_sq", "exp_avg_sq_scale", "exp_avg_sq_scale_inv"))


def load_hooks_outside(load_state_dict):
    """Wraps fp8amp's ``load_state_dict`` so that its hooks run outside torch's, which it wraps:
    there pre hooks saw fp8amp's inner form (O2's bare codes beside scale entries), post hooks the
    state before fp8amp's conversion (O2's codes as float32 values), and what either wrote was
    overwritten by that conversion. Now pre hooks take the state dict as given and post hooks the
    state as loaded, as in torch (whose own checks also follow its pre hooks)."""

    @functools.wraps(load_state_dict)
    def wrapper(self, state_dict):
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # (shallow, as torch's: a hook may change it in place)
            for hook in self._optimizer_load_state_dict_pre_hooks.values():
                result = hook(self, state_dict)
                state_dict = state_dict if result is None else result
        held = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
        with _hooks_held(self, held) as post:
            load_state_dict(self, state_dict)
        for hook in post.values():
            hook(self)

    return wrapper


def state_dict_hooks_outside(state_dict):
    """Wraps fp8amp's ``state_dict`` so that its post hooks take the state dict it returns (O2's
    moments as ScaledMoments), not torch's from inside it (bare codes beside scale entries)."""

    @functools.wraps(state_dict)
    def wrapper(self):
        with _hooks_held(self, ("_optimizer_state_dict_post_hooks",)) as post:
            saved = state_dict(self)
        for hook in post.values():
            result = hook(self, saved)
            saved = saved if result is None else result
        return saved

    return wrapper


@contextlib.contextmanager
def _hooks_held(optimizer, names: tuple[str, ...]):
    """Empties the optimizer's hook dicts ``names`` while torch's method runs, yielding the last;
    then puts the same dicts back (the hooks' handles still remove them)."""
    held = [getattr(optimizer, name) for name in names]
    try:
        for name in names:
            setattr(optimizer, name, OrderedDict())
        yield held[-1]
    finally:
        for name, hooks in zip(names, held):
            setattr(optimizer, name, hooks)


def check_groups(saved_groups: list[dict], groups: list[dict], where: str) -> None:
    """Refuses saved param groups of other sizes than the optimizer's, before anything is loaded
    (the checks of the saved states match them to params by position: a saved moment of another
    param's shape read as "a state dict of another model")."""
    saved_sizes, sizes = ([len(g["params"]) for g in gs] for gs in (saved_groups, groups))
    if saved_sizes != sizes:
        raise ValueError(f"{where}: the state dict has {_groups(saved_sizes)}, this optimizer {_groups(sizes)}: "
                         "build it with the param groups of the optimizer that saved it, in the same order")


def _groups(sizes: list[int]) -> str:
    """Param groups by their sizes, for messages: "2 param groups (4, 2 params)"."""
    return f"{len(sizes)} param group{'s' * (len(sizes) != 1)} ({', '.join(map(str, sizes))} params)"


def complete_groups(saved_groups: list[dict], groups: list[dict]) -> list[dict]:
    """Copies of ``saved_groups``, each completed by the keys of the optimizer's group of the same
    index that it lacks, and with that group's ``state_dtypes`` and ``master_rounding`` (where it
    has one: a group a framework appended itself may not): the level and the rounding stay the
    optimizer's, whatever saved the state (:func:`check_groups` has matched the groups' sizes).
    Tensor hyperparameters (torch's ``lr``, ``betas``) become Python floats."""
    return [{**{k: v for k, v in group.items() if k != "params"},
             **{k: _as_floats(v) if k in _HYPERPARAMETERS else v for k, v in saved.items()},
             "state_dtypes": group["state_dtypes"], **{k: group[k] for k in ("master_rounding",) if k in group}}
            for saved, group in zip(saved_groups, groups)]


#: The group keys torch may hold as tensors that fp8amp's groups hold as Python numbers.
_HYPERPARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay")


def _as_floats(value):
    """A saved hyperparameter with its one-element tensors (a tuple's too: betas) as Python floats."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)  # (a host read, at load time only)
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(map(_as_floats, value))
    return value


def convert_state(state: dict, formats: tuple[torch.dtype, torch.dtype], where: str) -> None:
    """Brings a loaded param's moments into ``formats`` (exp_avg dtype, exp_avg_sq dtype), in
    place: real ones (float32, or a 16-bit param's dtype as torch keeps them) into scaled formats
    (quantized with current scaling) or float32, scaled ones into float32 (their real values,
    exactly) or, codes of another format, into the group's. Their values were checked by
    :func:`check_moments`. ``where`` names the param in messages. Also the optimizer's step's, for
    a moment set by hand (``state["exp_avg"] = torch.zeros_like(p)``): a float32 or bfloat16 moment
    is real values, its scale entries stale."""
    for (key, scale_key, scale_inv_key), dtype in zip(MOMENT_KEYS, formats):
        value = state.get(key)
        if value is None:
            continue
        scale_inv = state.get(scale_inv_key)
        if scale_inv is not None and value.dtype not in _CODES:  # (check_moments refuses this in a load)
            state.pop(scale_key, None)
            del state[scale_inv_key]
            scale_inv = None
        if isinstance(value, DTensor):
            _convert_sharded(state, (key, scale_key, scale_inv_key), dtype, where)
            continue
        if scale_inv is None:  # real values: torch's moments, float32 or a 16-bit param's dtype
            if dtype == torch.float32:
                state[key] = value.float()
            else:  # (float64 as torch's AdamW takes it: cast to float32 first)
                _quantize_into(state, (key, scale_key, scale_inv_key),
                               value.float() if value.dtype == torch.float64 else value, dtype)
        elif dtype == torch.float32:  # an O2 moment into O1: its real values, exactly
            state[key] = dequantize(value, scale_inv, torch.float32)
            state.pop(scale_key, None)
            state.pop(scale_inv_key, None)
        elif value.dtype != dtype:  # codes of another format (FP16 ones of exp_avg): through their real values
            _quantize_into(state, (key, scale_key, scale_inv_key), dequantize(value, scale_inv, torch.float32), dtype)


def _quantize_into(state: dict, keys: tuple[str, str, str], real: torch.Tensor, dtype: torch.dtype) -> None:
    """A moment's real values into ``state`` as ``dtype`` codes with a scale from their amax."""
    key, scale_key, scale_inv_key = keys
    codes, scale_inv, _ = quantize_current(real, dtype)
    state[key] = codes
    state[scale_key] = scale_inv.reciprocal()  # exact: a power of two
    state[scale_inv_key] = scale_inv


def check_moments(state: dict, where: str) -> None:
    """Refuses a saved param's state that no Adam saves (a corrupt or hand-edited checkpoint), before
    anything is loaded: a refused state dict leaves the optimizer as it was. A state that is not
    empty (a param never stepped has none) holds a step count, one whole number >= 0, and two
    finite floating-point moments, exp_avg_sq not negative; codes (E4M3, and FP16 in a state with
    scale entries: torch keeps a 16-bit param's moments in its dtype) come with one finite
    positive scale_inv. Sharded (DTensor) moments are checked as they convert (:func:`convert_state`)."""
    if not state:
        return
    missing = [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in state]
    if missing:
        raise ValueError(f"{where}: the saved state has no {' or '.join(map(repr, missing))} (it has "
                         f"{', '.join(map(repr, state))}); Adam's state of a param holds 'step', 'exp_avg' and "
                         "'exp_avg_sq': load a state dict of torch.optim.Adam / AdamW or fp8amp's optimizer, as saved")
    _check_step(state["step"], where)
    scaled = any(scale_inv_key in state for _, _, scale_inv_key in MOMENT_KEYS)
    for key, _, scale_inv_key in MOMENT_KEYS:
        value, scale_inv = state[key], state.get(scale_inv_key)
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        if not value.is_floating_point():
            raise ValueError(f"{where}: state {key!r} is {value.dtype}; a moment is a floating-point tensor")
        if scale_inv is not None and value.dtype not in _CODES:
            raise ValueError(f"{where}: state {key!r} is {value.dtype} beside {scale_inv_key!r}; scaled moments are "
                             "E4M3, E5M2 or FP16 codes: load the state dict as the optimizer saved it")
        if scale_inv is None and (value.dtype in _FP8_DTYPES or (scaled and value.dtype == torch.float16)):
            raise ValueError(f"{where}: state {key!r} is {value.dtype} codes without {scale_inv_key!r}, so its real "
                             "values are unknown; load the state dict as the optimizer saved it")
        _check_finite(value, scale_inv, key, where)
        if scale_inv is not None and not (scale_inv.numel() == 1 and bool((scale_inv > 0).all())):
            raise ValueError(f"{where}: state {scale_inv_key!r} must be one finite positive value, got "
                             f"{scale_inv.flatten()[:4].tolist()}; the checkpoint is corrupt")
        if key == "exp_avg_sq" and bool((value.float() < 0).any()):  # one host read per state, at load time only
            raise ValueError(f"{where}: state 'exp_avg_sq' holds a negative value; the checkpoint is corrupt (a "
                             "second moment is a mean of squares: its square root would make every step skipped)")


def _check_step(step, where: str) -> None:
    """Refuses a step count that is not one whole number >= 0 (a NaN one stayed NaN for good; a
    negative one gave bias corrections of the wrong sign, then 0 to divide by)."""
    if isinstance(step, DTensor):
        return
    count = torch.as_tensor(step)
    if count.numel() != 1:
        what = f"{count.numel()} values"
    elif not bool(count.isfinite().all()):
        what = "inf or NaN"
    elif float(count) < 0:
        what = "a negative count"
    elif float(count) != int(float(count)):
        what = "a fraction"
    else:
        return
    raise ValueError(f"{where}: state 'step' holds {what}; a step count is one whole number >= 0 (the checkpoint "
                     "is corrupt)")


def _check_finite(value: torch.Tensor, scale_inv: torch.Tensor | None, key: str, where: str) -> None:
    finite = value.float().isfinite().all() and (scale_inv is None or scale_inv.isfinite().all())
    if not finite:  # one host read per state, at load time only
        raise ValueError(f"{where}: state {key!r} holds inf or NaN; the checkpoint is corrupt (a step "
                         "from it would be skipped, and every step after it)")


def _convert_sharded(state: dict, keys: tuple[str, str, str], dtype: torch.dtype, where: str) -> None:
    """convert_state of one sharded (DTensor) moment: real values (float32, what
    real_sharded_moments saves, resharded or not by the checkpoint) are quantized shard by shard,
    each rank's shard with a new scale from its own amax; codes already in ``dtype`` (with their
    per-shard scales, a same-layout load) are kept."""
    key, scale_key, scale_inv_key = keys
    value = state[key]
    if value.dtype == dtype:
        return
    if value.dtype != torch.float32 or dtype == torch.float32:
        raise NotImplementedError(
            f"{where}: state {key!r} is {value.dtype} but the group stores it as {dtype}; a sharded (DTensor) "
            "param's state converts from float32 real values only (what fp8amp's optimizer saves under FSDP2): "
            "load the state dict before fully_shard, or build the optimizer with the state dict's state_dtypes")
    local = value._local_tensor
    _check_finite(local, None, key, where)
    codes, scale_inv, _ = quantize_current(local, dtype)
    state[key] = DTensor.from_local(codes, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                    stride=value.stride())
    state[scale_key] = one_per_shard(scale_inv.reciprocal(), value)  # exact: a power of two
    state[scale_inv_key] = one_per_shard(scale_inv, value)


def real_sharded_moments(state: dict) -> dict:
    """A param's state to save, its sharded (DTensor) scaled moments as float32 DTensors of their
    real values, sharded as before, and their per-shard scale entries left out; other states as
    they are (a new dict). A per-shard scale is a DTensor of one value a shard, which a checkpoint
    cannot reshard; real values it can."""
    state = dict(state)
    for key, scale_key, scale_inv_key in MOMENT_KEYS:
        value = state.get(key)
        if isinstance(value, DTensor) and isinstance(state.get(scale_inv_key), DTensor):
            real = dequantize(value._local_tensor, state.pop(scale_inv_key)._local_tensor, torch.float32)
            state.pop(scale_key, None)
            state[key] = DTensor.from_local(real, value.device_mesh, value.placements, run_check=False,
                                            shape=value.shape, stride=value.stride())
    return state


def one_per_shard(value: torch.Tensor, sharded: "DTensor") -> "DTensor":
    """A shard's [1] value as a DTensor of one value a shard, over the shard dims of ``sharded``
    (a param, or a state sharded as its param)."""
    mesh = sharded.device_mesh
    is_shard = [isinstance(pl, Shard) for pl in sharded.placements]
    shards = math.prod(mesh.size(i) for i, s in enumerate(is_shard) if s)
    placements = [Shard(0) if s else pl for s, pl in zip(is_shard, sharded.placements)]
    return DTensor.from_local(value, mesh, placements, run_check=False, shape=(shards,), stride=(1,))


class ScaledMoment(ScaledTensor):
    """An O2 moment as :meth:`fp8amp.optim.Adam.state_dict` saves it: the E4M3 or FP16 codes with
    their scale, one tensor whose logical dtype is float32.

    ``Tensor.to`` of it gives its real values as a plain tensor, always (also to its own dtype and
    device, where torch would return the tensor itself): that is the cast ``torch.optim``'s
    ``load_state_dict`` applies to every state, so a plain Adam/AdamW loading fp8amp's state dict
    holds real moments. :meth:`fp8amp.optim.Adam.load_state_dict` takes the codes and the scale
    back bit for bit."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            return args[0].dequantize().to(*args[1:], **kwargs)
        if func is torch.Tensor.__deepcopy__:  # keep the type (a ScaledTensor clone would not)
            moment = args[0]
            return ScaledMoment(moment.codes.clone(), moment.scale_inv.clone(), moment.dtype)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        # A clone or a detach comes back a ScaledTensor: made a moment again, so that a state dict
        # copied tensor by tensor (as checkpoint tools do) still loads as real values. (Not views:
        # a row view keeps its link to the moment it writes through.)
        if func in _MOMENT_COPIES and type(out) is ScaledTensor:
            return ScaledMoment(out.codes, out.scale_inv, out.dtype)
        return out

    def __reduce_ex__(self, protocol):
        # Pickled as plain tensors: loads under any map_location (torch refuses a callable one, as
        # Lightning passes, for tensor subclasses it rebuilds as wrappers). The codes as uint8:
        # pickle.loads of a float8 tensor fails in torch.
        codes = self.codes
        raw = codes.view(torch.uint8) if codes.dtype in _FP8_DTYPES else codes
        return _rebuild_moment, (raw, codes.dtype, self.scale_inv, self.dtype)


def _rebuild_moment(codes: torch.Tensor, codes_dtype: torch.dtype, scale_inv: torch.Tensor,
                    dtype: torch.dtype) -> ScaledMoment:
    return ScaledMoment(codes.view(codes_dtype), scale_inv, dtype)


# (ScaledMoment also under its former module's name, which older state dicts give.)
torch.serialization.add_safe_globals([_rebuild_moment, (ScaledMoment, "fp8amp.optim.ScaledMoment")])
_MOMENT_COPIES = (torch.Tensor.clone, torch.clone, torch.Tensor.detach, torch.detach)


def moments_with_scales(state: dict) -> dict:
    """A param's saved state: each scaled moment and its scale as one ScaledMoment (a new dict:
    torch's state_dict shares the live per-param dicts)."""
    state = dict(state)
    for key, scale_key, scale_inv_key in MOMENT_KEYS:
        if scale_inv_key in state and not isinstance(state[key], DTensor):
            state.pop(scale_key)
            state[key] = ScaledMoment(state[key], state.pop(scale_inv_key))
    return state


def moments_as_codes(state: dict) -> dict:
    """The inverse of moments_with_scales: codes, then the scale and scale_inv entries in the order
    the optimizer makes them (the scale is the exact reciprocal of a power of two)."""
    moments = {key: state[key] for key, _, _ in MOMENT_KEYS if isinstance(state.get(key), ScaledTensor)}
    state = {key: moments[key].codes if key in moments else value for key, value in state.items()}
    for key, scale_key, scale_inv_key in MOMENT_KEYS:
        if key in moments:
            state[scale_key] = moments[key].scale_inv.reciprocal()
            state[scale_inv_key] = moments[key].scale_inv
    return state


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: The dtypes of scaled moments' codes (O2's E4M3 exp_avg, FP16 exp_avg_sq; E5M2 loads too).
_CODES = (*_FP8_DTYPES, torch.float16)


def fp8_states_as_bytes(states: dict) -> defaultdict:
    """An optimizer's ``state`` (param -> its state dict) to pickle: each plain float8 tensor (O2's
    ``exp_avg`` codes) as a uint8 view of its bytes, its dtype kept under ``"_fp8_dtypes"``."""
    out = defaultdict(dict)
    for param, state in states.items():
        fp8 = {k: v.dtype for k, v in state.items() if type(v) is torch.Tensor and v.dtype in _FP8_DTYPES}
        out[param] = {**state, **{k: state[k].view(torch.uint8) for k in fp8}, "_fp8_dtypes": fp8} if fp8 else state
    return out


def fp8_states_from_bytes(states: dict) -> None:
    """The inverse of fp8_states_as_bytes, in place (states without ``"_fp8_dtypes"`` stay as they are)."""
    for state in states.values():
        for k, dtype in state.pop("_fp8_dtypes", {}).items():
            state[k] = state[k].view(dtype)
