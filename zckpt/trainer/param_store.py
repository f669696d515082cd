"""Where a rank keeps its ZeRO-3 param shares (compute dtype): in a memory file, or with NVMe
offload of params in DeepSpeed's param swap files.

DeepSpeed's ``offload_param: nvme`` (``partitioned_param_swapper``) keeps each partition of at
least ``max(1 MiB, aio.block_size)`` bytes in
``<nvme_path>/zero_stage_3/<dtype>params/rank<R>/<ds_id>_param.tensor.swp`` (``bfloat16params``,
``float16params``, ``float32params``), the share from byte 0, padded to the aio alignment; the
smaller ones stay in memory. The store does the same: a gather reads the share from its file
(one param at a time, so memory holds the params in use, not the model), the optimizer step
writes the new values back. Unlike DeepSpeed, whose swap files lag until it evicts a param,
the files always hold the current values. Swap files move through the page cache (a share is
read by every gather, so the kernel's cache is the read-ahead).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Sequence

import torch

from ..core.errors import OutputError
from ..deepspeed import names as N
from ..deepspeed.swap_folder import STAGE_DIR
from ..deepspeed.swap_rules import SwapRule
from .arena import MemoryArena
from .swap import pread_exactly, pwrite_all


def live_param_folder(nvme_path: str, dtype: torch.dtype, rank: int) -> str:
    """DeepSpeed's live param swap folder of `rank` for params of `dtype`."""
    return os.path.join(nvme_path, STAGE_DIR, N.swap_params_dir(str(dtype).split(".")[1]), N.swap_rank_dir(rank))


class ParamStore:
    """The shares of every param (the plan's order, which is DeepSpeed's ds_id) of one rank."""

    def __init__(
        self, shares: Sequence[int], dtype: torch.dtype, folder: str | None = None, rule: SwapRule | None = None
    ) -> None:
        """`rule` is the run's swap rule; the store applies it to elements of `dtype`."""
        self.shares, self.dtype = tuple(shares), dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        rule = replace(rule, itemsize=self.itemsize) if rule is not None else None
        self.swapped = frozenset(
            i for i, share in enumerate(shares) if folder is not None and rule is not None and rule.swapped(share)
        )
        self.arena = MemoryArena(
            [0 if i in self.swapped else share * self.itemsize for i, share in enumerate(shares)], "zckpt-shards"
        )
        self.folder = folder
        self.rule = rule if folder is not None else None  # which shares the folder holds, how padded
        self.paths: dict[int, str] = {}
        self._fds: dict[int, int] = {}
        if self.swapped:
            assert folder is not None and rule is not None
            try:
                os.makedirs(folder, exist_ok=True)
                for index in sorted(self.swapped):
                    self.paths[index] = os.path.join(folder, N.swap_param_file_name(index))
                    fd = os.open(self.paths[index], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    self._fds[index] = fd
                    os.ftruncate(fd, rule.file_numel(shares[index]) * self.itemsize)
            except OSError as exc:
                self.close()
                raise OutputError(folder, f"cannot create the NVMe param swap files: {exc.strerror or exc}") from exc

    def view(self, index: int) -> torch.Tensor | None:
        """The share itself, where it is in memory (None for a swapped one)."""
        return None if index in self.swapped else self.arena.tensor(index, self.shares[index], self.dtype)

    def read(self, index: int) -> torch.Tensor:
        """Param `index`'s share (padding included): the memory view, or a fresh tensor read
        from its swap file."""
        held = self.view(index)
        if held is not None:
            return held
        out = torch.empty(self.shares[index], dtype=self.dtype)
        try:
            pread_exactly(self._fds[index], memoryview(out.view(torch.uint8).numpy()), 0)
        except OSError as exc:
            raise OutputError(self.paths[index], f"NVMe param swap read failed: {exc.strerror or exc}") from exc
        return out

    def write(self, index: int, values: torch.Tensor) -> None:
        """Set param `index`'s share to `values` (rounded to the compute dtype)."""
        held = self.view(index)
        if held is not None:
            held.copy_(values)
            return
        try:
            pwrite_all(
                self._fds[index], memoryview(values.detach().to(self.dtype).contiguous().view(torch.uint8).numpy()), 0
            )
        except OSError as exc:
            raise OutputError(self.paths[index], f"NVMe param swap write failed: {exc.strerror or exc}") from exc

    def location(self, index: int) -> tuple[str, int]:
        """(path, byte offset) of param `index`'s share: what the checkpoint writer copies."""
        if index in self.swapped:
            return self.paths[index], 0
        return self.arena.path, self.arena.byte_offset(index)

    def resident_bytes(self) -> int:
        """Bytes of shares held in memory."""
        return sum(self.shares[i] * self.itemsize for i in range(len(self.shares)) if i not in self.swapped)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
