"""The one table of exit codes: what each code means and which commands give it. ``zckpt --help``
renders it whole (:func:`table_text`); each command's help ends with its own line of it
(:func:`command_line`), so no help text carries a copy of its own.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

EVERY_COMMAND = "every command"


@dataclass(frozen=True)
class ExitCode:
    code: str  # "0", or "128+N" for the signals
    meaning: str  # the full sentence, for `zckpt --help` and the docs
    short: str  # a few words, for a command's own line
    commands: tuple[str, ...] = (EVERY_COMMAND,)
    per_command: tuple[tuple[str, str], ...] = ()  # (command, its few words) where they differ


SUCCESS = 0
BAD_INPUT = 1
USAGE = 2
ANSWER_NO = 3  # the command worked and the answer is no (incomplete, different, does not fit)
INTERRUPTED = 130  # 128 + SIGINT; any caught signal exits 128 + its number (SIGTERM: 143, SIGHUP: 129)

EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode("0", "success: the output is complete, or the answer is yes (complete, equal, fits).", "success"),
    ExitCode(
        "1",
        "bad input or a failed write: one line on stderr naming the file (--debug or ZCKPT_DEBUG=1: the traceback).",
        "bad input",
    ),
    ExitCode(
        "2",
        "bad usage: an unknown option, a bad value, options that contradict each other or the input.",
        "bad usage",
    ),
    ExitCode(
        "3",
        "the command worked and the answer is no: inspect found the input incomplete, verify found a problem, "
        "diff found A and B different, nvme-plan's settings exceed --memory-budget or --config's would fail.",
        "answer no",
        ("inspect", "verify", "diff", "nvme-plan"),
        (
            ("inspect", "incomplete"),
            ("verify", "a problem found"),
            ("diff", "A and B differ"),
            ("nvme-plan", "over budget, or --config would fail"),
        ),
    ),
    ExitCode(
        "128+N",
        "stopped by signal N before its output was complete (130 SIGINT/Ctrl-C, 143 SIGTERM, 129 SIGHUP), "
        "its temporary files removed; a signal after the output is complete changes nothing.",
        "signal N (130, 143)",
    ),
)

ERRORS_NOTE = "Under --json too an error is one line on stderr, with its exit code; stdout stays empty."


def codes_for(command: str) -> list[tuple[str, str]]:
    """(code, few words) for each code `command` can exit with."""
    rows = []
    for row in EXIT_CODES:
        if EVERY_COMMAND in row.commands or command in row.commands:
            rows.append((row.code, dict(row.per_command).get(command, row.short)))
    return rows


def command_line(command: str) -> str:
    """A command's line of the table, for the end of its help."""
    listed = ", ".join(f"{code} {words}" for code, words in codes_for(command))
    return f"Exit codes: {listed} (zckpt --help explains)."


def table_text(width: int = 76) -> str:
    """The whole table, as ``zckpt --help`` shows it (a click ``\\b`` block: kept as written)."""
    lines = ["\b", "Exit codes:"]
    for row in EXIT_CODES:
        lines += textwrap.wrap(f"{row.code:<6}{row.meaning}", width, initial_indent="  ", subsequent_indent=" " * 8)
    lines += textwrap.wrap(ERRORS_NOTE, width, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)
