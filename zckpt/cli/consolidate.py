"""``zckpt consolidate``: full weights from a ZeRO checkpoint, or a PEFT adapter folder or merged model."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import EXIT_USAGE, fail, guarded
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


class Format(str, enum.Enum):
    """The --format choices: the names of zckpt.ops.formats.FORMATS, then Lightning's single file
    (a test keeps them equal; spelled out here so that --help needs no import of the operations)."""

    safetensors = "safetensors"
    torch = "torch"
    lightning = "lightning"


def file_list(files: tuple[str, ...]) -> str:
    """The files written, short however many shards: all of two, else the first and a count."""
    return ", ".join(files) if len(files) <= 2 else f"{files[0]} ... ({len(files)} files)"


@app.command(
    cls=Command,
    short_help="Rebuild full weights, like zero_to_fp32.py (bit-identical).",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt consolidate runs/ckpt out/      # fp32 model.safetensors\n"
        "  zckpt consolidate runs/ckpt out/ --dtype bf16 --max-shard-size 2GB\n"
        "  zckpt consolidate runs/ckpt/global_step500 out/ --format torch\n"
        "  zckpt consolidate out/checkpoint-500 adapter/   # PEFT run: adapter folder\n"
        "  zckpt consolidate checkpoints/ out/ -f lightning   # lightning_model.pt\n"
        "  zckpt consolidate out/checkpoint-500 merged/ --merge-into base-model/\n"
        "  # on a cluster the processes split the bytes of every file:\n"
        "  torchrun --nproc-per-node 8 -m zckpt consolidate big/ out/\n\n"
        "zero_to_fp32.py's spellings work too: --max_shard_size, --exclude_frozen_parameters, "
        "-t, -d/--debug, and --safe_serialization (safetensors is the default here)."
    ),
)
def consolidate(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            metavar="CHECKPOINT",
            help=CHECKPOINT_HELP + " A PEFT run's checkpoint gives its adapter (see --peft).",
        ),
    ],
    output_dir: Annotated[
        Path,
        typer.Argument(
            metavar="OUTPUT_DIR",
            help="Folder for the weights (created if missing). Files appear only when all are complete.",
        ),
    ],
    tag: TagOption = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Dtype of floating tensors: fp32 (the exact masters; the default), or bf16/fp16 (rounded to nearest); float32, bfloat16 and float16 work too. Integer buffers keep their dtype. With --merge-into the default is the base model's dtype.",
        ),
    ] = None,
    format: Annotated[
        Format,
        typer.Option(
            "--format",
            "-f",
            metavar="FORMAT",
            help="safetensors (model.safetensors), torch (pytorch_model.bin pickle), or lightning (lightning_model.pt: the file PyTorch Lightning's convert_zero_checkpoint_to_fp32_state_dict writes, Lightning's state included; frozen params and buffers keep their saved dtype unless --dtype is given).",
        ),
    ] = Format.safetensors,
    max_shard_size: Annotated[
        str,
        typer.Option(
            "--max-shard-size",
            "--max_shard_size",
            metavar="SIZE",
            help="Largest shard before splitting into model-0000k-of-0000n files plus an index, e.g. 5GB, 500MB, 2GiB.",
        ),
    ] = "5GB",
    exclude_frozen: Annotated[
        bool,
        typer.Option(
            "--exclude-frozen",
            "--exclude_frozen_parameters",
            help="Leave out params that were frozen (requires_grad=False) in training.",
        ),
    ] = False,
    safe_serialization: Annotated[
        bool,
        typer.Option(
            "--safe_serialization",
            hidden=True,
            help="Accepted for zero_to_fp32.py's users: safetensors is already the default.",
        ),
    ] = False,
    peft: Annotated[
        Optional[bool],
        typer.Option(
            "--peft/--no-peft",
            help="A PEFT run's checkpoint: write PEFT's adapter folder (adapter_model.safetensors under PEFT's names, adapter_config.json, README.md). Default: when adapter_config.json is beside the checkpoint. --no-peft writes the raw tensors under their training names.",
            show_default=False,
        ),
    ] = None,
    merge_into: Annotated[
        Optional[Path],
        typer.Option(
            "--merge-into",
            metavar="BASE_DIR",
            help="Merge the PEFT LoRA adapter into this Hugging Face model folder (config.json + safetensors) and write the full merged model, streamed one base tensor at a time; equal to PEFT's merge_and_unload().",
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace weights files already in OUTPUT_DIR (stale shards are removed)."),
    ] = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
    debug: DebugOption = False,
    no_verify: NoVerifyOption = False,
    swap_folder: SwapFolderOption = None,
    tp_rules: TpRulesOption = None,
    wait: WaitOption = False,
    optimizer_states: Annotated[
        bool,
        typer.Option(
            "--optimizer-states",
            help="With --format lightning: add Lightning's optimizer_states (the fp32 masters' optimizer state, step and param groups, as torch.optim saves them), so that a Lightning Trainer without DeepSpeed resumes the whole run with Trainer.fit(ckpt_path=...). Lightning's converter writes none.",
        ),
    ] = False,
) -> None:
    """Rebuild full weights from a ZeRO 1/2/3 checkpoint (bit-identical to DeepSpeed's zero_to_fp32.py).

    Frozen params are kept, tied weights are written under every name, and the config and
    tokenizer files of a Hugging Face Trainer checkpoint-N folder are copied along. A PEFT
    run's checkpoint gives PEFT's adapter folder, or with --merge-into the merged model.
    --format lightning writes the one file PyTorch Lightning's converter writes.
    """
    from ..core.dtypes import output_dtype
    from ..core.run_folders import RUN_FOLDER_NOTES
    from ..core.sizes import format_size
    from ..ops.consolidate import consolidate as run_consolidate
    from ..ops.lightning import LEGACY_NOTE

    if safe_serialization and format is not Format.safetensors:
        fail(f"--safe_serialization asks for safetensors, but --format {format.value} was given", EXIT_USAGE)
    target = guarded(lambda: output_dtype(dtype), debug) if dtype is not None else None
    checkpoint, tag = checkpoint_and_tag(checkpoint, tag, debug)
    primary = primary_process()
    timer = Timer()
    result = with_progress(
        quiet or as_json or not primary,
        "consolidating",
        lambda progress: run_consolidate(
            checkpoint,
            output_dir,
            tag=tag,
            dtype=target,
            format=format.value,
            max_shard_size=max_shard_size,
            exclude_frozen=exclude_frozen,
            peft=peft,
            merge_into=merge_into,
            overwrite=overwrite,
            progress=progress,
            verify=not no_verify,
            swap_folder=swap_folder,
            wait=wait,
            optimizer_states=optimizer_states,
            tp_rules=tp_rules,
        ),
        debug,
    )
    if not primary:  # the first process of a torchrun job reports
        return
    index = result.index
    notes = [n for n in index.notes if n.startswith(RUN_FOLDER_NOTES) or n == LEGACY_NOTE]
    notes += [n for n in swap_notes(swap_folder, index.notes) if n not in notes]
    what = {"adapter": "PEFT adapter: ", "merged": f"adapter merged into {merge_into}: "}.get(result.peft or "", "")
    text = (
        f"wrote {what}{result.tensors} tensors ({format_size(result.bytes_written)}, {result.dtype.short}) from "
        f"{index.tag} (ZeRO-{index.zero_stage}, world size {index.world_size}) to {output_dir}: {file_list(result.files)}"
    )
    obj = write_report(
        "consolidate",
        inputs=source_inputs(
            checkpoint, index, swap_folder, merge_into=None if merge_into is None else str(merge_into)
        ),
        outputs={
            "output_dir": str(output_dir),
            "format": format.value,
            "dtype": result.dtype.short,
            "peft": result.peft,
        },
        files=written(output_dir, result.files),
        tensors=result.tensors,
        seconds=timer.seconds,
        notes=notes,
        tensor_bytes=result.bytes_written,
    )
    emit(as_json, quiet, obj, text, notes, notes_first=False)
