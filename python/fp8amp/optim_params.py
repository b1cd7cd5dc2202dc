"""The checks of the params of a group of fp8amp's optimizer (fp8amp.optim), where the group is made:
what the fused step cannot take is refused naming the param and what works, before any step."""

from __future__ import annotations

import torch

from .dequantized_view import DequantizedView
from .formats import FP16, HIGH_PRECISION_DTYPES
from .master_weight import MasterWeight
from .optim_calls import local
from .scaled_tensor import ScaledTensor

__all__ = ["check_params"]


def check_params(name: str, params: list[torch.Tensor], k: int) -> None:
    """Refuses the params of group ``k`` the step cannot take (``name``: the optimizer's, for
    messages), and makes each O1/O2 master's kept amax now (a step Dynamo traces can use but not
    make it)."""
    first: dict[int, int] = {}
    for i, p in enumerate(params):
        if getattr(p, "_fp8amp_replaced_by_master", False):  # kept from before initialize
            raise ValueError(
                f"{name}: param {i} of group {k} is a Linear weight that fp8amp.initialize replaced by an "
                "FP16 master: stepping it would not train the model's layer; pass the model's parameters as "
                "they are after initialize (model.parameters(), or the layer's)")
        j = first.setdefault(id(p), i)
        if j != i:  # (the fused op refused it at the first step, naming its own lists)
            raise ValueError(f"{name}: param {i} of group {k} is param {j} of the same group; list each "
                             "param once (torch.optim warns that a duplicate will be an error)")
    for i, p in enumerate(map(local, params)):
        if isinstance(p, DequantizedView) and isinstance(p._viewed, MasterWeight):
            # fully_shard along a dim other than 0: the shard is a view, stepped as a plain param
            # while the forward gathers plain values the master check refuses.
            dims = [place.dim for place in params[i].placements if place.is_shard()]
            raise ValueError(
                f"{name}: param {i} of group {k} is a shard of an FP16 master along dim "
                f"{', '.join(map(str, dims))} (fully_shard's shard_placement_fn): O1/O2 masters shard by rows "
                "only; return Shard(0) (or None) from shard_placement_fn for the masters")
        if isinstance(p, ScaledTensor):
            if p.storage_format != FP16:
                raise ValueError(
                    f"{name}: a ScaledTensor param must hold float16 codes (the O1/O2 master); "
                    f"param {i} of group {k} holds {p.storage_format}")
            if isinstance(p, MasterWeight):
                p.kept_amax()  # made now: a step Dynamo traces can use but not make it
        elif p.dtype not in HIGH_PRECISION_DTYPES:  # (bfloat16/float16 ones step in float32)
            raise ValueError(
                f"{name}: params must be float32, bfloat16 or float16 tensors or FP16 ScaledTensors (the "
                f"master weights); param {i} of group {k} is {p.dtype}")
