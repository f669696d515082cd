"""What the commands share: the typer app and its plain help, the options several commands take,
progress bars, and which process of a torchrun job reports.
"""

from __future__ import annotations

import enum
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from typer.core import TyperCommand

from .errors import guarded


class Command(TyperCommand):
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
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


class Stage(str, enum.Enum):
    one = "1"
    two = "2"
    three = "3"


TagOption = Annotated[
    Optional[str],
    typer.Option(
        "--tag",
        "-t",
        metavar="TAG",
        help="Tag folder to read, e.g. global_step1000. Default: the one named in 'latest'.",
    ),
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary line.")]
WorkersOption = Annotated[
    Optional[int], typer.Option("--workers", metavar="N", min=1, help="Files written at once (default: two per CPU).")
]
SwapFolderOption = Annotated[
    Optional[Path],
    typer.Option(
        "--swap-folder",
        metavar="NVME_PATH",
        help="A live ZeRO-Infinity swap folder of the same run (the nvme_path, or its zero_stage_3/): CHECKPOINT, any checkpoint of the run, gives the layout; the swap folder the newest fp32 masters and optimizer states of every swapped sub-group.",
    ),
]
TpRulesOption = Annotated[
    Optional[Path],
    typer.Option(
        "--tp-rules",
        metavar="FILE",
        help="For a tensor-parallel checkpoint that records no merge rules: a JSON file of Megatron's merge patterns (the keys of universal_checkpoint_info: tp_replicated_parameter_patterns, parameter_with_row_parallelism_patterns, vocabulary_parameter_patterns with original_vocab_size, ...), by which its tensor ranks' slices are joined.",
    ),
]
WaitOption = Annotated[
    bool,
    typer.Option(
        "--wait",
        help="If another zckpt run is writing OUTPUT_DIR, wait until it ends instead of refusing, then write (the usual checks apply).",
    ),
]
NoVerifyOption = Annotated[
    bool,
    typer.Option(
        "--no-verify",
        help="Skip the CRC-32 check of the checkpoint records whose bytes are used (on by default; it costs one read of those bytes from the page cache).",
    ),
]


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


def swap_notes(swap_folder: Path | None, notes: tuple[str, ...], quiet: bool) -> None:
    """With --swap-folder: say where the data came from (some may be the checkpoint's, older)."""
    if swap_folder is not None and not quiet:
        for note in notes:
            typer.echo(f"note: {note}", err=True)
