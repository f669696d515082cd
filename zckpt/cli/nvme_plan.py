"""``zckpt nvme-plan``: ZeRO-3 NVMe swap settings that cannot fail; exit 3 if a given config would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import EXIT_INCOMPLETE, guarded
from .shared import Command, app


@app.command(
    "nvme-plan",
    cls=Command,
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
            "--world-size", metavar="N", min=1, help="Ranks the run partitions over (default: a checkpoint's, else 1)."
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
            metavar="JSON",
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
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole report as JSON.")] = False,
) -> None:
    """Plan ZeRO-3 NVMe offload: offload_param buffer_size, buffer_count and max_in_cpu and
    offload_optimizer buffer_count with which DeepSpeed's swap-buffer assertions cannot fire,
    the pinned memory and swap-folder disk they cost, and cheaper alternatives."""
    from ..ops.nvme_plan import nvme_plan as plan_nvme
    from ..ops.nvme_plan import render

    report = guarded(
        lambda: plan_nvme(
            model, world_size=world_size, dtype=dtype, config=config, memory_budget=memory_budget, frozen=frozen
        )
    )
    typer.echo(json.dumps(report.as_dict(), indent=2) if as_json else render(report))
    if not report.ok:
        raise typer.Exit(EXIT_INCOMPLETE)
