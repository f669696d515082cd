"""One pass over the tag folder of a ZeRO checkpoint, filling a :class:`~.survey.Survey`
(:class:`ZeroReader`): the rank files listed and loaded, their pickles checked against what the
reader relies on, the layout rebuilt and validated, every param located as file segments, and the
training state built. The universal reader builds on it for the model_states files.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import numpy as np

from ..core.dtypes import BF16, FP16, FP32
from ..core.errors import CheckpointNotFoundError, CorruptFileError, LayoutError, ZckptError
from ..core.index import CheckpointIndex, Entry, Segment, TensorRef, TensorSource
from ..core.state import TrainingState
from ..core.untrusted import regular_file_inside
from ..io.checksums import RecordChecker, repeated_ranks
from ..io.materialize import read_scalar
from ..io.reading import FileReader, source_of
from ..torchfile import reader as torchfile
from . import names as N
from . import swap_folder as swap
from .layout import FlatGroup, LayoutParam, ZeroLayout, zero12_layout, zero3_layout_of_sub_groups
from .locate import natural_key
from .optim_state import build_training_state, flat_states, slice_mapping_layout
from .partition import zero3_partition
from .run_config import RunConfig, read_run_config
from .survey import Survey
from .swap_rules import Aio, SwapRule


_MAX_MISSING_RANKS = 4096  # beyond this many absent rank files, a world size is taken as damage


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(map(_is_count, value))


def _is_shape_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _is_shape(v) for k, v in value.items())


def _is_tensor_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, TensorRef) for t in value)


# What the reader relies on in each key it reads: (expected, test). A value of another type is a
# damaged or edited file, reported as such instead of failing later on a missing attribute.
Schema = dict[str, tuple[str, Any]]
MODEL_SCHEMA: Schema = {
    N.MODULE: ("a dict of tensors", lambda v: isinstance(v, dict)),
    N.PARAM_SHAPES: ("a list of {name: shape} dicts", lambda v: _is_shape_map(v) or (isinstance(v, (list, tuple)) and all(map(_is_shape_map, v)))),
    N.BUFFER_NAMES: ("a list of names", lambda v: v is None or (isinstance(v, (list, tuple, set)) and all(isinstance(n, str) for n in v))),
    N.FROZEN_PARAM_SHAPES: ("a {name: shape} dict", lambda v: v is None or _is_shape_map(v)),
    N.FROZEN_PARAM_FRAGMENTS: ("a {name: tensor} dict", lambda v: v is None or isinstance(v, dict)),
    N.SHARED_PARAMS: ("an {alias: name} dict", lambda v: v is None or (isinstance(v, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items()))),
    N.DS_CONFIG: ("a dict", lambda v: v is None or isinstance(v, dict)),
    N.DP_WORLD_SIZE: ("an integer", lambda v: v is None or _is_count(v)),
    N.MP_WORLD_SIZE: ("an integer", lambda v: v is None or _is_count(v)),
}
OPTIM_SCHEMA: Schema = {
    N.FP32_FLAT_GROUPS: ("a list of tensors", _is_tensor_list),
    N.SINGLE_PARTITION_OF_FP32_GROUPS: ("a list of tensors", _is_tensor_list),
    N.PARTITION_COUNT: ("an integer or a list of them", lambda v: v is None or _is_count(v) or (isinstance(v, (list, tuple)) and bool(v) and all(map(_is_count, v)))),
    N.ZERO_STAGE: ("an integer", lambda v: v is None or _is_count(v)),
    N.PARAM_ALIGNMENT_PADDINGS: ("a list of lists of integers", lambda v: v is None or (isinstance(v, (list, tuple)) and all(_is_shape(p) for p in v))),
}


def schema_problems(state: dict, schema: Schema) -> list[str]:
    """The keys of `state` whose values are not of the type DeepSpeed writes."""
    return [
        f"'{key}' is {type(state[key]).__name__}, expected {expected}: not as DeepSpeed writes it (damaged or edited)"
        for key, (expected, test) in schema.items()
        if key in state and not test(state[key])
    ]


def numel_of(shape: Any) -> int:
    return math.prod(shape)


def as_shape(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


class ZeroReader:
    """One pass over a tag folder of a ZeRO checkpoint, filling a Survey."""

    def __init__(self, result: Survey, swap_folder: swap.SwapFolder | None = None) -> None:
        assert result.location is not None
        self.result = result
        self.tag_dir = result.location.tag_dir
        self.problems = result.problems
        self.run_config: RunConfig = read_run_config({}, saved=True)  # the saved ds_config, as DeepSpeed read it
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.saved_flat: dict[int, list[TensorRef]] = {}  # ZeRO-3 fp32 groups as saved (NVMe ones empty)
        self.ds_ids: dict[str, int] = {}
        self.swap_folder = swap_folder  # a live swap folder giving the swapped sub-groups' data
        self.swap_claimed: set[str] = set()  # its files that the layout reads
        self.swap_ids: dict[int, str] = {}  # swapped sub-group -> "<first>_<last>"

    # --- helpers ------------------------------------------------------------------------------
    def _problem(self, error: type[ZckptError], path: str | None, text: str) -> None:
        self.problems.append(error(path, text))

    def _load(self, path: str) -> Any | None:
        try:
            return torchfile.load(path)
        except ZckptError as exc:
            self.problems.append(exc)
            return None

    def _path(self, name: str) -> str:
        return os.path.join(self.tag_dir, name)

    # --- main --------------------------------------------------------------------------------
    def run(self) -> None:
        model_files, optim_files = self._list_rank_files()
        if model_files is None:
            return
        zero3 = any(dp is not None for dp in model_files)
        model_paths = {rank: self._path(name) for rank, name in sorted(model_files.items(), key=lambda kv: kv[0] or 0)}
        self.result.files = sorted(model_paths.values()) + sorted(p for _, p in optim_files.values())
        models = {rank: self._load(p) for rank, p in model_paths.items()}
        optims = {rank: self._load(p) for rank, (_, p) in sorted(optim_files.items())}
        model0 = models.get(0 if zero3 else None)
        if isinstance(model0, dict) and not schema_problems(model0, MODEL_SCHEMA):
            self._declare(model0)
        if any(v is None for v in list(models.values()) + list(optims.values())) or not self._check_file_kinds(models, optims, model_paths, optim_files):
            self._describe_readable(models, optims, optim_files, zero3)
            return
        inner = {rank: optims[rank][N.OPTIMIZER_STATE_DICT] for rank in optims}
        self._describe(model0, inner[0], optim_files[0][0], zero3, model_paths[0 if zero3 else None])
        if not self._check_world(models, inner, model_paths, optim_files, zero3):
            return
        if self.swap_folder is not None and not self._check_swap_folder(zero3):
            return
        self._check_same_run(models, optims, model_paths, optim_files)
        with FileReader() as reader:
            self._check_steps(reader, inner, optim_files)
        if self.problems:
            return
        entries = self._entries(models, inner, model_paths, optim_files, zero3)
        if entries is None or self.problems:
            return
        location = self.result.location
        assert location is not None and self.result.dtype is not None
        self.result.index = CheckpointIndex(
            checkpoint_dir=location.checkpoint_dir,
            tag=location.tag,
            tag_dir=self.tag_dir,
            tags=location.tags,
            zero_stage=self.result.zero_stage or 0,
            world_size=self.result.world_size or 0,
            dtype=self.result.dtype,
            ds_version=self.result.ds_version,
            offload=self.result.offload,
            entries=tuple(entries),
            files=tuple(self.result.files),
            notes=tuple(self.result.notes),
        )
        try:
            self.result.state = build_training_state(
                self.result.index, self.layout, models, inner, {r: p for r, (_, p) in optim_files.items()}, self._state_swap_path,
                self.run_config.round_robin_gradients,
            )
        except ZckptError as exc:
            self.problems.append(exc)
            self.result.index = None
            return
        if not self._check_padding(self.result.state):
            self.result.index = self.result.state = None
            return
        if self.swap_folder is not None:
            self._report_swap_folder()

    def _check_swap_folder(self, zero3: bool) -> bool:
        """A swap folder belongs to a ZeRO-3 NVMe-offloaded run of the checkpoint's world size."""
        assert self.swap_folder is not None
        if not zero3 or self.result.offload != "nvme":
            self._problem(LayoutError, self.tag_dir, f"saved by a {'ZeRO-3' if zero3 else f'ZeRO-{self.result.zero_stage}'} run without offload_optimizer on NVMe: the swap folder {self.swap_folder.root} cannot belong to its run")
            return False
        problem = swap.check_world(self.swap_folder, self.result.world_size or 0)
        if problem is not None:
            self.problems.append(problem)
            return False
        return True

    def _report_swap_folder(self) -> None:
        """Refuse sub-group files the layout does not claim, compare the 16-bit param swaps with
        the masters, and put what was read from where into the index notes."""
        folder, state = self.swap_folder, self.result.state
        assert folder is not None and state is not None and self.result.index is not None
        for orphan in swap.sub_group_orphans(folder, self.swap_claimed):
            self._problem(LayoutError, orphan.path, f"not in the checkpoint's layout (it swaps no sub-group {orphan.swap_id} with this state): a swap folder of another run or layout")
        if self.problems:
            self.result.index = self.result.state = None
            return
        layout = self.layout
        sub_groups = tuple(
            swap.SwappedSubGroup(i, self.swap_ids.get(i), tuple(layout.params[p].name for p in group.params), group.partition, i in self.swap_ids)
            for i, group in enumerate(layout.flat_groups)
        )
        agreement = None
        dtype = swap.PARAM_DTYPES.get(folder.param_dtypes[0]) if folder.param_dtypes else None
        if dtype is not None:
            masters = {e.name: e.source for e in self.result.index.entries if e.kind == "param"}
            world = layout.world_size
            pieces = [
                (param.name, self.ds_ids[param.name], masters[param.name], [p.rank for p in parts], -(-param.numel // world))
                for param, parts in zip(layout.params, layout.by_param())
                if param.name in self.ds_ids and param.name in masters
            ]
            agreement = swap.compare_16bit(folder, pieces, dtype)
        report = swap.SwapReport(
            root=folder.root, world_size=layout.world_size, sub_groups=sub_groups,
            gradient_files=len(folder.of_kind("gradient")), orphans=tuple(f.path for f in folder.of_kind("orphan")),
            total_bytes=folder.total_bytes, checkpoint_tag=self.result.index.tag, checkpoint_step=state.global_steps, agreement=agreement,
            param_names={i: name for name, i in self.ds_ids.items()},
        )
        self.result.swap = report
        self.result.notes.extend(report.notes())
        index = dataclasses.replace(self.result.index, notes=tuple(self.result.notes))
        self.result.index = index
        self.result.state = dataclasses.replace(state, index=index)

    def _check_padding(self, state: TrainingState) -> bool:
        """Optimizer moments in each rank's padding must be zero, as DeepSpeed leaves them: data
        there means the file holds another rank's partition (ZeRO-3 rank files swapped or copied
        over each other have the same sizes, so nothing else tells). A few small reads, outside
        the CRC checks (those would read the whole record); swap files keep no zeros there."""
        dirty: dict[tuple[int, str], int] = {}
        with FileReader(verify=False) as reader:
            for run in state.state_padding:
                path = run.source.segments[0].path
                if run.state == "step" or not path.endswith(".pt"):
                    continue
                count = int(np.count_nonzero(reader.read_source(run.source)))
                if count:
                    dirty[(run.rank, path)] = dirty.get((run.rank, path), 0) + count
        if dirty:
            try:  # damaged bytes, rather than another rank's data? The CRC tells.
                checker = RecordChecker()
                for run in state.state_padding:
                    segment = run.source.segments[0]
                    if (run.rank, segment.path) in dirty:
                        checker.touch(segment.path, segment.offset, run.source.nbytes)
                checker.finish()
            except CorruptFileError as exc:
                self.problems.append(exc)
                return False
        for (rank, path), count in sorted(dirty.items()):
            self._problem(
                LayoutError, path,
                f"{count} optimizer-state elements in rank {rank}'s padding are not zero: the file holds another rank's partition (rank files swapped or copied)",
            )
        return not dirty

    def _state_swap_path(self, rank: int, flat: int, ref: TensorRef, layout: ZeroLayout, group: FlatGroup, optim_path: str, state: str) -> str | None:
        """A swapped optimizer state's file, named like the sub-group's fp32 swap file (the empty
        fp32 tensor carries the `ds_id`; the empty state tensors do not)."""
        return self._swap_path(rank, flat, self.saved_flat[rank][flat], layout, group, self.ds_ids, optim_path, state)

    def _list_rank_files(self) -> tuple[dict[int | None, str] | None, dict[int, tuple[str, str]]]:
        scanned = self._scan_rank_files("tag folder")
        if scanned is None:
            return None, {}
        model_files, optim_files = scanned
        if not model_files:
            self._problem(CheckpointNotFoundError, self.tag_dir, "no *_model_states.pt file in the tag folder")
            return None, optim_files
        if not optim_files:
            self._problem(CheckpointNotFoundError, self.tag_dir, "no *_optim_states.pt files: saved without ZeRO optimizer state, nothing to consolidate from")
            return None, optim_files
        if None in model_files and len(model_files) > 1:
            self._problem(LayoutError, self.tag_dir, "holds both ZeRO-1/2 (mp_rank_00_model_states.pt) and ZeRO-3 (zero_pp_rank_*_model_states.pt) model files: two runs are mixed")
            return None, optim_files
        return model_files, optim_files

    def _scan_rank_files(self, folder_kind: str) -> tuple[dict[int | None, str], dict[int, tuple[str, str]]] | None:
        """The model-states files by dp rank (None: ZeRO-1/2's one file) and the optimizer files
        by rank (with their bf16_ prefix); expert and model-parallel files are listed problems."""
        try:
            listing = sorted(os.listdir(self.tag_dir), key=natural_key)
        except OSError as exc:
            self._problem(CheckpointNotFoundError, self.tag_dir, f"cannot list {folder_kind} ({exc.strerror})")
            return None
        model_files: dict[int | None, str] = {}
        optim_files: dict[int, tuple[str, str]] = {}
        for name in listing:
            model_match, optim_match = N.MODEL_STATES_RE.match(name), N.OPTIM_STATES_RE.match(name)
            match = model_match or optim_match
            if N.EXPERT_STATES_RE.match(name):
                self._problem(LayoutError, self._path(name), "mixture-of-experts checkpoints (expert files) are not supported")
            elif match and int(match["mp"]) != 0:
                self._problem(LayoutError, self._path(name), "tensor/pipeline-parallel checkpoints (mp_rank > 0) are not supported")
            elif model_match:
                model_files[int(model_match["dp"]) if model_match["dp"] is not None else None] = name
            elif optim_match:
                rank = int(optim_match["dp"])
                prefix = optim_match["prefix"] or ""
                if rank in optim_files:
                    other = optim_files[rank][1]
                    self._problem(LayoutError, self._path(name), f"two optimizer files for rank {rank} (also {os.path.basename(other)}): files of a bf16 and a non-bf16 run are mixed")
                    continue
                optim_files[rank] = (prefix, self._path(name))
        return model_files, optim_files

    def _declare(self, model0: dict) -> None:
        """Record the params, buffers and tied names rank 0's model states declare, with the
        dtypes the module state dict stores them in (buffers and frozen params keep theirs)."""
        declared = self.result.declared
        module = model0.get(N.MODULE) if isinstance(model0.get(N.MODULE), dict) else {}
        buffers = list(model0.get(N.BUFFER_NAMES) or [])
        for name in buffers:
            ref = module.get(name)
            if isinstance(ref, TensorRef):
                declared.append((name, ref.shape, "buffer"))
        frozen = {name: as_shape(shape) for name, shape in (model0.get(N.FROZEN_PARAM_SHAPES) or {}).items()}
        shapes = model0.get(N.PARAM_SHAPES) or []
        trainable = [(name, as_shape(shape)) for group in ([shapes] if isinstance(shapes, dict) else shapes) for name, shape in group.items()]
        tied = {str(k): str(v) for k, v in (model0.get(N.SHARED_PARAMS) or {}).items()}
        if not frozen:  # ZeRO-1 records no frozen_param_shapes: its frozen params are only in the module
            known = {n for n, _ in trainable} | set(buffers) | set(tied)
            frozen = {n: ref.shape for n, ref in module.items() if n not in known and isinstance(ref, TensorRef) and ref.numel}
        declared.extend((name, shape, "frozen") for name, shape in frozen.items())
        declared.extend((name, shape, "param") for name, shape in trainable)
        self.result.declared_dtypes = {n: ref.dtype for n, ref in module.items() if isinstance(ref, TensorRef) and (n in frozen or n in buffers)}
        self.result.tied = tied

    def _check_file_kinds(self, models: dict, optims: dict, model_paths: dict, optim_files: dict) -> bool:
        ok = True
        for rank, state in models.items():
            if not isinstance(state, dict) or N.PARAM_SHAPES not in state or N.MODULE not in state:
                self._problem(CorruptFileError, model_paths[rank], "not a DeepSpeed model-states file (no 'module'/'param_shapes')")
                ok = False
            elif problems := schema_problems(state, MODEL_SCHEMA):
                self._problem(CorruptFileError, model_paths[rank], problems[0])
                ok = False
        for rank, state in optims.items():
            inner = state.get(N.OPTIMIZER_STATE_DICT) if isinstance(state, dict) else None
            if not isinstance(inner, dict) or not (N.FP32_FLAT_GROUPS in inner or N.SINGLE_PARTITION_OF_FP32_GROUPS in inner):
                self._problem(CorruptFileError, optim_files[rank][1], "not a DeepSpeed ZeRO optimizer-states file (no fp32 partitions)")
                ok = False
            elif problems := schema_problems(inner, OPTIM_SCHEMA):
                self._problem(CorruptFileError, optim_files[rank][1], problems[0])
                ok = False
        if 0 not in optims:
            self._problem(CheckpointNotFoundError, self._path(N.optim_states_name(0, bf16=any(p for p, _ in optim_files.values()))), "missing (rank 0 optimizer states)")
            ok = False
        return ok

    def _describe_readable(self, models: dict, optims: dict, optim_files: dict, zero3: bool) -> None:
        """Where some files cannot be read, describe the checkpoint from those that can (rank 0's
        first), rather than leave stage, world size and dtype unknown."""
        rank, model = next(((r, m) for r, m in sorted(models.items(), key=lambda kv: kv[0] or 0) if _sound(m, N.DS_CONFIG, MODEL_SCHEMA)), (None, None))
        inner = next((o[N.OPTIMIZER_STATE_DICT] for _, o in sorted(optims.items()) if isinstance(o, dict) and _sound(o.get(N.OPTIMIZER_STATE_DICT), N.PARTITION_COUNT, OPTIM_SCHEMA)), None)
        if model is None and inner is None:
            return
        prefix = optim_files[min(optim_files)][0] if optim_files else ""
        self._describe(model or {}, inner, prefix, zero3, self._path(N.model_states_name(3 if zero3 else 1, rank or 0)))
        dp = (model or {}).get(N.DP_WORLD_SIZE)
        if self.result.world_size is None and isinstance(dp, int) and dp > 0:
            self.result.world_size = dp

    def _describe(self, model0: dict, inner0: dict | None, prefix: str, zero3: bool, model_path: str) -> None:
        """Fill stage, world size, dtype, version and offload from rank 0's files (`inner0`:
        None when no optimizer file is readable; the config then says the stage). The saved
        ds_config is read as DeepSpeed read it; a value DeepSpeed refuses is a problem."""
        try:
            self.run_config = read_run_config(model0.get(N.DS_CONFIG) or {}, model_path, saved=True)
        except ZckptError as exc:
            self.problems.append(exc)
        run = self.run_config
        stage = inner0.get(N.ZERO_STAGE) if inner0 is not None else run.stage if run.stage_set else None
        if stage is None and inner0 is not None:  # BF16_Optimizer layout (bf16 + ZeRO-1 in some releases) has no stage key
            stage = run.stage or 1
            self.result.notes.append("optimizer state written by DeepSpeed's BF16_Optimizer (ZeRO-1 layout)")
        self.result.zero_stage = 3 if zero3 else int(stage) if stage is not None else None
        count = (inner0 or {}).get(N.PARTITION_COUNT)
        self.result.world_size = max(count) if isinstance(count, (list, tuple)) else int(count) if count is not None else None
        self.result.ds_version = str(model0.get(N.DS_VERSION)) if model0.get(N.DS_VERSION) is not None else None
        self.result.dtype = BF16 if prefix == N.BF16_PREFIX or run.dtype == "bf16" else FP16 if run.dtype == "fp16" else FP32
        devices = {run.device(N.CONFIG_OFFLOAD_OPTIMIZER), run.device(N.CONFIG_OFFLOAD_PARAM)}  # cpu_offload: true is "cpu"
        self.result.offload = N.OFFLOAD_DEVICE_NVME if N.OFFLOAD_DEVICE_NVME in devices else "cpu" if "cpu" in devices else "none"

    def _check_world(self, models: dict, inner: dict, model_paths: dict, optim_files: dict, zero3: bool) -> bool:
        world = self.result.world_size
        path0 = optim_files[0][1]
        if not isinstance(world, int) or world < 1:
            self._problem(CorruptFileError, path0, f"bad partition_count {world!r}")
            return False
        if world > len(inner) + _MAX_MISSING_RANKS:  # listing every missing rank would never end
            self._problem(CorruptFileError, path0, f"partition_count {world}, but {len(inner)} optimizer files are here: damaged, or nearly all rank files are missing")
            return False
        ok = True
        for rank, state in inner.items():
            count = state.get(N.PARTITION_COUNT)
            count = max(count) if isinstance(count, (list, tuple)) else count
            if count != world:
                self._problem(LayoutError, optim_files[rank][1], f"was written by a run of world size {count}, rank 0's by one of world size {world}: files of different runs are mixed")
                ok = False
        missing = [r for r in range(world) if r not in inner]
        bf16 = optim_files[0][0] == N.BF16_PREFIX
        for rank in missing:
            self._problem(CheckpointNotFoundError, self._path(N.optim_states_name(rank, bf16=bf16)), f"missing (world size {world} needs ranks 0-{world - 1})")
            ok = False
        for rank in sorted(set(inner) - set(range(world))):
            self._problem(LayoutError, optim_files[rank][1], f"rank {rank} does not belong to a checkpoint of world size {world}: files of different runs are mixed")
            ok = False
        prefixes = {prefix for prefix, _ in optim_files.values()}
        if len(prefixes) > 1:
            odd = next(p for r, (pre, p) in sorted(optim_files.items()) if pre != optim_files[0][0])
            self._problem(LayoutError, odd, "bf16_ and plain optimizer files are mixed: files of different runs")
            ok = False
        if zero3:
            for rank in range(world):
                if rank not in models:
                    self._problem(CheckpointNotFoundError, self._path(N.model_states_name(3, rank)), f"missing (world size {world} needs ranks 0-{world - 1})")
                    ok = False
            for rank in sorted(r for r in models if r >= world):
                self._problem(LayoutError, model_paths[rank], f"rank {rank} does not belong to a checkpoint of world size {world}")
                ok = False
        for rank, state in models.items():
            dp = state.get(N.DP_WORLD_SIZE)
            if dp is not None and dp != world:
                self._problem(LayoutError, model_paths[rank], f"says dp_world_size {dp}, optimizer files say {world}: files of different runs are mixed")
                ok = False
            mp = state.get(N.MP_WORLD_SIZE)
            if mp not in (None, 1):
                self._problem(LayoutError, model_paths[rank], f"model-parallel world size {mp} is not supported")
                ok = False
        return ok

    def _check_same_run(self, models: dict, optims: dict, model_paths: dict, optim_files: dict) -> None:
        """Every file of one save carries the same ds_config, version and step counter."""
        first_model = next(iter(models))
        reference = models[first_model]
        reference_path = model_paths[first_model]
        for key, what in ((N.DS_CONFIG, "DeepSpeed config"), (N.DS_VERSION, "DeepSpeed version"), (N.GLOBAL_STEPS, "global step"), (N.PARAM_SHAPES, "param shapes")):
            for rank, state in models.items():
                if key in state and key in reference and state[key] != reference[key]:
                    self._problem(LayoutError, model_paths[rank], f"{what} differs from {os.path.basename(reference_path)}'s: files of different runs are mixed")
        for rank, state in sorted(optims.items()):
            for key, what in ((N.DS_CONFIG, "DeepSpeed config"), (N.DS_VERSION, "DeepSpeed version")):
                if key in state and key in reference and state[key] != reference[key]:
                    self._problem(LayoutError, optim_files[rank][1], f"{what} differs from {os.path.basename(reference_path)}'s: files of different runs are mixed")

    def _check_steps(self, reader: FileReader, inner: dict, optim_files: dict) -> None:
        """Adam step counters must agree across ranks (cheap: a few scalars)."""
        steps: dict[int, Any] = {}
        for rank, state in sorted(inner.items()):
            try:
                step = _first_step(reader, state)
                reader.verify_now()  # a damaged counter is damage, not a sign of mixed runs
            except CorruptFileError as exc:
                self._problem(CorruptFileError, exc.path, exc.problem)
                continue
            if step is not None:
                steps[rank] = step
        if len(set(steps.values())) > 1:
            rank0_step = steps.get(0)
            for rank, step in steps.items():
                if step != rank0_step:
                    self._problem(LayoutError, optim_files[rank][1], f"optimizer is at step {step}, rank 0's at step {rank0_step}: files of different runs or saves are mixed")

    # --- entries -----------------------------------------------------------------------------
    def _entries(self, models: dict, inner: dict, model_paths: dict, optim_files: dict, zero3: bool) -> list[Entry] | None:
        model0 = models[0 if zero3 else None]
        model0_path = model_paths[0 if zero3 else None]
        module = model0[N.MODULE]
        world = self.result.world_size
        assert world is not None
        entries: list[Entry] = []

        buffer_names = list(model0.get(N.BUFFER_NAMES) or [])
        for name in buffer_names:
            if name in module:
                ref = module[name]
                if isinstance(ref, TensorRef):
                    entries.append(Entry(name, "buffer", self._whole(ref)))
            else:  # DeepSpeed lists the persistent buffers only, all of them in the state dict
                self._problem(LayoutError, model0_path, f"buffer {name} is listed in buffer_names but missing from the module state dict")
                return None

        param_shapes = model0[N.PARAM_SHAPES]
        if isinstance(param_shapes, dict):
            param_shapes = [param_shapes]
        trainable = [(name, as_shape(shape)) for group in param_shapes for name, shape in group.items()]
        trainable_names = {name for name, _ in trainable}
        self.shapes = dict(trainable)
        shared = dict(model0.get(N.SHARED_PARAMS) or {})

        frozen_shapes = model0.get(N.FROZEN_PARAM_SHAPES)
        if frozen_shapes is not None:
            # ZeRO-2/3 record their frozen params: the module holds nothing else than those, the
            # trainable ones, buffers, tied aliases and modules' extra state (torch's `_extra_state`)
            known = trainable_names | set(frozen_shapes) | set(buffer_names) | set(shared)
            unknown = [n for n, ref in module.items() if n not in known and isinstance(ref, TensorRef) and not n.endswith("_extra_state")]
            if unknown:
                self._problem(LayoutError, model0_path, f"param {unknown[0]} is in the module but neither trainable, recorded as frozen, a buffer nor a tied alias")
                return None
        fragments = {rank: list((m.get(N.FROZEN_PARAM_FRAGMENTS) or {}).values()) for rank, m in models.items()}
        if zero3 and not self._check_not_copies(model_paths, fragments, "frozen-param partitions"):
            return None  # each rank's file holds its own partition of the frozen params
        if frozen_shapes:
            for name, shape in frozen_shapes.items():
                source = self._frozen_source(name, as_shape(shape), models, model_paths, zero3, world)
                if source is None:
                    return None
                entries.append(Entry(name, "frozen", source))
        else:
            # ZeRO-1 runs record no frozen_param_shapes; the values are only in `module`.
            known = trainable_names | set(buffer_names) | set(shared)
            recovered = [n for n, ref in module.items() if n not in known and isinstance(ref, TensorRef)]
            for name in recovered:
                ref = module[name]
                if zero3 or ref.numel == 0:
                    self._problem(LayoutError, model0_path, f"param {name} is in the module but neither trainable nor recorded as frozen")
                    return None
                entries.append(Entry(name, "frozen", self._whole(ref)))
            if recovered:
                self.result.notes.append(f"{len(recovered)} frozen params read from the module state dict (zero_to_fp32.py drops them)")

        params = self._trainable(param_shapes, inner, optim_files, world, zero3, model0)
        if params is None:
            return None
        entries.extend(params)

        present = {e.name: e for e in entries}
        for alias, source_name in shared.items():
            if source_name in present:
                entries.append(Entry(alias, "tied", present[source_name].source, alias_of=source_name))
        return entries

    def _trainable(self, param_shapes: list[dict], inner: dict, optim_files: dict, world: int, zero3: bool, model0: dict) -> list[Entry] | None:
        """The trainable params' entries (fp32 masters), from the optimizer files' partitions."""
        if zero3:
            ds_ids = _ds_ids(model0)  # by module order: a param missing there would shift every later id
            named = [n for shapes in param_shapes for n in shapes] + list(model0.get(N.FROZEN_PARAM_SHAPES) or {})
            missing = [n for n in named if n not in ds_ids]
            if missing:
                self._problem(LayoutError, self._path(N.model_states_name(3, 0)), f"param {missing[0]} is missing from the module state dict (DeepSpeed numbers params by it)")
                return None
            optim_paths = {rank: path for rank, (_, path) in optim_files.items()}
            if not self._check_not_copies(optim_paths, {rank: _optimizer_partitions(state) for rank, state in inner.items()}, "fp32 partitions and optimizer states"):
                return None
            return self._zero3_params(param_shapes, inner, optim_files, world, ds_ids)
        return self._zero12_params(param_shapes, inner, optim_files, world)

    def _check_not_copies(self, paths: dict[int, str], partitions: dict[int, list[TensorRef]], what: str) -> bool:
        """No ZeRO-3 rank file may repeat another rank's partitions (`what`) byte for byte: one
        file was copied over another (told by the sizes and CRC-32s in the zip directories).
        Only the partitions are judged, small ones too: buffers and counters are alike on every
        honest rank. Where nothing tells (checksums.RepeatedRank), the survey says so."""
        files = {
            rank: (path, [(ref.offset, ref.dtype.itemsize) for ref in partitions.get(rank, []) if isinstance(ref, TensorRef) and ref.path == path and ref.numel])
            for rank, path in paths.items()
        }
        ok = True
        for repeat in repeated_ranks(files):
            if repeat.telling:
                self._problem(LayoutError, repeat.path, f"its {what} are byte-identical to rank {repeat.other}'s: one rank's file was copied over another's")
                ok = False
            elif repeat.partitioned:
                self.result.untold_copies.append(
                    f"{repeat.path}: its {what} are byte-identical to rank {repeat.other}'s, each one value repeated "
                    "(as honest ranks' slices of constant params are): cannot tell whether one rank's file was copied over another's"
                )
            else:
                self.result.untold_copies.append(
                    f"{repeat.path} holds the same tensors as {os.path.basename(repeat.other_path)} and none of its own (no {what}, "
                    "only state alike on every rank, such as buffers): cannot tell whether one rank's file was copied over another's"
                )
        return ok

    def _whole(self, ref: TensorRef) -> TensorSource:
        try:
            return source_of(ref)
        except ZckptError as exc:
            self.problems.append(exc)
            return TensorSource(ref.dtype, ref.shape, ())

    def _frozen_source(self, name: str, shape: tuple[int, ...], models: dict, model_paths: dict, zero3: bool, world: int) -> TensorSource | None:
        numel = numel_of(shape)
        if not zero3:
            model0 = models[None]
            ref = (model0.get(N.FROZEN_PARAM_FRAGMENTS) or {}).get(name)
            if not isinstance(ref, TensorRef) or ref.numel != numel:
                self._problem(LayoutError, model_paths[None], f"frozen param {name} has no full fragment of {numel} elements")
                return None
            return TensorSource(ref.dtype, shape, self._whole(ref).segments)
        segments: list[Segment] = []
        dtype = None
        share = zero3_partition(numel, world)[0]
        for rank in range(world):
            ref = (models[rank].get(N.FROZEN_PARAM_FRAGMENTS) or {}).get(name)
            if not isinstance(ref, TensorRef) or ref.numel != share:
                self._problem(LayoutError, model_paths[rank], f"frozen param {name}: expected a partition of {share} elements")
                return None
            dtype = ref.dtype
            segments.extend(self._whole(ref).segments)
        assert dtype is not None
        return TensorSource(dtype, shape, tuple(_truncate(segments, numel)))

    def _zero12_params(self, param_shapes: list[dict], inner: dict, optim_files: dict, world: int) -> list[Entry] | None:
        paddings = inner[0].get(N.PARAM_ALIGNMENT_PADDINGS)
        groups = {rank: list(inner[rank][N.SINGLE_PARTITION_OF_FP32_GROUPS]) for rank in range(world)}
        for rank, refs in groups.items():
            if len(refs) != len(param_shapes):
                self._problem(LayoutError, optim_files[rank][1], f"holds {len(refs)} param groups, the model states list {len(param_shapes)}")
                return None
        flat_order = [[LayoutParam(name, numel_of(shape), g) for name, shape in shapes.items()] for g, shapes in enumerate(param_shapes)]
        if paddings is not None and [len(p) for p in paddings] != [len(g) for g in flat_order]:
            self._problem(LayoutError, optim_files[0][1], f"{[len(p) for p in paddings]} alignment paddings per group for {[len(g) for g in flat_order]} params")
            return None
        layout = zero12_layout(flat_order, world, alignment_paddings=paddings, stage=self.result.zero_stage or 2)
        if not self._check_rank_identity(layout, inner, optim_files):
            return None
        for g, group in enumerate(layout.flat_groups):
            sizes = [groups[rank][g].numel for rank in range(world)]
            # DeepSpeed drops the tail padding when saving, except BF16_Optimizer, which keeps it
            for rank, size in enumerate(sizes):
                if size not in (group.saved[rank], group.partition):
                    needed = sum(layout.params[i].numel for i in group.params) + sum(group.alignment_paddings)
                    self._problem(LayoutError, optim_files[rank][1], f"param group {g}: holds {size} fp32 elements, expected {group.saved[rank]} (the params need {needed} in all, sizes {sizes}): truncated or mixed files")
                    return None
        return self._param_entries(layout, groups)

    def _check_rank_identity(self, layout: ZeroLayout, inner: dict, optim_files: dict) -> bool:
        """Each ZeRO-1/2 optimizer file's param_slice_mappings must name the params (and
        offsets) of the rank its file name says: swapped or copied rank files are caught here,
        where equal partition sizes hide them. The mappings follow the param group's order even
        under round-robin gradients (sample_ckpts/FORMAT_OBSERVED.md)."""
        described = slice_mapping_layout(layout, self.run_config.round_robin_gradients)
        by_rank = described.by_rank()

        def mapping_of(rank: int, flat: int) -> dict:
            return {described.params[p.param].name: (p.length, p.flat_offset) for p in by_rank.get((rank, flat), [])}

        for rank, state in sorted(inner.items()):
            mappings = state.get(N.PARAM_SLICE_MAPPINGS)
            if not isinstance(mappings, list) or len(mappings) != len(layout.flat_groups):
                continue  # older files without them: nothing to tell by
            for flat, mapping in enumerate(mappings):
                expected = mapping_of(rank, flat)
                found = {name: (getattr(a, "numel", None), getattr(a, "start", None)) for name, a in mapping.items()} if isinstance(mapping, dict) else None
                if found != expected:
                    owner = next((r for r in range(layout.world_size) if found == mapping_of(r, flat)), None)
                    said = f"; they are rank {owner}'s: rank files swapped or copied" if owner is not None and owner != rank else ""
                    self._problem(LayoutError, optim_files[rank][1], f"param group {flat}: its param_slice_mappings do not match rank {rank}'s partition{said}")
                    return False
        return True

    def _zero3_params(self, param_shapes: list[dict], inner: dict, optim_files: dict, world: int, ds_ids: dict[str, int]) -> list[Entry] | None:
        sub_groups = [[LayoutParam(name, numel_of(shape), 0) for name, shape in shapes.items()] for shapes in param_shapes]
        groups = (inner[0].get(N.OPTIMIZER_STATE_DICT) or {}).get("param_groups") or []
        listed = sorted(i for g in (groups if isinstance(groups, list) else []) if isinstance(g, dict) and isinstance(g.get("params"), list) for i in g["params"] if isinstance(i, int))
        if listed != list(range(len(sub_groups))):  # each sub-group in one param group, as DeepSpeed saves them
            self._problem(LayoutError, optim_files[0][1], f"its param_groups list sub-groups {listed[:8]}, the model states have {len(sub_groups)}")
            return None
        layout = zero3_layout_of_sub_groups(sub_groups, world, sub_group_param_groups(inner[0], len(sub_groups)))
        flat: dict[int, list[TensorRef]] = {}
        self.ds_ids = ds_ids
        for rank in range(world):
            refs = list(inner[rank][N.FP32_FLAT_GROUPS])
            self.saved_flat[rank] = refs
            if len(refs) != len(layout.flat_groups):
                self._problem(LayoutError, optim_files[rank][1], f"holds {len(refs)} fp32 sub-groups, the model states list {len(layout.flat_groups)}")
                return None
            if self.result.offload == "nvme" and any(r.numel == 0 for r in refs):
                refs = self._swapped_flat_groups(rank, refs, layout, ds_ids, optim_files[rank][1])
                if refs is None:
                    return None
            for index, (ref, group) in enumerate(zip(refs, layout.flat_groups)):
                if ref.numel != group.partition:
                    held, needed = sum(r.numel for r in refs), sum(g.partition for g in layout.flat_groups)
                    self._problem(LayoutError, optim_files[rank][1], f"holds {held} fp32 elements, the params need {needed} per rank (sub-group {index}: {ref.numel} for {group.partition}): truncated or mixed files")
                    return None
            flat[rank] = refs
        return self._param_entries(layout, flat)

    def _param_entries(self, layout: ZeroLayout, flat: dict[int, list[TensorRef]]) -> list[Entry] | None:
        """One entry per trainable param: its pieces, read from each rank's flat fp32 tensors."""
        odd = sorted({ref.path for refs in flat.values() for ref in refs if not (ref.is_contiguous and len(ref.shape) == 1)})
        for path in odd:  # byte offsets below assume one flat run of elements
            self._problem(CorruptFileError, path, "fp32 partition is not a flat contiguous tensor")
        if odd:
            return None
        self.layout, self.flat_refs = layout, flat
        entries = []
        for param, pieces in zip(layout.params, layout.by_param()):
            segments = tuple(_segment(flat[p.rank][p.flat], p.flat_offset, p.length) for p in pieces)
            shape = self.shapes[param.name]
            entries.append(Entry(param.name, "param", TensorSource(flat[0][0].dtype if flat[0] else FP32, shape, segments)))
        return entries

    def _swapped_flat_groups(self, rank: int, refs: list[TensorRef], layout: ZeroLayout, ds_ids: dict[str, int], optim_path: str) -> list[TensorRef] | None:
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
            self.result.notes.append(f"rank {rank}: fp32 masters of {swapped_count} sub-group(s) read from NVMe swap files")
        return located

    def _swap_path(self, rank: int, index: int, ref: TensorRef, layout: ZeroLayout, group: FlatGroup, ds_ids: dict[str, int], optim_path: str, state: str | None = None) -> str | None:
        """The swap file of one swapped sub-group (fp32 masters, or an optimizer `state`),
        checked to exist and to hold the sub-group's partition."""
        first, last = layout.params[group.params[0]].name, layout.params[group.params[-1]].name
        name = _swap_name(ref, ds_ids.get(first), ds_ids.get(last), state, optim_path)
        what = f"sub-group {index}'s {state or 'fp32 masters'}"
        if name is None:
            self._problem(LayoutError, optim_path, f"cannot name the swap file of {what}: no ds_id recorded and its params are not in the module state dict")
            return None
        if self.swap_folder is not None:
            return self._live_swap_path(rank, index, name, group.partition, what)
        path = os.path.join(self.tag_dir, N.OFFLOADED_TENSORS_DIR, N.offloaded_rank_dir(rank), name)
        if not regular_file_inside(path, self.tag_dir):  # raw bytes, no format: never through a link out
            self._problem(CheckpointNotFoundError, path, f"missing: {what} were offloaded to NVMe and belong here")
            return None
        needed = group.partition * ref.dtype.itemsize
        if os.path.getsize(path) < needed:
            self._problem(CorruptFileError, path, f"truncated: holds {os.path.getsize(path)} bytes, {what} need {needed}")
            return None
        return path


    def _live_swap_path(self, rank: int, index: int, name: str, numel: int, what: str) -> str | None:
        """The file of a swapped sub-group in the live swap folder, checked to hold exactly the
        partition (padded to the I/O alignment)."""
        assert self.swap_folder is not None
        path = self.swap_folder.optimizer_path(rank, name)
        if not regular_file_inside(path, self.swap_folder.root):
            held = sorted({f.swap_id for f in self.swap_folder.of_kind("sub_group") if f.rank == rank and f.swap_id})
            other = f" (it holds sub-groups {', '.join(held[:6])}: the swap folder of another run or layout)" if held and name[: -len(N.SWAP_SUFFIX)].rsplit("-", 1)[-1] not in held else ""
            self._problem(CheckpointNotFoundError, path, f"missing: the checkpoint's layout swaps {what} to NVMe, so the swap folder must hold it{other}")
            return None
        # a swap folder is read only for a ZeRO-3 run offloading to NVMe, whose aio settings were read
        problem = swap.size_problem(os.path.getsize(path), numel, SwapRule(self.run_config.aio or Aio()))
        if problem is not None:
            self._problem(CorruptFileError if problem.startswith("truncated") else LayoutError, path, f"{what}: {problem}")
            return None
        self.swap_claimed.add(path)
        self.swap_ids[index] = name[: -len(N.SWAP_SUFFIX)].rsplit("-", 1)[-1]
        return path


def _sound(state: Any, key: str, schema: Schema) -> bool:
    """A readable state dict holding `key`, with every key of `schema` as DeepSpeed writes it."""
    return isinstance(state, dict) and state.get(key) is not None and not schema_problems(state, schema)


def _segment(ref: TensorRef, start: int, length: int) -> Segment:
    if not ref.is_contiguous or len(ref.shape) != 1:
        raise CorruptFileError(ref.path, "fp32 partition is not a flat contiguous tensor")
    return Segment(ref.path, ref.offset + start * ref.dtype.itemsize, length)


def _truncate(segments: list[Segment], numel: int) -> list[Segment]:
    """The first `numel` elements of a run of segments (drops ZeRO-3 padding)."""
    kept: list[Segment] = []
    remaining = numel
    for segment in segments:
        if remaining <= 0:
            break
        take = min(segment.numel, remaining)
        kept.append(Segment(segment.path, segment.offset, take))
        remaining -= take
    if remaining:
        raise LayoutError(segments[0].path if segments else None, f"only {numel - remaining} of {numel} elements available")
    return kept


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


def _ds_ids(model0: dict) -> dict[str, int]:
    """DeepSpeed's param ids: params numbered in module order, each tied param once and frozen
    params included (the order of model.parameters(), which is the state dict's order less
    buffers and aliases; checked against a real run, see sample_ckpts/FORMAT_OBSERVED.md)."""
    skip = set(model0.get(N.BUFFER_NAMES) or []) | set(model0.get(N.SHARED_PARAMS) or {})
    params = [name for name in model0.get(N.MODULE) or {} if name not in skip]
    return {name: index for index, name in enumerate(params)}


def _first_step(reader: FileReader, inner: dict) -> Any:
    """The Adam step of the first param (group) with state, or None."""
    for key in (N.BASE_OPTIMIZER_STATE, N.OPTIMIZER_STATE_DICT):
        state = inner.get(key)
        if isinstance(state, dict) and isinstance(state.get("state"), dict):
            for per_param in state["state"].values():
                if isinstance(per_param, dict) and "step" in per_param:
                    step = per_param["step"]
                    if isinstance(step, TensorRef):
                        if step.numel != 1:
                            return None
                        return read_scalar(reader, source_of(step))
                    return step
        if isinstance(state, list):  # ZeRO-1/2 elastic layout: one state dict per group
            for group in state:
                if isinstance(group, dict) and "step" in group:
                    step = group["step"]
                    return read_scalar(reader, source_of(step)) if isinstance(step, TensorRef) and step.numel == 1 else step
    return None
