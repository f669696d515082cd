"""Consolidate a ZeRO checkpoint into full weights (safetensors or torch), like zero_to_fp32.py.

Differences from DeepSpeed's tool, all deliberate: frozen params are always kept (unless
excluded), including those ZeRO-1 records only in the module state dict; tied weights are
written under every name in safetensors too (the metadata says which name aliases which);
NVMe-offloaded checkpoints are read where the tool fails. Every tensor the tool writes comes
out with the same bits.

The plan and the writer are :mod:`.weights_folder`'s, shared with the PEFT outputs (:mod:`.peft`),
which a PEFT run's checkpoint gets instead.
"""

from __future__ import annotations

import os
from typing import Callable, Literal

from ..core.dtypes import FP32, DTypeLike, output_dtype
from ..core.errors import LayoutError, UsageError
from ..core.index import CheckpointIndex
from ..core.run_folders import TRAINER_CHECKPOINT_RE
from ..deepspeed.reader import open_checkpoint, open_training_state
from ..io.jobs import job_share
from ..io.output import refuse_output_inside_input
from .formats import FORMATS, SAFETENSORS, WeightsFormat, find_format
from .lightning import LIGHTNING, LIGHTNING_FILE, consolidate_lightning, without_legacy_prefix
from .peft import consolidate_peft
from .replicas import replica_problems
from .weights_folder import ConsolidationResult, OutputFormat, Progress, plan_consolidation, write_consolidated


def consolidate(
    checkpoint: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: DTypeLike | None = None,
    format: OutputFormat | WeightsFormat | Literal["lightning"] = "safetensors",
    max_shard_size: str | int = "5GB",
    exclude_frozen: bool = False,
    peft: bool | None = None,
    merge_into: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    verify: bool = True,
    swap_folder: str | os.PathLike[str] | None = None,
    wait: bool = False,
    optimizer_states: bool = False,
    tp_rules: str | os.PathLike[str] | None = None,
) -> ConsolidationResult:
    """Read a ZeRO checkpoint and write its consolidated weights into `output_dir`.

    With `verify` (the default), every record of the checkpoint whose bytes are used passes its
    CRC-32 check before the output is moved into place.

    A PEFT run's checkpoint (adapter_config.json beside the tag folders, or `peft` True) gives
    PEFT's adapter folder instead; with `merge_into` (a Hugging Face model folder) the adapter
    merged into that base model (see :mod:`zckpt.ops.peft`). `peft` False writes the raw tensors.
    `dtype` defaults to fp32, or for a merge to the base's own dtype.

    `format` "lightning": the one file PyTorch Lightning's converter writes
    (``output_dir/lightning_model.pt``: Lightning's state and the state dict, frozen params and
    buffers in their saved dtype unless `dtype` is given; see :mod:`zckpt.ops.lightning`); with
    `optimizer_states`, the optimizer's state too, so that a Lightning Trainer without DeepSpeed
    resumes the whole run from that file.

    `swap_folder` (a live ZeRO-Infinity ``<nvme_path>``): `checkpoint` (any checkpoint of the same
    run) gives the layout, the swap folder the fp32 masters of every swapped sub-group, so the
    run's newest weights are written (16-bit output rounds those masters to nearest).

    `tp_rules`: a ``--tp-rules`` JSON file of Megatron-style merge patterns, for a tensor-parallel
    run that records none (see :mod:`zckpt.deepspeed.megatron_rules`).

    One writer per output folder: another zckpt run writing `output_dir` makes this one refuse
    (an OutputError naming it), or with `wait` wait for it to end.

    Under torchrun (``WORLD_SIZE`` > 1) the processes share the weights files, each reading only
    what its files hold (see :func:`~zckpt.ops.weights_folder.write_consolidated`); the output is
    the one a single process writes. The split is by file: a single-file output (one shard, a
    PEFT adapter) is written by one process, as are Lightning's file and a PEFT merge (process 0;
    the others wait for it).
    """
    _refuse_file_name(os.fspath(output_dir), format)
    if optimizer_states and format != LIGHTNING:
        raise UsageError(None, "--optimizer-states goes with --format lightning (weights folders hold no optimizer)")
    state = open_training_state(checkpoint, tag, swap_folder, tp_rules) if optimizer_states else None
    index = state.index if state is not None else open_checkpoint(checkpoint, tag, swap_folder, tp_rules)
    in_place = (
        index.checkpoint_dir
        if TRAINER_CHECKPOINT_RE.match(os.path.basename(os.path.realpath(index.checkpoint_dir)))
        else None
    )
    refuse_output_inside_input(os.fspath(output_dir), (index.checkpoint_dir, index.tag_dir), may_be=in_place)
    index = without_legacy_prefix(index) or index  # Lightning < 2.1: the LightningModule's own names
    differing = replica_problems(index)  # a tied param is written once: its other copies must agree
    if differing:
        raise LayoutError(index.tag_dir, differing[0])
    if format == LIGHTNING:
        if peft or merge_into is not None:
            raise UsageError(
                None, "--format lightning writes Lightning's whole-model checkpoint; it takes no PEFT options"
            )
        written = _first_process_writes(
            os.fspath(output_dir),
            index,
            lambda: consolidate_lightning(
                index,
                os.fspath(output_dir),
                dtype=None if dtype is None else output_dtype(dtype),
                exclude_frozen=exclude_frozen,
                state=state,
                overwrite=overwrite,
                progress=progress,
                verify=verify,
                wait=wait,
            ),
        )
        assert written is not None  # consolidate_lightning always writes
        return written

    def peft_output() -> ConsolidationResult | None:
        return consolidate_peft(
            index,
            os.fspath(output_dir),
            peft=peft,
            merge_into=merge_into,
            dtype=dtype,
            format=format,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            progress=progress,
            verify=verify,
            wait=wait,
        )

    # a merge computes its tensors: one process writes it (an adapter folder is shared out)
    done = peft_output() if merge_into is None else _first_process_writes(os.fspath(output_dir), index, peft_output)
    if done is not None:
        return done
    dtype = FP32 if dtype is None else dtype
    plan = plan_consolidation(
        index, dtype=dtype, format=format, max_shard_size=max_shard_size, exclude_frozen=exclude_frozen
    )
    return write_consolidated(
        index, plan, os.fspath(output_dir), overwrite=overwrite, progress=progress, verify=verify, wait=wait
    )


def _first_process_writes(
    output_dir: str, index: CheckpointIndex, write: Callable[[], ConsolidationResult | None]
) -> ConsolidationResult | None:
    """`write()` on process 0 of a torchrun job, the others waiting for it and returning what it
    wrote (their own `index`); `write()` itself for a process alone."""
    part, parts, sync = job_share(output_dir)
    if parts == 1:
        return write()
    result = None
    try:
        if part == 0:
            result = write()
        sync()
    except BaseException:
        sync.fail()
        raise
    summary = sync.gather(
        None if result is None else (result.files, result.tensors, result.bytes_written, result.dtype, result.peft)
    )[0]
    if result is not None or summary is None:
        return result
    files, tensors, written, dtype, peft = summary
    return ConsolidationResult(output_dir, files, tensors, written, index, dtype, peft)


_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


def _refuse_file_name(output_dir: str, format: OutputFormat | WeightsFormat | Literal["lightning"]) -> None:
    """An OUTPUT_DIR named like a weights file (``out/pytorch_model.bin``: older zero_to_fp32.py
    took the output file, as Lightning's converter does) is refused rather than made a folder of
    that name or written as that one file: the output is a folder whose file names
    from_pretrained (or Lightning's users) expect, sharded or not."""
    if format == LIGHTNING:
        if output_dir.endswith((*_FILE_SUFFIXES, ".ckpt")) and not os.path.isdir(output_dir):
            folder = os.path.dirname(output_dir.rstrip(os.sep)) or "."
            raise UsageError(
                output_dir,
                f"OUTPUT_DIR names a file (Lightning's converter's output-file form); give the folder: "
                f"'{folder}' gets {LIGHTNING_FILE}",
            )
        return
    if output_dir.endswith(_FILE_SUFFIXES) and not os.path.isdir(output_dir):
        folder = os.path.dirname(output_dir.rstrip(os.sep)) or "."
        fmt = find_format(format) or SAFETENSORS
        other = "".join(
            f" (--format {f.name}: {f.single_file})" for f in FORMATS.values() if f is not fmt and f is not SAFETENSORS
        )
        raise UsageError(
            output_dir,
            f"OUTPUT_DIR names a file (zero_to_fp32.py's old output-file form); give the folder: "
            f"'{folder}' gets {fmt.single_file}{other}",
        )
