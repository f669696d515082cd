"""The processes of one torchrun job sharing a piece of work (a shared filesystem is assumed)."""

from __future__ import annotations

import os
from typing import Callable

from .interrupts import waiting_on_other_processes


def job_share() -> tuple[int, int, Callable[[], None] | None]:
    """(this process, process count, barrier) under torchrun; (0, 1, None) otherwise."""
    count = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if count <= 1:
        return 0, 1, None
    import torch.distributed as dist

    def barrier() -> None:
        with waiting_on_other_processes():  # a rank gone: only the signal watchdog ends the wait
            dist.barrier()

    if not dist.is_initialized():
        with waiting_on_other_processes():
            dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), barrier
