"""``zckpt to-dcp``: a torch.distributed.checkpoint (DCP) folder that FSDP2 / torchtitan resumes.

The folder holds ``{"model": ..., "optim": ...}`` laid out as
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` returns it (full
state dicts keyed by the module's own names), so a fresh model sharded with ``fully_shard`` at
any world size, plus torch's optimizer of the run (``torch.optim.AdamW``, ``SGD``, ``Adagrad``,
...; DeepSpeed's own as torch's equivalent: :func:`torch_group`) with the same groups, resumes
with ``dcp.load`` and ``set_state_dict``:

- ``model``: every name of the module's state dict (tied names both), trainable params as their
  fp32 masters (or rounded to `dtype`), frozen params and buffers as saved;
- ``optim["state"][name]``: every optimizer state of each trainable param (``exp_avg``,
  ``exp_avg_sq``, ...; DeepSpeedCPUAdagrad's ``exp_avg_sq`` as ``sum``, torch's Adagrad's name)
  plus its group's scalar states: ``step`` a float32 0-d tensor as torch's optimizers keep it,
  DeepSpeed's own optimizers' integer step included (torch counts steps per param, DeepSpeed per
  group: each param gets its group's), NAdam's ``mu_product`` as saved;
- ``optim["param_groups"]``: the groups' hyperparameters as saved, with their params' names
  (a run of DeepSpeed's own Adam, CPU Adagrad or Muon, which save fewer keys than torch's
  equivalent, gets torch's others: :func:`torch_group`).

What DCP has no place for (counters, the lr scheduler, the client state) goes into
``train_state.json`` beside it (:func:`train_state`).

Memory and speed: torch is not imported. zckpt lays the data file out itself (each tensor, and
each param group value, as the torch.save archive torch's writer puts there, one after another)
and writes ``.metadata`` as torch's planner and writer would for that layout
(:mod:`zckpt.torchfile.dcp_metadata`); the archives stream from the checkpoint's files through
zckpt's own torch.save writer (direct I/O or kernel copies where no dtype changes, CRC-32s on
helper threads), so a few MiB of buffers are in memory whatever the tensor sizes. The folder is
staged beside OUTPUT_DIR and renamed into place once complete, so it appears whole or not at all.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..core.dtypes import FP32, DType, DTypeLike, output_dtype
from ..core.errors import CorruptFileError, LayoutError, OutputError, UsageError
from ..core.index import TensorRef, TensorSource
from ..core.state import ScalarState, TrainingState
from ..deepspeed.elastic import missing_hyperparameters
from ..deepspeed.optimizers import deepspeed_adam_w_mode, deepspeed_own_optimizer, muon_adam_w_mode
from ..deepspeed.reader import open_training_state
from ..deepspeed.zenflow import dcp_weights_note, unsaved_moments_note
from ..io.checksums import RecordChecker
from ..io.interrupts import signals_deferred
from ..io.jobs import JobFailed, job_share, share_of
from ..io.materialize import read_scalar, read_tensor
from ..io.output import (
    OutputLock,
    StagedFolder,
    fsync_file,
    is_inside,
    output_error,
    refuse_output_inside_input,
)
from ..io.reading import FileReader, source_of
from ..torchfile.dcp_metadata import METADATA_FILE, StoredItem, TensorMeta, flatten, metadata_bytes
from ..torchfile.records import PickledObject
from ..torchfile.save import ArchivePlan, Copy, Inline, OutTensor, plan_archive, write_archives

TRAIN_STATE_FILE = "train_state.json"
TRAIN_STATE_FORMAT = "zckpt-train-state"
_MAX_JSON_ELEMENTS = 4096  # a tensor in the client state or scheduler: its values up to this many


@dataclass(frozen=True)
class DcpTensor:
    """One tensor of the DCP state dict: its path in the nested dict, where its bytes are, the
    dtype it is written in; or, for a scalar state kept as a Python number, that `value`."""

    path: tuple[str, ...]  # ("model", name) or ("optim", "state", name, key)
    shape: tuple[int, ...]
    dtype: DType
    source: TensorSource | None = None
    value: float | int | None = None

    @property
    def key(self) -> str:
        """The name DCP stores it under (its path joined with dots, as DCP flattens)."""
        return ".".join(self.path)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class DcpPlan:
    """Every tensor of the DCP state dict in writing order, the param groups, the sidecar."""

    tensors: tuple[DcpTensor, ...]
    param_groups: tuple[dict[str, Any], ...]
    dtype: DType  # of the trainable params


@dataclass(frozen=True)
class DcpResult:
    output_dir: str
    source: TrainingState
    dtype: DType
    tensors: int  # tensors written (model and optimizer)
    bytes_written: int  # the DCP files' and the sidecar's sizes
    files: tuple[str, ...]
    notes: tuple[str, ...] = ()  # what the input itself lacks (a ZenFlow overlap_step run's moments, in no file)


def plan_dcp(state: TrainingState, dtype: DTypeLike = "fp32") -> DcpPlan:
    """Lay out a training state as get_state_dict's ``{"model", "optim"}``; reads nothing."""
    target = output_dtype(dtype)
    entries = {e.name: e for e in state.index.entries}
    # the module's state dict order; anything the index holds beyond it (none expected) after it
    names = [n for n in state.module_names if n in entries] + [n for n in entries if n not in state.module_names]
    tensors = []
    renames = _TORCH_STATE_NAMES.get(deepspeed_own_optimizer(state.ds_config) or "", {})
    for name in names:
        source = entries[name].source
        kind = entries[entries[name].alias_of or name].kind
        out = target if kind == "param" and source.dtype.is_floating else source.dtype
        tensors.append(DcpTensor(("model", name), source.shape, out, source))
    for param in state.params:
        group = state.groups[param.group]
        scalars = {
            key: _scalar(key, scalar)
            for key, scalar in group.scalars.items()
            if scalar.tensor is not None or scalar.value is not None
        }
        for key, made in scalars.items():
            tensors.append(DcpTensor(("optim", "state", param.name, key), *made))
        for saved_key, source in param.states.items():
            key = renames.get(saved_key, saved_key)
            if key != saved_key and key in param.states:
                raise LayoutError(
                    state.index.tag_dir, f"{param.name}: optimizer states {saved_key!r} and {key!r} both saved"
                )
            if key in scalars:
                raise LayoutError(
                    state.index.tag_dir, f"{param.name}: optimizer state {key!r} is both per group and per param"
                )
            tensors.append(DcpTensor(("optim", "state", param.name, key), source.shape, source.dtype, source))
    refusal = missing_hyperparameters(state, "a torch optimizer state dict (DCP, Lightning)")
    if refusal is not None:  # an elastic_checkpoint run's groups, in no file (.deepspeed.elastic)
        raise refusal
    groups = tuple(
        {**torch_group(group.hyperparams, state.ds_config), "params": list(group.params)} for group in state.groups
    )
    for path, value in group_values(groups):
        if not _plain(value):
            name = ".".join(map(str, path))
            raise LayoutError(
                state.index.tag_dir, f"param group value {name} is a {type(value).__name__}: DCP keeps no such value"
            )
    return DcpPlan(tuple(tensors), groups, target)


# torch.optim.AdamW's group keys (torch 2.13) that DeepSpeed's own Adams do not save, with the
# values that make torch's Adam step as they did (decoupled_weight_decay: their adam_w_mode)
_TORCH_ADAM_DEFAULTS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}


# torch.optim.Adagrad's group keys (torch 2.13) that DeepSpeedCPUAdagrad does not save: it decays
# no lr and starts its sum at zero, as torch's Adagrad with these values does
_TORCH_ADAGRAD_DEFAULTS = {
    "lr_decay": 0,
    "initial_accumulator_value": 0,
    "foreach": None,
    "maximize": False,
    "differentiable": False,
    "fused": None,
}
# torch.optim.Muon's group keys (torch 2.13) that DeepSpeed's Muon group does not save, with the
# values of DeepSpeed's muon_update (0.19.8, runtime/zero/muon/original_muon.py): Nesterov always,
# 5 iterations of the quintic Newton-Schulz (3.4445, -4.7750, 2.0315) after dividing by the norm
# plus 1e-7, the update scaled by sqrt(max(1, rows / cols)) (torch's adjust_lr_fn "original").
# Its default ns_method "gram" iterates on the Gram matrix, the same polynomial reordered (equal
# up to rounding), which torch's Muon does not offer.
_TORCH_MUON_DEFAULTS = {
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.775, 2.0315),
    "eps": 1e-7,
    "ns_steps": 5,
    "adjust_lr_fn": None,
}
# the states DeepSpeed's own optimizers name otherwise than torch's equivalent does
_TORCH_STATE_NAMES = {"cpu_adagrad": {"exp_avg_sq": "sum"}}


def _completed(hyperparams: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    return {**hyperparams, **{k: v for k, v in defaults.items() if k not in hyperparams}}


def torch_group(hyperparams: dict[str, Any], ds_config: dict[str, Any]) -> dict[str, Any]:
    """A group's hyperparameters as saved, completed with the keys of torch's equivalent of the
    DeepSpeed optimizer that ran (dcp.load wants every key of the fresh optimizer's groups):
    FusedAdam / DeepSpeedCPUAdam torch's AdamW or Adam (:func:`torch_adam_group`),
    DeepSpeedCPUAdagrad torch's Adagrad, DeepSpeed's Muon torch's Muon (its Muon groups) and AdamW
    or Adam (its Adam groups, by ``adam_w_mode``). torch's own optimizers' groups, and DeepSpeed's
    Lion (torch has no Lion), as saved. What was saved is kept as saved."""
    own = deepspeed_own_optimizer(ds_config)
    if own == "adam":
        return torch_adam_group(hyperparams, deepspeed_adam_w_mode(ds_config))
    if own == "cpu_adagrad":
        return _completed(hyperparams, _TORCH_ADAGRAD_DEFAULTS)
    if own == "muon":
        if hyperparams.get("use_muon"):
            return _completed(hyperparams, _TORCH_MUON_DEFAULTS)
        return torch_adam_group(hyperparams, muon_adam_w_mode(ds_config))
    return dict(hyperparams)


def torch_adam_group(hyperparams: dict[str, Any], adam_w_mode: bool | None) -> dict[str, Any]:
    """A group's hyperparameters as saved, completed with the keys torch's AdamW (or Adam) has
    where DeepSpeed's FusedAdam or DeepSpeedCPUAdam ran (`adam_w_mode` not None): dcp.load wants
    every key of the fresh optimizer's groups. What was saved is kept as saved."""
    if adam_w_mode is None:
        return dict(hyperparams)
    return _completed(hyperparams, {**_TORCH_ADAM_DEFAULTS, "decoupled_weight_decay": adam_w_mode})


def _scalar(key: str, scalar: ScalarState) -> tuple[tuple[int, ...], DType, TensorSource | None, Any]:
    """(shape, dtype, source, value) of a per-group scalar state. ``step`` becomes what torch's
    AdamW keeps: a float32 0-d tensor (DeepSpeed saves a float32 tensor, or a Python number)."""
    if key == "step" or scalar.tensor is None:
        return (), FP32, scalar.tensor, scalar.value
    return scalar.tensor.shape, scalar.tensor.dtype, scalar.tensor, None


def torch_state_dict(plan: DcpPlan, reader: FileReader) -> dict[str, Any]:
    """The plan's ``{"model", "optim"}`` as real torch tensors, every one in memory at once: what
    ``get_state_dict`` would return, for torch's own ``dcp.save`` (the in-memory route that
    ``scripts/bench_dcp.py`` times and the tests compare ``to-dcp``'s files with)."""
    import torch

    model: dict[str, Any] = {}
    optim_state: dict[str, dict[str, Any]] = {}
    for item in plan.tensors:
        if item.source is None:
            tensor = torch.tensor(item.value, dtype=item.dtype.torch())
        elif item.shape == ():
            tensor = torch.tensor(read_scalar(reader, item.source), dtype=item.dtype.torch())
        else:
            tensor = read_tensor(reader, item.source, item.dtype)
        if item.path[0] == "model":
            model[item.path[1]] = tensor
        else:
            optim_state.setdefault(item.path[2], {})[item.path[3]] = tensor
    groups = [dict(group) for group in plan.param_groups]
    return {"model": model, "optim": {"state": optim_state, "param_groups": groups}}


def train_state(state: TrainingState, reader: FileReader) -> dict[str, Any]:
    """The sidecar: what a resume needs besides the model and optimizer, as plain JSON.

    ``torchtitan`` holds what maps onto torchtitan's ``train_state`` (its ``step`` is DeepSpeed's
    ``global_steps``); torchtitan's ``ntokens_seen`` has no DeepSpeed counterpart."""
    index = state.index
    return {
        "format": TRAIN_STATE_FORMAT,
        "version": 1,
        "source": {
            "checkpoint": os.path.abspath(index.checkpoint_dir),
            "tag": index.tag,
            "zero_stage": index.zero_stage,
            "world_size": index.world_size,
            "deepspeed_version": index.ds_version,
        },
        "global_steps": state.global_steps,
        "global_samples": state.global_samples,
        "skipped_steps": state.skipped_steps,
        "lr_scheduler": plain(state.lr_scheduler, reader),
        "loss_scaler": plain(state.loss_scaler, reader),
        "client_state": plain(state.client_state, reader),
        "torchtitan": {"step": state.global_steps},
    }


def plain(value: Any, reader: FileReader) -> Any:
    """`value` as JSON can hold it: tuples as lists, keys as strings, a small tensor as its
    values (``{"tensor": dtype, "shape": [...], "values": [...]}``), an object of a class zckpt does
    not import as ``{"class": ..., "state": ...}``, anything else as its ``repr``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # JSON has no NaN or Infinity
    if isinstance(value, np.generic):
        return plain(value.item(), reader)
    if isinstance(value, dict):
        return {str(k): plain(v, reader) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, reader) for v in value]
    if isinstance(value, TensorRef):
        described: dict[str, Any] = {"tensor": value.dtype.name, "shape": list(value.shape)}
        if value.numel <= _MAX_JSON_ELEMENTS and value.dtype.numpy_raw and value.is_contiguous:
            source = source_of(value)
            described["values"] = plain(read_tensor(reader, source).tolist(), reader) if value.numel else []
        return described
    if isinstance(value, PickledObject):
        return {"class": value.original_class, "state": plain(value.pickle_state, reader)}
    return repr(value)


def out_tensor(item: DcpTensor) -> OutTensor:
    """What torch.save of the item's tensor holds, as parts of the checkpoint's files (zckpt's
    torch.save writer streams them, converting dtypes where they differ: a step counter saved in
    another dtype becomes float32); a Python number as its bytes."""
    if item.source is None:  # a scalar state saved as a Python number: float32 (see _scalar)
        return OutTensor(item.dtype, item.shape, (Inline(np.asarray(item.value, np.float32).tobytes()),))
    if item.source.numel != math.prod(item.shape):  # a step counter of shape (1,) is fine, of (2,) not
        where = item.source.segments[0].path if item.source.segments else None
        raise CorruptFileError(where, f"{item.key}: {item.source.numel} values, {math.prod(item.shape)} expected")
    return OutTensor(item.dtype, item.shape, tuple(Copy(s, item.source.dtype) for s in item.source.segments))


def data_file(part: int) -> str:
    """The data file of process `part`: the name torch's ``FileSystemWriter`` gives rank `part`'s
    one file (``single_file_per_rank``)."""
    return f"__{part}_0.distcp"


def tensor_owners(plan: DcpPlan, parts: int) -> list[int]:
    """Which process writes each tensor of `plan` (by index): sizes balanced, as reshard shares
    its files. Every process computes the same answer, so none needs to be told."""
    sizes = [item.nbytes for item in plan.tensors]
    owners = [0] * len(sizes)
    for part in range(1, parts):
        for i in share_of(sizes, part, parts):
            owners[i] = part
    return owners


@dataclass(frozen=True)
class DcpLayout:
    """Where every item of a DCP goes: `items` in the state dict's order (as ``.metadata`` lists
    them, and torch's reader returns them), `files` each process's data file, its items in
    writing order with the torch.save archive that holds each."""

    items: tuple[StoredItem, ...]
    files: tuple[tuple[tuple[StoredItem, ArchivePlan], ...], ...]


def lay_out(plan: DcpPlan, owners: list[int], parts: int) -> DcpLayout:
    """Every process's data file: a process writes its tensors (`owners`) in plan order;
    process 0 also the param groups' values, one BYTE_IO item each, as torch's planner flattens
    them. Pure: every process computes the same layout, so process 0 writes the metadata of all
    the files without being told where the others put anything."""
    files: list[list[tuple[StoredItem, ArchivePlan]]] = [[] for _ in range(parts)]
    offsets = [0] * parts
    items = []

    def place(part: int, path: tuple, tensor: TensorMeta | None, archive: ArchivePlan) -> None:
        item = StoredItem(path, tensor, data_file(part), offsets[part], archive.total_size)
        files[part].append((item, archive))
        items.append(item)
        offsets[part] += archive.total_size

    for item, owner in zip(plan.tensors, owners):
        place(owner, item.path, TensorMeta(item.dtype, item.shape), plan_archive(out_tensor(item), "archive"))
    for path, value in group_values(plan.param_groups):
        place(0, path, None, plan_archive(value, "archive"))
    return DcpLayout(tuple(items), tuple(tuple(share) for share in files))


def group_values(param_groups: tuple[dict[str, Any], ...]) -> list[tuple[tuple, Any]]:
    """The param groups' values as DCP stores them: (path, value), torch's flattening of
    ``{"optim": {"param_groups": [...]}}`` (a value per key; a list that holds dicts entered)."""
    return list(flatten({"optim": {"param_groups": [dict(group) for group in param_groups]}}, lambda v: False))


def _plain(value: Any) -> bool:
    """A value torch.save (and zckpt's writer) pickles as itself: numbers, strings, None, and
    lists and tuples of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(_plain(v) for v in value)


def _write_file(path: str, content: bytes) -> None:
    """A small file, on the disk before this returns."""
    with open(path, "wb") as handle:
        handle.write(content)
    fsync_file(path)


def _write_data(
    path: str, items: Sequence[tuple[StoredItem, ArchivePlan]], reader: FileReader, progress: Callable[[int], None]
) -> None:
    """One process's data file: its archives one after another (zckpt's torch.save writer,
    streamed from the checkpoint's files: kernel copies or direct I/O, one reused buffer), synced."""
    write_archives(path, [archive for _, archive in items], reader, progress)
    fsync_file(path)


def to_dcp(
    checkpoint: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: DTypeLike = "fp32",
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    verify: bool = True,
    swap_folder: str | os.PathLike[str] | None = None,
    wait: bool = False,
    tp_rules: str | os.PathLike[str] | None = None,
) -> DcpResult:
    """Write `checkpoint`'s model and optimizer as a DCP folder `output_dir`, plus
    ``train_state.json``. The folder appears whole or not at all; an existing one (not empty) is
    replaced only with `overwrite`. `dtype`: of the trainable params (fp32 masters by default).
    `swap_folder`: a live ZeRO-Infinity folder of the same run, for the swapped sub-groups.
    `tp_rules`: a ``--tp-rules`` file, for a tensor-parallel run that records no merge rules.

    Under torchrun (``WORLD_SIZE`` > 1) the job's processes share the tensors (sizes balanced),
    each writing its own data file ``__<rank>_0.distcp`` as torch's writer names a rank's file;
    process 0 writes ``.metadata`` (it knows where the others put each tensor: the layout is
    planned, not measured), ``train_state.json``, and commits the folder once all are in."""
    output_dir = os.path.normpath(os.fspath(output_dir))
    source = open_training_state(checkpoint, tag, swap_folder, tp_rules)
    plan = plan_dcp(source, dtype)
    index = source.index
    refuse_output_inside_input(output_dir, (index.checkpoint_dir, index.tag_dir))
    if is_inside(index.tag_dir, output_dir):
        raise UsageError(output_dir, f"holds the input {index.tag_dir}; choose another folder")
    part, parts, sync = job_share(output_dir)
    owners = tensor_owners(plan, parts)
    layout = lay_out(plan, owners, parts)
    total = sum(item.nbytes for item, owner in zip(plan.tensors, owners) if owner == part)
    folder = StagedFolder(output_dir)
    lock = OutputLock(folder.parent, wait=wait, while_waiting=sync.waiting) if part == 0 else None
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress:
            progress(done, total)

    staged = False  # this process may remove the staging folder: it is this job's, being written
    try:
        if lock is not None:
            lock.acquire()
            empty = os.path.isdir(output_dir) and not os.path.islink(output_dir) and not os.listdir(output_dir)
            folder.create(overwrite=overwrite or empty, needed_bytes=sum(item.nbytes for item in plan.tensors))
            staged = True
        sync()
        staged = True  # process 0 made it for this job
        checker = RecordChecker() if verify else None
        with FileReader(verify=False, checker=checker) as reader:
            _write_data(folder.path(data_file(part)), layout.files[part], reader, advance)
            if part == 0:
                sidecar = json.dumps(train_state(source, reader), indent=2, allow_nan=False) + "\n"
        if checker is not None:  # the input records this job read, each byte by one process
            checker.finish(job=sync)
        if part == 0:
            _write_file(folder.path(METADATA_FILE), metadata_bytes(layout.items, checkpoint_id=output_dir))
            _write_file(folder.path(TRAIN_STATE_FILE), sidecar.encode("utf-8"))
        sync()  # every data file is in
        staged = part == 0  # committing, or cleaning up, is process 0's now
        if part == 0:
            with signals_deferred():
                folder.commit()
        sync()  # nobody returns before the folder is in place (or knows it could not be)
    except BaseException as exc:
        # process 0 cleans up under its lock; another process only while it writes, and not when
        # told of a failure (process 0 may have let the lock go)
        if staged and (part == 0 or not isinstance(exc, JobFailed)):
            folder.abort()
        sync.fail()
        if isinstance(exc, OSError) and not isinstance(exc, OutputError):
            raise output_error(output_dir, exc) from None
        raise
    finally:
        if lock is not None:
            lock.release()
    files = tuple(sorted(n for n in os.listdir(output_dir) if not n.startswith(".zckpt")))
    written = sum(os.path.getsize(os.path.join(output_dir, n)) for n in files)
    notes = (
        dcp_weights_note(source.ds_config, plan.dtype.short),
        unsaved_moments_note(source.ds_config, source.state_names),
    )
    return DcpResult(output_dir, source, plan.dtype, len(plan.tensors), written, files, tuple(n for n in notes if n))


__all__ = [
    "DcpLayout",
    "DcpPlan",
    "DcpResult",
    "DcpTensor",
    "TRAIN_STATE_FILE",
    "lay_out",
    "plan_dcp",
    "to_dcp",
    "torch_adam_group",
    "torch_group",
    "torch_state_dict",
    "train_state",
]
