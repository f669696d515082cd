"""Termination signals (SIGINT, SIGTERM, SIGHUP) become an exception only where that is safe.

The CLI turns a termination signal into an :class:`~zckpt.errors.Interrupted` exception raised
in the main thread, so the cleanup that runs for any error (temporary files, staging folders)
runs for a signal too. Python raises it at whatever bytecode the main thread is at, which is
harmless in zckpt's own code (every write is staged) but not inside a few pieces of bookkeeping
that must not be cut in half:

- ``Thread.start()`` waits for the new thread to run: an exception there leaves a started
  worker that ``concurrent.futures`` never registered, so nothing wakes it at interpreter exit
  and the process hangs forever in ``threading._shutdown`` (seen under load, where the wait is
  long). ``workers.WorkerPool`` starts its threads with signals held.
- ``zipfile.ZipFile.__init__`` cut before it set ``_writing`` leaves an object whose
  ``__del__`` prints a traceback ("Exception ignored in ... ZipFile.__del__") after the one-line
  error. :func:`uninterrupted` builds it with signals held.
- Renames that commit an output (``output.StagedOutput.commit``): all of them or none.

:func:`signals_deferred` holds the signals for such a block and delivers the first one when it
ends. Before the CLI is imported, :func:`exit_on_signal` answers a signal at start-up with the
same one line and exit code (nothing is written yet, so nothing needs cleaning).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Callable, Iterator, TypeVar

from .errors import Interrupted

CAUGHT_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

T = TypeVar("T")


def exit_now(signum: int) -> None:
    """One line on stderr and exit 128 + the signal's number, at once (no cleanup, no thread joins)."""
    os.write(2, f"zckpt: error: {Interrupted(signum)}\n".encode())
    os._exit(128 + signum)


def exit_on_signal() -> None:
    """Until the CLI installs its own handlers: a termination signal exits at once with the CLI's
    line and code, instead of a ``KeyboardInterrupt`` traceback from the middle of an import.
    A signal the parent ignores (``nohup``'s SIGHUP) stays ignored."""
    for signum in CAUGHT_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, lambda received, _frame: exit_now(received))


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold back SIGINT, SIGTERM and SIGHUP while the block runs; the first one received is
    delivered (to the handler that was in place) when it ends.

    The handlers are swapped for one that notes the signal. (A signal mask would not do: it is
    per thread, the kernel hands a signal sent to the process to any thread that leaves it
    unblocked, such as the CRC helper threads, and Python then runs the handler in the main
    thread all the same.) In other threads this does nothing: Python runs handlers, and so
    raises their exceptions, in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {}
    for signum in CAUGHT_SIGNALS:
        if signal.getsignal(signum) not in (signal.SIG_IGN, None):  # None: set outside Python; left alone
            previous[signum] = signal.signal(signum, lambda received, _frame: pending.append(received))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if pending:
            signal.raise_signal(pending[0])


def uninterrupted(build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``build(*args, **kwargs)`` with termination signals held: for constructors (such as
    ``zipfile.ZipFile``) whose half-built object misbehaves when it is collected."""
    with signals_deferred():
        return build(*args, **kwargs)
