"""``zckpt verify``: judge a checkpoint or weights output before use; exit 3 on any problem.

:func:`render` writes the :class:`~zckpt.ops.verify.VerifyReport` as the readable verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..core.sizes import format_size
from .errors import EXIT_INCOMPLETE, guarded
from .shared import (
    Command,
    DebugOption,
    JsonOption,
    QuietOption,
    SwapFolderOption,
    TagOption,
    TpRulesOption,
    WorkersOption,
    app,
    default_workers,
    emit,
    primary_process,
    schema,
)

if TYPE_CHECKING:
    from ..ops.verify import VerifyReport


@app.command(
    cls=Command,
    short_help="Check a checkpoint before use; exit 3 on any problem.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt verify runs/ckpt                # every file, CRC, rank, state\n"
        "  zckpt verify runs/ckpt --scan         # also NaN/Inf in every tensor\n"
        "  zckpt verify uc/global_step500_universal\n"
        "  zckpt verify out/ --json | jq .ok\n"
        "  # on a cluster the processes split the reading (the first one reports):\n"
        "  torchrun --nproc-per-node 8 ... -m zckpt verify big/"
    ),
)
def verify(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="PATH",
            help="Any CHECKPOINT the writers take (see consolidate -h), weights (a folder, .safetensors, .index.json, torch .bin/.pt), or a ZeRO-Infinity swap folder.",
        ),
    ],
    tag: TagOption = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
    debug: DebugOption = False,
    scan: Annotated[bool, typer.Option("--scan", help="Also read every tensor and report NaN and Inf values.")] = False,
    workers: WorkersOption = None,
    checkpoint: Annotated[
        Optional[Path],
        typer.Option(
            "--checkpoint",
            metavar="CKPT",
            help="With a swap folder as PATH: a checkpoint of the same run, whose layout the swap files must fit.",
        ),
    ] = None,
    swap_folder: SwapFolderOption = None,
    tp_rules: TpRulesOption = None,
) -> None:
    """Judge a checkpoint before anyone runs on it: exit 0 when every check passes, 3 when any fails.

    Reads every byte: files present and parsing, every CRC-32, ranks consistent (world size, tag,
    version, sizes, which rank each file belongs to), optimizer state complete, no leftovers of
    an interrupted zckpt run, with --scan no NaN/Inf; and says the disk and memory each zckpt
    operation on it would need.
    """
    from ..ops.verify import verify as run_verify

    report = guarded(
        lambda: run_verify(
            path,
            tag=tag,
            scan=scan,
            workers=workers or default_workers(),
            checkpoint=checkpoint,
            swap_folder=swap_folder,
            tp_rules=tp_rules,
        ),
        debug,
    )
    if primary_process():  # the first process of a torchrun job reports; every one exits alike
        emit(
            as_json,
            quiet,
            {"schema": schema("verify"), **report.as_dict()},
            None if as_json or quiet else render(report),
        )
    if not report.ok:
        raise typer.Exit(EXIT_INCOMPLETE)


def render(report: VerifyReport) -> str:
    """The readable verdict: one line per check, the problems, the notes and the needs."""
    lines = [f"{report.path}: {report.kind.replace('_', ' ')}, {report.files} files, {format_size(report.bytes)}"]
    for check in report.checks:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[check.ok]
        lines.append(f"  {mark} {check.name}: {check.detail}")
    for problem in report.problems:
        lines.append(f"problem: {problem}")
    for note in report.notes:
        lines.append(f"note: {note}")
    if report.needs:
        lines.append("needs:")
        for need in report.needs:
            lines.append(
                f"  {need.operation}: {format_size(need.disk_bytes)} of disk, about {format_size(need.memory_bytes)} of memory"
            )
    lines.append(
        "verified: OK"
        if report.ok
        else f"verified: {len(report.problems)} problem{'s' * (len(report.problems) > 1)} found"
    )
    return "\n".join(lines)
