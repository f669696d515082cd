"""``zckpt inspect``: what a checkpoint, weights file or swap folder holds; exit 3 if incomplete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import EXIT_INCOMPLETE, guarded
from .shared import Command, TagOption, app


@app.command(
    cls=Command,
    short_help="Describe a checkpoint or weights file; exit 3 if incomplete.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt inspect runs/ckpt              # summary of the tag in 'latest'\n"
        "  zckpt inspect runs/ckpt --json | jq .complete\n"
        "  zckpt inspect runs/ckpt --verify     # also check the CRC-32 checksums\n"
        "  zckpt inspect out/model.safetensors.index.json"
    ),
)
def inspect(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="PATH",
            help="A DeepSpeed checkpoint folder or tag folder, a consolidated folder, a .safetensors file, an .index.json, or a torch .bin/.pt file.",
        ),
    ],
    tag: TagOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full report as JSON.")] = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Also read every byte of the checkpoint files and check their CRC-32 checksums (a full pass over the data).",
        ),
    ] = False,
    checkpoint: Annotated[
        Optional[Path],
        typer.Option(
            "--checkpoint",
            metavar="CKPT",
            help="With a swap folder as PATH: a checkpoint of the same run, to name what each swap file holds, check the files against its layout and compare the 16-bit param swaps with the fp32 masters.",
        ),
    ] = None,
) -> None:
    """Tell what a checkpoint, weights file or live ZeRO-Infinity swap folder holds and whether it is complete (exit 3 if not)."""
    from ..ops.inspect import inspect_path, render

    report = guarded(lambda: inspect_path(path, tag, verify, checkpoint=checkpoint))
    typer.echo(json.dumps(report, indent=2) if as_json else render(report))
    if not report["complete"]:
        raise typer.Exit(EXIT_INCOMPLETE)
