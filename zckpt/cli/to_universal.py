"""``zckpt to-universal``: DeepSpeed's universal checkpoint of any ZeRO checkpoint."""

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
    StageOption,
    SwapFolderOption,
    TagOption,
    Timer,
    TpRulesOption,
    WaitOption,
    WorkersOption,
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
    "to-universal",
    cls=Command,
    short_help="Write DeepSpeed's universal checkpoint, for any world size.",
    epilog=(
        "\b\nExamples:\n"
        "  # writes global_step500_universal/ and latest_universal in runs/ckpt:\n"
        "  zckpt to-universal runs/ckpt runs/ckpt\n"
        "  zckpt to-universal runs/ckpt uc/ --stage 3         # for a ZeRO-3 run\n"
        "  zckpt to-universal moe/ uc/ --expert-parallel 1   # MoE, for expert degree 1\n"
        "  zckpt to-universal tp/ uc/ --tensor-parallel 1   # AutoTP, as plain ZeRO-3\n"
        "  # on a cluster the ranks split the params:\n"
        "  torchrun --nproc-per-node 8 ... -m zckpt to-universal big/ uc/"
    ),
)
def to_universal(
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
            help="Folder to write <tag>_universal/ and latest_universal into (created if missing; may be the checkpoint folder itself).",
        ),
    ],
    tag: TagOption = None,
    stage: StageOption = None,
    workers: WorkersOption = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the universal folder if OUTPUT_DIR has it already.")
    ] = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
    debug: DebugOption = False,
    no_verify: NoVerifyOption = False,
    swap_folder: SwapFolderOption = None,
    tp_rules: TpRulesOption = None,
    wait: WaitOption = False,
    allow_state_loss: Annotated[
        bool,
        typer.Option(
            "--allow-state-loss",
            help="Write it even where DeepSpeed's universal loader would not restore part of the optimizer's state "
            "(said first; `zckpt reshard` keeps every state).",
        ),
    ] = False,
    expert_parallel: Annotated[
        Optional[int],
        typer.Option(
            "--expert-parallel",
            metavar="E",
            help="A mixture-of-experts checkpoint: the expert-parallel degree of the run that will load it (default: its own; DeepSpeed's loader finds experts by their local ids at its degree).",
        ),
    ] = None,
    tensor_parallel: Annotated[
        Optional[int],
        typer.Option(
            "--tensor-parallel",
            metavar="T",
            help="A tensor-parallel checkpoint (AutoTP, Megatron-style): 1 writes the unsharded model's, for a run without tensor parallelism; default: a folder DeepSpeed's loader cuts for any tensor ranks (AutoTP; Megatron-style at ZeRO-1/2 only).",
        ),
    ] = None,
) -> None:
    """Write DeepSpeed's universal checkpoint: one file per param and optimizer state, for any world size.

    A run with "checkpoint": {"load_universal": true} resumes it with engine.load_checkpoint(OUTPUT_DIR)
    at any world size: fp32 masters, every optimizer state, steps, loss scaler and lr scheduler.
    Works on any ZeRO 1/2/3 checkpoint (no universal_checkpoint_info needed), and across stages
    (--stage: DeepSpeed's ZeRO-1/2 and ZeRO-3 loaders read different files). Where DeepSpeed's loader
    would not restore a state (AMSGrad's max_exp_avg_sq at ZeRO-3, NAdam's mu_product, SGD at ZeRO-3),
    nothing is written and one line says what; --allow-state-loss writes it anyway.
    DeepSpeed's loader finds a MoE run's experts by their local ids, so --expert-parallel names the
    loading run's degree; --tensor-parallel 1 writes a tensor-parallel run for one without.
    """
    from ..core.sizes import format_size
    from ..ops.universal import to_universal as run_to_universal

    checkpoint, tag = checkpoint_and_tag(checkpoint, tag, debug)
    primary = primary_process()
    timer = Timer()
    result = with_progress(
        quiet or as_json or not primary,
        "converting",
        lambda progress: run_to_universal(
            checkpoint,
            output_dir,
            tag=tag,
            target_stage=int(stage.value) if stage else None,
            overwrite=overwrite,
            workers=workers,
            progress=progress,
            verify=not no_verify,
            swap_folder=swap_folder,
            tp_rules=tp_rules,
            wait=wait,
            allow_state_loss=allow_state_loss,
            expert_parallel=expert_parallel,
            tensor_parallel=tensor_parallel,
        ),
        debug,
    )
    if not primary:  # the first process of a torchrun job reports
        return
    source = result.source.index
    text = (
        f"wrote {result.tag} for ZeRO-{result.target_stage} runs of any world size from {source.tag} (ZeRO-{source.zero_stage}, "
        f"world size {source.world_size}): {len(result.source.params)} params, {len(result.files)} files, "
        f"{format_size(result.bytes_written)} -> {output_dir}"
    )
    notes = [*swap_notes(swap_folder, source.notes), *result.notes]
    if result.loss is not None:
        notes = [*notes, f"written with --allow-state-loss: {result.loss.describe()}"]
    names = [f"{result.tag}/{name}" for name in result.files] + ["latest_universal"]
    obj = write_report(
        "to-universal",
        inputs=source_inputs(checkpoint, source, swap_folder),
        outputs={"output_dir": str(output_dir), "tag": result.tag, "zero_stage": result.target_stage},
        files=written(output_dir, names),
        # each file under zero/ is one tensor (a param's fp32 master or one optimizer state)
        tensors=sum(1 for name in result.files if name.startswith("zero/") and name.count("/") == 2),
        seconds=timer.seconds,
        notes=notes,
        params=len(result.source.params),
    )
    emit(as_json, quiet, obj, text, notes)
