"""The one table from the library's errors to exit codes: a command that fails says
one line on stderr (``zckpt: error: ...``, naming the file) and exits with the code its error's
type has in :data:`ERROR_EXITS` (what the codes mean: :mod:`.exit_codes`).
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import typer

from ..core.errors import Interrupted, UsageError, ZckptError
from .exit_codes import ANSWER_NO, BAD_INPUT, INTERRUPTED, USAGE
from .output import finish

# the codes by the names the commands use (their meanings: the table in .exit_codes)
EXIT_BAD_INPUT = BAD_INPUT
EXIT_USAGE = USAGE
EXIT_INCOMPLETE = ANSWER_NO
EXIT_DIFFERENT = ANSWER_NO  # diff: A and B differ; like inspect's 3, the command worked and the answer is no
EXIT_INTERRUPTED = INTERRUPTED  # 128 + SIGINT; any caught signal exits 128 + its number (SIGTERM: 143)

# What a library call's error makes the command say, and its exit code: the first type in this
# order that the error is (a UsageError is a ZckptError too; an Interrupted a KeyboardInterrupt).
ERROR_EXITS: tuple[tuple[type[BaseException], Callable[[Any], tuple[str, int]]], ...] = (
    (UsageError, lambda exc: (str(exc), EXIT_USAGE)),
    (ZckptError, lambda exc: (str(exc), EXIT_BAD_INPUT)),
    (Interrupted, lambda exc: (str(exc), 128 + exc.signum)),
    (KeyboardInterrupt, lambda exc: ("interrupted; nothing was written", EXIT_INTERRUPTED)),
    (MemoryError, lambda exc: ("out of memory", EXIT_BAD_INPUT)),
    # a bug, or bad input we failed to classify: still one line
    (
        Exception,
        lambda exc: (
            f"internal error: {type(exc).__name__}: {exc} (run with ZCKPT_DEBUG=1 for the traceback)",
            EXIT_BAD_INPUT,
        ),
    ),
)
ANSWERED = tuple(kind for kind, _ in ERROR_EXITS)

RECEIVED: list[int] = []  # the signal the handler (.signals) turned into an exception, for guarded()


def exit_for(exc: BaseException) -> tuple[str, int]:
    """The line a command says for `exc` and its exit code (see :data:`ERROR_EXITS`)."""
    return next(answer(exc) for kind, answer in ERROR_EXITS if isinstance(exc, kind))


def fail(message: str, code: int) -> None:
    """The one line on stderr, and exit `code`: the command has finished (see finish)."""
    finish((f"zckpt: error: {message}", True))
    raise typer.Exit(code)


def guarded(action: Callable[[], Any], debug: bool = False) -> Any:
    """Run a library call; turn its errors into one line and an exit code (:data:`ERROR_EXITS`)."""
    if debug or os.environ.get("ZCKPT_DEBUG"):
        try:
            return action()
        except Interrupted as exc:  # click would turn it into "Aborted!" and exit 1
            traceback.print_exc()
            raise typer.Exit(128 + exc.signum) from None
    RECEIVED.clear()
    try:
        try:
            result = action()
        except Exception:
            if RECEIVED:  # the signal's exception, wrapped on its way out (Python turns one raised
                raise Interrupted(RECEIVED[0]) from None  # in a class's __set_name__ into a RuntimeError)
            raise
        if RECEIVED:  # a signal whose exception a callback (a __del__, a weakref's) swallowed
            raise Interrupted(RECEIVED[0])
        return result
    except ANSWERED as exc:
        fail(*exit_for(exc))
