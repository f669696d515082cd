"""``zckpt diff``: two checkpoints or weights outputs compared tensor by tensor; exit 3 if they differ.

:func:`render` writes the :class:`~zckpt.ops.diff.DiffReport` as the readable report.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .errors import EXIT_DIFFERENT
from .shared import (
    Command,
    DebugOption,
    JsonOption,
    NoVerifyOption,
    QuietOption,
    app,
    emit,
    schema,
    with_progress,
)

if TYPE_CHECKING:
    from ..ops.diff import DiffReport, TensorDiff


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
        "listed but do not count."
    ),
)
def diff(
    a: Annotated[
        Path,
        typer.Argument(
            metavar="A",
            help="Any CHECKPOINT the writers take (see consolidate -h), or weights (a folder, .safetensors, .index.json, torch .bin/.pt).",
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
    quiet: QuietOption = False,
    as_json: JsonOption = False,
    debug: DebugOption = False,
    no_verify: NoVerifyOption = False,
) -> None:
    """Compare two checkpoints or weights outputs tensor by tensor, streaming (bounded memory).

    Reports names only in A or B, shape and dtype differences, and per tensor the max absolute
    and relative difference and how many elements differ. Values are compared in float64, so a
    bf16 output can be compared with fp32 masters (its dtype difference is reported too).
    """
    from ..ops.diff import diff as run_diff

    report = with_progress(
        quiet or as_json,
        "comparing",
        lambda progress: run_diff(a, b, atol=atol, rtol=rtol, states=states, progress=progress, verify=not no_verify),
        debug,
    )
    notes = [note for side in (report.a, report.b) for note in side.notes]  # --json: in its a and b
    obj = {"schema": schema("diff"), **report.to_dict()}
    emit(as_json, quiet, obj, None if as_json or quiet else render(report), notes)
    if not report.equal:
        raise typer.Exit(EXIT_DIFFERENT)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _shape(shape: tuple[int, ...]) -> str:
    return str(list(shape))


def render(report: DiffReport) -> str:
    """The readable report: what each side is, one line per difference, and a summary line."""
    lines = [f"A  {report.a.path}: {report.a.describe()}", f"B  {report.b.path}: {report.b.describe()}"]
    lines += [f"only in A    {n}" for n in report.only_in_a]
    lines += [f"only in B    {n}" for n in report.only_in_b]
    for t in report.tensors:
        if t.shape_differs:
            lines.append(
                f"shape        {t.name}: {_shape(t.shape_a)} {t.dtype_a} in A, {_shape(t.shape_b)} {t.dtype_b} in B"
            )
        elif t.dtype_differs:  # shown even when the values agree: the files are not the same
            lines.append(f"dtype        {t.name}: {t.dtype_a} in A, {t.dtype_b} in B; {_values(t)}")
        elif not t.equal:
            lines.append(f"values       {t.name}: {_values(t)}")
    lines += [f"scalar       {s.name}: {s.a!r} in A, {s.b!r} in B" for s in report.scalars if not s.equal]
    lines += [f"states       {note}" for note in report.notes]
    lines.append(_summary_line(report))
    return "\n".join(lines)


def _values(t: TensorDiff) -> str:
    if not t.changed:
        return "same values"
    stats = f"max abs diff {_number(t.max_abs_diff)}, max rel diff {_number(t.max_rel_diff)}"
    if not t.mismatched:
        return f"values within tolerance ({stats}; {t.changed} of {t.numel} elements not identical)"
    return f"{stats}, {t.mismatched} of {t.numel} elements outside tolerance"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"


def _summary_line(report: DiffReport) -> str:
    weights = sum(1 for t in report.tensors if t.kind == "weight")
    held = [_count(weights, "tensor")]
    if report.states and not report.states_missing:
        held.append(
            f"{_count(len(report.tensors) - weights, 'optimizer state tensor')} and {_count(len(report.scalars), 'scalar')}"
        )
    tolerance = f"atol {report.atol:g}, rtol {report.rtol:g}"
    dtypes = len(report.dtype_differences)
    if report.equal:
        extra = (
            f"; {dtypes} in another dtype, values {'within tolerance' if any(t.changed for t in report.tensors) else 'identical'}"
            if dtypes
            else ""
        )
        lacking = "; neither side keeps optimizer states" if len(report.states_missing) == 2 else ""
        return f"equal: {' and '.join(held)} compared ({tolerance}){extra}{lacking}"
    differing = report.differing
    kinds = [
        f"{count} in {what}"
        for what, count in (
            ("shape", sum(t.shape_differs for t in differing)),
            ("values", sum(bool(t.mismatched) for t in differing)),
        )
        if count
    ]
    parts = [
        f"{len(differing)} of {_count(len(report.tensors), 'tensor')}" + (f" ({', '.join(kinds)})" if kinds else "")
    ]
    if dtypes:
        parts.append(f"{dtypes} in another dtype")
    if report.only_in_a or report.only_in_b:
        parts.append(f"{_count(len(report.only_in_a), 'name')} only in A, {len(report.only_in_b)} only in B")
    scalars = sum(1 for s in report.scalars if not s.equal)
    if scalars:
        parts.append(f"{_count(scalars, 'scalar')} differ{'s' * (scalars == 1)}")
    if report.states_differ:
        parts.append(f"optimizer states only in {'B' if report.states_missing == ('a',) else 'A'}")
    return f"differ: {'; '.join(parts)}; {tolerance}"
