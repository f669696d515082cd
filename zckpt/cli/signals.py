"""Termination signals while a command runs: an exception inside its library call (so the cleanup
of temporary files and staging folders runs), one line and 128 + the signal's number outside it.
"""

from __future__ import annotations

import signal
from typing import Any

from ..core.errors import Interrupted
from ..io.interrupts import CAUGHT_SIGNALS, exit_now, handler_ran, raise_in_zckpt_code, watch_for_stuck_handlers
from .errors import RECEIVED, guarded
from .output import arm


def raise_interrupted(signum: int, frame: Any) -> None:
    """Turn a termination signal into an exception, so the cleanup of temporary files and
    staging folders runs as for Ctrl-C. A second signal kills at once (default action), in case
    the cleanup itself hangs; what it leaves the next run removes."""
    handler_ran()
    for caught in CAUGHT_SIGNALS:
        signal.signal(caught, signal.SIG_DFL)
    if not in_guarded_call(frame):
        # outside a command's library call (typer reading the command line, an import, the
        # summary line) nothing of ours is half-written: one line and 128 + the signal, at once
        # (typer would turn an exception into a silent exit 130, a callback would swallow it)
        exit_now(signum)
    RECEIVED.append(signum)
    raise_in_zckpt_code(Interrupted(signum), frame)


def in_guarded_call(frame: Any) -> bool:
    """Whether the code a signal interrupted runs inside `guarded` (a command's library call)."""
    while frame is not None:
        if frame.f_code is guarded.__code__:
            return True
        frame = frame.f_back
    return False


def catch_signals() -> None:
    for caught in CAUGHT_SIGNALS:
        if signal.getsignal(caught) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            signal.signal(caught, raise_interrupted)
    watch_for_stuck_handlers()
    arm()  # a command's last output (.output.finish): signals after it are ignored
