#!/usr/bin/env python3
"""Proof for a behaviour-preserving refactor: every command gives byte-identical results at two trees.

Each side ("before", "after") is a git revision, exported with ``git archive REV | tar -x``, or a
folder (a dirty working tree: its tracked and untracked, not ignored, files are copied). The same
run list is run against both, each run in a fresh folder with the side's own code
(``PYTHONPATH=<tree> python -m zckpt ...``; ``python -m torch.distributed.run ... -m zckpt`` for
``train`` and the multi-process ``reshard``/``to-universal``) on the side's own ``sample_ckpts``:

- every sample checkpoint: ``consolidate`` (fp32, bf16, fp16 without frozen params, torch format,
  small shards), ``reshard`` to world sizes 1-4 at ZeRO stages 1-3, ``to-universal`` (default,
  ``--target-stage`` 1 and 3), ``inspect``/``verify`` (text and JSON) and a universal chain
  (to-universal, reshard and consolidate from it, ``diff --states``); per sample layout: other
  tags (``--tag``), the live swap folder (``--swap-folder``), PEFT adapters and merges
  (``--merge-into``, ``--no-peft``), a Trainer output folder;
- ``zckpt train`` at 1-3 processes (fp32, bf16 with NVMe offload, fp16, ``--nvme-params``,
  ``--data``) and ``--resume`` of it at the same and other world sizes, from its own and a
  resharded checkpoint;
- ``diff``, ``nvme-plan``, every ``--help``, and failing inputs (a missing, copied, damaged or
  truncated rank file, an output inside the input, an existing output, bad options and configs)
  so that error lines and exit codes are compared too.

Compared per run: every file and folder under the run's folder (its path, mode and sha256, so
the input copies it holds too; each tree's modes are first set to git's 644/755) and the
sample_ckpts of both trees, and per command its exit code, stdout and stderr, with the
side's folders replaced by ``<RUN>``, ``<TREE>``, ``<SIDE>`` and ``train``'s measured
``tokens/s`` figure (a timing, different in every run) replaced by ``<rate>``. Prints a table,
each difference, and exits 1 on any.

    python scripts/same_outputs.py                               # merge-base(main, HEAD) vs HEAD
    python scripts/same_outputs.py --before main --after .      # the working tree, uncommitted edits included
    python scripts/same_outputs.py --before HEAD --after HEAD   # run-to-run noise: must find none
    python scripts/same_outputs.py --quick --only 'reshard|train'
    python scripts/same_outputs.py --list

Measured on 2 busy cores, 2 workers: the full list (545 runs, 862 commands) about 8.5 min per
side, ``--quick`` (163 runs) 2.5-4 min per side.

Exit codes: 0 identical; 1 a difference; 2 bad options or a side that cannot be set up.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import difflib
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Layout of a side's folder: tree/ (the code and samples), runs/<run>/ (the cwd of each run), tmp/.
# Every path a command gets is relative to its run folder, so the strings (and whatever zckpt
# stores of them, e.g. train's nvme_path in ds_config) are the same on both sides.
TREE = "../../tree"
SAMPLES = f"{TREE}/sample_ckpts"

# The run's measured throughput, the one figure of zckpt's output that is a timing.
RATE = re.compile(r"tokens/s [0-9][0-9,.]*")
RUN_NAME = re.compile(r"[A-Za-z0-9_.+=-]+")
# Representative samples for --quick: each stage, a 16-bit ZeRO-1 BF16_Optimizer, two tags,
# a live swap folder, a Trainer folder and a PEFT run.
QUICK_SAMPLES = (
    "z2_fp32_ws1",
    "z1_bf16_ws3_bf16optimizer_frozen",
    "z3_bf16_ws3_subgroups_groups",
    "z2_fp32_ws2_twotags",
    "z3_bf16_ws2_nvme_live_swap",
    "hf_trainer",
    "peft_lora.llama_z3_bf16_ws2",
)
COMMANDS = ("consolidate", "inspect", "verify", "reshard", "to-universal", "diff", "nvme-plan", "train")


# --------------------------------------------------------------------------- the run list


def zckpt(*args: str) -> tuple[str, ...]:
    """Interpreter arguments of one ``python -m zckpt`` command."""
    return ("-m", "zckpt", *args)


def torchrun(processes: int, *args: str) -> tuple[str, ...]:
    """Interpreter arguments of a zckpt command under torchrun (``--standalone``: a free port each, so runs can overlap)."""
    return ("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", "-m", "zckpt", *args)


@dataclass(frozen=True)
class Copy:
    """Copy a file or folder into the run folder before the commands (inputs the run damages or writes into)."""

    source: str
    target: str

    def apply(self, run_dir: Path) -> None:
        source = run_dir / self.source
        if source.is_dir():
            shutil.copytree(source, run_dir / self.target, symlinks=True)
        else:
            shutil.copyfile(source, run_dir / self.target)


@dataclass(frozen=True)
class Remove:
    """Delete a file of a copied input (a missing rank file)."""

    path: str

    def apply(self, run_dir: Path) -> None:
        (run_dir / self.path).unlink()


@dataclass(frozen=True)
class Truncate:
    """Cut a copied file to half its size (an interrupted copy)."""

    path: str

    def apply(self, run_dir: Path) -> None:
        target = run_dir / self.path
        os.truncate(target, target.stat().st_size // 2)


@dataclass(frozen=True)
class FlipByte:
    """Flip one bit in the middle of one tensor record of a torch file: damage only a checksum can see."""

    path: str
    record: str  # e.g. "data/3": the record whose name ends so

    def apply(self, run_dir: Path) -> None:
        target = run_dir / self.path
        with zipfile.ZipFile(target) as archive:
            (record,) = [info for info in archive.infolist() if info.filename.endswith("/" + self.record)]
        with target.open("r+b") as handle:
            handle.seek(record.header_offset)
            name_length, extra_length = struct.unpack("<HH", handle.read(30)[26:30])
            offset = record.header_offset + 30 + name_length + extra_length + record.file_size // 2
            handle.seek(offset)
            byte = handle.read(1)[0]
            handle.seek(offset)
            handle.write(bytes([byte ^ 0x01]))


@dataclass(frozen=True)
class Write:
    """A small input file of the run's own (a DeepSpeed config, training text)."""

    path: str
    text: str

    def apply(self, run_dir: Path) -> None:
        (run_dir / self.path).write_text(self.text)


SetupStep = Copy | Remove | Truncate | FlipByte | Write


@dataclass(frozen=True)
class Run:
    """One folder's worth of work: setup steps, then commands run in order in that folder."""

    name: str
    group: str
    commands: tuple[tuple[str, ...], ...]
    setup: tuple[SetupStep, ...] = ()
    quick: bool = True  # part of --quick
    heavy: bool = False  # starts processes that import torch and train: scheduled first

    def __post_init__(self) -> None:
        if not RUN_NAME.fullmatch(self.name):
            raise ValueError(f"run name {self.name!r} is not a plain folder name")


@dataclass(frozen=True)
class Sample:
    """A bundled checkpoint and what its layout offers beyond the checkpoint folder."""

    name: str  # folder under sample_ckpts, peft runs as peft_lora.<run>
    checkpoint: str  # relative to a run folder
    other_tags: tuple[str, ...] = ()
    swap_folder: str | None = None
    peft_base: str | None = None
    trainer_output: str | None = None  # the folder holding checkpoint-N


def find_samples(samples_dir: Path) -> list[Sample]:
    """Every sample checkpoint under sample_ckpts, from its folder layout (sample_ckpts/README.md, peft_lora/README.md)."""
    found = []
    for case in sorted(path for path in samples_dir.iterdir() if path.is_dir()):
        runs = sorted(path for path in case.iterdir() if path.is_dir()) if case.name == "peft_lora" else [case]
        for folder in runs:
            checkpoints = sorted(
                path
                for path in folder.iterdir()
                if path.is_dir() and (path.name == "checkpoint" or path.name.startswith("checkpoint-"))
            )
            for checkpoint in checkpoints:
                name = folder.name if folder == case else f"{case.name}.{folder.name}"
                name += f".{checkpoint.name}" if len(checkpoints) > 1 else ""
                relative = f"{SAMPLES}/{checkpoint.relative_to(samples_dir).as_posix()}"
                latest = (checkpoint / "latest").read_text().strip() if (checkpoint / "latest").is_file() else ""
                tags = tuple(
                    sorted(
                        path.name
                        for path in checkpoint.iterdir()
                        if path.is_dir() and path.name.startswith("global_step") and path.name != latest
                    )
                )
                found.append(
                    Sample(
                        name=name,
                        checkpoint=relative,
                        other_tags=tags,
                        swap_folder=f"{SAMPLES}/{case.name}/live_swap" if (folder / "live_swap").is_dir() else None,
                        peft_base=f"{relative.rsplit('/', 1)[0]}/base"
                        if (folder / "base").is_dir() and (checkpoint / "adapter_config.json").is_file()
                        else None,
                        trainer_output=relative.rsplit("/", 1)[0]
                        if checkpoint.name.startswith("checkpoint-") and folder == case
                        else None,
                    )
                )
    return found


def sample_runs(sample: Sample) -> list[Run]:
    """The runs of one sample checkpoint: every writing command and option family, and the readers."""
    s, ck, quick = sample.name, sample.checkpoint, sample.name in QUICK_SAMPLES
    runs = [
        Run(f"consolidate.{s}.fp32", "consolidate", (zckpt("consolidate", ck, "out"),), quick=quick),
        Run(f"consolidate.{s}.bf16", "consolidate", (zckpt("consolidate", ck, "out", "--dtype", "bf16"),), quick=quick),
        Run(
            f"consolidate.{s}.fp16-exclude-frozen",
            "consolidate",
            (zckpt("consolidate", ck, "out", "--dtype", "fp16", "--exclude-frozen"),),
            quick=quick,
        ),
        Run(
            f"consolidate.{s}.torch",
            "consolidate",
            (zckpt("consolidate", ck, "out", "--format", "torch"),),
            quick=quick,
        ),
        Run(
            f"consolidate.{s}.shards",
            "consolidate",
            (zckpt("consolidate", ck, "out", "--max-shard-size", "6KB"),),
            quick=quick,
        ),
    ]
    for world in (1, 2, 3, 4):
        for stage in (1, 2, 3):
            in_quick = quick and world in (1, 3) and stage in (1, 3)
            runs.append(
                Run(
                    f"reshard.{s}.w{world}.s{stage}",
                    "reshard",
                    (zckpt("reshard", ck, "out", "-w", str(world), "--stage", str(stage)),),
                    quick=in_quick,
                )
            )
    runs += [
        Run(f"to-universal.{s}.default", "to-universal", (zckpt("to-universal", ck, "out"),), quick=quick),
        Run(f"to-universal.{s}.t1", "to-universal", (zckpt("to-universal", ck, "out", "--target-stage", "1"),)),
        Run(f"to-universal.{s}.t3", "to-universal", (zckpt("to-universal", ck, "out", "--target-stage", "3"),)),
        Run(
            f"inspect.{s}",
            "inspect/verify",
            (
                zckpt("inspect", ck),
                zckpt("inspect", ck, "--json"),
                zckpt("verify", ck, "--scan"),
                zckpt("verify", ck, "--json"),
            ),
            quick=quick,
        ),
        Run(
            f"chain.{s}.universal",
            "chain",
            (
                zckpt("to-universal", ck, "uc"),
                zckpt("inspect", "uc"),
                zckpt("verify", "uc"),
                zckpt("reshard", "uc", "resharded", "-w", "2"),
                zckpt("consolidate", "uc", "consolidated", "--format", "torch"),
                zckpt("diff", ck, "uc", "--states"),
                zckpt("diff", ck, "consolidated", "--json"),
            ),
            quick=quick,
        ),
    ]
    for tag in sample.other_tags:
        runs += [
            Run(
                f"consolidate.{s}.tag-{tag}",
                "consolidate",
                (zckpt("consolidate", ck, "out", "--tag", tag),),
                quick=quick,
            ),
            Run(
                f"reshard.{s}.tag-{tag}",
                "reshard",
                (zckpt("reshard", ck, "out", "-w", "3", "--tag", tag),),
                quick=quick,
            ),
            Run(
                f"to-universal.{s}.tag-{tag}",
                "to-universal",
                (zckpt("to-universal", ck, "out", "--tag", tag),),
                quick=quick,
            ),
        ]
    if sample.swap_folder:
        swap = sample.swap_folder
        runs += [
            Run(
                f"consolidate.{s}.swap-folder",
                "consolidate",
                (
                    zckpt("consolidate", ck, "out", "--swap-folder", swap),
                    zckpt("consolidate", ck, "bf16", "--swap-folder", swap, "--dtype", "bf16"),
                ),
                quick=quick,
            ),
            Run(
                f"reshard.{s}.swap-folder",
                "reshard",
                (
                    zckpt("reshard", ck, "out", "-w", "3", "--swap-folder", swap),
                    zckpt("reshard", ck, "z1", "-w", "1", "--stage", "1", "--swap-folder", swap),
                ),
                quick=quick,
            ),
            Run(
                f"to-universal.{s}.swap-folder",
                "to-universal",
                (zckpt("to-universal", ck, "out", "--swap-folder", swap),),
                quick=quick,
            ),
            Run(
                f"inspect.{s}.swap-folder",
                "inspect/verify",
                (
                    zckpt("inspect", swap),
                    zckpt("inspect", swap, "--checkpoint", ck),
                    zckpt("inspect", swap, "--checkpoint", ck, "--json"),
                    zckpt("verify", swap, "--checkpoint", ck, "--scan"),
                    zckpt("verify", ck, "--swap-folder", swap),
                ),
                quick=quick,
            ),
        ]
    if sample.peft_base:
        base = sample.peft_base
        runs += [
            Run(f"peft.{s}.no-peft", "peft", (zckpt("consolidate", ck, "out", "--no-peft"),), quick=quick),
            Run(f"peft.{s}.merge", "peft", (zckpt("consolidate", ck, "out", "--merge-into", base),), quick=quick),
            Run(
                f"peft.{s}.merge-fp32-shards",
                "peft",
                (zckpt("consolidate", ck, "out", "--merge-into", base, "--dtype", "fp32", "--max-shard-size", "20KB"),),
                quick=quick,
            ),
            Run(
                f"peft.{s}.merge-bf16",
                "peft",
                (
                    zckpt("consolidate", ck, "out", "--merge-into", base, "--dtype", "bf16"),
                    zckpt("consolidate", ck, "refused", "--merge-into", base, "--format", "torch"),
                ),
                quick=quick,
            ),
        ]
    if sample.trainer_output:
        runs.append(
            Run(
                f"consolidate.{s}.trainer-output",
                "consolidate",
                (zckpt("consolidate", sample.trainer_output, "out"), zckpt("inspect", sample.trainer_output)),
                quick=quick,
            )
        )
    return runs


TRAIN_SMALL = ("--layers", "2", "--dim", "64", "--vocab", "97", "--seq-len", "16", "--micro-batch", "2")
TRAIN_TINY = ("--layers", "1", "--dim", "32", "--heads", "2", "--vocab", "61", "--seq-len", "8")


def train_runs() -> list[Run]:
    """``zckpt train`` and ``--resume``: in memory, on NVMe, one process and several; resumed at other world sizes."""
    return [
        Run(
            "train.fp32-ws2",
            "train",
            (
                torchrun(2, "train", "--out", "out", "--steps", "2", "--seed", "1", *TRAIN_SMALL),
                torchrun(2, "train", "--out", "resumed2", "--resume", "out", "--steps", "3", "--seed", "1"),
                torchrun(3, "train", "--out", "resumed3", "--resume", "out", "--steps", "3", "--seed", "1"),
                zckpt("train", "--out", "refused", "--resume", "out", "--dtype", "bf16"),
                zckpt("consolidate", "out", "consolidated"),
            ),
            heavy=True,
        ),
        Run(
            "train.bf16-nvme-ws2",
            "train",
            (
                torchrun(
                    2,
                    "train",
                    "--out",
                    "out",
                    "--steps",
                    "3",
                    "--save-every",
                    "2",
                    "--layers",
                    "1",
                    "--dim",
                    "256",
                    "--vocab",
                    "97",
                    "--seq-len",
                    "16",
                    "--micro-batch",
                    "2",
                    "--dtype",
                    "bf16",
                    "--tie-embeddings",
                    "--warmup",
                    "1",
                    "--sub-group-size",
                    "300000",
                    "--nvme-path",
                    "nvme",
                ),
                zckpt("train", "--out", "resumed1", "--resume", "out", "--steps", "4", "--nvme-path", "nvme1"),
                zckpt("consolidate", "out", "consolidated", "--swap-folder", "nvme"),
            ),
            heavy=True,
        ),
        Run(
            "train.fp16-ws1-resharded",
            "train",
            (
                zckpt(
                    "train",
                    "--out",
                    "out",
                    "--steps",
                    "3",
                    "--dtype",
                    "fp16",
                    *TRAIN_TINY,
                    "--grad-accum",
                    "2",
                    "--clip",
                    "0.5",
                    "--sub-group-size",
                    "0",
                    "--freeze",
                    r"\.bias$",
                ),
                zckpt("reshard", "out", "resharded", "-w", "2"),
                torchrun(2, "train", "--out", "resumed", "--resume", "resharded", "--steps", "4"),
                zckpt("to-universal", "out", "uc"),
                zckpt(
                    "train",
                    "--out",
                    "from-universal",
                    "--resume",
                    "uc",
                    "--steps",
                    "4",
                    *TRAIN_TINY,
                ),
            ),
            heavy=True,
        ),
        Run(
            "train.data-file-no-save",
            "train",
            (
                zckpt("train", "--steps", "2", "--layers", "1", "--dim", "32", "--seq-len", "8", "--data", "data.txt"),
                zckpt(
                    "train",
                    "--out",
                    "out",
                    "--steps",
                    "2",
                    "--layers",
                    "1",
                    "--dim",
                    "32",
                    "--seq-len",
                    "8",
                    "--data",
                    "data.txt",
                    "--vocab",
                    "300",
                ),
                zckpt("train", "--steps", "2", "--data", "data.txt", "--vocab", "100"),
            ),
            setup=(Write("data.txt", "The quick brown fox jumps over the lazy dog. " * 40),),
            quick=False,
            heavy=True,
        ),
        Run(
            "train.nvme-params-ws2",
            "train",
            (
                torchrun(
                    2,
                    "train",
                    "--out",
                    "out",
                    "--steps",
                    "2",
                    "--layers",
                    "1",
                    "--dim",
                    "512",
                    "--vocab",
                    "97",
                    "--seq-len",
                    "16",
                    "--micro-batch",
                    "1",
                    "--nvme-path",
                    "nvme",
                    "--nvme-params",
                    "--bounded-memory",
                ),
            ),
            quick=False,
            heavy=True,
        ),
    ]


def other_runs() -> list[Run]:
    """Help texts, the multi-process converters, diff, nvme-plan and failing inputs (their one-line errors and exit codes)."""
    z2 = f"{SAMPLES}/z2_fp32_ws1/checkpoint"
    z2ws3 = f"{SAMPLES}/z2_bf16_ws3_frozen_groups/checkpoint"
    z3 = f"{SAMPLES}/z3_bf16_ws3_subgroups_groups/checkpoint"
    z3ws2 = f"{SAMPLES}/z3_fp32_ws2_tied_frozen/checkpoint"
    z1ws2 = f"{SAMPLES}/z1_fp32_ws2_frozen_tied/checkpoint"
    llama = f"{SAMPLES}/peft_lora/llama_z3_bf16_ws2"
    gpt2 = f"{SAMPLES}/peft_lora/gpt2_z2_fp32_ws2"
    runs = [
        Run(
            "help",
            "help",
            (
                zckpt(),
                zckpt("--help"),
                zckpt("--version"),
                zckpt("no-such-command"),
                *(zckpt(command, "--help") for command in COMMANDS),
                *(zckpt(command) for command in COMMANDS if command != "train"),
            ),
        ),
        Run(
            "torchrun.reshard", "torchrun", (torchrun(2, "reshard", z3, "out", "-w", "4", "--stage", "2"),), heavy=True
        ),
        Run("torchrun.to-universal", "torchrun", (torchrun(2, "to-universal", z3, "out"),), heavy=True),
        Run(
            "diff.samples",
            "diff",
            (
                zckpt("diff", z2, f"{SAMPLES}/z2_fp32_ws1/reference/live.safetensors"),
                zckpt("diff", z2, f"{SAMPLES}/z2_fp32_ws1/reference/zero_to_fp32/pytorch_model.bin", "--json"),
                zckpt("diff", z2, f"{SAMPLES}/z2_fp32_ws2_twotags/checkpoint"),
                zckpt("diff", z2, f"{SAMPLES}/z2_fp32_ws2_twotags/checkpoint", "--json", "--states"),
                zckpt(
                    "diff",
                    z3,
                    f"{SAMPLES}/z3_bf16_ws3_subgroups_groups/reference/live.safetensors",
                    "--rtol",
                    "1e-3",
                    "--atol",
                    "1e-6",
                ),
                zckpt("diff", z2, "no-such-file"),
                zckpt("diff", z2, z2, "--rtol", "-1"),
            ),
        ),
        Run(
            "diff.dtypes",
            "diff",
            (
                zckpt("consolidate", z3, "fp32"),
                zckpt("consolidate", z3, "bf16", "--dtype", "bf16"),
                zckpt("diff", "fp32", "bf16"),
                zckpt("diff", "fp32", "bf16", "--rtol", "4e-3"),
                zckpt("diff", "fp32/model.safetensors", "bf16", "--json"),
            ),
        ),
        Run(
            "nvme-plan",
            "nvme-plan",
            (
                zckpt("nvme-plan", f"{llama}/base/config.json"),
                zckpt("nvme-plan", f"{gpt2}/base/config.json", "--frozen", "--world-size", "2", "--dtype", "fp32"),
                zckpt(
                    "nvme-plan",
                    f"{SAMPLES}/z3_bf16_ws2_nvmeoffload_frozen_tied_groups/checkpoint",
                    "--world-size",
                    "8",
                    "--json",
                ),
                zckpt("nvme-plan", z3, "--memory-budget", "1KB"),
                zckpt("nvme-plan", f"{llama}/base", "--config", "ds_small_buffer.json", "--memory-budget", "8GB"),
                zckpt("nvme-plan", f"{llama}/merged_step3.safetensors"),
                zckpt("nvme-plan", f"{llama}/base/config.json", "--config", "no-such.json"),
                zckpt("nvme-plan", f"{llama}/base/config.json", "--config", "ds_bad.json"),
            ),
            setup=(
                Write(
                    "ds_small_buffer.json",
                    json.dumps(
                        {
                            "zero_optimization": {
                                "stage": 3,
                                "offload_param": {
                                    "device": "nvme",
                                    "nvme_path": "/nvme",
                                    "buffer_size": 1024,
                                    "buffer_count": 5,
                                },
                            }
                        }
                    ),
                ),
                Write("ds_bad.json", json.dumps({"zero_optimization": "oops"})),
            ),
        ),
        Run(
            "error.missing-rank-file",
            "errors",
            (
                zckpt("consolidate", "ck", "out"),
                zckpt("reshard", "ck", "out", "-w", "2"),
                zckpt("to-universal", "ck", "out"),
                zckpt("inspect", "ck"),
                zckpt("verify", "ck"),
                zckpt("diff", "ck", z2ws3),
            ),
            setup=(Copy(z2ws3, "ck"), Remove("ck/global_step3/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")),
        ),
        Run(
            "error.rank-file-copied-z1",
            "errors",
            (
                zckpt("consolidate", "ck", "out"),
                zckpt("reshard", "ck", "out", "-w", "3"),
                zckpt("verify", "ck"),
            ),
            setup=(
                Copy(z1ws2, "ck"),
                Copy(
                    "ck/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                    "ck/global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                ),
            ),
        ),
        Run(
            "error.rank-file-copied-z3",
            "errors",
            (
                zckpt("consolidate", "ck", "out"),
                zckpt("to-universal", "ck", "out"),
                zckpt("verify", "ck"),
                zckpt("verify", "ck", "--json"),
            ),
            setup=(
                Copy(z3ws2, "ck"),
                Copy(
                    "ck/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                    "ck/global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                ),
            ),
        ),
        # z2_fp32_ws1's optimizer file: data/3 holds the fp32 masters (every command reads it), data/1 a moment (reshard reads it, consolidate not)
        Run(
            "error.flipped-bit-master",
            "errors",
            (
                zckpt("consolidate", "ck", "out"),
                zckpt("reshard", "ck", "out", "-w", "2"),
                zckpt("verify", "ck"),
                zckpt("consolidate", "ck", "unchecked", "--no-verify"),
                zckpt("diff", "ck", z2),
                zckpt("diff", "ck", z2, "--no-verify", "--json"),
            ),
            setup=(Copy(z2, "ck"), FlipByte("ck/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt", "data/3")),
        ),
        Run(
            "error.flipped-bit-moment",
            "errors",
            (
                zckpt("consolidate", "ck", "out"),
                zckpt("reshard", "ck", "resharded", "-w", "2"),
                zckpt("to-universal", "ck", "uc"),
                zckpt("verify", "ck", "--json"),
            ),
            setup=(Copy(z2, "ck"), FlipByte("ck/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt", "data/1")),
        ),
        Run(
            "error.truncated",
            "errors",
            (
                zckpt("consolidate", "ck", "out"),
                zckpt("inspect", "ck"),
                zckpt("verify", "ck"),
                zckpt("reshard", "ck", "out", "-w", "2"),
            ),
            setup=(Copy(z3, "ck"), Truncate("ck/global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt")),
        ),
        Run(
            "error.output-inside-input",
            "errors",
            (
                zckpt("consolidate", "ck", "ck/out"),
                zckpt("reshard", "ck", "ck/global_step3/x", "-w", "2"),
                zckpt("to-universal", "ck", "ck/global_step3"),
            ),
            setup=(Copy(z2ws3, "ck"),),
        ),
        Run(
            "error.output-exists",
            "errors",
            (
                zckpt("consolidate", z2, "out"),
                zckpt("consolidate", z2, "out"),
                zckpt("consolidate", z2, "out", "--overwrite", "--dtype", "bf16"),
                zckpt("reshard", z2, "r", "-w", "2"),
                zckpt("reshard", z2, "r", "-w", "2"),
                zckpt("reshard", z2, "r", "-w", "3", "--overwrite"),
                zckpt("to-universal", z2, "u"),
                zckpt("to-universal", z2, "u"),
                zckpt("to-universal", z2, "u", "--overwrite"),
            ),
        ),
        Run(
            "error.usage",
            "errors",
            (
                zckpt("reshard", z2, "out", "-w", "0"),
                zckpt("reshard", z2, "out"),
                zckpt("reshard", z2, "out", "-w", "2", "--stage", "4"),
                zckpt("consolidate", z2, "out", "--dtype", "int8"),
                zckpt("consolidate", z2, "out", "--format", "onnx"),
                zckpt("consolidate", z2, "out", "--max-shard-size", "lots"),
                zckpt("consolidate", "no-such-checkpoint", "out"),
                zckpt("consolidate", z2, "out", "--tag", "global_step99"),
                zckpt("consolidate", z2, "out", "--tag", "../x"),
                zckpt("to-universal", z2, "out", "--target-stage", "0"),
                zckpt("inspect", "."),
                zckpt("train", "--steps", "0"),
                zckpt("train", "--dim", "30", "--heads", "4", "--steps", "1"),
                zckpt("consolidate", z2, "out", "--merge-into", f"{llama}/base"),
            ),
        ),
        Run(
            "error.config",
            "errors",
            (
                zckpt("reshard", z2, "out", "-w", "2", "--config", "sub_group_negative.json"),
                zckpt("reshard", z2, "out", "-w", "2", "--config", "not_a_dict.json"),
                zckpt("reshard", z2, "out", "-w", "2", "--config", "no-such.json"),
                zckpt("reshard", z2, "out", "-w", "2", "--config", "broken.json"),
                zckpt("reshard", z2, "ok", "-w", "2", "--stage", "3", "--config", "sub_group_string.json"),
            ),
            setup=(
                Write("sub_group_negative.json", json.dumps({"zero_optimization": {"sub_group_size": -5}})),
                Write("not_a_dict.json", json.dumps({"zero_optimization": "oops"})),
                Write("broken.json", '{"zero_optimization": {'),
                Write(
                    "sub_group_string.json", json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": "500"}})
                ),
            ),
        ),
        # the two outputs allowed inside their input: weights beside a checkpoint-N folder's config, a universal folder beside the tags
        Run(
            "in-place.hf-trainer",
            "in-place",
            (
                zckpt("consolidate", "checkpoint-3", "checkpoint-3"),
                zckpt("consolidate", "checkpoint-3", "checkpoint-3", "--dtype", "bf16"),
                zckpt("consolidate", "checkpoint-3", "checkpoint-3", "--dtype", "bf16", "--overwrite"),
                zckpt("consolidate", "checkpoint-3", "checkpoint-3/sub"),
                zckpt("reshard", "checkpoint-3", "r", "-w", "3"),
            ),
            setup=(Copy(f"{SAMPLES}/hf_trainer/checkpoint-3", "checkpoint-3"),),
        ),
        Run(
            "in-place.to-universal",
            "in-place",
            (
                zckpt("to-universal", "ck", "ck"),
                zckpt("inspect", "ck"),
                zckpt("inspect", "ck", "--tag", "global_step3_universal"),
            ),
            setup=(Copy(z2ws3, "ck"),),
        ),
    ]
    return runs


def build_runs(samples: list[Sample], quick: bool, only: re.Pattern[str] | None) -> list[Run]:
    """The whole run list, filtered; heavy runs first so that the long ones do not end the schedule alone."""
    runs = [run for sample in samples for run in sample_runs(sample)] + train_runs() + other_runs()
    names = collections.Counter(run.name for run in runs)
    duplicates = [name for name, count in names.items() if count > 1]
    if duplicates:
        raise ValueError(f"run names used twice: {duplicates}")
    runs = [run for run in runs if (run.quick or not quick) and (only is None or only.search(run.name))]
    return sorted(runs, key=lambda run: not run.heavy)


# --------------------------------------------------------------------------- sides


@dataclass
class Side:
    """One tree under test and the folders its runs use."""

    label: str
    description: str
    root: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def tree(self) -> Path:
        return self.root / "tree"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def replacements(self, run_dir: Path) -> list[tuple[str, str]]:
        """Absolute paths that differ between sides, longest first, each as given and resolved."""
        pairs = []
        for path, token in ((run_dir, "<RUN>"), (self.tree, "<TREE>"), (self.root, "<SIDE>")):
            for spelling in {str(path), str(path.resolve())}:
                pairs.append((spelling, token))
        return sorted(pairs, key=lambda pair: -len(pair[0]))


class SetupError(Exception):
    """A side could not be prepared (a bad revision, a tree without zckpt): exit 2."""


def git(repo: Path, *args: str) -> str:
    """A git command's output; its failure (a bad revision) is a SetupError."""
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SetupError(f"git {' '.join(args)}: {result.stderr.strip() or 'failed'}")
    return result.stdout.strip()


def export_revision(repo: Path, revision: str, tree: Path) -> str:
    """``git archive REV | tar -x``: exactly the committed tree. Returns a description."""
    commit = git(repo, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    tree.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", commit], stdout=subprocess.PIPE)
    extract = subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() != 0 or extract.returncode != 0:
        raise SetupError(f"git archive {revision} | tar -x failed")
    subject = git(repo, "log", "-1", "--format=%s", commit)
    return f"rev {revision} = {commit[:10]} ({subject[:60]})"


IGNORED_OUTSIDE_GIT = shutil.ignore_patterns(
    ".git", ".venv*", "__pycache__", "*.egg-info", ".pytest_cache", "build", "dist"
)


def copy_folder(folder: Path, tree: Path) -> str:
    """A working tree as it is: git's tracked and untracked files that are not ignored (else all but caches and venvs)."""
    top = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    listing = subprocess.run(
        ["git", "-C", str(folder), "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True
    )
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != folder or listing.returncode != 0:
        shutil.copytree(folder, tree, symlinks=True, ignore=IGNORED_OUTSIDE_GIT)
        return f"folder {folder} (not a git work tree's top: all but caches and venvs)"
    tree.mkdir(parents=True)
    copied = 0
    for name in sorted(set(listing.stdout.decode().split("\0")) - {""}):
        source = folder / name
        if not source.is_symlink() and not source.is_file():  # deleted, or a submodule
            continue
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, tree / name, follow_symlinks=False)
        copied += 1
    return f"folder {folder} ({copied} files: tracked and untracked, not ignored)"


def normalise_modes(tree: Path) -> None:
    """Give every file the mode git records (644, or 755 if executable) and every folder 755:
    ``tar -x`` of ``git archive`` gives 664/775, a checkout gives the umask's, and the modes of the
    input copies a run makes are compared."""
    for directory, subdirs, files in os.walk(tree):
        os.chmod(directory, 0o755)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755 if os.stat(path).st_mode & 0o111 else 0o644)


def side_environment(tree: Path, tmp: Path) -> dict[str, str]:
    """The side's code first on the path; everything that could make two runs differ pinned or removed."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ZCKPT_", "TORCHELASTIC_", "PYTHON", "OMP_", "MKL_"))
        and key
        not in {
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
            "ROLE_RANK",
        }
    }
    env.update(
        PYTHONPATH=str(tree),
        PYTHONHASHSEED="0",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        COLUMNS="100",
        LINES="40",
        TERM="dumb",
        NO_COLOR="1",
        LC_ALL="C.UTF-8",
        TZ="UTC",
        TMPDIR=str(tmp),
    )
    return env


def prepare_side(label: str, spec: str, repo: Path, work: Path) -> Side:
    """Export or copy the tree, then check that ``python -m zckpt`` there runs that tree's code."""
    root = work / label
    root.mkdir()
    (root / "runs").mkdir()
    (root / "tmp").mkdir()
    folder = Path(spec).expanduser()
    description = (
        copy_folder(folder.resolve(), root / "tree") if folder.is_dir() else export_revision(repo, spec, root / "tree")
    )
    normalise_modes(root / "tree")
    side = Side(label, description, root, side_environment(root / "tree", root / "tmp"))
    probe = subprocess.run(
        [sys.executable, "-c", "import zckpt, torch; print(zckpt.__file__)"],
        cwd=side.runs,
        env=side.env,
        capture_output=True,
        text=True,
    )
    loaded = Path(probe.stdout.strip() or "?").resolve()
    if probe.returncode != 0 or side.tree.resolve() not in loaded.parents:
        raise SetupError(
            f"{label}: python -m zckpt does not run the exported tree's code (loaded {loaded}): {probe.stderr.strip()[-300:]}"
        )
    if not (side.tree / "sample_ckpts").is_dir():
        raise SetupError(f"{label}: {description} has no sample_ckpts/")
    return side


# --------------------------------------------------------------------------- running and hashing


@dataclass
class CommandResult:
    """One command as run on one side, its output normalised."""

    argv: list[str]
    exit: int | str  # "timeout" when killed
    stdout: str
    stderr: str
    seconds: float

    def console(self) -> str:
        """What the user sees of a command, the text compared between sides."""
        return f"$ {' '.join(self.argv)}\nexit {self.exit}\n--- stdout\n{self.stdout}--- stderr\n{self.stderr}"


@dataclass
class RunResult:
    """One run on one side: its commands and the manifest of its folder afterwards."""

    name: str
    group: str
    commands: list[CommandResult]
    files: dict[str, str]  # relative path -> "file <mode> <sha256>", "dir <mode>" or "link <target>"
    seconds: float

    def entries(self) -> dict[str, str]:
        """Everything compared for this run: its files, and each command's exit code and console text."""
        consoles = {
            f"<command {index}: exit, stdout, stderr>": hashlib.sha256(
                command.console().encode("utf-8", "surrogateescape")
            ).hexdigest()
            for index, command in enumerate(self.commands, 1)
        }
        return {**self.files, **consoles}


def tree_manifest(folder: Path) -> dict[str, str]:
    """Every file, folder (empty ones too) and link under ``folder``: path, mode and content hash."""
    manifest = {}
    for directory, subdirs, files in os.walk(folder):
        subdirs.sort()
        here = Path(directory)
        for name in sorted(subdirs + files):
            path = here / name
            relative = path.relative_to(folder).as_posix()
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                manifest[relative] = f"link {os.readlink(path)}"
            elif stat.S_ISDIR(info.st_mode):
                manifest[relative + "/"] = f"dir {stat.S_IMODE(info.st_mode):o}"
            elif stat.S_ISREG(info.st_mode):
                digest = hashlib.sha256()
                with path.open("rb") as handle:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        digest.update(block)
                manifest[relative] = f"file {stat.S_IMODE(info.st_mode):o} {digest.hexdigest()}"
            else:
                manifest[relative] = f"other {stat.S_IFMT(info.st_mode):o}"
    return manifest


def normalise(text: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        text = text.replace(old, new)
    return RATE.sub("tokens/s <rate>", text)


def shown(argv: tuple[str, ...]) -> list[str]:
    """A command as a user would type it (``zckpt ...``, ``python -m torch.distributed.run ...``)."""
    return ["zckpt", *argv[2:]] if argv[:2] == ("-m", "zckpt") else ["python", *argv]


def run_command(argv: tuple[str, ...], run_dir: Path, side: Side, timeout: float) -> CommandResult:
    """One command in its own session, so that a timeout kills torchrun's workers too."""
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, *argv],
        cwd=run_dir,
        env=side.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        exit_code: int | str = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        exit_code = "timeout"
    replacements = side.replacements(run_dir)
    decode = lambda data: normalise(data.decode("utf-8", "surrogateescape"), replacements)  # noqa: E731
    return CommandResult(shown(argv), exit_code, decode(stdout), decode(stderr), time.monotonic() - started)


def execute(run: Run, side: Side, timeout: float) -> RunResult:
    started = time.monotonic()
    run_dir = side.runs / run.name
    run_dir.mkdir()
    try:
        for step in run.setup:
            step.apply(run_dir)
    except (
        OSError,
        ValueError,
        zipfile.BadZipFile,
    ) as exc:  # an input the tree lacks: a result to compare, not a crash of the whole proof
        failed = CommandResult(
            ["<setup>", type(step).__name__], "setup failed", "", normalise(f"{exc}\n", side.replacements(run_dir)), 0.0
        )
        return RunResult(run.name, run.group, [failed], tree_manifest(run_dir), time.monotonic() - started)
    commands = [run_command(argv, run_dir, side, timeout) for argv in run.commands]
    return RunResult(run.name, run.group, commands, tree_manifest(run_dir), time.monotonic() - started)


def execute_side(side: Side, runs: list[Run], workers: int, timeout: float) -> tuple[dict[str, RunResult], float]:
    """All runs of one side, ``workers`` at a time; prints a progress line every tenth of the list."""
    started = time.monotonic()
    results: dict[str, RunResult] = {}
    inputs = tree_manifest(side.tree / "sample_ckpts")
    results["inputs.sample_ckpts"] = RunResult("inputs.sample_ckpts", "inputs", [], inputs, 0.0)
    step = max(1, len(runs) // 10)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(execute, run, side, timeout) for run in runs]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            result = future.result()
            results[result.name] = result
            if done % step == 0 or done == len(runs):
                print(
                    f"  {side.label}: {done}/{len(runs)} runs, {format_seconds(time.monotonic() - started)}", flush=True
                )
    return results, time.monotonic() - started


def save_manifest(side: Side, results: dict[str, RunResult]) -> None:
    """Everything recorded for a side, for a later look with --keep."""
    data = {
        name: {
            "group": result.group,
            "seconds": round(result.seconds, 2),
            "files": result.files,
            "commands": [
                {
                    "argv": command.argv,
                    "exit": command.exit,
                    "stdout": command.stdout,
                    "stderr": command.stderr,
                    "seconds": round(command.seconds, 2),
                }
                for command in result.commands
            ],
        }
        for name, result in sorted(results.items())
    }
    (side.root / "manifest.json").write_text(
        json.dumps({"side": side.label, "tree": side.description, "runs": data}, indent=1)
    )


# --------------------------------------------------------------------------- comparing and reporting


@dataclass
class Difference:
    """One entry (a file or a command's console) that is not the same on both sides."""

    run: str
    entry: str
    detail: list[str]


def compare(
    before: dict[str, RunResult], after: dict[str, RunResult]
) -> tuple[list[Difference], dict[str, collections.Counter[str]]]:
    """Every entry of every run, before against after; counts per group."""
    differences: list[Difference] = []
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        group = (old or new).group
        counts[group]["runs"] += 1
        if old is None or new is None:
            differences.append(Difference(name, "<run>", [f"ran only {'after' if old is None else 'before'}"]))
            counts[group]["differing"] += 1
            continue
        old_entries, new_entries = old.entries(), new.entries()
        for entry in sorted(set(old_entries) | set(new_entries)):
            counts[group]["consoles" if entry.startswith("<command") else "files"] += 1
            if old_entries.get(entry) == new_entries.get(entry):
                counts[group]["identical"] += 1
                continue
            counts[group]["differing"] += 1
            differences.append(Difference(name, entry, describe(entry, old, new, old_entries, new_entries)))
    return differences, counts


def describe(
    entry: str, old: RunResult, new: RunResult, old_entries: dict[str, str], new_entries: dict[str, str]
) -> list[str]:
    """A difference in a few lines: a diff of the console text, or the two hashes of a file."""
    if entry.startswith("<command"):
        index = int(entry.split()[1].rstrip(":")) - 1
        old_text = old.commands[index].console().splitlines() if index < len(old.commands) else []
        new_text = new.commands[index].console().splitlines() if index < len(new.commands) else []
        lines = list(difflib.unified_diff(old_text, new_text, "before", "after", n=1, lineterm=""))
        return lines[:24] + ([f"... {len(lines) - 24} more diff lines"] if len(lines) > 24 else [])
    return [f"before: {old_entries.get(entry, 'absent')}", f"after:  {new_entries.get(entry, 'absent')}"]


def format_seconds(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s"


def exit_code_summary(results: dict[str, RunResult]) -> str:
    codes = collections.Counter(str(command.exit) for result in results.values() for command in result.commands)
    return ", ".join(f"exit {code}: {count}" for code, count in sorted(codes.items()))


def report(
    sides: list[Side],
    results: list[dict[str, RunResult]],
    seconds: list[float],
    differences: list[Difference],
    counts: dict[str, collections.Counter[str]],
    show: int,
) -> None:
    print()
    print(f"{'side':7} {'runs':>5} {'commands':>9} {'wall':>7}  tree")
    for side, result, wall in zip(sides, results, seconds):
        commands = sum(len(run.commands) for run in result.values())
        print(f"{side.label:7} {len(result) - 1:5} {commands:9} {format_seconds(wall):>7}  {side.description}")
    for side, result in zip(sides, results):
        print(f"{side.label}: {exit_code_summary(result)}")
        crashed = sorted(
            {
                name
                for name, run in result.items()
                for command in run.commands
                if "Traceback (most recent call last)" in command.stderr or command.exit == "timeout"
            }
        )
        if crashed:
            print(
                f"{side.label}: a traceback or timeout in {len(crashed)} run(s): {', '.join(crashed[:10])}{' ...' if len(crashed) > 10 else ''}"
            )
    print()
    print(f"{'group':15} {'runs':>5} {'files':>6} {'consoles':>8} {'identical':>9} {'differing':>9}")
    total: collections.Counter[str] = collections.Counter()
    for group in sorted(counts):
        row = counts[group]
        total.update(row)
        print(
            f"{group:15} {row['runs']:5} {row['files']:6} {row['consoles']:8} {row['identical']:9} {row['differing']:9}"
        )
    print(
        f"{'total':15} {total['runs']:5} {total['files']:6} {total['consoles']:8} {total['identical']:9} {total['differing']:9}"
    )
    print(
        "(files: paths under the run folders, outputs and input copies, empty folders included; consoles: a command's exit code, stdout and stderr)"
    )
    if not differences:
        print("\nIDENTICAL: every file, exit code and message is the same before and after.")
        return
    by_run: dict[str, list[str]] = collections.defaultdict(list)
    for difference in differences:
        by_run[difference.run].append(difference.entry)
    print(f"\nDIFFERENT: {len(differences)} entries in {len(by_run)} run(s)")
    for run, entries in sorted(by_run.items()):
        print(f"  {run}: {', '.join(entries[:3])}{f' (+{len(entries) - 3} more)' if len(entries) > 3 else ''}")
    # details: messages first (they say what changed), then files
    ordered = sorted(
        differences,
        key=lambda difference: (not difference.entry.startswith("<command"), difference.run, difference.entry),
    )
    print(f"\ndetails ({min(show, len(ordered))} of {len(ordered)}; exit codes and messages first):")
    for difference in ordered[:show]:
        print(f"  {difference.run}  {difference.entry}")
        for line in difference.detail:
            print(f"      {line}")
    if len(ordered) > show:
        print(f"  ... {len(ordered) - show} more (--show N; --keep keeps each side's manifest.json)")


# --------------------------------------------------------------------------- main


def default_before(repo: Path) -> str:
    """Where the branch left main: a refactor branch is compared with its own starting point, not with what main merged since."""
    try:
        return git(repo, "merge-base", "main", "HEAD")
    except SetupError as exc:
        raise SetupError(f"no merge-base of main and HEAD ({exc}); pass --before") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument("--before", help="git revision or folder (default: merge-base of main and HEAD)")
    parser.add_argument(
        "--after", default="HEAD", help="git revision or folder, e.g. . for the working tree (default: HEAD)"
    )
    parser.add_argument(
        "--repo", type=Path, default=ROOT, help="the git repository revisions are read from (default: this script's)"
    )
    parser.add_argument(
        "--work", type=Path, help="folder for the trees and run folders (default: a new temporary folder)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder (trees, run folders, manifest.json per side)"
    )
    parser.add_argument("--workers", type=int, default=2, help="runs at once per side (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one command may take (default 600)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a subset: 7 representative samples, fewer reshard targets, the main train chains",
    )
    parser.add_argument("--only", type=re.compile, help="only runs whose name matches this regular expression")
    parser.add_argument("--list", action="store_true", help="print the run list and exit")
    parser.add_argument("--show", type=int, default=30, help="differences printed in detail (default 30)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")

    work = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix="same_outputs_"))
    made: list[Path] = []
    try:
        if args.work:
            work.mkdir(parents=True, exist_ok=True)
            clash = [work / label for label in ("before", "after") if (work / label).exists()]
            if clash:
                raise SetupError(f"{', '.join(map(str, clash))} exist: remove them or pick another --work")
        made.append(work / "before")
        sides = [prepare_side("before", args.before or default_before(args.repo), args.repo, work)]
        runs = build_runs(
            find_samples(sides[0].tree / "sample_ckpts"), args.quick, args.only
        )  # the before tree's samples
        if args.list:
            for run in runs:
                print(f"{run.name}  [{run.group}]")
                for command in run.commands:
                    print(f"    {' '.join(shown(command))}")
            print(f"{len(runs)} runs, {sum(len(run.commands) for run in runs)} commands")
            return 0
        made.append(work / "after")
        sides.append(prepare_side("after", args.after, args.repo, work))
        if args.after == "HEAD" and git(args.repo, "status", "--porcelain", "--untracked-files=no"):
            print(
                "note: the working tree has uncommitted changes, which --after HEAD leaves out (--after . compares them)",
                file=sys.stderr,
            )
        print(f"same_outputs: {len(runs)} runs per side, {args.workers} at a time; work folder {work}")
        for side in sides:
            print(f"  {side.label}: {side.description}")
        results, seconds = [], []
        for side in sides:
            side_results, wall = execute_side(side, runs, args.workers, args.timeout)
            save_manifest(side, side_results)
            results.append(side_results)
            seconds.append(wall)
        differences, counts = compare(results[0], results[1])
        report(sides, results, seconds, differences, counts, args.show)
        if args.keep:
            print(f"kept: {work} (per side: tree/, runs/<run>/, manifest.json)")
        return 1 if differences else 0
    except SetupError as exc:
        print(f"same_outputs: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            if args.work:
                for path in made:
                    shutil.rmtree(path, ignore_errors=True)
            else:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
