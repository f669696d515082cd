"""``zckpt to-dcp``: a torch.distributed.checkpoint folder, for FSDP2 and torchtitan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .shared import (
    CHECKPOINT_HELP,
    Command,
    DebugOption,
    JsonOption,
    NoVerifyOption,
    QuietOption,
    SwapFolderOption,
    TagOption,
    Timer,
    TpRulesOption,
    WaitOption,
    app,
    checkpoint_and_tag,
    emit,
    primary_process,
    source_inputs,
    swap_notes,
    with_progress,
    write_report,
    written,
)


@app.command(
    "to-dcp",
    cls=Command,
    short_help="Write a torch DCP folder that FSDP2 / torchtitan resume.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt to-dcp runs/ckpt dcp/step-500\n"
        "  zckpt to-dcp runs/ckpt dcp/step-500 --dtype bf16   # bf16 weights"
    ),
)
def to_dcp(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            metavar="CHECKPOINT",
            help=CHECKPOINT_HELP,
        ),
    ],
    output_dir: Annotated[
        Path,
        typer.Argument(
            metavar="OUTPUT_DIR",
            help="The DCP folder to write (.metadata, __0_0.distcp, train_state.json); it appears whole or not at all.",
        ),
    ],
    tag: TagOption = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Dtype of the trainable params: fp32 (the exact masters; the default), or bf16/fp16 (rounded to nearest). Frozen params, buffers and optimizer states keep their saved dtype.",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace OUTPUT_DIR if it exists and is not empty.")
    ] = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
    debug: DebugOption = False,
    no_verify: NoVerifyOption = False,
    swap_folder: SwapFolderOption = None,
    tp_rules: TpRulesOption = None,
    wait: WaitOption = False,
) -> None:
    """Write a torch.distributed.checkpoint (DCP) folder holding {"model", "optim"} as get_state_dict returns them.

    A fresh model wrapped with FSDP2's fully_shard at any world size, with torch.optim.AdamW over
    the same param groups, resumes it with dcp.load and set_state_dict: fp32 masters, Adam
    moments, each param's step and the groups' hyperparameters. The counters, lr scheduler and
    client state go into OUTPUT_DIR/train_state.json.
    """
    from ..core.sizes import format_size
    from ..ops.dcp import to_dcp as run_to_dcp

    checkpoint, tag = checkpoint_and_tag(checkpoint, tag, debug)
    primary = primary_process()
    timer = Timer()
    result = with_progress(
        quiet or as_json or not primary,
        "converting",
        lambda progress: run_to_dcp(
            checkpoint,
            output_dir,
            tag=tag,
            dtype=dtype or "fp32",
            overwrite=overwrite,
            progress=progress,
            verify=not no_verify,
            swap_folder=swap_folder,
            tp_rules=tp_rules,
            wait=wait,
        ),
        debug,
    )
    if not primary:  # the first process of a torchrun job reports
        return
    source = result.source.index
    text = (
        f"wrote DCP of {source.tag} (ZeRO-{source.zero_stage}, world size {source.world_size}): "
        f"{len(result.source.params)} trainable params ({result.dtype.short}) "
        f"{'with their optimizer states' if result.source.state_names else 'without optimizer state (the checkpoint holds none)'}, "
        f"{result.tensors} tensors, {format_size(result.bytes_written)} -> {output_dir}"
    )
    notes = [*swap_notes(swap_folder, source.notes), *result.notes]
    obj = write_report(
        "to-dcp",
        inputs=source_inputs(checkpoint, source, swap_folder),
        outputs={"output_dir": str(output_dir), "dtype": result.dtype.short},
        files=written(output_dir, result.files),
        tensors=result.tensors,
        seconds=timer.seconds,
        notes=notes,
        params=len(result.source.params),
    )
    emit(as_json, quiet, obj, text, notes)
