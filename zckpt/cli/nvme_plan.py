"""``zckpt nvme-plan``: ZeRO-3 NVMe swap settings that cannot fail; exit 3 if a given config would.

:func:`render` writes the :class:`~zckpt.ops.nvme_plan.NvmePlan` for people, then the JSON to paste.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..core.sizes import format_size
from ..deepspeed import swap_rules as R
from .errors import EXIT_INCOMPLETE, guarded
from .shared import CONFIG_METAVAR, Command, DebugOption, JsonOption, QuietOption, app, emit, schema

if TYPE_CHECKING:
    from ..ops.nvme_plan import NvmePlan


@app.command(
    "nvme-plan",
    cls=Command,
    short_help="ZeRO-3 NVMe swap settings that cannot fail; exit 3 if a given config would.",
    epilog=(
        "\b\nExamples:\n"
        "  zckpt nvme-plan Qwen3-0.6B/config.json             # settings, JSON to paste\n"
        "  zckpt nvme-plan runs/ckpt --config ds_config.json  # which settings fail\n"
        "  zckpt nvme-plan model/ -w 8 --memory-budget 32GB\n"
        "  zckpt nvme-plan model/ --json | jq .config_snippet\n\n"
        "Pinned memory and --memory-budget are per rank."
    ),
)
def nvme_plan(
    model: Annotated[
        Path,
        typer.Argument(
            metavar="MODEL",
            help="A DeepSpeed checkpoint, a weights file or folder (safetensors or torch, sharded or not), or a Hugging Face config.json (llama, mistral, qwen2, qwen3, gpt2).",
        ),
    ],
    world_size: Annotated[
        Optional[int],
        typer.Option(
            "--world-size",
            "-w",
            metavar="N",
            min=1,
            help="Ranks the run partitions over (default: a checkpoint's, else 1).",
        ),
    ] = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="bf16, fp16 or fp32 (default: the config's, else the checkpoint's, else bf16).",
        ),
    ] = None,
    config: Annotated[
        Optional[Path],
        typer.Option(
            "--config",
            metavar=CONFIG_METAVAR,
            help="The run's DeepSpeed config: its aio, sub_group_size, pipelining and nvme_path are used, and each swap setting that would fail is named.",
        ),
    ] = None,
    memory_budget: Annotated[
        Optional[str],
        typer.Option(
            "--memory-budget", metavar="SIZE", help="Pinned host memory one rank may use, e.g. 8GB or 512MiB."
        ),
    ] = None,
    frozen: Annotated[
        bool,
        typer.Option(
            "--frozen",
            help="Count every param of MODEL as frozen, as the base of a PEFT (LoRA) run is: no optimizer state, all kept on NVMe.",
        ),
    ] = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
    debug: DebugOption = False,
) -> None:
    """Plan ZeRO-3 NVMe offload: offload_param buffer_size, buffer_count and max_in_cpu and
    offload_optimizer buffer_count with which DeepSpeed's swap-buffer assertions cannot fire,
    the pinned memory and swap-folder disk they cost, and cheaper alternatives."""
    from ..ops.nvme_plan import nvme_plan as plan_nvme

    report = guarded(
        lambda: plan_nvme(
            model, world_size=world_size, dtype=dtype, config=config, memory_budget=memory_budget, frozen=frozen
        ),
        debug,
    )
    emit(
        as_json,
        quiet,
        {"schema": schema("nvme-plan"), **report.as_dict()},
        None if as_json or quiet else render(report),
    )
    if not report.ok:
        raise typer.Exit(EXIT_INCOMPLETE)


def render(plan: NvmePlan) -> str:
    """The plan for people: facts, settings, costs, problems, alternatives, then the JSON to paste."""
    swapped = plan.swapped
    largest = max(swapped, key=lambda s: s.partition_numel, default=None)
    lines = [
        f"model: {plan.model} ({plan.model_kind}), {plan.params} params, {plan.numel:,} elements; "
        f"world size {plan.world_size}, {plan.dtype}",
        f"swapped to NVMe: {len(swapped)} params (partitions of at least {format_size(plan.swap_threshold_bytes)} per rank)",
    ]
    if largest:
        lines.append(f"largest: {largest.name} ({largest.partition_numel:,} elements per rank)")
    p = plan.pinned
    lines += [
        f"offload_param: buffer_size {plan.offload_param[R.BUFFER_SIZE]}, buffer_count {plan.offload_param[R.BUFFER_COUNT]}, "
        f"max_in_cpu {plan.offload_param[R.MAX_IN_CPU]} (a buffer holds the largest swapped partition; one buffer per swapped "
        "param, since a whole-model gather, as transformers and PEFT run at init under ZeRO-3, swaps them all in at once)",
        f"offload_optimizer: buffer_count {plan.offload_optimizer[R.BUFFER_COUNT]}"
        if plan.offload_optimizer
        else "offload_optimizer: not on NVMe",
        f"pinned memory per rank: {format_size(p.total)} (param swap buffers {format_size(p.param_swap_buffers)}, "
        f"param CPU copy {format_size(p.param_cpu_copy)}, param swap-out buffer {format_size(p.param_swap_out_buffer)}, "
        f"optimizer swap buffers {format_size(p.optimizer_swap_buffers)})"
        + (
            ""
            if plan.memory_budget is None
            else f"; budget {format_size(plan.memory_budget)}: " + ("fits" if plan.fits_budget else "does NOT fit")
        ),
        f"swap folder: {format_size(plan.disk.total)} per rank (params {format_size(plan.disk.params)}, optimizer at most "
        f"{format_size(plan.disk.optimizer)}), {format_size(plan.disk.total * plan.world_size)} for {plan.world_size} rank(s)",
    ]
    if plan.config is not None:
        if plan.problems:
            lines.append(f"{plan.config}: {len(plan.problems)} setting(s) would fail:")
            lines += [f"  {pr.setting} = {pr.value} (needs {pr.needed}): {pr.error}; {pr.why}" for pr in plan.problems]
        else:
            lines.append(f"{plan.config}: no swap setting would fail")
    if plan.alternatives:
        lines.append("alternatives:")
        for a in plan.alternatives:
            settings = ", ".join(f"{k} = {v}" for k, v in a.settings.items())
            fits = (
                ""
                if plan.memory_budget is None
                else " (fits the budget)"
                if a.pinned_bytes_per_rank <= plan.memory_budget
                else ""
            )
            lines.append(
                f"  {a.what}: {settings}; pinned {format_size(a.pinned_bytes_per_rank)} per rank{fits}; {a.tradeoff}"
            )
    lines += [f"note: {n}" for n in plan.notes]
    if plan.fits_budget is False:
        fitting = [a for a in plan.alternatives if a.pinned_bytes_per_rank <= plan.memory_budget]
        cheapest = min(plan.alternatives, key=lambda a: a.pinned_bytes_per_rank, default=None)
        if fitting:
            lines.append(
                f"over the budget of {format_size(plan.memory_budget)} per rank: these settings pin {format_size(plan.pinned.total)}; "
                f"the alternatives marked 'fits the budget' fit ({', '.join(a.what for a in fitting)})"
            )
        else:
            least = (
                f"; the cheapest alternative ({cheapest.what}) pins {format_size(cheapest.pinned_bytes_per_rank)}"
                if cheapest
                else ""
            )
            lines.append(
                f"NOTHING FITS the budget of {format_size(plan.memory_budget)} per rank: these settings pin "
                f"{format_size(plan.pinned.total)}{least}; raise the budget, or run on more ranks"
            )
        lines.append(f"the settings above (they do NOT fit the budget of {format_size(plan.memory_budget)} per rank):")
    else:
        lines.append("paste into the DeepSpeed config:")
    lines.append(json.dumps(plan.snippet(), indent=2))
    return "\n".join(lines)
