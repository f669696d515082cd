"""``zckpt reshard``: a checkpoint rewritten for another world size or ZeRO stage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import EXIT_USAGE, fail
from .shared import (
    CHECKPOINT_HELP,
    CONFIG_METAVAR,
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
    WorldSizeOption,
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
    cls=Command,
    short_help="Rewrite a checkpoint for another world size or ZeRO stage.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt reshard runs/ckpt runs/ckpt-4gpu -w 4     # same ZeRO stage, 4 ranks\n"
        "  zckpt reshard runs/ckpt out/ -w 3 --stage 3    # ZeRO-2 -> ZeRO-3, 3 ranks\n"
        "  zckpt reshard pp2/ pp3/ -w 1 --layer-partition 0,2,4,6  # 3 stages\n"
        "  zckpt reshard out/checkpoint-500 new/checkpoint-500 -w 8 \\\n"
        "      --config ds_config.json\n"
        "  # on a cluster the ranks split the files:\n"
        "  torchrun --nproc-per-node 8 ... -m zckpt reshard big/ out/ -w 512"
    ),
)
def reshard(
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
            help="Checkpoint folder to write (created if missing): latest, the tag folder, and the files beside it.",
        ),
    ],
    world_size: WorldSizeOption,
    stage: StageOption = None,
    tag: TagOption = None,
    config: Annotated[
        Optional[Path],
        typer.Option(
            "--config",
            metavar=CONFIG_METAVAR,
            help="The target run's DeepSpeed config JSON: its layout settings (round_robin_gradients, sub_group_size, parameter_alignment, ...) override the checkpoint's.",
        ),
    ] = None,
    workers: WorkersOption = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace the tag folder and carried files if OUTPUT_DIR has them already."),
    ] = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
    debug: DebugOption = False,
    no_verify: NoVerifyOption = False,
    swap_folder: SwapFolderOption = None,
    tp_rules: TpRulesOption = None,
    wait: WaitOption = False,
    pipeline_stages: Annotated[
        Optional[int],
        typer.Option(
            "--pipeline-stages",
            metavar="P",
            help="A pipeline-parallel checkpoint: 1 puts every layer in one stage (default: its own stages; --world-size is then the data-parallel ranks per stage).",
        ),
    ] = None,
    layer_partition: Annotated[
        Optional[str],
        typer.Option(
            "--layer-partition",
            metavar="0,A,B,..,L",
            help="A pipeline-parallel checkpoint cut into other stages: each new stage's first layer, then the layer count (the new run's PipelineModule `parts`, as it logs them: stage s holds layers parts[s] to parts[s+1]-1).",
        ),
    ] = None,
    tensor_parallel: Annotated[
        Optional[int],
        typer.Option(
            "--tensor-parallel",
            metavar="T",
            help="A tensor-parallel checkpoint (AutoTP, Megatron-style): 1 writes the unsharded model's, for a run without tensor parallelism; another T (Megatron-style runs, with pipeline stages too) cuts every param for T tensor ranks by its merge rules (default: its own tensor ranks).",
        ),
    ] = None,
    padded_vocab_size: Annotated[
        Optional[int],
        typer.Option(
            "--padded-vocab-size",
            metavar="V",
            help="With --tensor-parallel T, a Megatron-style run: the vocabulary rows the new run pads to (default: unpadded at T=1, else the rows saved; at most the rows saved).",
        ),
    ] = None,
    expert_parallel: Annotated[
        Optional[int],
        typer.Option(
            "--expert-parallel",
            metavar="E",
            help="A mixture-of-experts checkpoint: the new run's expert-parallel degree (default: its own; experts move between expert ranks; --world-size a multiple of it).",
        ),
    ] = None,
) -> None:
    """Rewrite a ZeRO checkpoint for another world size and/or ZeRO stage, with the whole training state.

    Stock DeepSpeed loads the output with a plain engine.load_checkpoint(OUTPUT_DIR) at the new
    world size: fp32 masters, optimizer states, steps, loss scaler, lr scheduler and client
    state exactly as saved. Files beside the tag folders (Trainer's config, trainer_state.json,
    ...) are copied along.
    """
    from ..core.sizes import format_size
    from ..ops.reshard import reshard as run_reshard

    if world_size < 1:
        fail(f"--world-size must be at least 1, got {world_size}", EXIT_USAGE)
    layer_parts = None
    if layer_partition is not None:
        try:
            layer_parts = tuple(int(part) for part in layer_partition.split(","))
        except ValueError:
            fail(f"--layer-partition {layer_partition}: comma-separated layer numbers are expected", EXIT_USAGE)
    checkpoint, tag = checkpoint_and_tag(checkpoint, tag, debug)
    primary = primary_process()
    timer = Timer()
    result = with_progress(
        quiet or as_json or not primary,
        "resharding",
        lambda progress: run_reshard(
            checkpoint,
            output_dir,
            world_size=world_size,
            stage=int(stage.value) if stage else None,
            tag=tag,
            config=config,
            overwrite=overwrite,
            workers=workers,
            progress=progress,
            verify=not no_verify,
            swap_folder=swap_folder,
            wait=wait,
            pipeline_stages=pipeline_stages,
            tp_rules=tp_rules,
            expert_parallel=expert_parallel,
            layer_partition=layer_parts,
            tensor_parallel=tensor_parallel,
            padded_vocab_size=padded_vocab_size,
        ),
        debug,
    )
    if not primary:  # the first process of a torchrun job reports
        return
    source = result.source.index
    dp = result.target.world_size
    out_stages = 1
    if result.source.stages:
        out_stages = len(layer_parts) - 1 if layer_parts else pipeline_stages or len(result.source.stages)
    tp = source.topology.tp if tensor_parallel is None else tensor_parallel
    world, shape = f"{dp * out_stages * tp}", ""
    if out_stages > 1 or tp > 1:
        parts = [f"{out_stages} pipeline stage{'s' * (out_stages != 1)}"] if out_stages > 1 else []
        parts += [f"{tp} tensor ranks"] if tp > 1 else []
        shape = f" ({' x '.join(parts)} x {dp} data-parallel rank{'s' * (dp != 1)})"
    if expert_parallel is not None:
        shape = f" (expert-parallel {expert_parallel}, was {source.topology.ep})"
    text = (
        f"wrote {result.tag} for world size {world}{shape} (ZeRO-{result.target.stage}) from world size "
        f"{source.world_size} (ZeRO-{source.zero_stage}): {len(result.files)} files, {format_size(result.bytes_written)}"
        + (f", {len(result.carried)} files carried" if result.carried else "")
        + (f", {len(result.dropped)} left out ({', '.join(result.dropped)})" if result.dropped else "")
        + f" -> {output_dir}"
    )
    notes = [*swap_notes(swap_folder, result.source.index.notes), *result.notes]
    names = [f"{result.tag}/{name}" for name in result.files] + ["latest", *result.carried]
    obj = write_report(
        "reshard",
        inputs=source_inputs(checkpoint, source, swap_folder),
        outputs={
            "output_dir": str(output_dir),
            "tag": result.tag,
            "zero_stage": result.target.stage,
            "world_size": int(world),
            "data_parallel": dp,
            "pipeline_stages": out_stages,
            "tensor_parallel": tp,
            "carried": list(result.carried),
            "left_out": list(result.dropped),
        },
        files=written(output_dir, names),
        tensors=None,  # the files hold flat partitions, not one tensor per param
        seconds=timer.seconds,
        notes=notes,
        params=len(result.source.params),
    )
    emit(as_json, quiet, obj, text, notes)
