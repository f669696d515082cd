"""Thread pools for zckpt's helpers (checksums, reads ahead, O_DIRECT writes, swap I/O)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, Callable, TypeVar

from .interrupts import signals_deferred

T = TypeVar("T")


class WorkerPool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` that a termination signal cannot wedge.

    ``submit`` (which may start a thread) runs with signals held, so every thread it starts is
    registered for the wake-up at interpreter exit. Leaving a ``with`` block by an exception
    (an error, or a signal) cancels the work not yet started instead of running all of it, and
    waits only for the items already running (each a bounded chunk of I/O or arithmetic), so
    no helper touches a file after the caller's cleanup removed it."""

    def __init__(self, max_workers: int, name: str) -> None:
        super().__init__(max_workers, thread_name_prefix=name)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:  # type: ignore[override]
        with signals_deferred():
            return super().submit(fn, *args, **kwargs)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self.shutdown(wait=True, cancel_futures=exc_type is not None)
        return False
