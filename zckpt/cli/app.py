"""The ``zckpt`` command line: parse options, call one library function, print.

Exit codes: 0 success; 1 bad input or a failed write (one line on stderr naming the file and
the problem; ``ZCKPT_DEBUG=1`` or ``--debug`` shows the traceback); 2 bad usage (unknown
option, bad value, options that contradict each other or the input); 3 ``inspect`` found the
checkpoint incomplete or inconsistent, or ``diff`` found A and B different (the command worked
and the answer is no, which a script can tell from 1, could not compare); 128 + the signal's number when stopped by a signal (130
SIGINT/Ctrl-C, 143 SIGTERM from kill, timeout or Slurm, 129 SIGHUP), after removing its
temporary files and staging folders.

``consolidate`` also takes zero_to_fp32.py's spellings (``--max_shard_size``,
``--exclude_frozen_parameters``, ``--safe_serialization``, ``-t``, ``-d``/``--debug``).
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from typer.core import TyperCommand

from ..core.errors import Interrupted, UsageError, ZckptError
from ..io.interrupts import CAUGHT_SIGNALS, exit_now, exit_without_teardown, handler_ran, raise_in_zckpt_code, waiting_on_other_processes, watch_for_stuck_handlers
from ..io.jobs import leave_job

EXIT_BAD_INPUT = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT; any caught signal exits 128 + its number (SIGTERM: 143)


class _Command(TyperCommand):
    """Plain click help: ``CHECKPOINT OUTPUT_DIR`` in the usage line and the argument list,
    no type placeholders (``<path>``, ``<bool>``) where no value is taken."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar or param.name.upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        params = self.get_params(ctx)
        arguments = [(p.metavar or p.name.upper(), p.help or "") for p in params if p.param_type_name == "argument"]
        options = [r for p in params if p.param_type_name == "option" and (r := p.get_help_record(ctx))]
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


app = typer.Typer(
    name="zckpt",
    help=(
        "Read, consolidate, reshard and inspect DeepSpeed ZeRO checkpoints, without DeepSpeed and without running pickled code.\n\n"
        "Exit codes: 0 success; 1 bad input or failed write (one line naming the file; ZCKPT_DEBUG=1 for the traceback); "
        "2 bad usage; 3 inspect found the input incomplete, or diff found a difference; 130/143 interrupted by SIGINT/SIGTERM (temporary files removed)."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain click help: wrapped at 80 columns, the same on a terminal and in a pipe
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 80},
)


def _show_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"zckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    pass


class Format(str, enum.Enum):
    safetensors = "safetensors"
    torch = "torch"


TagOption = Annotated[
    Optional[str],
    typer.Option("--tag", "-t", metavar="TAG", help="Tag folder to read, e.g. global_step1000. Default: the one named in 'latest'."),
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary line.")]
WorkersOption = Annotated[Optional[int], typer.Option("--workers", metavar="N", min=1, help="Files written at once (default: two per CPU).")]
SwapFolderOption = Annotated[
    Optional[Path],
    typer.Option("--swap-folder", metavar="NVME_PATH", help="A live ZeRO-Infinity swap folder of the same run (the nvme_path, or its zero_stage_3/): CHECKPOINT, any checkpoint of the run, gives the layout; the swap folder the newest fp32 masters and optimizer states of every swapped sub-group."),
]
WaitOption = Annotated[bool, typer.Option("--wait", help="If another zckpt run is writing OUTPUT_DIR, wait until it ends instead of refusing, then write (the usual checks apply).")]
NoVerifyOption = Annotated[bool, typer.Option("--no-verify", help="Skip the CRC-32 check of the checkpoint records whose bytes are used (on by default; it costs one read of those bytes from the page cache).")]


def _fail(message: str, code: int) -> None:
    typer.echo(f"zckpt: error: {message}", err=True)
    raise typer.Exit(code)


def _guarded(action: Callable[[], Any], debug: bool = False) -> Any:
    """Run a library call; turn its errors into one line and an exit code."""
    if debug or os.environ.get("ZCKPT_DEBUG"):
        try:
            return action()
        except Interrupted as exc:  # click would turn it into "Aborted!" and exit 1
            traceback.print_exc()
            raise typer.Exit(128 + exc.signum) from None
    _RECEIVED.clear()
    try:
        try:
            result = action()
        except Exception:
            if _RECEIVED:  # the signal's exception, wrapped on its way out (Python turns one raised
                raise Interrupted(_RECEIVED[0]) from None  # in a class's __set_name__ into a RuntimeError)
            raise
        if _RECEIVED:  # a signal whose exception a callback (a __del__, a weakref's) swallowed
            raise Interrupted(_RECEIVED[0])
        return result
    except UsageError as exc:
        _fail(str(exc), EXIT_USAGE)
    except ZckptError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    except Interrupted as exc:
        _fail(str(exc), 128 + exc.signum)
    except KeyboardInterrupt:
        _fail("interrupted; nothing was written", EXIT_INTERRUPTED)
    except MemoryError:
        _fail("out of memory", EXIT_BAD_INPUT)
    except Exception as exc:  # a bug, or bad input we failed to classify: still one line
        _fail(f"internal error: {type(exc).__name__}: {exc} (run with ZCKPT_DEBUG=1 for the traceback)", EXIT_BAD_INPUT)


def _with_progress(quiet: bool, description: str, call: Callable[[Callable[[int, int], None]], Any], debug: bool = False) -> Any:
    """Run `call(progress)` guarded (see _guarded), with a progress bar while it runs."""
    update, close = _progress_bar(quiet, description)
    try:
        return _guarded(lambda: call(update), debug)
    finally:
        close()


def _primary_process() -> bool:
    """The first process of a torchrun job (or the only process): the one that reports."""
    return os.environ.get("RANK", "0") == "0"


def _file_list(files: tuple[str, ...]) -> str:
    """The files written, short however many shards: all of two, else the first and a count."""
    return ", ".join(files) if len(files) <= 2 else f"{files[0]} ... ({len(files)} files)"


def _progress_bar(quiet: bool, description: str) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A (callback, close) pair driving a tqdm bar on stderr, silent when quiet or not a terminal."""
    if quiet or not sys.stderr.isatty():
        return (lambda done, total: None), (lambda: None)
    from tqdm import tqdm

    # decimal units, as the summary line and every size zckpt prints (format_size): 405MB, 405 MB
    bar = tqdm(total=None, unit="B", unit_scale=True, unit_divisor=1000, desc=description, leave=False, file=sys.stderr)

    def update(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    return update, bar.close


@app.command(
    cls=_Command,
    short_help="Rebuild full weights, like zero_to_fp32.py (bit-identical).",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt consolidate runs/ckpt out/      # fp32 model.safetensors\n"
        "  zckpt consolidate runs/ckpt out/ --dtype bf16 --max-shard-size 2GB\n"
        "  zckpt consolidate runs/ckpt/global_step500 out/ --format torch\n"
        "  zckpt consolidate out/checkpoint-500 adapter/   # PEFT run: adapter folder\n"
        "  zckpt consolidate out/checkpoint-500 merged/ --merge-into base-model/\n\n"
        "zero_to_fp32.py's spellings work too: --max_shard_size, --exclude_frozen_parameters, "
        "-t, -d/--debug, and --safe_serialization (safetensors is the default here)."
    ),
)
def consolidate(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT", help="DeepSpeed checkpoint folder (holding 'latest'), or one tag folder inside it.")],
    output_dir: Annotated[Path, typer.Argument(metavar="OUTPUT_DIR", help="Folder for the weights (created if missing). Files appear only when all are complete.")],
    tag: TagOption = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", metavar="DTYPE", help="Dtype of floating tensors: fp32 (the exact masters; the default), or bf16/fp16 (rounded to nearest); float32, bfloat16 and float16 work too. Integer buffers keep their dtype. With --merge-into the default is the base model's dtype.")] = None,
    format: Annotated[Format, typer.Option("--format", "-f", metavar="FORMAT", help="safetensors (model.safetensors) or torch (pytorch_model.bin pickle).")] = Format.safetensors,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", "--max_shard_size", metavar="SIZE", help="Largest shard before splitting into model-0000k-of-0000n files plus an index, e.g. 5GB, 500MB, 2GiB.")] = "5GB",
    exclude_frozen: Annotated[bool, typer.Option("--exclude-frozen", "--exclude_frozen_parameters", help="Leave out params that were frozen (requires_grad=False) in training.")] = False,
    safe_serialization: Annotated[bool, typer.Option("--safe_serialization", help="Accepted for zero_to_fp32.py's users: safetensors is already the default.")] = False,
    peft: Annotated[Optional[bool], typer.Option("--peft/--no-peft", help="A PEFT run's checkpoint: write PEFT's adapter folder (adapter_model.safetensors under PEFT's names, adapter_config.json, README.md). Default: when adapter_config.json is beside the checkpoint. --no-peft writes the raw tensors under their training names.", show_default=False)] = None,
    merge_into: Annotated[Optional[Path], typer.Option("--merge-into", metavar="BASE_DIR", help="Merge the PEFT LoRA adapter into this Hugging Face model folder (config.json + safetensors) and write the full merged model, streamed one base tensor at a time; equal to PEFT's merge_and_unload().")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace weights files already in OUTPUT_DIR (stale shards are removed).")] = False,
    quiet: QuietOption = False,
    no_verify: NoVerifyOption = False,
    debug: Annotated[bool, typer.Option("--debug", "-d", help="Show the Python traceback of an error (as ZCKPT_DEBUG=1 does).")] = False,
    swap_folder: SwapFolderOption = None,
    wait: WaitOption = False,
) -> None:
    """Rebuild full weights from a ZeRO 1/2/3 checkpoint (bit-identical to DeepSpeed's zero_to_fp32.py).

    Frozen params are kept, tied weights are written under every name, and the config and
    tokenizer files of a Hugging Face Trainer checkpoint-N folder are copied along. A PEFT
    run's checkpoint gives PEFT's adapter folder, or with --merge-into the merged model.
    """
    from ..core.dtypes import output_dtype
    from ..core.run_folders import TRAINER_FOLDER_NOTE
    from ..core.sizes import format_size
    from ..ops.consolidate import consolidate as run_consolidate

    if safe_serialization and format is Format.torch:
        _fail("--safe_serialization asks for safetensors, but --format torch was given", EXIT_USAGE)
    target = _guarded(lambda: output_dtype(dtype), debug) if dtype is not None else None
    result = _with_progress(
        quiet,
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
        ),
        debug,
    )
    if not quiet:
        index = result.index
        what = {"adapter": "PEFT adapter: ", "merged": f"adapter merged into {merge_into}: "}.get(result.peft or "", "")
        typer.echo(
            f"wrote {what}{result.tensors} tensors ({format_size(result.bytes_written)}, {result.dtype.short}) from "
            f"{index.tag} (ZeRO-{index.zero_stage}, world size {index.world_size}) to {output_dir}: {_file_list(result.files)}"
        )
        for note in index.notes:
            if note.startswith(TRAINER_FOLDER_NOTE):
                typer.echo(f"note: {note}", err=True)
    _swap_notes(swap_folder, result.index.notes, quiet)


def _swap_notes(swap_folder: Path | None, notes: tuple[str, ...], quiet: bool) -> None:
    """With --swap-folder: say where the data came from (some may be the checkpoint's, older)."""
    if swap_folder is not None and not quiet:
        for note in notes:
            typer.echo(f"note: {note}", err=True)


@app.command(
    cls=_Command,
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
    path: Annotated[Path, typer.Argument(metavar="PATH", help="A DeepSpeed checkpoint folder or tag folder, a consolidated folder, a .safetensors file, an .index.json, or a torch .bin/.pt file.")],
    tag: TagOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full report as JSON.")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Also read every byte of the checkpoint files and check their CRC-32 checksums (a full pass over the data).")] = False,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", metavar="CKPT", help="With a swap folder as PATH: a checkpoint of the same run, to name what each swap file holds, check the files against its layout and compare the 16-bit param swaps with the fp32 masters.")] = None,
) -> None:
    """Tell what a checkpoint, weights file or live ZeRO-Infinity swap folder holds and whether it is complete (exit 3 if not)."""
    from ..ops.inspect import inspect_path, render

    report = _guarded(lambda: inspect_path(path, tag, verify, checkpoint=checkpoint))
    typer.echo(json.dumps(report, indent=2) if as_json else render(report))
    if not report["complete"]:
        raise typer.Exit(EXIT_INCOMPLETE)


@app.command(
    cls=_Command,
    short_help="Check a checkpoint before use; exit 3 on any problem.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt verify runs/ckpt                # every file, CRC, rank, state\n"
        "  zckpt verify runs/ckpt --scan         # also NaN/Inf in every tensor\n"
        "  zckpt verify uc/global_step500_universal\n"
        "  zckpt verify out/ --json | jq .ok"
    ),
)
def verify(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="A DeepSpeed checkpoint folder or tag folder, a universal folder, or consolidated weights (folder, .safetensors, .index.json, torch .bin).")],
    tag: TagOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full report as JSON.")] = False,
    scan: Annotated[bool, typer.Option("--scan", help="Also read every tensor and report NaN and Inf values.")] = False,
    workers: Annotated[Optional[int], typer.Option("--workers", metavar="N", min=1, help="Files read at once (default: 2).")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", metavar="CKPT", help="With a swap folder as PATH: a checkpoint of the same run, whose layout the swap files must fit.")] = None,
    swap_folder: SwapFolderOption = None,
) -> None:
    """Judge a checkpoint before anyone runs on it: exit 0 when every check passes, 3 when any fails.

    Reads every byte: files present and parsing, every CRC-32, ranks consistent (world size, tag,
    version, sizes, which rank each file belongs to), optimizer state complete, no leftovers of
    an interrupted zckpt run, with --scan no NaN/Inf; and says the disk and memory each zckpt
    operation on it would need.
    """
    from ..ops.verify import render, verify as run_verify

    report = _guarded(lambda: run_verify(path, tag=tag, scan=scan, workers=workers or 2, checkpoint=checkpoint, swap_folder=swap_folder))
    typer.echo(json.dumps(report.as_dict(), indent=2) if as_json else render(report))
    if not report.ok:
        raise typer.Exit(EXIT_INCOMPLETE)


class Stage(str, enum.Enum):
    one = "1"
    two = "2"
    three = "3"


@app.command(
    cls=_Command,
    short_help="Rewrite a checkpoint for another world size or ZeRO stage.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt reshard runs/ckpt runs/ckpt-4gpu -w 4     # same ZeRO stage, 4 ranks\n"
        "  zckpt reshard runs/ckpt out/ -w 3 --stage 3    # ZeRO-2 -> ZeRO-3, 3 ranks\n"
        "  zckpt reshard out/checkpoint-500 new/checkpoint-500 -w 8 \\\n"
        "      --config ds_config.json\n"
        "  # on a cluster the ranks split the files:\n"
        "  torchrun --nproc-per-node 8 ... -m zckpt reshard big/ out/ -w 512"
    ),
)
def reshard(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT", help="DeepSpeed checkpoint folder (holding 'latest'), one tag folder, or a Hugging Face checkpoint-N folder.")],
    output_dir: Annotated[Path, typer.Argument(metavar="OUTPUT_DIR", help="Checkpoint folder to write (created if missing): latest, the tag folder, and the files beside it.")],
    world_size: Annotated[int, typer.Option("--world-size", "-w", metavar="M", help="Data-parallel ranks of the run that will load it.")],
    stage: Annotated[Optional[Stage], typer.Option("--stage", metavar="STAGE", help="ZeRO stage of that run: 1, 2 or 3 (default: the checkpoint's).")] = None,
    tag: TagOption = None,
    config: Annotated[Optional[Path], typer.Option("--config", metavar="FILE", help="The target run's DeepSpeed config JSON: its layout settings (round_robin_gradients, sub_group_size, parameter_alignment, ...) override the checkpoint's.")] = None,
    workers: WorkersOption = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the tag folder and carried files if OUTPUT_DIR has them already.")] = False,
    quiet: QuietOption = False,
    no_verify: NoVerifyOption = False,
    swap_folder: SwapFolderOption = None,
    wait: WaitOption = False,
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
        _fail(f"--world-size must be at least 1, got {world_size}", EXIT_USAGE)
    primary = _primary_process()
    result = _with_progress(
        quiet or not primary,
        "resharding",
        lambda progress: run_reshard(
            checkpoint, output_dir, world_size=world_size, stage=int(stage.value) if stage else None, tag=tag,
            config=config, overwrite=overwrite, workers=workers, progress=progress, verify=not no_verify, swap_folder=swap_folder,
            wait=wait,
        ),
    )
    if primary:
        _swap_notes(swap_folder, result.source.index.notes, quiet)
    if not quiet and primary:
        source = result.source.index
        typer.echo(
            f"wrote {result.tag} for world size {result.target.world_size} (ZeRO-{result.target.stage}) from world size "
            f"{source.world_size} (ZeRO-{source.zero_stage}): {len(result.files)} files, {format_size(result.bytes_written)}"
            + (f", {len(result.carried)} files carried" if result.carried else "")
            + (f", {len(result.dropped)} left out ({', '.join(result.dropped)})" if result.dropped else "")
            + f" -> {output_dir}"
        )


@app.command(
    "to-universal",
    cls=_Command,
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
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT", help="DeepSpeed checkpoint folder (holding 'latest'), one tag folder, or a universal folder.")],
    output_dir: Annotated[Path, typer.Argument(metavar="OUTPUT_DIR", help="Folder to write <tag>_universal/ and latest_universal into (created if missing; may be the checkpoint folder itself).")],
    tag: TagOption = None,
    target_stage: Annotated[Optional[Stage], typer.Option("--target-stage", metavar="STAGE", help="ZeRO stage of the run that will load it: 1, 2 or 3 (default: the checkpoint's). DeepSpeed's ZeRO-1/2 and ZeRO-3 loaders read different files.")] = None,
    workers: WorkersOption = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the universal folder if OUTPUT_DIR has it already.")] = False,
    quiet: QuietOption = False,
    no_verify: NoVerifyOption = False,
    swap_folder: SwapFolderOption = None,
    wait: WaitOption = False,
) -> None:
    """Write DeepSpeed's universal checkpoint: one file per param and optimizer state, for any world size.

    A run with "checkpoint": {"load_universal": true} resumes it with engine.load_checkpoint(OUTPUT_DIR)
    at any world size: fp32 masters, every optimizer state, steps, loss scaler and lr scheduler.
    Works on any ZeRO 1/2/3 checkpoint (no universal_checkpoint_info needed), and across stages.
    """
    from ..core.sizes import format_size
    from ..ops.universal import to_universal as run_to_universal

    primary = _primary_process()
    result = _with_progress(
        quiet or not primary,
        "converting",
        lambda progress: run_to_universal(
            checkpoint, output_dir, tag=tag, target_stage=int(target_stage.value) if target_stage else None,
            overwrite=overwrite, workers=workers, progress=progress, verify=not no_verify, swap_folder=swap_folder,
            wait=wait,
        ),
    )
    if primary:
        _swap_notes(swap_folder, result.source.index.notes, quiet)
    if not quiet and primary:
        source = result.source.index
        typer.echo(
            f"wrote {result.tag} for ZeRO-{result.target_stage} runs of any world size from {source.tag} (ZeRO-{source.zero_stage}, "
            f"world size {source.world_size}): {len(result.source.params)} params, {len(result.files)} files, "
            f"{format_size(result.bytes_written)} -> {output_dir}"
        )


EXIT_DIFFERENT = 3  # diff: A and B differ; like inspect's 3, the command worked and the answer is no


@app.command(
    cls=_Command,
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
    a: Annotated[Path, typer.Argument(metavar="A", help="A DeepSpeed checkpoint (folder, tag folder, checkpoint-N), a universal folder, or weights: a .safetensors or torch .bin/.pt file, an .index.json, or their folder.")],
    b: Annotated[Path, typer.Argument(metavar="B", help="The same kinds as A; relative differences are taken against B.")],
    atol: Annotated[float, typer.Option("--atol", metavar="X", min=0.0, help="Absolute tolerance; with --rtol 0 too, values must be equal.")] = 0.0,
    rtol: Annotated[float, typer.Option("--rtol", metavar="Y", min=0.0, help="Relative tolerance, a multiple of |B|.")] = 0.0,
    states: Annotated[bool, typer.Option("--states", help="Also compare optimizer states (exp_avg, ..., steps, hyperparameters, counters); a side without them (weights) makes the states differ.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole report as JSON.")] = False,
    no_verify: NoVerifyOption = False,
) -> None:
    """Compare two checkpoints or weights outputs tensor by tensor, streaming (bounded memory).

    Reports names only in A or B, shape and dtype differences, and per tensor the max absolute
    and relative difference and how many elements differ. Values are compared in float64, so a
    bf16 output can be compared with fp32 masters (its dtype difference is reported too).
    """
    from ..ops.diff import diff as run_diff, render

    report = _with_progress(
        False, "comparing", lambda progress: run_diff(a, b, atol=atol, rtol=rtol, states=states, progress=progress, verify=not no_verify)
    )
    for side in (report.a, report.b):
        for note in side.notes:
            typer.echo(f"note: {note}", err=True)
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else render(report))
    if not report.equal:
        raise typer.Exit(EXIT_DIFFERENT)


@app.command(
    "nvme-plan",
    cls=_Command,
    short_help="ZeRO-3 NVMe swap settings that cannot fail; exit 3 if a given config would.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt nvme-plan Qwen3-0.6B/config.json             # settings, JSON to paste\n"
        "  zckpt nvme-plan runs/ckpt --config ds_config.json  # which settings fail\n"
        "  zckpt nvme-plan model/ --world-size 8 --memory-budget 32GB\n"
        "  zckpt nvme-plan model/ --json | jq .config_snippet\n\n"
        "Pinned memory and --memory-budget are per rank. Exit 0 when the plan fits the budget and "
        "the given config would not fail, 3 otherwise, 1 unreadable input, 2 bad option."
    ),
)
def nvme_plan(
    model: Annotated[Path, typer.Argument(metavar="MODEL", help="A DeepSpeed checkpoint, a weights file or folder (safetensors or torch, sharded or not), or a Hugging Face config.json (llama, mistral, qwen2, qwen3, gpt2).")],
    world_size: Annotated[Optional[int], typer.Option("--world-size", metavar="N", min=1, help="Ranks the run partitions over (default: a checkpoint's, else 1).")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", metavar="DTYPE", help="bf16, fp16 or fp32 (default: the config's, else the checkpoint's, else bf16).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", metavar="JSON", help="The run's DeepSpeed config: its aio, sub_group_size, pipelining and nvme_path are used, and each swap setting that would fail is named.")] = None,
    memory_budget: Annotated[Optional[str], typer.Option("--memory-budget", metavar="SIZE", help="Pinned host memory one rank may use, e.g. 8GB or 512MiB.")] = None,
    frozen: Annotated[bool, typer.Option("--frozen", help="Count every param of MODEL as frozen, as the base of a PEFT (LoRA) run is: no optimizer state, all kept on NVMe.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole report as JSON.")] = False,
) -> None:
    """Plan ZeRO-3 NVMe offload: offload_param buffer_size, buffer_count and max_in_cpu and
    offload_optimizer buffer_count with which DeepSpeed's swap-buffer assertions cannot fire,
    the pinned memory and swap-folder disk they cost, and cheaper alternatives."""
    from ..ops.nvme_plan import nvme_plan as plan_nvme, render

    report = _guarded(lambda: plan_nvme(model, world_size=world_size, dtype=dtype, config=config, memory_budget=memory_budget, frozen=frozen))
    typer.echo(json.dumps(report.as_dict(), indent=2) if as_json else render(report))
    if not report.ok:
        raise typer.Exit(EXIT_INCOMPLETE)


@app.command(
    cls=_Command,
    short_help="Train a small GPT with ZeRO-3; checkpoints in DeepSpeed's layout.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt train --steps 50                        # one process, nothing saved\n"
        "  torchrun --nproc-per-node 2 -m zckpt train --out runs/gpt --steps 200 \\\n"
        "      --save-every 100 --dtype bf16 --tie-embeddings\n"
        "  torchrun --nproc-per-node 3 -m zckpt train --out runs/gpt --steps 300 \\\n"
        "      --resume runs/gpt                         # bf16, tied, global batch 9\n"
        "\n"
        "On --resume the model shape, --dtype and --freeze are the checkpoint's (other values "
        "are refused); --lr, --warmup, --clip, --sub-group-size, --micro-batch, --grad-accum "
        "and --steps are the checkpoint's unless given; the global batch is kept across world "
        "sizes where a split gives it (a note says what was chosen)."
    ),
)
def train(
    out: Annotated[Optional[Path], typer.Option("--out", metavar="DIR", help="Checkpoint folder (latest, global_stepN/, model_config.json). Without it nothing is saved.")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, metavar="N", help="Optimizer steps to reach, counted from the start of the run (resumed steps included); the lr decay ends there. Default: 20; on --resume, the end of the checkpoint's schedule.", show_default=False)] = None,
    save_every: Annotated[Optional[int], typer.Option("--save-every", min=0, metavar="N", help="Save every N steps (default 0: only at the end).", show_default=False)] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", min=1, metavar="N", help="Transformer blocks (default 2).", show_default=False)] = None,
    dim: Annotated[Optional[int], typer.Option("--dim", min=1, metavar="N", help="Model width: embedding and hidden size (default 64; a multiple of --heads).", show_default=False)] = None,
    heads: Annotated[Optional[int], typer.Option("--heads", min=1, metavar="N", help="Attention heads per block (default 4).", show_default=False)] = None,
    vocab: Annotated[Optional[int], typer.Option("--vocab", min=1, metavar="N", help="Vocabulary size: token ids 0..N-1 (default 256; at least 256 with --data).", show_default=False)] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", min=1, metavar="N", help="Tokens per sequence, the model's context length (default 64).", show_default=False)] = None,
    micro_batch: Annotated[Optional[int], typer.Option("--micro-batch", min=1, metavar="N", help="Sequences per rank per micro-step (default 4).", show_default=False)] = None,
    grad_accum: Annotated[Optional[int], typer.Option("--grad-accum", min=1, metavar="N", help="Micro-steps per optimizer step (default 1).", show_default=False)] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", metavar="LR", help="Peak learning rate (default 0.001; DeepSpeed's WarmupDecayLR: linear warmup from 0, then linear decay to 0 at --steps).", show_default=False)] = None,
    warmup: Annotated[Optional[int], typer.Option("--warmup", min=0, metavar="N", help="Warmup steps (default 0: no warmup and no decay, a constant lr).", show_default=False)] = None,
    clip: Annotated[Optional[float], typer.Option("--clip", min=0.0, metavar="NORM", help="Gradient clipping by global norm (default 1.0; 0: none).", show_default=False)] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", metavar="DTYPE", help="Compute dtype: fp32 (default), bf16 or fp16 (dynamic loss scaling). Masters are fp32.", show_default=False)] = None,
    tie_embeddings: Annotated[Optional[bool], typer.Option("--tie-embeddings/--no-tie-embeddings", help="The lm head shares the token embedding (default: not).", show_default=False)] = None,
    freeze: Annotated[Optional[str], typer.Option("--freeze", metavar="REGEX", help="Freeze the params whose names match.")] = None,
    sub_group_size: Annotated[Optional[int], typer.Option("--sub-group-size", min=0, metavar="N", help="ZeRO-3 optimizer sub-group size (elements per rank), as DeepSpeed's (default 1000000000; 0: one sub-group per param).", show_default=False)] = None,
    nvme_path: Annotated[Optional[Path], typer.Option("--nvme-path", metavar="DIR", help="NVMe offload: the fp32 masters, Adam moments and gradients of sub-groups of at least 1 MiB per rank live in DeepSpeed's swap files under DIR/zero_stage_3/optimizer/rank<R>/, streamed through a fixed buffer pool; checkpoints get offloaded_tensors/.")] = None,
    nvme_params: Annotated[bool, typer.Option("--nvme-params", help="With --nvme-path, the param shares too (DeepSpeed's offload_param): those of at least 1 MiB per rank live in DIR/zero_stage_3/<dtype>params/rank<R>/<ds_id>_param.tensor.swp and are read when a module gathers them.")] = False,
    bounded_memory: Annotated[bool, typer.Option("--bounded-memory", help="Have glibc unmap every freed block of 1 MiB or more, so resident memory stays at the params in use, the swap buffers and the activations whatever the depth (with --nvme-params); steps take longer (measured 1.3-1.5x).")] = False,
    resume: Annotated[Optional[Path], typer.Option("--resume", metavar="PATH", help="Resume from a checkpoint: zckpt's, DeepSpeed's ZeRO-3, resharded or universal; any world size. Its model, dtype and schedule are taken from it (a checkpoint without model_config.json needs --layers --dim --heads --vocab --seq-len).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", min=0, metavar="N", help="Seed of the init and of the synthetic data stream (default 0; on --resume it only picks the data: give the first run's to continue its stream).", show_default=False)] = None,
    data: Annotated[Optional[Path], typer.Option("--data", metavar="FILE", help="A text file read as bytes (--vocab >= 256); default: deterministic synthetic tokens.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", metavar="DEVICE", help="auto (default), cpu or cuda. auto: each rank's GPU (cuda:LOCAL_RANK, nccl) when torch sees CUDA, else CPU (gloo). On CUDA the shares, optimizer and swap files stay in host memory.", show_default=False)] = None,
    quiet: QuietOption = False,
) -> None:
    """Train a GPT-style model with ZeRO-3 on torch.distributed (CPU and gloo, or CUDA and nccl).

    One process as is; several under torchrun. Checkpoints are DeepSpeed ZeRO-3 checkpoints
    (zero_to_fp32, zckpt consolidate and a DeepSpeed engine read them)."""
    from ..trainer import plan_training, train as run_train

    def text(path: Optional[Path]) -> Optional[str]:
        return None if path is None else str(path)

    options = dict(
        out=text(out), steps=steps, save_every=save_every, layers=layers, dim=dim, heads=heads, vocab=vocab, seq_len=seq_len,
        micro_batch=micro_batch, grad_accum=grad_accum, lr=lr, warmup=warmup, clip=clip, dtype=dtype.lower() if dtype else None,
        tie_embeddings=tie_embeddings, freeze=freeze, sub_group_size=sub_group_size, nvme_path=text(nvme_path), nvme_params=nvme_params or None,
        bounded_memory=bounded_memory or None, resume=text(resume), seed=seed, data=text(data), device=device.lower() if device else None,
    )
    plan = _guarded(lambda: plan_training({name: value for name, value in options.items() if value is not None}))
    config = plan.config
    if not quiet and _primary_process():
        for note in plan.notes:
            typer.echo(f"note: {note}", err=True)
    bar = None
    if not quiet and _primary_process() and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=config.steps, unit="step", desc="train", leave=False, file=sys.stderr)

    def on_step(log: Any) -> None:
        if quiet:
            return
        line = f"step {log.step}  loss {log.loss:.4f}  lr {log.lr:.3e}  tokens/s {log.tokens_per_s:,.0f}"
        line += "  (skipped: fp16 overflow)" if log.skipped else ""
        line += f"  saved {log.saved}" if log.saved else ""
        if bar is not None:
            bar.n = log.step
            bar.write(line)
            bar.refresh()
        else:
            typer.echo(line)

    # ranks wait on each other in collectives where no signal handler runs (a rank gone waits
    # out gloo's 30-minute timeout): the signal watchdog ends such a wait
    waits = waiting_on_other_processes() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else contextlib.nullcontext()
    try:
        with waits:
            result = _guarded(lambda: run_train(config, on_step))
    finally:
        if bar is not None:
            bar.close()
    if not quiet and _primary_process() and result.checkpoints and out is not None:
        typer.echo(f"wrote {out}/{result.checkpoints[-1]} ({result.global_steps} steps, {result.skipped_steps} skipped)")
    if not quiet and _primary_process() and result.swapped_sub_groups is not None:
        swapped, total = result.swapped_sub_groups
        typer.echo(f"NVMe offload: {swapped} of {total} optimizer sub-groups per rank in {nvme_path}/zero_stage_3/optimizer/ "
                   "(DeepSpeed swaps those of at least 1 MiB of fp32 per rank)")
    if not quiet and _primary_process() and result.swapped_params is not None:
        swapped, total, folder = result.swapped_params
        typer.echo(f"NVMe offload: {swapped} of {total} params per rank in {folder}/ (those of at least 1 MiB per rank)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torch 2.13's gloo threads can abort a rank's interpreter exit ("terminate called without
        # an active exception"), which torchrun reports as a failed job; everything is written
        exit_without_teardown(0)


def _raise_interrupted(signum: int, frame: Any) -> None:
    """Turn a termination signal into an exception, so the cleanup of temporary files and
    staging folders runs as for Ctrl-C. A second signal kills at once (default action), in case
    the cleanup itself hangs; what it leaves the next run removes."""
    handler_ran()
    for caught in CAUGHT_SIGNALS:
        signal.signal(caught, signal.SIG_DFL)
    if not _in_guarded_call(frame):
        # outside a command's library call (typer reading the command line, an import, the
        # summary line) nothing of ours is half-written: one line and 128 + the signal, at once
        # (typer would turn an exception into a silent exit 130, a callback would swallow it)
        exit_now(signum)
    _RECEIVED.append(signum)
    raise_in_zckpt_code(Interrupted(signum), frame)


_RECEIVED: list[int] = []  # the signal _raise_interrupted turned into an exception


def _in_guarded_call(frame: Any) -> bool:
    """Whether the code a signal interrupted runs inside `_guarded` (a command's library call)."""
    while frame is not None:
        if frame.f_code is _guarded.__code__:
            return True
        frame = frame.f_back
    return False


def _catch_signals() -> None:
    for caught in CAUGHT_SIGNALS:
        if signal.getsignal(caught) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            signal.signal(caught, _raise_interrupted)
    watch_for_stuck_handlers()


def _usage_line(error: Any) -> str:
    """click's usage error (three lines and a blank) as zckpt's one line, with where to look."""
    message = " ".join(error.format_message().replace("Value error, ", "").split())
    where = f" (see '{error.ctx.command_path} -h')" if getattr(error, "ctx", None) is not None else ""
    return f"zckpt: error: {message}{where}"


def main() -> None:
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
    from typer._click.exceptions import UsageError as ClickUsageError

    _catch_signals()
    try:
        code = app(prog_name="zckpt", standalone_mode=False)
    except NoArgsIsHelpError as exc:  # `zckpt` or `zckpt COMMAND` alone: the help, as before
        exc.show()
        code = EXIT_USAGE
    except ClickUsageError as exc:  # an unknown option or command, a bad option value, a missing argument
        typer.echo(_usage_line(exc), err=True)
        code = EXIT_USAGE
    except ClickException as exc:
        typer.echo(f"zckpt: error: {exc.format_message()}", err=True)
        code = exc.exit_code
    code = code if isinstance(code, int) else 0
    leave_job(code)  # a torchrun process: out at once (see leave_job)
    if _RECEIVED:
        # interrupted, and the cleanup has run: skip the interpreter's teardown. Its last
        # garbage collection and torch's static destructors (deregistering every operator) take
        # half a second of CPU, and the signal matrix saw them take over 20 s on a machine
        # running 8 processes on its 2 cores
        exit_without_teardown(code)
    sys.exit(code)
