"""Runs a test's function on several processes of this host joined by a gloo process group."""

import datetime
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn, world: int, port: int, args: tuple, results, backend: str = "gloo",
               timeout: datetime.timedelta | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)  # one GPU a rank
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    try:
        results[rank] = fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world: int, *args, backend: str = "gloo", timeout: datetime.timedelta | None = None) -> list:
    """``fn(rank, *args)`` on ``world`` spawned processes, each in the process group of
    ``backend`` (``"nccl"``: rank r on GPU r; ``timeout``: its collectives', default the
    backend's); returns what each rank's call returned, in rank order (CPU tensors: CUDA ones
    cannot cross the processes' manager). ``fn`` must be a module-level function (it is pickled by
    name into the new processes)."""
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(fn, world, port, args, results, backend, timeout), nprocs=world, join=True)
        return [results[r] for r in range(world)]


def error_of(call) -> str:
    """``"Type: message"`` of the error ``call()`` raises on a rank (where pytest.raises cannot reach:
    the result travels back to the test), or ``"no error"``."""
    try:
        call()
    except (ValueError, TypeError, RuntimeError, NotImplementedError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
