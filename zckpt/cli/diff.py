"""``zckpt diff``: two checkpoints or weights outputs compared tensor by tensor; exit 3 if they differ."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .errors import EXIT_DIFFERENT
from .shared import Command, NoVerifyOption, app, with_progress


@app.command(
    cls=Command,
    short_help="Compare two checkpoints or weights; exit 3 if they differ.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt diff runs/ckpt out/                  # vs its consolidation\n"
        "  zckpt diff runs/ckpt runs/ckpt-8 --states  # reshard kept every state?\n"
        "  zckpt diff out-fp32/ out-bf16/ --atol 1e-2\n"
        "  zckpt diff a/model.safetensors b/pytorch_model.bin --json | jq .differing\n\n"
        "Equal means: the same names and shapes, and every element within "
        "atol + rtol * |B| (NaN equals NaN at the same position); dtype differences are "
        "listed but do not count. Exit 0 equal, 3 different, 1 unreadable input, 2 bad option."
    ),
)
def diff(
    a: Annotated[
        Path,
        typer.Argument(
            metavar="A",
            help="A DeepSpeed checkpoint (folder, tag folder, checkpoint-N), a universal folder, or weights: a .safetensors or torch .bin/.pt file, an .index.json, or their folder.",
        ),
    ],
    b: Annotated[
        Path, typer.Argument(metavar="B", help="The same kinds as A; relative differences are taken against B.")
    ],
    atol: Annotated[
        float,
        typer.Option(
            "--atol", metavar="X", min=0.0, help="Absolute tolerance; with --rtol 0 too, values must be equal."
        ),
    ] = 0.0,
    rtol: Annotated[
        float, typer.Option("--rtol", metavar="Y", min=0.0, help="Relative tolerance, a multiple of |B|.")
    ] = 0.0,
    states: Annotated[
        bool,
        typer.Option(
            "--states",
            help="Also compare optimizer states (exp_avg, ..., steps, hyperparameters, counters); a side without them (weights) makes the states differ.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole report as JSON.")] = False,
    no_verify: NoVerifyOption = False,
) -> None:
    """Compare two checkpoints or weights outputs tensor by tensor, streaming (bounded memory).

    Reports names only in A or B, shape and dtype differences, and per tensor the max absolute
    and relative difference and how many elements differ. Values are compared in float64, so a
    bf16 output can be compared with fp32 masters (its dtype difference is reported too).
    """
    from ..ops.diff import diff as run_diff
    from ..ops.diff import render

    report = with_progress(
        False,
        "comparing",
        lambda progress: run_diff(a, b, atol=atol, rtol=rtol, states=states, progress=progress, verify=not no_verify),
    )
    for side in (report.a, report.b):
        for note in side.notes:
            typer.echo(f"note: {note}", err=True)
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else render(report))
    if not report.equal:
        raise typer.Exit(EXIT_DIFFERENT)
