"""The trainable params of a ZeRO checkpoint, located in the rank files' flat partitions: the
layout rebuilt from the model states (:mod:`.layout`, the one copy of DeepSpeed's partition
arithmetic), checked against what each optimizer file holds, every param's pieces turned into
file segments, and the training state built on the same layout. ZeRO-3 sub-groups offloaded to
NVMe are read from their swap files (in the tag folder, or in a live swap folder).
"""

from __future__ import annotations

import os
import re

from ..core.dtypes import FP32
from ..core.errors import CheckpointNotFoundError, CorruptFileError, LayoutError
from ..core.index import CheckpointIndex, Entry, PackedSegments, Segment, TensorRef, TensorSource
from ..core.state import TrainingState
from ..core.untrusted import regular_file_inside
from . import names as N
from . import swap_folder as swap
from .layout import FlatGroup, LayoutParam, ZeroLayout, zero3_layout_of_sub_groups, zero12_layout
from .model_states import ds_ids as module_ds_ids
from .optim_state import build_training_state, flat_states
from .rank_checks import check_not_copies, check_rank_identity
from .rank_files import LoadedRanks
from .run_config import CPU, NVME, RunConfig
from .schema import as_shape, numel_of
from .survey import Survey
from .swap_rules import Aio, SwapRule


class Partitions:
    """Reads the trainable params of one ZeRO checkpoint from its rank partitions; keeps the
    layout and the swap files it used for the training state and the swap-folder report."""

    def __init__(
        self, result: Survey, tag_dir: str, run_config: RunConfig, swap_folder: swap.SwapFolder | None = None
    ) -> None:
        self.result = result
        self.tag_dir = tag_dir
        self.run_config = run_config  # the saved ds_config, as DeepSpeed read it
        self.swap_folder = swap_folder  # a live swap folder giving the swapped sub-groups' data
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.saved_flat: dict[int, list[TensorRef]] = {}  # ZeRO-3 fp32 groups as saved (NVMe ones empty)
        self.ds_ids: dict[str, int] = {}
        self.swap_claimed: set[str] = set()  # its files that the layout reads
        self.swap_ids: dict[int, str] = {}  # swapped sub-group -> "<first>_<last>"
        self.layout: ZeroLayout | None = None

    def _problem(self, error: type, path: str | None, text: str) -> None:
        self.result.add(error, path, text)

    def entries(self, ranks: LoadedRanks, world: int) -> list[Entry] | None:
        """The trainable params' entries (fp32 masters), from the optimizer files' partitions."""
        model0 = ranks.model0
        param_shapes = model0[N.PARAM_SHAPES]
        param_shapes = [param_shapes] if isinstance(param_shapes, dict) else param_shapes
        self.shapes = {name: as_shape(shape) for group in param_shapes for name, shape in group.items()}
        if ranks.zero3:
            ds_ids = module_ds_ids(model0)  # by module order: a param missing there would shift every later id
            named = [n for shapes in param_shapes for n in shapes] + list(model0.get(N.FROZEN_PARAM_SHAPES) or {})
            missing = [n for n in named if n not in ds_ids]
            if missing:
                self._problem(
                    LayoutError,
                    ranks.model0_path,
                    f"param {missing[0]} is missing from the module state dict (DeepSpeed numbers params by it)",
                )
                return None
            partitions = {rank: _optimizer_partitions(state) for rank, state in ranks.inner.items()}
            if not check_not_copies(self.result, ranks.optim_paths, partitions, "fp32 partitions and optimizer states"):
                return None
            return self._zero3_params(param_shapes, ranks, world, ds_ids)
        return self._zero12_params(param_shapes, ranks, world)

    def training_state(self, index: CheckpointIndex, ranks: LoadedRanks) -> TrainingState:
        """The whole training state on the layout the entries were read with."""
        assert self.layout is not None
        return build_training_state(
            index,
            self.layout,
            ranks.models,
            ranks.inner,
            ranks.optim_paths,
            self._state_swap_path,
            self.run_config.round_robin_gradients,
            self.run_config.device(N.CONFIG_OFFLOAD_OPTIMIZER) in (CPU, NVME),  # ZeRO-1/2 treat nvme as cpu
        )

    # --- ZeRO-1/2 -----------------------------------------------------------------------------
    def _zero12_params(self, param_shapes: list[dict], ranks: LoadedRanks, world: int) -> list[Entry] | None:
        """Each param's pieces in the ZeRO-1/2 flat partitions. Guarantee: each rank saves its fp32
        partition less the tail padding (zero/stage_1_and_2.py:3388), whose size follows from
        param_shapes, the alignment and the world size (:440-446, :540-550)."""
        inner, optim_files = ranks.inner, ranks.optim_files
        paddings = inner[0].get(N.PARAM_ALIGNMENT_PADDINGS)
        groups = {rank: list(inner[rank][N.SINGLE_PARTITION_OF_FP32_GROUPS]) for rank in range(world)}
        for rank, refs in groups.items():
            if len(refs) != len(param_shapes):
                self._problem(
                    LayoutError,
                    optim_files[rank][1],
                    f"holds {len(refs)} param groups, the model states list {len(param_shapes)}",
                )
                return None
        flat_order = [
            [LayoutParam(name, numel_of(shape), g) for name, shape in shapes.items()]
            for g, shapes in enumerate(param_shapes)
        ]
        if paddings is not None and [len(p) for p in paddings] != [len(g) for g in flat_order]:
            self._problem(
                LayoutError,
                optim_files[0][1],
                f"{[len(p) for p in paddings]} alignment paddings per group for {[len(g) for g in flat_order]} params",
            )
            return None
        counts = inner[0].get(N.PARTITION_COUNT)  # per group, each checked to be the world size
        counts = list(counts) if isinstance(counts, (list, tuple)) and len(counts) == len(flat_order) else None
        layout = zero12_layout(
            flat_order, world, alignment_paddings=paddings, stage=self.result.zero_stage or 2, partition_counts=counts
        )
        if not check_rank_identity(self.result, layout, inner, optim_files, self.run_config.round_robin_gradients):
            return None
        for g, group in enumerate(layout.flat_groups):
            sizes = [groups[rank][g].numel for rank in range(world)]
            # DeepSpeed drops the tail padding when saving, except BF16_Optimizer, which keeps it
            for rank, size in enumerate(sizes):
                if size not in (group.saved[rank], group.partition):
                    needed = sum(layout.params[i].numel for i in group.params) + sum(group.alignment_paddings)
                    self._problem(
                        LayoutError,
                        optim_files[rank][1],
                        f"param group {g}: holds {size} fp32 elements, the partitioning of its param_shapes over {world} ranks gives it {group.saved[rank]} (the params need {needed} in all, sizes {sizes}): a ZeRO-1/2 partitioning zckpt does not read (a feature that pads or orders the flat group otherwise)",
                    )
                    return None
        return self._param_entries(layout, groups)

    # --- ZeRO-3 -------------------------------------------------------------------------------
    def _zero3_params(
        self, param_shapes: list[dict], ranks: LoadedRanks, world: int, ds_ids: dict[str, int]
    ) -> list[Entry] | None:
        """Each param's pieces in the ZeRO-3 sub-groups. Guarantee: each sub-group's fp32 partition
        is its params' partitions end to end (``_create_fp32_partitions``, zero/stage3.py:1081-1120),
        each its aligned size over the world size (``_partition_param``, partition_parameters.py:1816-1817)."""
        inner, optim_files = ranks.inner, ranks.optim_files
        sub_groups = [
            [LayoutParam(name, numel_of(shape), 0) for name, shape in shapes.items()] for shapes in param_shapes
        ]
        groups = (inner[0].get(N.OPTIMIZER_STATE_DICT) or {}).get("param_groups") or []
        listed = sorted(
            i
            for g in (groups if isinstance(groups, list) else [])
            if isinstance(g, dict) and isinstance(g.get("params"), list)
            for i in g["params"]
            if isinstance(i, int)
        )
        if listed != list(range(len(sub_groups))):  # each sub-group in one param group, as DeepSpeed saves them
            self._problem(
                LayoutError,
                optim_files[0][1],
                f"its param_groups list sub-groups {listed[:8]}, the model states have {len(sub_groups)}",
            )
            return None
        layout = zero3_layout_of_sub_groups(sub_groups, world, sub_group_param_groups(inner[0], len(sub_groups)))
        flat: dict[int, list[TensorRef]] = {}
        self.ds_ids = ds_ids
        for rank in range(world):
            refs = list(inner[rank][N.FP32_FLAT_GROUPS])
            self.saved_flat[rank] = refs
            if len(refs) != len(layout.flat_groups):
                self._problem(
                    LayoutError,
                    optim_files[rank][1],
                    f"holds {len(refs)} fp32 sub-groups, the model states list {len(layout.flat_groups)}",
                )
                return None
            if self.result.offload == "nvme" and any(r.numel == 0 for r in refs):
                located = self._swapped_flat_groups(rank, refs, layout, ds_ids, optim_files[rank][1])
                if located is None:
                    return None
                refs = located
            for index, (ref, group) in enumerate(zip(refs, layout.flat_groups)):
                if ref.numel != group.partition:
                    held, needed = sum(r.numel for r in refs), sum(g.partition for g in layout.flat_groups)
                    self._problem(
                        LayoutError,
                        optim_files[rank][1],
                        f"holds {held} fp32 elements, the partitioning of its param_shapes gives {needed} per rank (sub-group {index}: {ref.numel} for {group.partition}): a ZeRO-3 partitioning zckpt does not read (a feature that pads or groups the flat partitions otherwise)",
                    )
                    return None
            flat[rank] = refs
        return self._param_entries(layout, flat)

    def _param_entries(self, layout: ZeroLayout, flat: dict[int, list[TensorRef]]) -> list[Entry] | None:
        """One entry per trainable param: its pieces, read from each rank's flat fp32 tensors."""
        odd = sorted(
            {ref.path for refs in flat.values() for ref in refs if not (ref.is_contiguous and len(ref.shape) == 1)}
        )
        for path in odd:  # byte offsets below assume one flat run of elements
            self._problem(CorruptFileError, path, "fp32 partition is not a flat contiguous tensor")
        if odd:
            return None
        self.layout = layout
        entries = []
        for param, pieces in zip(layout.params, layout.by_param()):
            segments = PackedSegments(_segment(flat[p.rank][p.flat], p.flat_offset, p.length) for p in pieces)
            shape = self.shapes[param.name]
            entries.append(
                Entry(param.name, "param", TensorSource(flat[0][0].dtype if flat[0] else FP32, shape, segments))
            )
        return entries

    # --- NVMe swap files ----------------------------------------------------------------------
    def _swapped_flat_groups(
        self, rank: int, refs: list[TensorRef], layout: ZeroLayout, ds_ids: dict[str, int], optim_path: str
    ) -> list[TensorRef] | None:
        """Point the sub-groups whose fp32 masters were offloaded to NVMe (saved empty in the
        optimizer file) at their swap files in <tag>/offloaded_tensors/rankRR/."""
        located: list[TensorRef] = []
        for index, (ref, group) in enumerate(zip(refs, layout.flat_groups)):
            if ref.numel or not group.partition:
                located.append(ref)
                continue
            path = self._swap_path(rank, index, ref, layout, group, ds_ids, optim_path)
            if path is None:
                return None
            located.append(TensorRef.flat(path, 0, ref.dtype, group.partition))
        if (swapped_count := sum(1 for a, b in zip(refs, located) if a is not b)) and self.swap_folder is None:
            self.result.notes.append(
                f"rank {rank}: fp32 masters of {swapped_count} sub-group(s) read from NVMe swap files"
            )
        return located

    def _state_swap_path(
        self, rank: int, flat: int, ref: TensorRef, layout: ZeroLayout, group: FlatGroup, optim_path: str, state: str
    ) -> str | None:
        """A swapped optimizer state's file, named like the sub-group's fp32 swap file (the empty
        fp32 tensor carries the `ds_id`; the empty state tensors do not)."""
        return self._swap_path(rank, flat, self.saved_flat[rank][flat], layout, group, self.ds_ids, optim_path, state)

    def _swap_path(
        self,
        rank: int,
        index: int,
        ref: TensorRef,
        layout: ZeroLayout,
        group: FlatGroup,
        ds_ids: dict[str, int],
        optim_path: str,
        state: str | None = None,
    ) -> str | None:
        """The swap file of one swapped sub-group (fp32 masters, or an optimizer `state`),
        checked to exist and to hold the sub-group's partition."""
        first, last = layout.params[group.params[0]].name, layout.params[group.params[-1]].name
        name = _swap_name(ref, ds_ids.get(first), ds_ids.get(last), state, optim_path)
        what = f"sub-group {index}'s {state or 'fp32 masters'}"
        if name is None:
            self._problem(
                LayoutError,
                optim_path,
                f"cannot name the swap file of {what}: no ds_id recorded and its params are not in the module state dict",
            )
            return None
        if self.swap_folder is not None:
            return self._live_swap_path(rank, index, name, group.partition, what)
        path = os.path.join(self.tag_dir, N.OFFLOADED_TENSORS_DIR, N.offloaded_rank_dir(rank), name)
        if not regular_file_inside(path, self.tag_dir):  # raw bytes, no format: never through a link out
            self._problem(CheckpointNotFoundError, path, f"missing: {what} were offloaded to NVMe and belong here")
            return None
        needed = group.partition * ref.dtype.itemsize
        if os.path.getsize(path) < needed:
            self._problem(
                CorruptFileError, path, f"truncated: holds {os.path.getsize(path)} bytes, {what} need {needed}"
            )
            return None
        return path

    def _live_swap_path(self, rank: int, index: int, name: str, numel: int, what: str) -> str | None:
        """The file of a swapped sub-group in the live swap folder, checked to hold exactly the
        partition (padded to the I/O alignment)."""
        assert self.swap_folder is not None
        path = self.swap_folder.optimizer_path(rank, name)
        if not regular_file_inside(path, self.swap_folder.root):
            held = sorted({f.swap_id for f in self.swap_folder.of_kind("sub_group") if f.rank == rank and f.swap_id})
            other = (
                f" (it holds sub-groups {', '.join(held[:6])}: the swap folder of another run or layout)"
                if held and name[: -len(N.SWAP_SUFFIX)].rsplit("-", 1)[-1] not in held
                else ""
            )
            self._problem(
                CheckpointNotFoundError,
                path,
                f"missing: the checkpoint's layout swaps {what} to NVMe, so the swap folder must hold it{other}",
            )
            return None
        # a swap folder is read only for a ZeRO-3 run offloading to NVMe, whose aio settings were read
        problem = swap.size_problem(os.path.getsize(path), numel, SwapRule(self.run_config.aio or Aio()))
        if problem is not None:
            self._problem(
                CorruptFileError if problem.startswith("truncated") else LayoutError, path, f"{what}: {problem}"
            )
            return None
        self.swap_claimed.add(path)
        self.swap_ids[index] = name[: -len(N.SWAP_SUFFIX)].rsplit("-", 1)[-1]
        return path


def _segment(ref: TensorRef, start: int, length: int) -> Segment:
    if not ref.is_contiguous or len(ref.shape) != 1:
        raise CorruptFileError(ref.path, "fp32 partition is not a flat contiguous tensor")
    return Segment(ref.path, ref.offset + start * ref.dtype.itemsize, length)


def _swap_name(ref: TensorRef, first: int | None, last: int | None, state: str | None, optim_path: str) -> str | None:
    """A swapped sub-group's file: DeepSpeed pickles its `ds_id` ("<first>_<last>") on the empty
    fp32 tensor left in the optimizer file; without it, the ids are computed from module order.
    `state` (an optimizer state name of `optim_path`, None for the masters) is part of the name."""
    recorded = (ref.attributes or {}).get("ds_id")
    if isinstance(recorded, str) and re.fullmatch(r"\d+_\d+", recorded):
        return N.swap_file_name(*map(int, recorded.split("_")), state, optim_path)
    if first is None or last is None:
        return None
    return N.swap_file_name(first, last, state, optim_path)


def sub_group_param_groups(inner0: dict, count: int) -> list[int]:
    """The param group of each ZeRO-3 sub-group: the optimizer's param_groups list sub-group
    indices as their `params`."""
    groups = ((inner0.get(N.OPTIMIZER_STATE_DICT) or {}).get("param_groups")) or []
    owner = [0] * count
    for g, group in enumerate(groups):
        for index in group.get("params", []) if isinstance(group, dict) else []:
            if isinstance(index, int) and 0 <= index < count:
                owner[index] = g
    return owner


def _optimizer_partitions(inner: dict) -> list[TensorRef]:
    """What a ZeRO-3 optimizer file holds of its own rank: its fp32 sub-group partitions and
    their per-element states (not the step counters, alike on every rank)."""
    flat = [ref for ref in inner.get(N.FP32_FLAT_GROUPS) or [] if isinstance(ref, TensorRef)]
    state = flat_states(inner).get("state")
    entries = [state.get(index) if isinstance(state, dict) else None for index in range(len(flat))]
    moments = [
        value
        for ref, entry in zip(flat, entries)
        if isinstance(entry, dict)
        for value in entry.values()
        if isinstance(value, TensorRef) and len(value.shape) == 1 and value.numel == ref.numel
    ]
    return flat + moments
