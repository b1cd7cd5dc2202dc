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

See docs/o1_o2.md#optimizer ("Loading a state dict").
"""

from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = ()

from .ops import quantize_current

__all__ = ["complete_groups", "convert_state", "MOMENT_KEYS"]

#: Each moment's state key with the keys of its scale and scale_inv (present when it is scaled).
MOMENT_KEYS = (("exp_avg", "exp_avg_scale", "exp_avg_scale_inv"),
               ("exp_avg_sq", "exp_avg_sq_scale", "exp_avg_sq_scale_inv"))


def complete_groups(saved_groups: list[dict], groups: list[dict]) -> list[dict]:
    """Copies of ``saved_groups``, each completed by the keys of the optimizer's group of the same
    index that it lacks (torch's own ``load_state_dict`` reports a different number of groups)."""
    return [{**{k: v for k, v in group.items() if k != "params"}, **saved}
            for saved, group in zip(saved_groups, groups)] + list(saved_groups[len(groups):])


def convert_state(state: dict, formats: tuple[torch.dtype, torch.dtype], where: str) -> None:
    """Brings a loaded param's moments into ``formats`` (exp_avg dtype, exp_avg_sq dtype) where
    they are float32 and the formats are scaled, in place; refuses non-finite moments. ``where``
    names the param in messages."""
    for (key, scale_key, scale_inv_key), dtype in zip(MOMENT_KEYS, formats):
        value = state.get(key)
        if value is None:
            continue
        scale_inv = state.get(scale_inv_key)
        if isinstance(value, DTensor):  # FSDP2: each shard would need its own scales
            if dtype != value.dtype:
                raise NotImplementedError(
                    f"{where}: state {key!r} is {value.dtype} but the group stores it as {dtype}; converting "
                    "the state of a sharded (DTensor) param is not supported: load the state dict before "
                    "fully_shard, or build the optimizer with the state dict's state_dtypes")
            continue
        finite = value.float().isfinite().all() and (scale_inv is None or scale_inv.isfinite().all())
        if not finite:  # one host read per state, at load time only
            raise ValueError(f"{where}: state {key!r} holds inf or NaN; the checkpoint is corrupt (a step "
                             "from it would be skipped, and every step after it)")
        if value.dtype == torch.float32 and dtype != torch.float32:
            codes, scale_inv, _ = quantize_current(value, dtype)
            state[key] = codes
            state[scale_key] = scale_inv.reciprocal()  # exact: a power of two
            state[scale_inv_key] = scale_inv
