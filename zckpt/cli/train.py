"""``zckpt train``: the ZeRO-3 trainer, with progress lines and its summary."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..io.interrupts import exit_without_teardown, waiting_on_other_processes
from .errors import guarded
from .shared import (
    Command,
    DebugOption,
    JsonOption,
    QuietOption,
    Timer,
    app,
    checkpoint_and_tag,
    emit,
    primary_process,
    write_report,
    written,
)


@app.command(
    cls=Command,
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
    out: Annotated[
        Optional[Path],
        typer.Option(
            "--out",
            metavar="DIR",
            help="Checkpoint folder (latest, global_stepN/, model_config.json). Without it nothing is saved.",
        ),
    ] = None,
    steps: Annotated[
        Optional[int],
        typer.Option(
            "--steps",
            min=1,
            metavar="N",
            help="Optimizer steps to reach, counted from the start of the run (resumed steps included); the lr decay ends there. Default: 20; on --resume, the end of the checkpoint's schedule.",
            show_default=False,
        ),
    ] = None,
    save_every: Annotated[
        Optional[int],
        typer.Option(
            "--save-every",
            min=0,
            metavar="N",
            help="Save every N steps (default 0: only at the end).",
            show_default=False,
        ),
    ] = None,
    layers: Annotated[
        Optional[int],
        typer.Option("--layers", min=1, metavar="N", help="Transformer blocks (default 2).", show_default=False),
    ] = None,
    dim: Annotated[
        Optional[int],
        typer.Option(
            "--dim",
            min=1,
            metavar="N",
            help="Model width: embedding and hidden size (default 64; a multiple of --heads).",
            show_default=False,
        ),
    ] = None,
    heads: Annotated[
        Optional[int],
        typer.Option("--heads", min=1, metavar="N", help="Attention heads per block (default 4).", show_default=False),
    ] = None,
    vocab: Annotated[
        Optional[int],
        typer.Option(
            "--vocab",
            min=1,
            metavar="N",
            help="Vocabulary size: token ids 0..N-1 (default 256; at least 256 with --data).",
            show_default=False,
        ),
    ] = None,
    seq_len: Annotated[
        Optional[int],
        typer.Option(
            "--seq-len",
            min=1,
            metavar="N",
            help="Tokens per sequence, the model's context length (default 64).",
            show_default=False,
        ),
    ] = None,
    micro_batch: Annotated[
        Optional[int],
        typer.Option(
            "--micro-batch",
            min=1,
            metavar="N",
            help="Sequences per rank per micro-step (default 4).",
            show_default=False,
        ),
    ] = None,
    grad_accum: Annotated[
        Optional[int],
        typer.Option(
            "--grad-accum", min=1, metavar="N", help="Micro-steps per optimizer step (default 1).", show_default=False
        ),
    ] = None,
    lr: Annotated[
        Optional[float],
        typer.Option(
            "--lr",
            metavar="LR",
            help="Peak learning rate (default 0.001; DeepSpeed's WarmupDecayLR: linear warmup from 0, then linear decay to 0 at --steps).",
            show_default=False,
        ),
    ] = None,
    warmup: Annotated[
        Optional[int],
        typer.Option(
            "--warmup",
            min=0,
            metavar="N",
            help="Warmup steps (default 0: no warmup and no decay, a constant lr).",
            show_default=False,
        ),
    ] = None,
    clip: Annotated[
        Optional[float],
        typer.Option(
            "--clip",
            min=0.0,
            metavar="NORM",
            help="Gradient clipping by global norm (default 1.0; 0: none).",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Compute dtype: fp32 (default), bf16 or fp16 (dynamic loss scaling). Masters are fp32.",
            show_default=False,
        ),
    ] = None,
    tie_embeddings: Annotated[
        Optional[bool],
        typer.Option(
            "--tie-embeddings/--no-tie-embeddings",
            help="The lm head shares the token embedding (default: not).",
            show_default=False,
        ),
    ] = None,
    freeze: Annotated[
        Optional[str], typer.Option("--freeze", metavar="REGEX", help="Freeze the params whose names match.")
    ] = None,
    sub_group_size: Annotated[
        Optional[int],
        typer.Option(
            "--sub-group-size",
            min=0,
            metavar="N",
            help="ZeRO-3 optimizer sub-group size (elements per rank), as DeepSpeed's (default 1000000000; 0: one sub-group per param).",
            show_default=False,
        ),
    ] = None,
    nvme_path: Annotated[
        Optional[Path],
        typer.Option(
            "--nvme-path",
            metavar="DIR",
            help="NVMe offload: the fp32 masters, Adam moments and gradients of sub-groups of at least 1 MiB per rank live in DeepSpeed's swap files under DIR/zero_stage_3/optimizer/rank<R>/, streamed through a fixed buffer pool; checkpoints get offloaded_tensors/.",
        ),
    ] = None,
    nvme_params: Annotated[
        bool,
        typer.Option(
            "--nvme-params",
            help="With --nvme-path, the param shares too (DeepSpeed's offload_param): those of at least 1 MiB per rank live in DIR/zero_stage_3/<dtype>params/rank<R>/<ds_id>_param.tensor.swp and are read when a module gathers them.",
        ),
    ] = False,
    bounded_memory: Annotated[
        bool,
        typer.Option(
            "--bounded-memory",
            help="Have glibc unmap every freed block of 1 MiB or more, so resident memory stays at the params in use, the swap buffers and the activations whatever the depth (with --nvme-params); steps take longer (measured 1.3-1.5x).",
        ),
    ] = False,
    resume: Annotated[
        Optional[Path],
        typer.Option(
            "--resume",
            metavar="PATH",
            help="Resume from a checkpoint: zckpt's, DeepSpeed's ZeRO-3, resharded or universal; any world size. Its model, dtype and schedule are taken from it (a checkpoint without model_config.json needs --layers --dim --heads --vocab --seq-len).",
        ),
    ] = None,
    seed: Annotated[
        Optional[int],
        typer.Option(
            "--seed",
            min=0,
            metavar="N",
            help="Seed of the init and of the synthetic data stream (default 0; on --resume it only picks the data: give the first run's to continue its stream).",
            show_default=False,
        ),
    ] = None,
    data: Annotated[
        Optional[Path],
        typer.Option(
            "--data",
            metavar="FILE",
            help="A text file read as bytes (--vocab >= 256); default: deterministic synthetic tokens.",
        ),
    ] = None,
    device: Annotated[
        Optional[str],
        typer.Option(
            "--device",
            metavar="DEVICE",
            help="auto (default), cpu or cuda. auto: each rank's GPU (cuda:LOCAL_RANK, nccl) when torch sees CUDA, else CPU (gloo). On CUDA the shares, optimizer and swap files stay in host memory.",
            show_default=False,
        ),
    ] = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
    debug: DebugOption = False,
) -> None:
    """Train a GPT-style model with ZeRO-3 on torch.distributed (CPU and gloo, or CUDA and nccl).

    One process as is; several under torchrun. Checkpoints are DeepSpeed ZeRO-3 checkpoints
    (zero_to_fp32, zckpt consolidate and a DeepSpeed engine read them)."""
    from ..trainer import plan_training
    from ..trainer import train as run_train

    def text(path: Optional[Path]) -> Optional[str]:
        return None if path is None else str(path)

    if resume is not None:  # a checkpoint's 'latest' file, as every command takes it: the tag it names
        folder, named = checkpoint_and_tag(resume, None, debug)
        resume = folder / named if named is not None else folder

    options = dict(
        out=text(out),
        steps=steps,
        save_every=save_every,
        layers=layers,
        dim=dim,
        heads=heads,
        vocab=vocab,
        seq_len=seq_len,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        lr=lr,
        warmup=warmup,
        clip=clip,
        dtype=dtype.lower() if dtype else None,
        tie_embeddings=tie_embeddings,
        freeze=freeze,
        sub_group_size=sub_group_size,
        nvme_path=text(nvme_path),
        nvme_params=nvme_params or None,
        bounded_memory=bounded_memory or None,
        resume=text(resume),
        seed=seed,
        data=text(data),
        device=device.lower() if device else None,
    )
    plan = guarded(lambda: plan_training({name: value for name, value in options.items() if value is not None}), debug)
    config = plan.config
    report = primary_process() and not as_json  # lines as it goes: the first process, not under --json
    if not quiet and report:
        for note in plan.notes:
            typer.echo(f"note: {note}", err=True)
    bar = None
    if not quiet and report and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=config.steps, unit="step", desc="train", leave=False, file=sys.stderr)

    def on_step(log: Any) -> None:
        if quiet or not report:
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
    timer = Timer()
    try:
        with waits:
            result = guarded(lambda: run_train(config, on_step), debug)
    finally:
        if bar is not None:
            bar.close()
    if primary_process():
        lines = []
        if result.checkpoints and out is not None:
            lines.append(
                f"wrote {out}/{result.checkpoints[-1]} ({result.global_steps} steps, {result.skipped_steps} skipped)"
            )
        if result.swapped_sub_groups is not None:
            swapped, total = result.swapped_sub_groups
            lines.append(
                f"NVMe offload: {swapped} of {total} optimizer sub-groups per rank in {nvme_path}/zero_stage_3/optimizer/ "
                "(DeepSpeed swaps those of at least 1 MiB of fp32 per rank)"
            )
        if result.swapped_params is not None:
            swapped, total, folder = result.swapped_params
            lines.append(
                f"NVMe offload: {swapped} of {total} params per rank in {folder}/ (those of at least 1 MiB per rank)"
            )
        names: list[str] = []
        if out is not None:  # the library names the tag folders it saved: their files, and what sits beside them
            for tag in result.checkpoints:
                names += sorted(str(p.relative_to(out)) for p in (out / tag).rglob("*") if p.is_file())
            names += [n for n in ("latest", "model_config.json") if (out / n).is_file()]
        obj = write_report(
            "train",
            inputs={"resume": None if resume is None else str(resume), "data": None if data is None else str(data)},
            outputs={"out": None if out is None else str(out), "checkpoints": list(result.checkpoints)},
            files=written(out, names) if out is not None else [],
            tensors=None,  # the checkpoints' files hold flat partitions
            seconds=timer.seconds,
            notes=list(plan.notes),
            global_steps=result.global_steps,
            skipped_steps=result.skipped_steps,
            losses=list(result.losses),
        )
        emit(as_json, quiet, obj, "\n".join(lines) if lines else None)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torch 2.13's gloo threads can abort a rank's interpreter exit ("terminate called without
        # an active exception"), which torchrun reports as a failed job; everything is written
        exit_without_teardown(0)
