"""What the commands share: the typer app and its plain help, the options several commands take
(defined once, one spelling per idea: tests/test_cli/test_option_names.py holds every command to
them), what CHECKPOINT accepts, progress bars, which process of a torchrun job reports, and a
command's last output: the text and notes, or with --json one object (:func:`emit`).
"""

from __future__ import annotations

import copy
import enum
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, Sequence

import typer
from typer.core import TyperCommand

from .errors import guarded
from .exit_codes import command_line, table_text
from .output import finish

# Old spellings that keep working but are not shown: scripts have them (to-universal's
# --target-stage, now --stage as on reshard; zero_to_fp32.py's underscored flags)
HIDDEN_SPELLINGS = frozenset({"--target-stage", "--max_shard_size", "--exclude_frozen_parameters"})


class Command(TyperCommand):
    """Plain click help: ``CHECKPOINT OUTPUT_DIR`` in the usage line and the argument list,
    no type placeholders (``<path>``, ``<bool>``) where no value is taken, hidden aliases left
    out (of the help and of shell completion), and the command's line of the exit-code table (:mod:`.exit_codes`) at the end."""

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
        options = [r for p in params if p.param_type_name == "option" and (r := _shown(p).get_help_record(ctx))]
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    def shell_complete(self, ctx: Any, incomplete: str) -> list[Any]:
        return [item for item in super().shell_complete(ctx, incomplete) if item.value not in HIDDEN_SPELLINGS]

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        super().format_epilog(ctx, formatter)
        formatter.write_paragraph()
        with formatter.indentation():
            formatter.write_text(command_line(self.name))


def _shown(param: Any) -> Any:
    """`param` as its help shows it: without its hidden spellings."""
    if not HIDDEN_SPELLINGS & set(param.opts + param.secondary_opts):
        return param
    shown = copy.copy(param)
    shown.opts = [o for o in param.opts if o not in HIDDEN_SPELLINGS]
    shown.secondary_opts = [o for o in param.secondary_opts if o not in HIDDEN_SPELLINGS]
    return shown


app = typer.Typer(
    name="zckpt",
    help=(
        "Read, consolidate, reshard and inspect DeepSpeed ZeRO checkpoints, without DeepSpeed and without running pickled code.\n\n"
        "Every command takes -q/--quiet, --json (one JSON object on stdout) and -d/--debug.\n\n" + table_text()
    ),
    no_args_is_help=True,
    add_completion=True,
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
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


class Stage(str, enum.Enum):
    one = "1"
    two = "2"
    three = "3"


# --- the options several commands take, one spelling and one short help each -------------------
# (tests/test_cli/test_option_names.py holds every command to these names)

TagOption = Annotated[
    Optional[str],
    typer.Option(
        "--tag", "-t", metavar="TAG", help="Tag folder to read, e.g. global_step1000 (default: 'latest' names it)."
    ),
]
QuietOption = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="Print nothing but errors: no progress bar, summary, report or notes."),
]
JsonOption = Annotated[
    bool,
    typer.Option(
        "--json", help='Print one JSON object on stdout and nothing else (its "schema" key: zckpt.COMMAND/1).'
    ),
]
DebugOption = Annotated[
    bool, typer.Option("--debug", "-d", help="On an error, show the Python traceback (as ZCKPT_DEBUG=1 does).")
]
WorkersOption = Annotated[
    Optional[int],
    typer.Option(
        "--workers",
        metavar="N",
        min=1,
        help="Files read or written at once (default: two per CPU; threads mostly wait on the disk).",
    ),
]
WorldSizeOption = Annotated[
    int,
    typer.Option("--world-size", "-w", metavar="N", min=1, help="Data-parallel ranks of the run that will load it."),
]
StageOption = Annotated[
    Optional[Stage],
    typer.Option(
        "--stage",
        "--target-stage",
        metavar="STAGE",
        help="ZeRO stage of the run that will load it: 1, 2 or 3 (default: the checkpoint's).",
    ),
]
SwapFolderOption = Annotated[
    Optional[Path],
    typer.Option(
        "--swap-folder",
        metavar="NVME_PATH",
        help="A live ZeRO-Infinity swap folder of the same run: its newer fp32 masters and optimizer states are used.",
    ),
]
TpRulesOption = Annotated[
    Optional[Path],
    typer.Option(
        "--tp-rules",
        metavar="FILE",
        help="JSON of Megatron's merge patterns, for a tensor-parallel checkpoint that records none.",
    ),
]
WaitOption = Annotated[
    bool, typer.Option("--wait", help="Wait for another zckpt run writing OUTPUT_DIR to end, instead of refusing.")
]
NoVerifyOption = Annotated[bool, typer.Option("--no-verify", help="Skip the CRC-32 check of the bytes read.")]

CONFIG_METAVAR = "FILE"  # --config: a DeepSpeed config JSON, in every command that takes one
CHECKPOINT_HELP = (
    "A DeepSpeed checkpoint folder or its 'latest' file; a tag, universal or checkpoint-N folder; "
    "a Trainer output_dir or Lightning checkpoint folder (the newest inside)."
)


def default_workers() -> int:
    """--workers' default: two per CPU (the writers' own default; verify's too)."""
    return 2 * (os.cpu_count() or 1)


def checkpoint_and_tag(path: Path, tag: Optional[str], debug: bool = False) -> tuple[Path, Optional[str]]:
    """CHECKPOINT as every command takes it: a checkpoint folder's 'latest' (or 'latest_universal')
    file stands for its folder, at the tag it names (or --tag), as inspect has always read it."""
    from ..deepspeed.names import LATEST_FILE, LATEST_UNIVERSAL_FILE

    if path.name in (LATEST_FILE, LATEST_UNIVERSAL_FILE) and path.is_file():
        from ..deepspeed.locate import tag_named_in

        return path.parent, tag if tag is not None else guarded(lambda: tag_named_in(str(path)), debug)
    return path, tag


def with_progress(
    quiet: bool, description: str, call: Callable[[Callable[[int, int], None]], Any], debug: bool = False
) -> Any:
    """Run `call(progress)` guarded (see guarded), with a progress bar while it runs."""
    update, close = progress_bar(quiet, description)
    try:
        return guarded(lambda: call(update), debug)
    finally:
        close()


def primary_process() -> bool:
    """The first process of a torchrun job (or the only process): the one that reports."""
    return os.environ.get("RANK", "0") == "0"


def progress_bar(quiet: bool, description: str) -> tuple[Callable[[int, int], None], Callable[[], None]]:
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


def swap_notes(swap_folder: Path | None, notes: tuple[str, ...]) -> list[str]:
    """With --swap-folder: where the data came from (some may be the checkpoint's, older)."""
    return list(notes) if swap_folder is not None else []


class Timer:
    """Seconds since it was made: a command's --json "seconds"."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    @property
    def seconds(self) -> float:
        return round(time.monotonic() - self.started, 3)


def written(root: Path, names: Any) -> list[dict[str, Any]]:
    """The files written, as --json lists them: each path relative to OUTPUT_DIR and its size on disk."""
    return [{"path": str(name), "bytes": (root / name).stat().st_size} for name in names if (root / name).is_file()]


def schema(command: str) -> str:
    return f"zckpt.{command}/1"


def source_inputs(checkpoint: Path, index: Any, swap_folder: Optional[Path], **more: Any) -> dict[str, Any]:
    """A writing command's --json "inputs": the checkpoint read, its tag, stage and world size."""
    return {
        "checkpoint": str(checkpoint),
        "tag": index.tag,
        "zero_stage": index.zero_stage,
        "world_size": index.world_size,
        "swap_folder": None if swap_folder is None else str(swap_folder),
        **more,
    }


def write_report(
    command: str,
    *,
    inputs: dict[str, Any],
    outputs: dict[str, Any],
    files: list[dict[str, Any]],
    tensors: Optional[int],
    seconds: float,
    notes: list[str],
    **more: Any,
) -> dict[str, Any]:
    """A writing command's --json object: what it read, what it wrote (every file with its bytes),
    how many tensors, how long, and the notes it would have printed."""
    return {
        "schema": schema(command),
        "command": command,
        "inputs": inputs,
        "outputs": outputs,
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "tensors": tensors,
        "seconds": seconds,
        "notes": notes,
        **more,
    }


def emit(
    as_json: bool,
    quiet: bool,
    obj: dict[str, Any],
    text: Optional[str],
    notes: Sequence[str] = (),
    notes_first: bool = True,
) -> None:
    """A command's last output: --json's object alone on stdout; else, unless quiet, the text on
    stdout and the notes on stderr (before it, or after it)."""
    if as_json:
        finish((json.dumps(obj, indent=2), False))
    elif quiet:
        finish()
    else:
        said = [(f"note: {note}", True) for note in notes]
        shown = [(text, False)] if text is not None else []
        finish(*(said + shown if notes_first else shown + said))
