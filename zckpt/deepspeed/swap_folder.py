"""A live ZeRO-Infinity swap folder, mapped onto the layout of a checkpoint of the same run.

While a ZeRO-3 run offloads to NVMe, the newest training state is not in any checkpoint but in
``<nvme_path>/zero_stage_3/`` (DeepSpeed 0.19.8, ``runtime/swap_tensor/``)::

    optimizer/rank<R>/<first>_<last>.tensor.swp          fp32 masters of a swapped sub-group
    optimizer/rank<R>/<state>-<first>_<last>.tensor.swp  its optimizer states (exp_avg, ...)
    optimizer/rank<R>/<first>_<last>_gradient_<offset>_<numel>.tensor.swp   gradients in flight
    <dtype>params/rank<R>/<ds_id>_param.tensor.swp        16-bit param partitions (offload_param)

Raw little-endian elements, no header, each file padded to ``1024 * intra_op_parallelism``
bytes. Nothing in the folder names a param or gives a shape: names, shapes, ds_ids, sub-groups
and which sub-groups are swapped come from a checkpoint of the same run (any one: the layout
does not change while the run lives). Sub-groups whose fp32 partition is under DeepSpeed's
swap threshold (1 MiB) never reach the folder; they are only in the checkpoint.

This module plans (pure: names, sizes, which file is whose) and checks what can be checked
without tensor data; the reader points its sources at the files, and :func:`compare_16bit`
reads the 16-bit param swaps against the fp32 masters.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

from ..core.dtypes import BF16, FP16, DType
from ..core.errors import CheckpointNotFoundError, LayoutError
from ..core.index import TensorSource
from ..io.materialize import convert
from ..io.reading import FileReader
from . import names as N
from .swap_rules import SwapRule

STAGE_DIR = "zero_stage_3"
OPTIMIZER_DIR = "optimizer"
PARAMS_DIR_RE = re.compile(r"^(?P<dtype>[a-z0-9]+)params$")  # bfloat16params, float16params
RANK_DIR_RE = re.compile(r"^rank(?P<rank>\d+)$")
_SUFFIX = re.escape(N.SWAP_SUFFIX)  # .tensor.swp
SUB_GROUP_RE = re.compile(
    rf"^(?:(?P<state>[A-Za-z_]\w*)-)?(?P<id>\d+_\d+){_SUFFIX}$"
)  # optimizer_utils.SwapTensorContext
GRADIENT_RE = re.compile(
    rf"^(?P<id>\d+_\d+)_gradient_(?P<offset>\d+)_(?P<numel>\d+){_SUFFIX}$"
)  # get_or_create_gradient_paths
PARAM_RE = re.compile(rf"^(?P<id>\d+)_param{_SUFFIX}$")  # partitioned_param_swapper._get_swap_paths
PARAM_DTYPES = {"bfloat16": BF16, "float16": FP16}
NO_CRC_NOTE = "raw swap files carry no checksum: damage inside them cannot be detected, only sizes, layout and the 16-bit/fp32 agreement"

FileKind = Literal["sub_group", "gradient", "param16", "orphan"]


@dataclass(frozen=True)
class SwapFile:
    """One file of the swap folder, classified by its name."""

    rank: int | None  # None: not inside a rank<R> folder
    folder: str  # "optimizer", "bfloat16params", ... (relative to zero_stage_3)
    name: str
    path: str
    size: int
    kind: FileKind
    swap_id: str | None = None  # "<first>_<last>" of a sub-group file or a gradient
    state: str | None = None  # a sub-group file's optimizer state; None: the fp32 masters
    param_id: int | None = None  # a 16-bit param file's ds_id


@dataclass(frozen=True)
class SwapFolder:
    """What a swap folder holds, by name only (no bytes read)."""

    root: str  # the zero_stage_3 folder
    files: tuple[SwapFile, ...]
    optimizer_ranks: tuple[int, ...]
    param_dtypes: tuple[str, ...]  # e.g. ("bfloat16",)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def of_kind(self, kind: FileKind) -> list[SwapFile]:
        return [f for f in self.files if f.kind == kind]

    def optimizer_path(self, rank: int, name: str) -> str:
        return os.path.join(self.root, OPTIMIZER_DIR, f"rank{rank}", name)

    def param_file(self, rank: int, ds_id: int) -> SwapFile | None:
        return self._param_files.get((rank, ds_id))

    @cached_property
    def _param_files(self) -> dict[tuple[int | None, int | None], SwapFile]:
        return {(f.rank, f.param_id): f for f in self.files if f.kind == "param16"}


def is_swap_folder(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is ``<nvme_path>`` or ``<nvme_path>/zero_stage_3`` of a ZeRO-3 NVMe run."""
    try:
        swap_root(path)
    except CheckpointNotFoundError:
        return False
    return True


def swap_root(path: str | os.PathLike[str]) -> str:
    """The ``zero_stage_3`` folder of `path` (given as itself or as its parent, the nvme_path)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(path, "no such swap folder")
    for candidate in (path, os.path.join(path, STAGE_DIR)):
        if os.path.isdir(candidate) and _has_swap_dirs(candidate):
            return candidate
    raise CheckpointNotFoundError(
        path, f"not a DeepSpeed swap folder: no {STAGE_DIR}/ holding {OPTIMIZER_DIR}/ or <dtype>params/ rank folders"
    )


def _has_swap_dirs(folder: str) -> bool:
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(
        (name == OPTIMIZER_DIR or PARAMS_DIR_RE.match(name)) and os.path.isdir(os.path.join(folder, name))
        for name in names
    )


def scan(path: str | os.PathLike[str]) -> SwapFolder:
    """List and classify every file of a swap folder."""
    root = swap_root(path)
    files: list[SwapFile] = []
    optimizer_ranks: set[int] = set()
    dtypes: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        relative = os.path.relpath(dirpath, root)
        parts = [] if relative == "." else relative.split(os.sep)
        rank_match = RANK_DIR_RE.match(parts[1]) if len(parts) == 2 else None
        folder = parts[0] if parts else ""
        if rank_match and folder == OPTIMIZER_DIR:
            optimizer_ranks.add(int(rank_match["rank"]))
        if len(parts) == 1 and (m := PARAMS_DIR_RE.match(folder)) and m["dtype"] not in dtypes:
            dtypes.append(m["dtype"])
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            size = os.path.getsize(full)
            rank = int(rank_match["rank"]) if rank_match else None
            files.append(_classify(rank, folder, name, full, size))
    return SwapFolder(root, tuple(files), tuple(sorted(optimizer_ranks)), tuple(dtypes))


def _classify(rank: int | None, folder: str, name: str, path: str, size: int) -> SwapFile:
    if rank is not None and folder == OPTIMIZER_DIR:
        if m := GRADIENT_RE.match(name):
            return SwapFile(rank, folder, name, path, size, "gradient", swap_id=m["id"])
        if m := SUB_GROUP_RE.match(name):
            return SwapFile(rank, folder, name, path, size, "sub_group", swap_id=m["id"], state=m["state"])
    if rank is not None and PARAMS_DIR_RE.match(folder) and (m := PARAM_RE.match(name)):
        return SwapFile(rank, folder, name, path, size, "param16", param_id=int(m["id"]))
    return SwapFile(rank, folder, name, path, size, "orphan")


def size_problem(size: int, numel: int, rule: SwapRule) -> str | None:
    """Why a swap file of `size` bytes cannot hold a partition of `numel` fp32 elements, or
    None. A file longer than the padded partition belongs to a bigger layout (another run)."""
    needed, padded = numel * rule.itemsize, rule.file_numel(numel) * rule.itemsize
    if size < needed:
        return f"truncated: holds {size} bytes, the partition needs {needed}"
    if size > padded:
        return f"holds {size} bytes, the partition needs {needed} (padded to {padded}): a swap folder of another run or layout"
    return None


def check_world(folder: SwapFolder, world_size: int) -> LayoutError | None:
    """The folder must hold one optimizer rank folder per rank of the checkpoint. Guarantee: with
    the optimizer offloaded to NVMe, every data-parallel rank swaps into its own ``rank<R>``
    folder and a save copies it (deepspeed/runtime/engine.py:4937-4946)."""
    if not folder.optimizer_ranks:
        return LayoutError(
            folder.root,
            f"no {OPTIMIZER_DIR}/rank<R>/ folders: not the swap folder of a run with offload_optimizer on NVMe",
        )
    if folder.optimizer_ranks != tuple(range(world_size)):
        shown = ", ".join(map(str, folder.optimizer_ranks[:8]))
        return LayoutError(
            os.path.join(folder.root, OPTIMIZER_DIR),
            f"holds the swap files of ranks {shown}; the checkpoint was saved by {world_size} ranks (world size differs: another run)",
        )
    return None


@dataclass(frozen=True)
class SwappedSubGroup:
    """A sub-group of the checkpoint's layout and where its data lives during training."""

    index: int
    swap_id: str | None  # "<first>_<last>"; None for an in-memory sub-group
    params: tuple[str, ...]
    partition: int  # fp32 elements per rank
    swapped: bool


@dataclass(frozen=True)
class Agreement:
    """The 16-bit param swaps compared with the fp32 masters rounded to their dtype."""

    dtype: str
    params: int  # params with a 16-bit swap file on every rank
    elements: int
    differing: int
    per_param: dict[str, int] = field(default_factory=dict)  # name -> differing elements (nonzero only)

    @property
    def agrees(self) -> bool:
        return self.differing == 0

    def describe(self) -> str:
        if not self.params:
            return "no 16-bit param swap files to compare (params kept in memory, or offload_param is not nvme)"
        if self.agrees:
            return f"16-bit param swaps of {self.params} param(s) ({self.elements} elements) equal the fp32 masters rounded to {self.dtype}"
        return (
            f"16-bit param swaps: {self.differing} of {self.elements} elements ({self.params} param(s)) differ from the fp32 masters "
            f"rounded to {self.dtype} (DeepSpeed rewrites a 16-bit swap file only when it evicts the param, so it can be older than the masters; the masters are used)"
        )


@dataclass(frozen=True)
class SwapReport:
    """What reading a checkpoint's layout from a live swap folder found, for the user."""

    root: str
    world_size: int
    sub_groups: tuple[SwappedSubGroup, ...]
    gradient_files: int
    orphans: tuple[str, ...]
    total_bytes: int
    checkpoint_tag: str
    checkpoint_step: int | None
    agreement: Agreement | None = None
    param_names: dict[int, str] = field(default_factory=dict)  # ds_id -> name (frozen params too)

    @property
    def in_memory(self) -> tuple[SwappedSubGroup, ...]:
        return tuple(g for g in self.sub_groups if not g.swapped)

    def notes(self) -> list[str]:
        swapped = [g for g in self.sub_groups if g.swapped]
        lines = [
            f"fp32 masters and optimizer states of {len(swapped)} swapped sub-group(s) read from the live swap folder {self.root}"
        ]
        if self.in_memory:
            count = sum(len(g.params) for g in self.in_memory)
            lines.append(
                f"{len(self.in_memory)} sub-group(s) ({count} param(s), {sum(g.partition for g in self.in_memory)} elements per rank) "
                f"are under DeepSpeed's swap threshold and never in the swap folder: they come from the checkpoint "
                f"({self.checkpoint_tag}) and may be older than the swapped ones"
            )
        step = f"step {self.checkpoint_step}" if self.checkpoint_step is not None else self.checkpoint_tag
        lines.append(
            f"step counters, Adam steps, lr scheduler and loss scaler are not in swap files: they are the checkpoint's ({step})"
        )
        if self.agreement is not None:
            lines.append(self.agreement.describe())
        if self.orphans:
            lines.append(
                f"{len(self.orphans)} file(s) in the swap folder belong to no sub-group or param (ignored): {', '.join(self.orphans[:4])}"
            )
        return lines


def sub_group_orphans(folder: SwapFolder, claimed: set[str]) -> list[SwapFile]:
    """Sub-group files (fp32 or state) of the folder that no sub-group of the layout claims."""
    return [f for f in folder.of_kind("sub_group") if f.path not in claimed]


def compare_16bit(
    folder: SwapFolder, param_pieces: list[tuple[str, int, TensorSource, list[int], int]], dtype: DType
) -> Agreement:
    """Count elements where a 16-bit param swap differs from its fp32 master rounded to `dtype`.

    `param_pieces`: (name, ds_id, fp32 master source, rank of each of its segments, per-rank
    share ceil(numel / world)). A param counts only when every rank has its file; the 16-bit
    file holds the rank's share from byte 0 (padded), the fp32 segment of that rank its first
    elements."""
    params = elements = differing = 0
    per_param: dict[str, int] = {}
    with FileReader(verify=False) as reader:
        for name, ds_id, master, ranks, share in param_pieces:
            files = [folder.param_file(rank, ds_id) for rank in ranks]
            if not files or any(f is None or f.size < share * dtype.itemsize for f in files):
                continue
            count = 0
            for segment, swap in zip(master.segments, files):
                assert swap is not None
                fp32 = np.empty(segment.numel, dtype=np.float32)
                reader.read_segments(master.dtype, (segment,), fp32)
                rounded = convert(fp32, master.dtype, dtype)
                stored = np.empty(segment.numel, dtype=np.uint16)
                reader.read_into(swap.path, 0, memoryview(stored.view(np.uint8)))
                count += int(np.count_nonzero(rounded.view(np.uint16) != stored))
                elements += segment.numel
            params += 1
            differing += count
            if count:
                per_param[name] = count
    return Agreement(dtype.name, params, elements, differing, per_param)


def rank_problems(folder: SwapFolder) -> list[str]:
    """What can be checked with no checkpoint: ZeRO-3 ranks own equal partitions, so every rank
    holds the same sub-group and 16-bit param files with the same sizes."""
    problems = []
    if folder.optimizer_ranks and folder.optimizer_ranks != tuple(range(len(folder.optimizer_ranks))):
        problems.append(
            f"{os.path.join(folder.root, OPTIMIZER_DIR)}: rank folders {', '.join(map(str, folder.optimizer_ranks))} are not 0..{len(folder.optimizer_ranks) - 1}: some ranks' files are missing"
        )
    by_rank: dict[tuple[str, int], dict[str, int]] = {}
    for f in folder.files:
        if f.kind in ("sub_group", "param16") and f.rank is not None:
            by_rank.setdefault((f.folder, f.rank), {})[f.name] = f.size
    for sub in sorted({key[0] for key in by_rank}):
        ranks = sorted(rank for kind, rank in by_rank if kind == sub)
        reference = by_rank[(sub, ranks[0])]
        for rank in ranks[1:]:
            files = by_rank[(sub, rank)]
            where = os.path.join(folder.root, sub, f"rank{rank}")
            for name in sorted(set(reference) ^ set(files)):
                held = "holds" if name in files else "lacks"
                problems.append(f"{where}: {held} {name}, rank {ranks[0]} {'does not' if name in files else 'does'}")
            for name in sorted(set(reference) & set(files)):
                if reference[name] != files[name]:
                    problems.append(
                        f"{os.path.join(where, name)}: {files[name]} bytes, rank {ranks[0]}'s has {reference[name]}"
                    )
    return problems


def file_roles(folder: SwapFolder, report: SwapReport | None) -> list[dict]:
    """One row per file: rank, folder, name, size, kind and what it holds (param names when a
    checkpoint's layout is known, ds_ids otherwise)."""
    groups = {g.swap_id: g for g in report.sub_groups if g.swap_id} if report is not None else {}
    names = report.param_names if report is not None else {}
    rows = []
    for f in folder.files:
        if f.kind == "sub_group":
            what = f.state or "fp32 masters"
            group = groups.get(f.swap_id or "")
            holds = (
                f"{what} of sub-group {group.index} ({', '.join(group.params)})"
                if group
                else f"{what} of the sub-group of params {f.swap_id.replace('_', '..') if f.swap_id else '?'}"
            )
        elif f.kind == "gradient":
            holds = f"gradients in flight of sub-group {f.swap_id}"
        elif f.kind == "param16":
            holds = f"16-bit partition of {names.get(f.param_id, f'param ds_id {f.param_id}') if f.param_id is not None else '?'}"
        else:
            holds = "nothing DeepSpeed names this way (orphan)"
        rows.append(
            {"rank": f.rank, "folder": f.folder, "name": f.name, "size": f.size, "kind": f.kind, "holds": holds}
        )
    return rows
