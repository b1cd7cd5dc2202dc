"""Runs a test's function on several processes of this host joined by a gloo process group."""

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn, world: int, port: int, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world: int, *args) -> list:
    """``fn(rank, *args)`` on ``world`` spawned processes, each in the process group; returns what
    each rank's call returned, in rank order. ``fn`` must be a module-level function (it is
    pickled by name into the new processes)."""
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(fn, world, port, args, results), nprocs=world, join=True)
        return [results[r] for r in range(world)]
