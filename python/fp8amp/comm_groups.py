"""The process groups the FP8 all-reduce (fp8amp.distributed) runs its small collectives over, besides
the state's own: the chunks' amax communicator (:func:`amax_group`) and the group of the layout check
of ``all_reduce_grads`` (:func:`host_group`). Each is derived from the state's group once, not per
FP8CommState, and only where every rank of the world makes it: a group made by a subgroup's members
alone advances torch's count of groups on those ranks only, and torch names later groups from that
count, so a group made over the whole world afterwards hung in its rendezvous.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["device_backend", "amax_group", "host_group"]


def _registered(group) -> bool:
    """Whether torch still holds ``group`` (``dist.destroy_process_group`` drops it)."""
    try:
        dist.get_backend(group)
    except ValueError:
        return False
    return True


def _backend_config(group) -> str:
    """``dist.get_backend_config(group)``, which for a group torch no longer holds raised a TypeError
    from inside torch ("Invariant encountered: value was None")."""
    if group is not None and not _registered(group):
        raise ValueError("fp8amp.distributed: the FP8CommState's process_group was destroyed "
                         "(dist.destroy_process_group, or the world's, then init_process_group again): pass a group "
                         "made since, or None for the default group")
    return dist.get_backend_config(group)


def device_backend(group, device: torch.device) -> str:
    """The name of the backend that runs ``group``'s collectives on ``device``'s tensors. Not
    ``dist.get_backend(group)``: a group made without naming a backend (``init_process_group()``, as
    under torchrun) has one backend per device type, and get_backend says "undefined"."""
    for entry in _backend_config(group).split(","):  # e.g. "cpu:gloo,cuda:nccl"
        device_type, _, backend = entry.rpartition(":")
        if device_type in ("", device.type):  # no device type: one backend for all
            return backend
    return "none"


def _is_subgroup(group) -> bool:
    return group is not None and dist.get_world_size(group) < dist.get_world_size()


#: The communicators made from a process group, by (group, backend): made once per group, not per
#: FP8CommState, so that a state made per call or per bucket (``None`` as the hook's state) does not make
#: a new one (a gloo mesh, an NCCL communicator) every time. Keyed by the group itself, not its id,
#: which a group made after another was destroyed and collected may reuse.
_DERIVED_GROUPS: dict = {}


def _prune() -> None:
    """Forgets the groups derived from groups destroyed since (``dist.destroy_process_group``) and
    destroys those torch still holds, which would keep their communicators until the world is
    destroyed. Called where every rank of the world calls (the derived groups span it), so that
    every rank destroys them at the same point."""
    for key in [key for key in _DERIVED_GROUPS if not _registered(key[0])]:
        derived = _DERIVED_GROUPS.pop(key)
        if _registered(derived):
            dist.destroy_process_group(derived)


def _derived_group(group, backend: str):
    """A group of ``group``'s ranks on ``backend`` of its own, made once (collectively, by the first
    call, which every rank of ``group`` makes: ``group`` spans the world). Named from torch's count of
    groups, not with ``use_local_synchronization``, whose names torch 2.11 makes from the ranks alone:
    two groups over the same ranks (the amax and the host group, or one made again after a destroy)
    shared a name and so their rendezvous keys, and the ranks hung in the second's."""
    _prune()
    group = group if group is not None else dist.group.WORLD
    key = (group, backend)
    derived = _DERIVED_GROUPS.get(key)
    if derived is None:
        ranks = dist.get_process_group_ranks(group)
        derived = _DERIVED_GROUPS[key] = dist.new_group(ranks=ranks, backend=backend)
    return derived


def amax_group(group):
    """The group the chunks' amaxes are reduced over (fp8amp.comm_amax.ChunkAmaxes): ``group``'s ranks
    and backends in a communicator of their own, so that those small reductions run beside the
    chunks' data collectives instead of waiting behind them in one NCCL stream; a subgroup of the
    world itself (a group of its own would be made by its members alone)."""
    if _is_subgroup(group):
        return group
    return _derived_group(group, _backend_config(group))


def host_group(group, device: Optional[torch.device]) -> tuple:
    """The group and device over which the ranks compare the layouts of the gradients they reduce:
    ``group`` on the CPU where it runs CPU tensors (gloo), else a gloo group of the same ranks (a
    host-to-host all-reduce, which waits for no GPU work). A subgroup of the world without gloo
    compares over itself on ``device``, the gradients' (or, with none, its backend's current device):
    its host read then waits for the GPU work queued before it, where a gloo group of its own would
    be made by its members alone."""
    cpu = torch.device("cpu")
    if device_backend(group, cpu) == "gloo":
        return group, cpu
    if not _is_subgroup(group):
        return _derived_group(group, "gloo"), cpu
    if device is None:
        device_type = _backend_config(group).split(",")[0].rpartition(":")[0] or "cuda"
        index = None if device_type == "cpu" else torch.get_device_module(device_type).current_device()
        device = torch.device(device_type, index)
    return group, device
