"""Termination signals (SIGINT, SIGTERM, SIGHUP) become an exception only where that is safe.

The CLI turns a termination signal into an :class:`~zckpt.core.errors.Interrupted` exception raised
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

More generally, the exception is only ever raised in zckpt's own code, which is written for it
(every write staged, cleanup in ``finally``): :func:`raise_in_zckpt_code` raises at once when the
signal interrupted a zckpt frame, and otherwise (the main thread inside the standard library,
torch, an import, a garbage collector's callback) at the next line of a zckpt frame or the next
call a zckpt frame makes. The signal matrix once saw the exception raised inside importlib's
module-lock callback during garbage collection, after which the process never exited.

:func:`signals_deferred` holds the signals for such a block and delivers the first one when it
ends. Before the CLI is imported, :func:`exit_on_signal` answers a signal at start-up with the
same one line and exit code (nothing is written yet, so nothing needs cleaning).

Python runs a handler only between bytecodes of the main thread: while that thread waits inside
native code that retries on EINTR (a gloo collective or rendezvous waiting for a rank that
died, which waits up to its 30-minute timeout), no handler runs and the signal seems ignored.
:func:`watch_for_stuck_handlers` sees each signal arrive through ``signal.set_wakeup_fd`` on a
thread of its own and, when no handler has run :data:`GRACE_SECONDS` later while the process
waits on others (:func:`waiting_on_other_processes`), exits at once (what the run had staged is
then a dead run's leftovers, which the next run removes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from ..core.errors import Interrupted

CAUGHT_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

GRACE_SECONDS = 3.0  # a handler that has not run by then never will: the main thread is stuck in native code

TYPE_CHECKING = False  # not typing's: `zckpt` imports this module first thing, start-up time counts
if TYPE_CHECKING:
    from typing import Any, Callable, Iterator, TypeVar

    T = TypeVar("T")

_handled = [0]  # termination signals a Python-level handler has run for (the watchdog compares)
_armed = [0]  # threads now waiting on other processes
_armed_lock = threading.Lock()


def exit_now(signum: int, line: str | None = None) -> None:
    """One line on stderr and exit 128 + the signal's number, at once (no cleanup, no thread joins)."""
    os.write(2, f"zckpt: error: {line or Interrupted(signum)}\n".encode())
    os._exit(128 + signum)


def exit_without_teardown(code: int) -> None:
    """Flush stdout and stderr and exit with `code` at once, skipping the interpreter's teardown
    (thread joins, the last garbage collection, torch's static destructors): for a process whose
    work and cleanup are done but whose teardown can hang, abort or take seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def handler_ran() -> None:
    """Called first by every Python-level handler of a termination signal (see the watchdog)."""
    _handled[0] += 1


@contextlib.contextmanager
def waiting_on_other_processes() -> Iterator[None]:
    """Mark a stretch where this process may wait on others without end (collectives, a
    rendezvous, barriers): a termination signal whose handler cannot run there ends the process
    after :data:`GRACE_SECONDS` (see :func:`watch_for_stuck_handlers`). Any thread may enter it."""
    with _armed_lock:
        _armed[0] += 1
    try:
        yield
    finally:
        with _armed_lock:
            _armed[0] -= 1


def watch_for_stuck_handlers(grace: float = GRACE_SECONDS) -> None:
    """Exit with one line when a termination signal's handler has not run `grace` seconds after
    the signal arrived while the process waits on others (:func:`waiting_on_other_processes`).
    Elsewhere the main thread only waits on bounded I/O and gets to the handler. Call from the
    main thread, once handlers that call :func:`handler_ran` are in place."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)  # the C-level handler writes each signal's number here

    def watch() -> None:
        arrivals = 0
        while True:
            signum = os.read(read_end, 1)[0]
            if signum not in CAUGHT_SIGNALS:
                continue
            arrivals += 1
            deadline = time.monotonic() + grace
            while _handled[0] < arrivals:
                if _armed[0] and time.monotonic() >= deadline:
                    exit_now(
                        signum,
                        f"interrupted by {signal.Signals(signum).name}; exited at once: the process was waiting on other "
                        "processes (a rank gone?) where no handler runs; the next run removes what it staged",
                    )
                time.sleep(0.05)

    threading.Thread(target=watch, name="zckpt-signal-watch", daemon=True).start()


def exit_on_signal() -> None:
    """Until the CLI installs its own handlers: a termination signal exits at once with the CLI's
    line and code, instead of a ``KeyboardInterrupt`` traceback from the middle of an import.
    A signal the parent ignores (``nohup``'s SIGHUP) stays ignored."""
    for signum in CAUGHT_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, lambda received, _frame: exit_now(received))


def _note(pending: list[int]) -> Callable[[int, Any], None]:
    def note(received: int, _frame: Any) -> None:
        handler_ran()
        pending.append(received)

    return note


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
            previous[signum] = signal.signal(signum, _note(pending))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if pending:
            signal.raise_signal(pending[0])


# zckpt's own code is every module under the package folder: the parent of this module's zckpt/io/
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def in_zckpt_code(frame: Any) -> bool:
    return frame.f_code.co_filename.startswith(_PACKAGE_DIR)


def raise_in_zckpt_code(exc: BaseException, frame: Any) -> None:
    """Raise `exc` now if `frame` (where a signal handler interrupted the main thread) is zckpt
    code; otherwise as soon as the main thread runs a line of zckpt code or a zckpt frame makes a
    call (a trace function, on the main thread only, gone once it has fired)."""
    if in_zckpt_code(frame):
        raise exc
    previous = sys.gettrace()
    traced = []

    def fire() -> None:
        sys.settrace(previous)
        for marked in traced:
            marked.f_trace = None
        raise exc

    def tracer(current: Any, event: str, _arg: Any) -> Any:
        if event == "call" and current.f_back is not None and in_zckpt_code(current.f_back):
            fire()  # before the callee's first line: as if raised at the call in the zckpt frame
        if event == "line" and in_zckpt_code(current):
            fire()
        return tracer if in_zckpt_code(current) else None

    caller = frame
    while caller is not None:  # the zckpt frames below: their next line fires
        if in_zckpt_code(caller):
            caller.f_trace, caller.f_trace_lines = tracer, True
            traced.append(caller)
        caller = caller.f_back
    sys.settrace(tracer)


def uninterrupted(build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``build(*args, **kwargs)`` with termination signals held: for constructors (such as
    ``zipfile.ZipFile``) whose half-built object misbehaves when it is collected."""
    with signals_deferred():
        return build(*args, **kwargs)
