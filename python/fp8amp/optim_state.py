"""Loading an optimizer state dict into :class:`fp8amp.optim.Adam` / ``AdamW`` that another
optimizer saved: a plain ``torch.optim.Adam`` / ``AdamW`` (a run moved onto fp8amp, or the
optimizer passed into :func:`fp8amp.initialize`), or fp8amp's at another level.

- Param groups: torch's dict lacks fp8amp's keys (``state_dtypes``); each saved group takes
  them from the optimizer's group of the same index, so the level chosen at construction (by
  ``initialize``) stays. Then the group is checked as a new group would be (``amsgrad=True``...).
- States: moments held without a scale (float32) in a group whose ``state_dtypes`` stores them
  scaled (O2: E4M3 ``exp_avg``, FP16 ``exp_avg_sq``) are quantized into those formats with a
  power-of-two scale from their amax, the rule the optimizer's step uses, and the scale pair is
  added. Scaled moments are kept as saved (the op takes both kinds in one call).
- Every moment must be finite: an inf or NaN (a corrupt checkpoint) is a ``ValueError`` naming
  the param and the state, where the step would otherwise skip every step from then on.
- Sharded (FSDP2, DTensor) moments: :func:`real_sharded_moments` saves each scaled moment as a
  float32 DTensor of its real values, sharded as the param, without its per-shard scales, so that
  ``torch.distributed.checkpoint`` reshards it as any plain state; on load each rank's new shard is
  quantized with a new scale from its own amax (:func:`convert_state`). The codes and scales of a
  same-layout load are not kept as saved; the real values are, and the next step depends on them
  alone (docs/distributed.md#checkpoints).

See docs/o1_o2.md#optimizer ("Loading a state dict").
"""

from __future__ import annotations

import math

import torch

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without distributed
    DTensor = Shard = ()

from .ops import dequantize, quantize_current

__all__ = ["complete_groups", "convert_state", "real_sharded_moments", "one_per_shard", "MOMENT_KEYS"]

#: Each moment's state key with the keys of its scale and scale_inv (present when it is scaled).
MOMENT_KEYS = (("exp_avg", "exp_avg_scale", "exp_avg_scale_inv"),
               ("exp_avg_sq", "exp_avg_sq_scale", "exp_avg_sq_scale_inv"))


def complete_groups(saved_groups: list[dict], groups: list[dict]) -> list[dict]:
    """Copies of ``saved_groups``, each completed by the keys of the optimizer's group of the same
    index that it lacks, and with that group's ``state_dtypes``: the level stays the optimizer's,
    whatever level saved the state (torch's own ``load_state_dict`` reports a different number of
    groups)."""
    return [{**{k: v for k, v in group.items() if k != "params"}, **saved, "state_dtypes": group["state_dtypes"]}
            for saved, group in zip(saved_groups, groups)] + list(saved_groups[len(groups):])


def convert_state(state: dict, formats: tuple[torch.dtype, torch.dtype], where: str) -> None:
    """Brings a loaded param's moments into ``formats`` (exp_avg dtype, exp_avg_sq dtype), in
    place: real ones (float32, or a 16-bit param's dtype as torch keeps them) into scaled formats
    (quantized with current scaling) or float32, scaled ones into float32 (their real values,
    exactly); refuses non-finite moments and a negative exp_avg_sq.
    ``where`` names the param in messages."""
    for (key, scale_key, scale_inv_key), dtype in zip(MOMENT_KEYS, formats):
        value = state.get(key)
        if value is None:
            continue
        scale_inv = state.get(scale_inv_key)
        if isinstance(value, DTensor):
            _convert_sharded(state, (key, scale_key, scale_inv_key), dtype, where)
            continue
        _check_finite(value, scale_inv, key, where)
        if key == "exp_avg_sq" and bool((value < 0).any()):  # one host read per state, at load time only
            raise ValueError(f"{where}: state 'exp_avg_sq' holds a negative value; the checkpoint is corrupt (a "
                             "second moment is a mean of squares: its square root would make every step skipped)")
        if scale_inv is None:  # real values: torch's moments, float32 or a 16-bit param's dtype
            if dtype == torch.float32:
                state[key] = value.float()
            else:
                codes, scale_inv, _ = quantize_current(value, dtype)
                state[key] = codes
                state[scale_key] = scale_inv.reciprocal()  # exact: a power of two
                state[scale_inv_key] = scale_inv
        elif dtype == torch.float32:  # an O2 moment into O1: its real values, exactly
            state[key] = dequantize(value, scale_inv, torch.float32)
            state.pop(scale_key, None)
            state.pop(scale_inv_key, None)


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
