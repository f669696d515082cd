"""The ``zckpt`` command line: parse options, call one library function, print (the text of a
report is rendered here, in the command's module, never in the library). One module per command
registers it on the app (:mod:`.shared`); :mod:`.errors` maps errors to exit codes,
:mod:`.signals` turns termination signals into the cleanup that errors get.

Exit codes: 0 success; 1 bad input or a failed write (one line on stderr naming the file and
the problem; ``ZCKPT_DEBUG=1`` or ``--debug`` shows the traceback); 2 bad usage (unknown
option, bad value, options that contradict each other or the input); 3 ``inspect`` found the
checkpoint incomplete or inconsistent, or ``diff`` found A and B different (the command worked
and the answer is no, which a script can tell from 1, could not compare); 128 + the signal's number when stopped by a signal (130
SIGINT/Ctrl-C, 143 SIGTERM from kill, timeout or Slurm, 129 SIGHUP), after removing its
temporary files and staging folders.

``consolidate`` also takes zero_to_fp32.py's spellings (``--max_shard_size``,
``--exclude_frozen_parameters``, ``--safe_serialization``, ``-t``, ``-d``/``--debug``).
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from ..io.interrupts import exit_without_teardown
from ..io.jobs import leave_job
from .errors import EXIT_USAGE, RECEIVED
from .shared import app
from .signals import catch_signals

# each registers its command on `app` when imported, in this order: the order --help lists them
# isort: off
from . import consolidate, inspect, verify, reshard, to_universal, to_dcp, diff, nvme_plan, train  # noqa: F401
# isort: on

__all__ = ["app", "main"]


def _usage_line(error: Any) -> str:
    """click's usage error (three lines and a blank) as zckpt's one line, with where to look."""
    message = " ".join(error.format_message().replace("Value error, ", "").split())
    where = f" (see '{error.ctx.command_path} -h')" if getattr(error, "ctx", None) is not None else ""
    return f"zckpt: error: {message}{where}"


def main() -> None:
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
    from typer._click.exceptions import UsageError as ClickUsageError

    catch_signals()
    try:
        code = app(prog_name="zckpt", standalone_mode=False)
    except NoArgsIsHelpError as exc:  # `zckpt` or `zckpt COMMAND` alone: the help, as before
        exc.show()
        code = EXIT_USAGE
    except ClickUsageError as exc:  # an unknown option or command, a bad option value, a missing argument
        typer.echo(_usage_line(exc), err=True)
        code = EXIT_USAGE
    except ClickException as exc:
        typer.echo(f"zckpt: error: {exc.format_message()}", err=True)
        code = exc.exit_code
    code = code if isinstance(code, int) else 0
    leave_job(code)  # a torchrun process: out at once (see leave_job)
    if RECEIVED:
        # interrupted, and the cleanup has run: skip the interpreter's teardown. Its last
        # garbage collection and torch's static destructors (deregistering every operator) take
        # half a second of CPU, and the signal matrix saw them take over 20 s on a machine
        # running 8 processes on its 2 cores
        exit_without_teardown(code)
    sys.exit(code)
