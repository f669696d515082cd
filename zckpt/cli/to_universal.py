"""``zckpt to-universal``: DeepSpeed's universal checkpoint of any ZeRO checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .shared import (
    Command,
    NoVerifyOption,
    QuietOption,
    Stage,
    SwapFolderOption,
    TagOption,
    TpRulesOption,
    WaitOption,
    WorkersOption,
    app,
    primary_process,
    swap_notes,
    with_progress,
)


@app.command(
    "to-universal",
    cls=Command,
    short_help="Write DeepSpeed's universal checkpoint, for any world size.",
    epilog=(
        "\b\nExamples:\n"
        "  # writes global_step500_universal/ and latest_universal in runs/ckpt:\n"
        "  zckpt to-universal runs/ckpt runs/ckpt\n"
        "  zckpt to-universal runs/ckpt uc/ --target-stage 3   # for a ZeRO-3 run\n"
        "  # on a cluster the ranks split the params:\n"
        "  torchrun --nproc-per-node 8 ... -m zckpt to-universal big/ uc/"
    ),
)
def to_universal(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            metavar="CHECKPOINT",
            help="DeepSpeed checkpoint folder (holding 'latest'), one tag folder, or a universal folder.",
        ),
    ],
    output_dir: Annotated[
        Path,
        typer.Argument(
            metavar="OUTPUT_DIR",
            help="Folder to write <tag>_universal/ and latest_universal into (created if missing; may be the checkpoint folder itself).",
        ),
    ],
    tag: TagOption = None,
    target_stage: Annotated[
        Optional[Stage],
        typer.Option(
            "--target-stage",
            metavar="STAGE",
            help="ZeRO stage of the run that will load it: 1, 2 or 3 (default: the checkpoint's). DeepSpeed's ZeRO-1/2 and ZeRO-3 loaders read different files.",
        ),
    ] = None,
    workers: WorkersOption = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the universal folder if OUTPUT_DIR has it already.")
    ] = False,
    quiet: QuietOption = False,
    no_verify: NoVerifyOption = False,
    swap_folder: SwapFolderOption = None,
    tp_rules: TpRulesOption = None,
    wait: WaitOption = False,
) -> None:
    """Write DeepSpeed's universal checkpoint: one file per param and optimizer state, for any world size.

    A run with "checkpoint": {"load_universal": true} resumes it with engine.load_checkpoint(OUTPUT_DIR)
    at any world size: fp32 masters, every optimizer state, steps, loss scaler and lr scheduler.
    Works on any ZeRO 1/2/3 checkpoint (no universal_checkpoint_info needed), and across stages.
    """
    from ..core.sizes import format_size
    from ..ops.universal import to_universal as run_to_universal

    primary = primary_process()
    result = with_progress(
        quiet or not primary,
        "converting",
        lambda progress: run_to_universal(
            checkpoint,
            output_dir,
            tag=tag,
            target_stage=int(target_stage.value) if target_stage else None,
            overwrite=overwrite,
            workers=workers,
            progress=progress,
            verify=not no_verify,
            swap_folder=swap_folder,
            tp_rules=tp_rules,
            wait=wait,
        ),
    )
    if primary:
        swap_notes(swap_folder, result.source.index.notes, quiet)
    if not quiet and primary:
        source = result.source.index
        typer.echo(
            f"wrote {result.tag} for ZeRO-{result.target_stage} runs of any world size from {source.tag} (ZeRO-{source.zero_stage}, "
            f"world size {source.world_size}): {len(result.source.params)} params, {len(result.files)} files, "
            f"{format_size(result.bytes_written)} -> {output_dir}"
        )
