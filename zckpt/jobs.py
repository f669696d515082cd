"""The processes of one torchrun job sharing a piece of work (a shared filesystem is assumed)."""

from __future__ import annotations

import os
from typing import Callable


def job_share() -> tuple[int, int, Callable[[], None] | None]:
    """(this process, process count, barrier) under torchrun; (0, 1, None) otherwise."""
    count = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if count <= 1:
        return 0, 1, None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), dist.barrier
