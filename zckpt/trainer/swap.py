"""NVMe offload of ZeRO-3 optimizer sub-groups, in DeepSpeed's live swap layout.

A swapped sub-group's fp32 master and Adam moments live in three files of
``<nvme_path>/zero_stage_3/optimizer/rank<R>/`` (``<first>_<last>.tensor.swp``,
``exp_avg-<first>_<last>.tensor.swp``, ``exp_avg_sq-...``): raw fp32, zero-padded to the swap
rule's alignment, the names and sizes DeepSpeed's optimizer swapper gives them, so zckpt's swap
folder reader and the checkpoint writer read them as they read DeepSpeed's.

Its fp32 gradient lives in a fourth file, ``<first>_<last>_gradient_0_<numel>.tensor.swp``
(DeepSpeed's name for gradient swaps, ``optimizer_utils.get_or_create_gradient_paths``; DeepSpeed
writes one such file per param share, zckpt one per sub-group from offset 0). Backward hands each
param's reduce-scattered share to :meth:`OptimizerSwapper.put_gradient`: the I/O thread writes it
at the share's offset, or adds it to what an earlier micro-step wrote, with at most a few shares
in flight, so gradient accumulation takes a few shares' memory, not the model's.

The optimizer step streams the sub-groups through a fixed pool of page-aligned buffers (three
sets of four, fewer when fewer sub-groups are swapped): one background thread reads sub-group
i+1 and writes sub-group i-1 back while AdamW runs on sub-group i. The states of the first
sub-groups (one per buffer set) do not wait for the step: :meth:`OptimizerSwapper.read_ahead`
reads them on a second thread while the last micro-step computes, so the step starts on data
already in memory (the step waits on the disk, not on AdamW). Memory is the pool, whatever
the model's size. On local filesystems the whole blocks of the state files move with O_DIRECT
(no page-cache copy, as DeepSpeed's aio does) and a tail shorter than a block through the page
cache; elsewhere everything is buffered. Gradient files, written a share at a time at any
offset, are always buffered.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ..core.errors import OutputError
from ..deepspeed import names as N
from ..deepspeed.swap_folder import OPTIMIZER_DIR, STAGE_DIR
from ..io.direct_write import BLOCK, DIRECT_MIN_BYTES, wants_direct
from ..io.workers import WorkerPool

SWAP_KEYS = (None, "exp_avg", "exp_avg_sq")  # the master's file, then each Adam moment's
IN_FLIGHT = 3  # buffer sets: one being read, one in AdamW, one being written back
GRADIENT_SHARES_IN_FLIGHT = 4  # gradient shares handed to the I/O thread and not yet written


def live_optimizer_folder(nvme_path: str, rank: int) -> str:
    """DeepSpeed's live optimizer swap folder of `rank` (``rank<R>``, not zero-padded)."""
    return os.path.join(nvme_path, STAGE_DIR, OPTIMIZER_DIR, N.swap_rank_dir(rank))


@dataclass(frozen=True)
class SwappedGroup:
    """One swapped sub-group: flat group `flat`, `numel` elements per rank, files of `file_numel`."""

    flat: int
    numel: int
    file_numel: int
    first_ds_id: int
    last_ds_id: int

    def file_names(self) -> tuple[str, ...]:
        return tuple(N.swap_file_name(self.first_ds_id, self.last_ds_id, key) for key in SWAP_KEYS)

    def gradient_file_name(self) -> str:
        return N.swap_gradient_file_name(self.first_ds_id, self.last_ds_id, 0, self.numel)


@dataclass
class SwapCounters:
    """What the swapper moved, and the seconds its I/O thread spent moving it."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class OptimizerSwapper:
    """The swap files of one rank's swapped sub-groups and the buffer pool that streams them."""

    def __init__(self, folder: str, groups: Sequence[SwappedGroup], in_flight: int = IN_FLIGHT) -> None:
        self.folder = folder
        self.groups = {g.flat: g for g in groups}
        self.counters = SwapCounters()
        self.paths: dict[int, tuple[str, ...]] = {}  # the master's and the moments' files
        self.gradient_paths: dict[int, str] = {}
        self._fds: dict[int, list[tuple[int, int | None]]] = {}  # (buffered, O_DIRECT or None) per file
        self._gradient_fds: dict[int, int] = {}
        try:
            os.makedirs(folder, exist_ok=True)
            for group in groups:
                self.paths[group.flat] = tuple(os.path.join(folder, name) for name in group.file_names())
                self._fds[group.flat] = [self._create(path, group.file_numel * 4) for path in self.paths[group.flat]]
                self.gradient_paths[group.flat] = os.path.join(folder, group.gradient_file_name())
                self._gradient_fds[group.flat] = self._create(
                    self.gradient_paths[group.flat], group.numel * 4, direct=False
                )[0]
        except OSError as exc:
            self.close()
            raise OutputError(folder, f"cannot create the NVMe swap files: {exc.strerror or exc}") from exc
        largest = max((g.file_numel for g in groups), default=0)
        self.buffer_bytes = _round_up(max(largest * 4, 1), BLOCK)
        # three sets pipeline reads, AdamW and writes; fewer sub-groups than that need fewer.
        # A set: master, exp_avg, exp_avg_sq, gradient
        self._buffers = [
            [mmap.mmap(-1, self.buffer_bytes) for _ in range(len(SWAP_KEYS) + 1)]
            for _ in range(min(in_flight, len(groups)))
        ]
        self._views = [[torch.frombuffer(b, dtype=torch.float32) for b in slot] for slot in self._buffers]
        self._io = WorkerPool(1, "zckpt-swap")
        self._ahead_io = WorkerPool(1, "zckpt-swap-ahead")  # state reads ahead of the step
        self._ahead: dict[int, tuple[int, Future]] = {}  # flat -> (buffer set, its state read)
        self._counting = threading.Lock()  # both threads add to the counters
        self._gradient_writes: deque[Future] = deque()

    @property
    def pool_bytes(self) -> int:
        """Bytes of the buffer pool: all the memory the swapped optimizer state takes."""
        return sum(len(b) for slot in self._buffers for b in slot)

    @staticmethod
    def _create(path: str, size: int, direct: bool = True) -> tuple[int, int | None]:
        """A zero-filled swap file of `size` bytes: its buffered descriptor and, where the
        filesystem takes O_DIRECT (and `direct`), an O_DIRECT one (None elsewhere)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, size)
        if not direct or not wants_direct(
            path, DIRECT_MIN_BYTES
        ):  # the filesystem check (swap files stream whatever their size)
            return fd, None
        try:
            return fd, os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError:  # EINVAL: this filesystem refuses O_DIRECT after all
            return fd, None

    @staticmethod
    def _pieces(fds: tuple[int, int | None], size: int) -> list[tuple[int, int, int]]:
        """(descriptor, start, end): the whole blocks through O_DIRECT, the rest buffered."""
        fd, direct = fds
        cut = size // BLOCK * BLOCK if direct is not None else 0
        pieces = [(direct, 0, cut)] if direct is not None and cut else []
        return pieces + ([(fd, cut, size)] if cut < size else [])

    @property
    def direct(self) -> bool:
        """Whether the swap files move with O_DIRECT."""
        return any(direct is not None for fds in self._fds.values() for _, direct in fds)

    # -- streaming through the pool -------------------------------------------------------------
    def _submit(self, move, flat: int, slot: int, pool: WorkerPool | None = None) -> Future:
        """`move` (read or write) on the I/O thread (or `pool`'s); a failing disk becomes one clear error."""

        def run() -> None:
            try:
                move(flat, slot)
            except OSError as exc:
                raise OutputError(
                    self.folder, f"NVMe swap I/O of sub-group {flat} failed: {exc.strerror or exc}"
                ) from exc

        return (pool or self._io).submit(run)

    def _count(self, read: int = 0, written: int = 0, read_seconds: float = 0.0, write_seconds: float = 0.0) -> None:
        with self._counting:
            self.counters.bytes_read += read
            self.counters.bytes_written += written
            self.counters.read_seconds += read_seconds
            self.counters.write_seconds += write_seconds

    def _read(self, flat: int, slot: int) -> None:
        self._read_states(flat, slot)
        self._read_gradient(flat, slot)

    def _read_states(self, flat: int, slot: int) -> None:
        """Sub-group `flat`'s master and moments into buffer set `slot`."""
        started, size = time.perf_counter(), self.groups[flat].file_numel * 4
        for fds, buffer in zip(self._fds[flat], self._buffers[slot]):
            for fd, start, end in self._pieces(fds, size):
                pread_exactly(fd, memoryview(buffer)[start:end], start)
        self._count(read=3 * size, read_seconds=time.perf_counter() - started)

    def _read_gradient(self, flat: int, slot: int, states: Future | None = None) -> None:
        """Sub-group `flat`'s gradient into buffer set `slot` (once `states`, its read ahead, is done)."""
        if states is not None:
            states.result()
        started, gradient_size = time.perf_counter(), self.groups[flat].numel * 4
        pread_exactly(self._gradient_fds[flat], memoryview(self._buffers[slot][-1])[:gradient_size], 0)
        self._count(read=gradient_size, read_seconds=time.perf_counter() - started)

    def _write(self, flat: int, slot: int) -> None:
        started, size = time.perf_counter(), self.groups[flat].file_numel * 4
        for fds, buffer in zip(self._fds[flat], self._buffers[slot]):
            for fd, start, end in self._pieces(fds, size):
                pwrite_all(fd, memoryview(buffer)[start:end], start)
        self._count(written=3 * size, write_seconds=time.perf_counter() - started)

    # -- the first sub-groups' states, read while backward runs ---------------------------------
    def read_ahead(self, flats: Sequence[int]) -> None:
        """Start reading the states (not the gradients, still being written) of the first
        sub-groups :meth:`stream` will be given `flats`, each into the buffer set it will use,
        on the read-ahead thread. Call only while no stream is running (every buffer is free)."""
        for i, flat in enumerate(flats[: len(self._buffers)]):
            if flat not in self._ahead:
                self._ahead[flat] = (i, self._submit(self._read_states, flat, i, self._ahead_io))

    def drop_ahead(self) -> None:
        """Wait for the reads ahead and forget them (the step they were for is not coming, or a
        file they read is about to change); raises the first I/O error."""
        ahead, self._ahead = self._ahead, {}
        for _, future in ahead.values():
            future.result()

    # -- gradients, a share at a time during backward -------------------------------------------
    def put_gradient(
        self,
        flat: int,
        offset: int,
        grad: torch.Tensor,
        accumulate: bool,
        on_written: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Write the fp32 `grad` at element `offset` of sub-group `flat`'s gradient file, or add
        it to what is there (`accumulate`), on the I/O thread; `on_written` then gets the values
        the file now holds (on that thread). `grad` is the swapper's from now on. Waits while
        GRADIENT_SHARES_IN_FLIGHT shares are still on their way."""
        while len(self._gradient_writes) >= GRADIENT_SHARES_IN_FLIGHT:
            self._gradient_writes.popleft().result()
        self._gradient_writes.append(
            self._io.submit(self._put_gradient, flat, offset, grad.contiguous(), accumulate, on_written)
        )

    def _put_gradient(self, flat: int, offset: int, grad: torch.Tensor, accumulate: bool, on_written) -> None:
        started, fd, position = time.perf_counter(), self._gradient_fds[flat], offset * 4
        try:
            if accumulate:
                held = torch.empty_like(grad)
                pread_exactly(fd, memoryview(held.numpy()).cast("B"), position)
                grad = held.add_(grad)
                self._count(read=grad.numel() * 4)
            pwrite_all(fd, memoryview(grad.numpy()).cast("B"), position)
        except OSError as exc:
            raise OutputError(
                self.folder, f"NVMe swap of a gradient of sub-group {flat} failed: {exc.strerror or exc}"
            ) from exc
        self._count(written=grad.numel() * 4, write_seconds=time.perf_counter() - started)
        if on_written is not None:
            on_written(grad)

    def drain_gradients(self) -> None:
        """Wait until every gradient handed over is in its file (raises the first I/O error)."""
        while self._gradient_writes:
            self._gradient_writes.popleft().result()

    def stream(self, flats: Sequence[int]) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Yield (flat, [master, exp_avg, exp_avg_sq, gradient]) for each swapped sub-group in
        `flats`, the tensors views of pool buffers holding the file contents; what the caller
        changes in the first three is written back once it asks for the next one. Sub-group
        i+1 is read meanwhile (after every gradient handed over has been written); a sub-group
        whose states were read ahead (:meth:`read_ahead`) only needs its gradient read."""
        self.drain_gradients()
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}
        slots = len(self._buffers)
        ahead, self._ahead = self._ahead, {}

        def read(i: int) -> Future:
            slot, states = ahead.pop(flats[i], (None, None))
            if states is not None and slot == i % slots:
                return self._submit(lambda flat, slot: self._read_gradient(flat, slot, states), flats[i], slot)
            if states is not None:  # read ahead into another buffer set: read again
                states.result()
            return self._submit(self._read, flats[i], i % slots)

        try:
            if flats:
                reads[0] = read(0)
            for i, flat in enumerate(flats):
                reads.pop(i).result()
                if i + 1 < len(flats):
                    if i + 1 - slots in writes:  # the buffer set it reuses has been written back
                        writes.pop(i + 1 - slots).result()
                    reads[i + 1] = read(i + 1)
                numel = self.groups[flat].numel
                yield flat, [view[:numel] for view in self._views[i % slots]]
                writes[i] = self._submit(self._write, flat, i % slots)
        finally:
            for future in [*reads.values(), *writes.values(), *(f for _, f in ahead.values())]:
                future.result()

    # -- random access (initial masters, checkpoint loads, gathers) -----------------------------
    def read_range(self, flat: int, key: int, offset: int, count: int) -> np.ndarray:
        """`count` fp32 elements of sub-group `flat`'s file `key` (0 master, 1, 2 the moments)."""
        out = np.empty(count, dtype=np.float32)
        try:
            pread_exactly(self._fds[flat][key][0], memoryview(out).cast("B"), offset * 4)
        except OSError as exc:
            raise OutputError(self.folder, f"NVMe swap read of sub-group {flat} failed: {exc.strerror or exc}") from exc
        return out

    def write_range(self, flat: int, key: int, offset: int, values: np.ndarray) -> None:
        self.drop_ahead()  # a read ahead would hold the values before this write
        data = np.ascontiguousarray(values, dtype=np.float32)
        try:
            pwrite_all(self._fds[flat][key][0], memoryview(data).cast("B"), offset * 4)
        except OSError as exc:
            raise OutputError(
                self.folder, f"NVMe swap write of sub-group {flat} failed: {exc.strerror or exc}"
            ) from exc

    def flush(self) -> None:
        """Every swap file on the disk (before a checkpoint copies them)."""
        for fds in self._fds.values():
            for fd, _ in fds:
                os.fsync(fd)

    def close(self) -> None:
        if hasattr(self, "_io"):
            self._io.shutdown(wait=True)
            self._ahead_io.shutdown(wait=True)
            self._ahead = {}
        for fds in self._fds.values():
            for fd, direct in fds:
                os.close(fd)
                if direct is not None:
                    os.close(direct)
        for fd in self._gradient_fds.values():
            os.close(fd)
        self._fds, self._gradient_fds = {}, {}


def pread_exactly(fd: int, view: memoryview, position: int) -> None:
    """Fill `view` from `fd` at byte `position`; a short file is an error (OSError), not zeros."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], position + done)
        if count <= 0:
            raise OSError(f"the file ends before byte {position + len(view)}")
        done += count


def pwrite_all(fd: int, view: memoryview, position: int) -> None:
    """Write all of `view` to `fd` at byte `position` (pwrite may write less)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], position + done)
