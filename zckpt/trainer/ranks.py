"""Run one function on W gloo ranks, a process each (torch.multiprocessing), and collect what
every rank returned: how the round trip runs its phases and the tests their distributed cases."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..io.interrupts import exit_without_teardown


def _entry(rank: int, world: int, folder: str, fn: Callable[..., Any], args: tuple, backend: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(folder, f"result{rank}.pt"))
    finally:
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    # torch 2.13's gloo threads can abort the interpreter's exit ("terminate called without an
    # active exception", about one run in four here); the result is saved: leave now
    exit_without_teardown(0)


def run_ranks(
    world: int, folder: str | os.PathLike[str], fn: Callable[..., Any], *args: Any, backend: str = "gloo"
) -> list[Any]:
    """fn(rank, world, *args) on every rank, in a process group made with `backend`; returns
    what each rank returned, by rank. One rank runs in this process (one thread, like a spawned
    rank), without a process group.

    `fn` must not tear down the group and make another: a rank whose init returns first would
    close its connections while a slower rank still completes its own side of the handshake
    ("Gloo connectFullMesh failed ... Connection closed by peer" under load)."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    if world == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [fn(0, 1, *args)]
        finally:
            torch.set_num_threads(threads)
    for stale in ["rendezvous", *(f"result{r}.pt" for r in range(world))]:  # a file rendezvous must start from no file
        if os.path.exists(os.path.join(folder, stale)):
            os.remove(os.path.join(folder, stale))
    mp.spawn(_entry, args=(world, folder, fn, args, backend), nprocs=world, join=True)
    return [torch.load(os.path.join(folder, f"result{rank}.pt"), weights_only=False) for rank in range(world)]
