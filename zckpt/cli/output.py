"""A command's last output, after which no signal changes its outcome.

Until its output is complete a termination signal stops a command (``.signals``: the cleanup
runs, one line, 128 + the signal). Once it is complete the command has finished: a signal then
(Ctrl-C pressed just after the summary line, a job scheduler's SIGTERM at the end of a step)
must neither print a second line nor change the exit code, and must not meet the default
action that Python puts back while the interpreter shuts down (killed, no line). :func:`finish`
prints the last lines with signals held and ignores them from then on.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import typer

from ..io.interrupts import CAUGHT_SIGNALS, handler_ran

_ARMED = [False]  # the CLI's own handlers are in place (main, not a test's in-process runner)


def arm() -> None:
    """Called once the CLI's signal handlers are in place: from then on finish() holds and ignores
    signals (an in-process caller, such as a test runner, keeps its own handlers)."""
    _ARMED[0] = True


def _armed() -> bool:
    return _ARMED[0] and threading.current_thread() is threading.main_thread()


def ignore_signals() -> None:
    """The command has finished: SIGINT, SIGTERM and SIGHUP are ignored until the process exits."""
    if not _armed():
        return
    for signum in CAUGHT_SIGNALS:
        if signal.getsignal(signum) is not None:  # None: set outside Python; left alone
            signal.signal(signum, signal.SIG_IGN)


def _held(_signum: int, _frame: Any) -> None:
    """A signal while the last lines are written: they are written all the same (a second one
    kills at once, should the write hang on a stalled pipe)."""
    handler_ran()
    for signum in CAUGHT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def finish(*lines: tuple[str, bool]) -> None:
    """Print a command's last lines, each (text, to stderr), in order; from then on signals are
    ignored: the output is complete, and the exit code is the command's."""
    for signum in CAUGHT_SIGNALS if _armed() else ():
        if signal.getsignal(signum) not in (signal.SIG_IGN, None):
            signal.signal(signum, _held)
    try:
        for text, err in lines:
            typer.echo(text, err=err)
    finally:
        ignore_signals()
