"""Tensors in an anonymous memory file, readable by path like any file's bytes.

The trainer keeps its shards, fp32 masters and Adam moments here: the checkpoint writer then
streams them with the code that copies bytes between files (no copy into a scratch file, no
second writer), and NVMe offload swaps the same byte ranges to disk.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Sequence

import torch

_ALIGN = 64
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_big_frees_to_the_system(threshold: int = 1 << 20) -> bool:
    """Have glibc serve every allocation of `threshold` bytes or more with its own mapping,
    unmapped when freed.

    glibc raises its mmap threshold each time a big block is freed (up to 32 MiB), so the
    gathered params and gradients a ZeRO-3 step allocates and frees then come from the heap,
    which keeps the freed memory: resident memory grows with the model's depth although no
    more than a few params are alive at once (measured: scripts/trainer_memory.py). A fixed
    threshold stops that, at a price: every big block is then fresh pages the kernel must fault
    in and zero (measured: a 30% longer step). False where the C library has no mallopt."""
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


class MemoryArena:
    """One anonymous memory file (memfd) holding tensors at known byte offsets; its bytes are
    readable by path (``/proc/self/fd/N``) like any file's."""

    def __init__(self, sizes: Sequence[int], name: str = "zckpt-optimizer") -> None:
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // _ALIGN) * _ALIGN
        self.offsets = offsets
        self.fd = os.memfd_create(name)
        os.ftruncate(self.fd, max(total, _ALIGN))
        self._map = mmap.mmap(self.fd, max(total, _ALIGN))
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"

    def tensor(self, slot: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (
            torch.frombuffer(self._map, dtype=dtype, count=numel, offset=self.offsets[slot])
            if numel
            else torch.empty(0, dtype=dtype)
        )

    def byte_offset(self, slot: int) -> int:
        return self.offsets[slot]

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)
