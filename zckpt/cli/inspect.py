"""``zckpt inspect``: what a checkpoint, weights file or swap folder holds; exit 3 if incomplete.

:func:`render` writes the report dict that :mod:`zckpt.ops.inspect` builds as the readable summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..core.sizes import format_size
from .errors import EXIT_INCOMPLETE, guarded
from .shared import Command, DebugOption, JsonOption, QuietOption, TagOption, TpRulesOption, app, emit, schema


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
            help="Any CHECKPOINT the writers take (see consolidate -h), weights (a folder, .safetensors, .index.json, torch .bin/.pt), or a ZeRO-Infinity swap folder.",
        ),
    ],
    tag: TagOption = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
    debug: DebugOption = False,
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
    tp_rules: TpRulesOption = None,
) -> None:
    """Tell what a checkpoint, weights file or live ZeRO-Infinity swap folder holds and whether it is complete (exit 3 if not)."""
    from ..ops.inspect import inspect_path

    report = guarded(lambda: inspect_path(path, tag, verify, checkpoint=checkpoint, tp_rules=tp_rules), debug)
    emit(as_json, quiet, {"schema": schema("inspect"), **report}, None if as_json or quiet else render(report))
    if not report["complete"]:
        raise typer.Exit(EXIT_INCOMPLETE)


# --- text: the report dict (ops.inspect) as the readable summary ------------------------------


def _human(numel: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if numel >= size:
            return f"{numel / size:.2f}{unit}"
    return str(numel)


def _shown(value: Any) -> str:
    """A report value as the summary shows it: unknown rather than Python's None."""
    return "unknown" if value is None else str(value)


def _universal_load(loss: dict[str, Any] | None, has_states: bool) -> str:
    """What one ZeRO stage's universal loader makes of the checkpoint's optimizer state (a
    report's ``universal_loss`` entry), as the end of a sentence."""
    if loss is None:
        return "restores every state" if has_states else "restores the masters; the checkpoint holds no optimizer state"
    misread = loss.get("per_param", [])
    lost = [s for s in loss["states"] if s not in misread] + loss["scalars"]
    parts = [f"lose {', '.join(lost)}"] if lost else []
    parts += [f"misread {', '.join(misread)} (laid out per element of the partition)"] if misread else []
    if loss["missing"]:
        skipped = f" and would not read {', '.join(lost)}" if lost else ""
        return f"fails (no {', '.join(loss['missing'])}){skipped}"
    return f"would {' and '.join(parts)}"


def _universal_lines(training: dict[str, Any]) -> list[str]:
    """What each ZeRO stage's universal loader makes of the optimizer state, once one of them
    would not restore all of it (every stage then, so that one loader's failing is not read as
    all's); none when each restores it all."""
    losses = training.get("universal_loss") or {}
    if not any(losses.values()):
        return []
    has_states = bool(training["optimizer_states"])
    loads = {key: _universal_load(losses.get(key), has_states) for key in ("zero1_2", "zero3", "zero1_bf16_optimizer")}
    if "zero1_bf16_optimizer" in losses and loads["zero1_bf16_optimizer"] != loads["zero1_2"]:
        rows = [("ZeRO-1 BF16_Optimizer", "zero1_bf16_optimizer"), ("ZeRO-2 or other ZeRO-1", "zero1_2")]
    else:
        rows = [("ZeRO-1/2", "zero1_2")]
    return [
        f"  universal      a {stages} run's universal load {loads[key]}" for stages, key in (*rows, ("ZeRO-3", "zero3"))
    ]


def render(report: dict[str, Any], max_rows: int = 40) -> str:
    """The readable summary of a report."""
    lines = []
    if report["kind"] == "swap_folder":
        lines += _render_swap_folder(report)
    elif report["kind"] == "deepspeed_checkpoint":
        universal = report.get("universal")
        lines.append(f"DeepSpeed {'universal' if universal else 'ZeRO'} checkpoint: {report['path']}")
        tags = ", ".join(report["tags"]) or "none"
        missing = "missing; " if report["tag"] is not None and report["tag"] not in report["tags"] else ""
        lines.append(f"  tag            {_shown(report['tag'])} ({missing}tags present: {tags})")
        stage, world, dtype = _shown(report["zero_stage"]), _shown(report["world_size"]), _shown(report["dtype"])
        if universal:
            flavour = "ZeRO-3" if report["zero_stage"] == 3 else "ZeRO-1/2"
            lines.append(
                f"  loads into     {flavour} runs with load_universal, any world size (saved by world size {world}; dtype {dtype})"
            )
        else:
            lines.append(f"  ZeRO stage     {stage}   world size {world}   dtype {dtype}   offload {report['offload']}")
        if report.get("writer") == "zckpt train":
            lines.append(f"  written by     zckpt train (DeepSpeed {_shown(report['ds_version'])}'s layout)")
        else:
            lines.append(f"  DeepSpeed      {_shown(report['ds_version'])}")
        lines.append(
            f"  params         {report['params']} ({_human(report['trainable_numel'])} trainable elements, {_human(report['frozen_numel'])} frozen)"
        )
        if report["frozen"]:
            lines.append(
                f"  frozen         {', '.join(report['frozen'][:8])}{' ...' if len(report['frozen']) > 8 else ''}"
            )
        if report["buffers"]:
            lines.append(
                f"  buffers        {', '.join(report['buffers'][:8])}{' ...' if len(report['buffers']) > 8 else ''}"
            )
        training = report.get("training_state")
        if training:
            steps = sorted({str(g["step"]) for g in training["param_groups"]})
            scaler = training["loss_scaler"]
            lines.append(
                f"  optimizer      {', '.join(training['optimizer_states']) or 'no state'} in {len(training['param_groups'])} param group(s), "
                f"step {'/'.join(steps)}; global step {training['global_steps']}, {training['skipped_steps']} skipped"
            )
            lines += _universal_lines(training)
            lines.append(
                f"  saved          loss scaler: {'none' if scaler is None else scaler['class'].rsplit('.', 1)[-1] + ' ' + str(scaler.get('cur_scale'))}; "
                f"lr scheduler: {'yes' if training['lr_scheduler'] else 'no'}; client state: {', '.join(training['client_state']) or 'none'}"
            )
    elif report["kind"] == "folder":
        lines.append(f"folder: {report['path']}")
    else:
        lines.append(f"{report['kind']} weights: {report['path']}")
        if "tensors" in report:
            lines.append(f"  tensors        {report['tensors']} ({format_size(report['total_bytes'])})")
    adapter = report.get("adapter")
    if adapter:
        patterns = "".join(f"; {k} {json.dumps(adapter[k])}" for k in ("rank_pattern", "alpha_pattern") if adapter[k])
        saved = f"; modules_to_save {', '.join(adapter['modules_to_save'])}" if adapter["modules_to_save"] else ""
        targets = adapter["target_modules"]
        lines.append(
            f"  adapter        {adapter['type']} r={adapter['r']} alpha={adapter['lora_alpha']}{' (rsLoRA)' if adapter['use_rslora'] else ''}: "
            f"{adapter['lora_tensors']} LoRA tensors + {adapter['other_tensors']} other; targets "
            f"{', '.join(targets) if isinstance(targets, list) else targets}{patterns}{saved}"
        )
        if not adapter["mergeable"]:
            lines.append(f"  merge          not supported: {adapter['not_mergeable_because']}")
    if report.get("frozen_excluded"):
        lines.append("  frozen base    not in these files (saved with exclude_frozen_parameters)")
    for alias, source in report.get("tied", {}).items():
        lines.append(f"  tied           {alias} -> {source}")
    for alias, source in report.get("tied_missing_source", {}).items():
        lines.append(f"  tied           {alias} -> {source} (source not in the files: left out)")
    for note in report.get("notes", []):
        lines.append(f"  note           {note}")
    lines.append(f"  complete       {'yes' if report['complete'] else 'NO'}")
    for problem in report["problems"]:
        lines.append(f"  problem        {problem}")
    params = report.get("parameters", [])
    if params:
        lines.append("")
        width = min(60, max(len(p["name"]) for p in params))
        for p in params[:max_rows]:
            kind = f"  [{p['kind']}]" if p.get("kind") not in (None, "param") else ""
            placement = f"  {p['placement']}" if p.get("placement") else ""
            lines.append(f"  {p['name']:<{width}}  {str(p['shape']):<16} {p['dtype']:<6}{kind}{placement}")
        if len(params) > max_rows:
            lines.append(f"  ... {len(params) - max_rows} more (--json lists all)")
    return "\n".join(lines)


def _render_swap_folder(report: dict[str, Any]) -> list[str]:
    lines = [f"ZeRO-Infinity swap folder: {report['root']}"]
    lines.append(
        f"  ranks          {report['world_size']}   16-bit params {', '.join(report['param_dtypes']) or 'none'}   disk {format_size(report['total_bytes'])}"
    )
    if report["checkpoint"]:
        lines.append(f"  layout from    {report['checkpoint']}")
    for group in report["sub_groups"]:
        where = f"swapped as {group['swap_id']}" if group["swapped"] else "in memory (not in the swap folder)"
        lines.append(
            f"  sub-group {group['index']:<4} {where}: {', '.join(group['params'])} ({group['partition_numel']} per rank)"
        )
    for rank in report["ranks"]:
        lines.append(f"  rank {rank['rank']}         {len(rank['files'])} files, {format_size(rank['bytes'])}")
        for row in rank["files"]:
            lines.append(f"    {row['folder'] + '/' + row['name']:<44} {format_size(row['size']):>10}  {row['holds']}")
    lines.append(f"  gradients      {len(report['gradient_files'])} file(s) in flight")
    for orphan in report["orphans"]:
        lines.append(f"  orphan         {orphan}")
    lines.append(f"  checksums      none: {report['checksums']}")
    return lines
