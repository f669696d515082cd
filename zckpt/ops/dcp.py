"""``zckpt to-dcp``: a torch.distributed.checkpoint (DCP) folder that FSDP2 / torchtitan resumes.

The folder holds ``{"model": ..., "optim": ...}`` laid out as
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` returns it (full
state dicts keyed by the module's own names), so a fresh model sharded with ``fully_shard`` at
any world size, plus ``torch.optim.AdamW`` with the same groups, resumes with ``dcp.load`` and
``set_state_dict``:

- ``model``: every name of the module's state dict (tied names both), trainable params as their
  fp32 masters (or rounded to `dtype`), frozen params and buffers as saved;
- ``optim["state"][name]``: every optimizer state of each trainable param (``exp_avg``,
  ``exp_avg_sq``, ...) plus its group's ``step``, a float32 0-d tensor as torch's AdamW keeps it
  (torch counts steps per param, DeepSpeed per group: each param gets its group's);
- ``optim["param_groups"]``: the groups' hyperparameters as saved, with their params' names
  (a run of DeepSpeed's own Adam, which saves fewer keys than torch's, gets torch's others:
  :func:`torch_adam_group`).

What DCP has no place for (counters, the lr scheduler, the client state) goes into
``train_state.json`` beside it (:func:`train_state`).

Memory and speed: torch plans the DCP (``.metadata``) from a state dict of meta tensors (shapes
and dtypes only); the data file is written by zckpt, each tensor as the torch.save archive torch's
writer would put there, streamed from the checkpoint's files by zckpt's own torch.save writer
(kernel copies where no dtype changes, CRC-32s on helper threads), so a few MiB of buffers are
in memory whatever the tensor sizes. The folder is staged beside OUTPUT_DIR and renamed into
place once complete, so it appears whole or not at all.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..core.dtypes import FP32, DType, DTypeLike, output_dtype
from ..core.errors import CorruptFileError, LayoutError, OutputError, UsageError
from ..core.index import TensorRef, TensorSource
from ..core.state import ScalarState, TrainingState
from ..deepspeed.optimizers import deepspeed_adam_w_mode
from ..deepspeed.reader import open_training_state
from ..deepspeed.save import share_of
from ..io.interrupts import signals_deferred
from ..io.jobs import JobFailed, job_share
from ..io.materialize import read_scalar, read_tensor, write_all
from ..io.output import OutputLock, StagedFolder, is_inside, output_error, refuse_output_inside_input
from ..io.reading import FileReader, source_of
from ..io.workers import WorkerPool
from ..torchfile.records import PickledObject
from ..torchfile.save import ArchiveAppender, Copy, Inline, OutTensor, plan_archive

if TYPE_CHECKING:
    import torch

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


def plan_dcp(state: TrainingState, dtype: DTypeLike = "fp32") -> DcpPlan:
    """Lay out a training state as get_state_dict's ``{"model", "optim"}``; reads nothing."""
    target = output_dtype(dtype)
    entries = {e.name: e for e in state.index.entries}
    # the module's state dict order; anything the index holds beyond it (none expected) after it
    names = [n for n in state.module_names if n in entries] + [n for n in entries if n not in state.module_names]
    tensors = []
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
        for key, source in param.states.items():
            if key in scalars:
                raise LayoutError(
                    state.index.tag_dir, f"{param.name}: optimizer state {key!r} is both per group and per param"
                )
            tensors.append(DcpTensor(("optim", "state", param.name, key), source.shape, source.dtype, source))
    adam_w_mode = deepspeed_adam_w_mode(state.ds_config)
    groups = tuple(
        {**torch_adam_group(group.hyperparams, adam_w_mode), "params": list(group.params)} for group in state.groups
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


def torch_adam_group(hyperparams: dict[str, Any], adam_w_mode: bool | None) -> dict[str, Any]:
    """A group's hyperparameters as saved, completed with the keys torch's AdamW (or Adam) has
    where DeepSpeed's FusedAdam or DeepSpeedCPUAdam ran (`adam_w_mode` not None): dcp.load wants
    every key of the fresh optimizer's groups. What was saved is kept as saved."""
    if adam_w_mode is None:
        return dict(hyperparams)
    missing = {**_TORCH_ADAM_DEFAULTS, "decoupled_weight_decay": adam_w_mode}
    return {**hyperparams, **{k: v for k, v in missing.items() if k not in hyperparams}}


def _scalar(key: str, scalar: ScalarState) -> tuple[tuple[int, ...], DType, TensorSource | None, Any]:
    """(shape, dtype, source, value) of a per-group scalar state. ``step`` becomes what torch's
    AdamW keeps: a float32 0-d tensor (DeepSpeed saves a float32 tensor, or a Python number)."""
    if key == "step" or scalar.tensor is None:
        return (), FP32, scalar.tensor, scalar.value
    return scalar.tensor.shape, scalar.tensor.dtype, scalar.tensor, None


def _materialize(reader: FileReader, item: DcpTensor) -> "torch.Tensor":
    """The item's tensor in memory (torch's in-memory route, scripts/bench_dcp.py)."""
    import torch

    if item.source is None:
        return torch.tensor(item.value, dtype=item.dtype.torch())
    if item.shape == ():
        return torch.tensor(read_scalar(reader, item.source), dtype=item.dtype.torch())
    return read_tensor(reader, item.source, item.dtype)


def state_dict_of(plan: DcpPlan) -> dict[str, Any]:
    """The nested ``{"model", "optim"}`` state dict with meta tensors: what DCP plans from."""
    import torch

    model: dict[str, Any] = {}
    optim_state: dict[str, dict[str, Any]] = {}
    for item in plan.tensors:
        meta = torch.empty(item.shape, dtype=item.dtype.torch(), device="meta")
        if item.path[0] == "model":
            model[item.path[1]] = meta
        else:
            optim_state.setdefault(item.path[2], {})[item.path[3]] = meta
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


def share_layout(plan: DcpPlan, owners: list[int], part: int) -> dict[str, tuple[int, int]]:
    """Where process `part` (not 0) puts its tensors in its data file, in plan order: key ->
    (offset, length). Pure: the lengths are those of the archives as planned."""
    layout: dict[str, tuple[int, int]] = {}
    offset = 0
    for item, owner in zip(plan.tensors, owners):
        if owner == part:
            length = plan_archive(out_tensor(item), "archive").total_size
            layout[item.key] = (offset, length)
            offset += length
    return layout


def _write_share(
    path: str, plan: DcpPlan, owners: list[int], part: int, reader: FileReader, progress: Callable[[int], None]
) -> None:
    """Process `part` (not 0): its tensors into its data file in plan order, each archive the
    size planned (process 0's metadata, from :func:`share_layout`, says where they are)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with WorkerPool(2, "zckpt-dcp") as helpers:
            archives = ArchiveAppender(fd, reader, helpers, progress)
            for item, owner in zip(plan.tensors, owners):
                if owner != part:
                    continue
                archive = plan_archive(out_tensor(item), "archive")
                start = os.lseek(fd, 0, os.SEEK_CUR)
                archives.append(archive)
                if os.lseek(fd, 0, os.SEEK_CUR) - start != archive.total_size:
                    raise RuntimeError(f"{item.key}: the archive written is not the one planned")
        os.fsync(fd)
    finally:
        os.close(fd)


def _writer_class(
    final_dir: str, reader: FileReader, plan: DcpPlan, owners: list[int], progress: Callable[[int], None]
) -> type:
    """A torch DCP storage writer that streams each tensor from the checkpoint's files (defined
    here: torch is imported only when a DCP is written). Tensors another process of the job
    writes (`owners`) are only recorded in the metadata, at the places that process puts them."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    items = {item.key: item for item in plan.tensors}
    owner_of = {item.key: owner for item, owner in zip(plan.tensors, owners)}
    elsewhere = {
        key: (part, place)
        for part in sorted(set(owners) - {0})
        for key, place in share_layout(plan, owners, part).items()
    }

    class Writer(dcp.FileSystemWriter):
        """torch's file writer, its data written by zckpt: every item into one ``__0_0.distcp`` as
        torch's writer lays it out (a tensor as the torch.save archive of it, any other value as
        the bytes the planner serialized), but a tensor's archive streamed from the checkpoint's
        files (:class:`zckpt.torchfile.save.ArchiveAppender`: kernel copies, one reused buffer)
        rather than torch.save of a tensor in memory; and nothing kept, where torch 2.13's own
        loop keeps every tensor of a file until it is done. ``.metadata`` names the final folder
        as the checkpoint, not the staging one."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            results = []
            fd = os.open(os.path.join(self.path, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                with WorkerPool(2, "zckpt-dcp") as helpers:
                    archives = ArchiveAppender(fd, reader, helpers, progress)
                    for write_item in plan.items:
                        if write_item.type != WriteItemType.BYTE_IO and owner_of[write_item.index.fqn] != 0:
                            part, (at, size) = elsewhere[write_item.index.fqn]
                            results.append(WriteResult(write_item.index, size, _StorageInfo(data_file(part), at, size)))
                            continue
                        offset = os.lseek(fd, 0, os.SEEK_CUR)
                        if write_item.type == WriteItemType.BYTE_IO:
                            write_all(fd, planner.resolve_data(write_item).getbuffer())
                        else:
                            archives.append(plan_archive(out_tensor(items[write_item.index.fqn]), "archive"))
                        length = os.lseek(fd, 0, os.SEEK_CUR) - offset
                        results.append(WriteResult(write_item.index, length, _StorageInfo(name, offset, length)))
                os.fsync(fd)
            finally:
                os.close(fd)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(results)
            return done

        def storage_meta(self) -> Any:
            meta = super().storage_meta()
            if meta is not None:
                meta.checkpoint_id = final_dir
            return meta

    return Writer


def _write_dcp(
    folder: str, final_dir: str, plan: DcpPlan, owners: list[int], reader: FileReader, progress: Callable[[int], None]
) -> None:
    """Write process 0's DCP files of `plan` into `folder`: torch plans and writes ``.metadata``
    (for every process's tensors), zckpt streams the data of those `owners` gives process 0."""
    import torch.distributed.checkpoint as dcp

    writer = _writer_class(final_dir, reader, plan, owners, progress)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.save(
                state_dict_of(plan),
                storage_writer=writer(folder, single_file_per_rank=True, thread_count=1, sync_files=True),
                planner=dcp.DefaultSavePlanner(),
                no_dist=True,
            )
        except dcp.api.CheckpointException as exc:
            # torch wraps whatever the writer raised (a damaged input file, a full disk, a signal
            # turned into Interrupted): the original is the error to report, and to clean up for
            raise _original(exc) from None


def _original(exc: BaseException) -> BaseException:
    """The first exception a torch CheckpointException carries (it holds (exception, trace) per rank)."""
    failures = getattr(exc, "failures", None) or {}
    for failure in failures.values():
        if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
            return failure[0]
    return exc


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
) -> DcpResult:
    """Write `checkpoint`'s model and optimizer as a DCP folder `output_dir`, plus
    ``train_state.json``. The folder appears whole or not at all; an existing one (not empty) is
    replaced only with `overwrite`. `dtype`: of the trainable params (fp32 masters by default).
    `swap_folder`: a live ZeRO-Infinity folder of the same run, for the swapped sub-groups.

    Under torchrun (``WORLD_SIZE`` > 1) the job's processes share the tensors (sizes balanced),
    each writing its own data file ``__<rank>_0.distcp`` as torch's writer names a rank's file;
    process 0 writes ``.metadata`` (it knows where the others put each tensor: the layout is
    planned, not measured), ``train_state.json``, and commits the folder once all are in."""
    output_dir = os.path.normpath(os.fspath(output_dir))
    source = open_training_state(checkpoint, tag, swap_folder)
    plan = plan_dcp(source, dtype)
    index = source.index
    refuse_output_inside_input(output_dir, (index.checkpoint_dir, index.tag_dir))
    if is_inside(index.tag_dir, output_dir):
        raise UsageError(output_dir, f"holds the input {index.tag_dir}; choose another folder")
    part, parts, sync = job_share(output_dir)
    owners = tensor_owners(plan, parts)
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
        with FileReader(verify=verify) as reader:
            if part == 0:
                _write_dcp(folder.staging, output_dir, plan, owners, reader, advance)
                sidecar = json.dumps(train_state(source, reader), indent=2, allow_nan=False) + "\n"
            else:
                _write_share(folder.path(data_file(part)), plan, owners, part, reader, advance)
        if part == 0:
            with open(folder.path(TRAIN_STATE_FILE), "w", encoding="utf-8") as handle:
                handle.write(sidecar)
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
    return DcpResult(output_dir, source, plan.dtype, len(plan.tensors), written, files)


__all__ = ["DcpPlan", "DcpResult", "DcpTensor", "TRAIN_STATE_FILE", "plan_dcp", "to_dcp", "train_state"]
