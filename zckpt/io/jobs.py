"""The processes of one torchrun job sharing a piece of work (a shared filesystem is assumed)."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from ..core.errors import OutputError
from .interrupts import exit_without_teardown, waiting_on_other_processes

_GO, _WAITING, _FAILED = 0, 1, 2  # what a process brings to a barrier; the highest wins
GONE = (
    "another process of this job stopped answering (killed, or its node lost); "
    "the folder holds the previous output or the whole new one"
)


class JobFailed(OutputError):
    """Raised in a barrier: another process of the job failed (its own error says why)."""


class JobSync:
    """Barriers between the processes of one job that also carry bad news: a process that fails
    says so (:meth:`fail`) in the barrier the others wait in, and they raise instead of waiting
    for it or committing an output without its files. Process 0 may also answer a barrier with
    :meth:`waiting` (it waits for the output's lock, see ``output.OutputLock``): the others' barrier then
    goes on, in short collectives rather than one as long as the wait.

    `max_of(value)` is an all-reduce (max) over the job's processes; None for a process alone.
    `gather_of(value)` every process's `value` (an all-gather of small picklable objects, in
    process order). `path` is the output the job writes, named in the error; `part` is this
    process's index among the job's `parts`.

    A process that dies without a word (SIGKILL, its node lost) cannot say it failed: the others
    learn it from the collective they wait in, which fails (gloo: "Connection closed by peer")
    and raises :class:`JobFailed` too, not an internal error. So a worker that was not told
    leaves the staging folder alone (process 0 may be the one gone, its lock free, the staging
    folder soon another run's), and each process's line says the job's output is whole or the
    previous one (what the dead process left, the next run removes).
    """

    def __init__(
        self,
        max_of: Callable[[int], int] | None,
        path: str,
        gather_of: Callable[[Any], list[Any]] | None = None,
        part: int = 0,
        parts: int = 1,
    ) -> None:
        self.max_of = max_of
        self.gather_of = gather_of
        self.path = path
        self.part, self.parts = part, parts  # this process, and how many share the job
        self._told = False  # this process has said it failed, or heard another did: no more collectives

    def __call__(self) -> None:
        """Wait until every process arrives; raise if one of them failed."""
        while self.max_of is not None:
            news = self._collective(self.max_of, _GO)
            if news == _FAILED:
                self._told = True
                raise JobFailed(
                    self.path,
                    "another process of this job failed (its own error says why); the previous output is kept",
                )
            if news == _GO:
                return

    @property
    def alone(self) -> bool:
        """Whether this process works alone (no gathers: a job of one, or a barrier only)."""
        return self.gather_of is None

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value`, in process order ([value] alone). A collective: every
        process calls it at the same point, after a barrier (:meth:`__call__`) has told them
        that none failed, and nothing between the two may raise."""
        if self.gather_of is None:
            return [value]
        return self._collective(self.gather_of, value)

    def waiting(self) -> None:
        """Process 0, between tries of a lock held by another run: the others keep waiting."""
        if self.max_of is not None:
            self._collective(self.max_of, _WAITING)

    def _collective(self, call: Callable[[Any], Any], value: Any) -> Any:
        """`call(value)`; a collective failing because a process of the job is gone: JobFailed."""
        try:
            return call(value)
        except RuntimeError:  # torch's DistBackendError is one: a peer's connection closed, or a timeout
            self._told = True  # no more collectives: their peers are gone
            raise JobFailed(self.path, GONE) from None

    def fail(self) -> None:
        """Tell the others this process failed, once; they hear it in the barrier they wait in.
        Best effort: processes already gone (stopped by the same signal) are not waited for."""
        if self.max_of is None or self._told:
            return
        self._told = True
        try:
            self.max_of(_FAILED)
        except Exception:  # a collective whose peers are gone fails: this process's own error stands
            pass


def share_of(sizes: list[int], part: int, parts: int) -> list[int]:
    """Indices of the items (files, pieces, unread byte ranges; by size) process `part` of
    `parts` takes: biggest first, each to the least loaded process, so every process computes
    the same balanced split.

    >>> share_of([10, 1, 1, 10], 0, 2), share_of([10, 1, 1, 10], 1, 2)
    ([0, 1], [3, 2])
    """
    load = [0] * parts
    owner = {}
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        chosen = min(range(parts), key=lambda p: (load[p], p))
        owner[index] = chosen
        load[chosen] += sizes[index]
    return [i for i in sorted(owner, key=lambda i: (-sizes[i], i)) if owner[i] == part]


def job_share(path: str) -> tuple[int, int, JobSync]:
    """(this process, process count, barrier) under torchrun; (0, 1, a no-op barrier) otherwise.
    `path`: the output the job writes (named when another process fails)."""
    count = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if count <= 1:
        return 0, 1, JobSync(None, path)
    import torch
    import torch.distributed as dist

    def max_of(value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int64)
        with waiting_on_other_processes():  # a rank gone: only the signal watchdog ends the wait
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def gather_of(value: Any) -> list[Any]:
        found: list[Any] = [None] * dist.get_world_size()
        with waiting_on_other_processes():
            dist.all_gather_object(found, value)
        return found

    if not dist.is_initialized():
        with waiting_on_other_processes():
            dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    return rank, size, JobSync(max_of, path, gather_of, rank, size)


def leave_job(code: int) -> None:
    """End a process that joined a torch.distributed group at once, with `code` (output flushed):
    torch 2.13's gloo threads can abort the interpreter's exit ("terminate called without an
    active exception", SIGABRT instead of the command's exit code). Elsewhere does nothing."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        exit_without_teardown(code)
