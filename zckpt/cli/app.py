"""The ``zckpt`` command line: parse options, call one library function, print (the text of a
report is rendered here, in the command's module, never in the library). One module per command
registers it on the app (:mod:`.shared`); :mod:`.errors` maps errors to exit codes,
:mod:`.signals` turns termination signals into the cleanup that errors get.

The exit codes are one table, :mod:`.exit_codes`, which ``zckpt --help`` renders. The options
several commands take are defined once (:mod:`.shared`), one spelling per idea; old spellings
stay as hidden aliases (``to-universal --target-stage``, zero_to_fp32.py's ``--max_shard_size``,
``--exclude_frozen_parameters``, ``--safe_serialization``), and tests/test_cli/test_option_names.py
holds every command's options to one table of names. A command's last output goes through
:func:`.output.finish`, after which no signal changes the outcome.
"""

from __future__ import annotations

import sys
from typing import Any

from ..io.interrupts import exit_without_teardown
from ..io.jobs import leave_job
from .errors import EXIT_USAGE, RECEIVED
from .output import finish, ignore_signals
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
        finish((_usage_line(exc), True))
        code = EXIT_USAGE
    except ClickException as exc:
        finish((f"zckpt: error: {exc.format_message()}", True))
        code = exc.exit_code
    ignore_signals()  # finished (help, version, completion too): a signal now changes nothing
    code = code if isinstance(code, int) else 0
    leave_job(code)  # a torchrun process: out at once (see leave_job)
    if RECEIVED:
        # interrupted, and the cleanup has run: skip the interpreter's teardown. Its last
        # garbage collection and torch's static destructors (deregistering every operator) take
        # half a second of CPU, and the signal matrix saw them take over 20 s on a machine
        # running 8 processes on its 2 cores
        exit_without_teardown(code)
    sys.exit(code)
