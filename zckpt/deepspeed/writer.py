"""Lay a TrainingState out as DeepSpeed would have saved it, for any world size and ZeRO stage.

:func:`plan_target` settles what the loading run will look like (stage, world size, the layout
settings of its config); :func:`plan_checkpoint` turns the state into the object tree of every
file (model_states, optim_states), with each tensor described as parts of source files. Both
are pure: no tensor byte is read. :mod:`zckpt.deepspeed.save` then streams the bytes.

The trees follow DeepSpeed's own ``state_dict()`` methods (``stage_1_and_2.py``, ``stage3.py``,
``bf16_optimizer.py``, ``engine._save_checkpoint``) key for key, in the format of the release
that wrote the input (0.14: no ``param_alignment_paddings``, ``sparse_tensor_module_names``).
Padding elements are zeros, so the same input always gives the same bytes.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, Callable

from ..core.dtypes import BF16, BY_SHORT, FP32, DType
from ..core.errors import LayoutError, UsageError
from ..core.index import Segment, TensorRef, TensorSource, slice_segments
from ..core.state import ScalarState, TrainingState
from ..core.topology import RankCoords, Topology
from ..torchfile.reader import PickledEnumMember, PickledObject, TorchDevice, TorchSize, global_name
from ..torchfile.save import Copy, GlobalName, OutTensor, PickledEnum, PickledInstance, PickledReduce, Zeros, torch_size
from . import muon
from . import names as N
from .elastic import (
    BASE_OPTIMIZER_STATE_STEP,
    elastic_base_state,
    elastic_input,
    elastic_output,
    missing_hyperparameters,
)
from .engine_config import static_loss_scaler
from .layout import (
    LayoutParam,
    ZeroLayout,
    parameter_alignment_paddings,
    round_robin_order,
    zero3_layout,
    zero12_layout,
)
from .optim_state import slice_mapping_layout
from .partition import zero3_partition
from .run_config import CPU, NVME, OFFLOAD_OPTIMIZER_DEVICE_KEY, STAGE_KEY, read_run_config
from .swap_rules import SwapRule

UINT8 = BY_SHORT["uint8"]  # a file copied as its bytes
ZERO_STAGE_ENUM = GlobalName("deepspeed.runtime.zero.config", "ZeroStageEnum")
FRAGMENT_ADDRESS = GlobalName("deepspeed.utils.tensor_fragment", "fragment_address")


@dataclass(frozen=True)
class Target:
    """The run that will load the checkpoint: what its layout depends on."""

    stage: int
    world_size: int
    ds_config: dict[str, Any]
    dtype: DType  # training dtype
    round_robin: bool
    parameter_alignment: bool
    sub_group_size: int
    bf16_optimizer: bool  # DeepSpeed picks BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation)
    ds_version: str  # the release whose format is written
    nvme_offload: bool = False  # the run swaps optimizer state (or params) to NVMe
    # ZeRO-3 with the optimizer offloaded to NVMe: which sub-groups are swapped (they are saved
    # in offloaded_tensors/, not in the optim files); None when the optimizer is not swapped
    swap: SwapRule | None = None
    clip_grad: float | None = None  # gradient_clipping the ZeRO-1/2 files carry where the input's files hold none
    optimizer_offload: bool = False  # ZeRO-1/2 offloading the optimizer (cpu, or nvme read as cpu)

    @property
    def topology(self) -> Topology:
        """The ranks the files are planned for: data-parallel over world_size (zckpt writes no
        other layout)."""
        return Topology.data_parallel(self.world_size)


@dataclass(frozen=True)
class RawFile:
    """A file of raw little-endian tensor bytes, no header: an NVMe swap file."""

    tensor: OutTensor


@dataclass(frozen=True)
class PlannedFile:
    name: str  # file name inside the tag folder
    obj: Any  # the object tree torch.save would pickle, or a RawFile
    rank: int | None  # the data-parallel rank it belongs to (None: shared)


@dataclass(frozen=True)
class LazyFile:
    """A planned file whose object tree is built each time `obj` is read, by a pure function of
    the plan. A rank file's tree cuts every param (a piece per param and state): thousands of
    them held at once grow with the ranks, one at a time does not (the writer builds each when
    it writes it)."""

    name: str
    build: Callable[[], Any] = field(repr=False, compare=False)
    rank: int | None
    # files of one `alike` key (not None) pickle alike, their tensors of the same sizes: their
    # archives are as large where their names are as long, so one is planned for the size of all
    alike: Any = field(default=None, compare=False)

    @property
    def obj(self) -> Any:
        return self.build()


AnyPlannedFile = PlannedFile | LazyFile


def derived_file(planned: AnyPlannedFile, make: Callable[[Any], Any], name: str | None = None) -> AnyPlannedFile:
    """A file of `planned`'s rank holding ``make(planned.obj)`` (named `name`, default its own):
    built when read where `planned` is lazy, else now."""
    name = planned.name if name is None else name
    if isinstance(planned, LazyFile):
        return LazyFile(name, lambda: make(planned.obj), planned.rank)
    return PlannedFile(name, make(planned.obj), planned.rank)


@dataclass(frozen=True)
class CheckpointPlan:
    tag: str  # the folder the files go in
    target: Target
    layout: ZeroLayout
    files: tuple[AnyPlannedFile, ...]  # names relative to the tag folder ("zero/<param>/fp32.pt")
    latest_file: str = N.LATEST_FILE  # written last, naming the tag folder
    # folders made even when no file goes in them: a run offloading to NVMe copies
    # offloaded_tensors/rankRR/ back on load, and fails where it is missing
    folders: tuple[str, ...] = ()


def _merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def plan_target(
    state: TrainingState,
    world_size: int,
    stage: int | None = None,
    config: dict | None = None,
    config_path: str | None = None,
) -> Target:
    """The target run: the checkpoint's own config with the new stage, then `config` (the target
    run's ds_config, read from `config_path` if given) over it, read as DeepSpeed reads it.
    Raises UsageError for a value DeepSpeed refuses, a value zckpt cannot know that the layout
    depends on, or settings no loader can meet."""
    if not isinstance(world_size, int) or world_size < 1:
        raise UsageError(None, f"--world-size must be at least 1, got {world_size}")
    index = state.index
    given = read_run_config(config, config_path) if config is not None else None
    if stage is None and given is not None and given.stage_set:
        given.require(STAGE_KEY, config_path, "pass --stage")
        if given.stage not in (1, 2, 3):
            raise UsageError(
                config_path,
                f"{STAGE_KEY} reads as {given.stage} (ZeRO off): reshard writes ZeRO stage 1, 2 or 3 checkpoints; pass --stage",
            )
        stage = given.stage
    if stage is None and index.zero_stage == 0:
        raise UsageError(
            None,
            "a ZeRO-0 checkpoint: pass --stage 1, 2 or 3 (zckpt writes ZeRO files; DeepSpeed resumes ZeRO-0 files "
            "at any data-parallel size as they are)",
        )
    if stage is None:
        stage = index.zero_stage
    if stage not in (1, 2, 3):
        raise UsageError(None, f"--stage must be 1, 2 or 3, got {stage}")
    # only the stage changes: DeepSpeed ignores stage-3 settings (sub_group_size, offload_param)
    # at stages 1/2, and keeping them lets a later reshard back to ZeRO-3 rebuild the same layout
    merged = _merge(state.ds_config, config or {})
    zero = merged.get(N.CONFIG_ZERO)
    merged[N.CONFIG_ZERO] = {
        **(zero if isinstance(zero, dict) else {}),
        N.CONFIG_STAGE: stage,
    }  # true/false: the deprecated form
    # the target run's config: problems that appear only at the new stage are the options' doing
    run = read_run_config(
        merged, config_path if config is not None else index.tag_dir, saved=config is None, error=UsageError
    )
    if (
        stage == 3 or stage == 1 and index.dtype == BF16 and run.grad_accum_dtype == "fp32"
    ):  # swapping; BF16_Optimizer or not
        run.require(
            OFFLOAD_OPTIMIZER_DEVICE_KEY,
            config_path,
            "set it in --config (where the optimizer state lives decides the layout)",
        )
    clip = run.gradient_clipping
    if (
        stage < 3 and N.CLIP_GRAD not in state.optimizer_extras
    ):  # the ZeRO-1/2 files carry it and the loader restores it
        run.require(
            N.CONFIG_GRADIENT_CLIPPING,
            config_path,
            "set it in --config (the ZeRO-1/2 files carry it and DeepSpeed's loader restores it)",
        )
        clip = N.default_gradient_clipping(N.version_tuple(index.ds_version or "0.0.0")) if clip is None else clip
    return Target(
        stage=stage,
        world_size=world_size,
        ds_config=merged,
        dtype=index.dtype,
        round_robin=stage < 3 and run.round_robin_gradients,
        parameter_alignment=stage < 3 and run.parameter_alignment,
        sub_group_size=run.sub_group_size,
        bf16_optimizer=run.bf16_optimizer(index.dtype == BF16),
        ds_version=index.ds_version or "0.0.0",
        nvme_offload=run.device(N.CONFIG_OFFLOAD_OPTIMIZER) == NVME or run.device(N.CONFIG_OFFLOAD_PARAM) == NVME,
        swap=run.swap_rule,  # ZeRO-1/2 runs treat "nvme" as CPU offload: no swap rule
        clip_grad=clip,
        optimizer_offload=stage < 3 and run.device(N.CONFIG_OFFLOAD_OPTIMIZER) in (CPU, NVME),
    )


def target_layout(state: TrainingState, target: Target) -> ZeroLayout:
    """Where every param goes in the target run's flat partitions."""
    groups: list[list[LayoutParam]] = [[] for _ in state.groups]
    for param in state.params:
        groups[param.group].append(LayoutParam(param.name, math.prod(param.shape), param.group))
    if target.stage == 3:
        return zero3_layout(groups, target.world_size, target.sub_group_size)
    if target.round_robin and not target.bf16_optimizer:
        groups = [[group[i] for i in round_robin_order(len(group), target.world_size)] for group in groups]
    paddings = None
    if target.parameter_alignment and not target.bf16_optimizer:
        paddings = [parameter_alignment_paddings([p.numel for p in group], target.dtype.itemsize) for group in groups]
    return zero12_layout(
        groups,
        target.world_size,
        alignment_paddings=paddings,
        keep_group_padding=target.bf16_optimizer,
        stage=target.stage,
    )


def at_model_parallel_rank(
    planned: AnyPlannedFile, mp_rank: int, model_values: dict[str, Any] | Callable[[dict], dict[str, Any]]
) -> AnyPlannedFile:
    """A file this writer planned (named for model-parallel rank 0) as model-parallel rank
    `mp_rank` names it (a pipeline stage, a tensor rank); its model-states file (ZeRO-1/2's one,
    or each of ZeRO-3's per data rank) with `model_values` set, in the keys' places (a function:
    the values, of the file's object tree, computed when it is built)."""
    optim = N.OPTIM_STATES_RE.match(planned.name)
    if optim is not None:
        return replace(planned, name=N.optim_states_name(int(optim["dp"]), mp_rank, bool(optim["prefix"])))
    model = N.MODEL_STATES_RE.match(planned.name)
    assert model is not None, planned.name
    name = (
        N.model_states_name(1, 0, mp_rank) if model["dp"] is None else N.model_states_name(3, int(model["dp"]), mp_rank)
    )
    values = model_values if callable(model_values) else lambda _obj: model_values
    return derived_file(planned, lambda obj: {**obj, **values(obj)}, name)


def require_data_parallel(state: TrainingState, what: str) -> None:
    """The data-parallel writers refuse the state of another layout (a pipeline run's stages are
    written by :mod:`.pipeline_writer`), rather than write a checkpoint its engine could not load."""
    topology = state.index.topology
    if state.stages or not topology.data_parallel_only:
        raise LayoutError(
            state.index.tag_dir, f"{topology.describe()}: {what} of such checkpoints is not supported yet"
        )


def plan_checkpoint(state: TrainingState, target: Target, tag: str | None = None) -> CheckpointPlan:
    """Every file of the target checkpoint as an object tree (swap files as RawFiles); pure."""
    require_data_parallel(state, "reshard")
    layout = target_layout(state, target)
    optim = OptimPlanner(state, target, layout)
    ranks = list(target.topology.data_ranks())
    optim_files = [
        LazyFile(
            N.rank_optim_states_name(at, bf16=target.dtype == BF16), functools.partial(optim.file, at.data), at.data
        )
        for at in ranks
    ]
    swap_files = [f for at in ranks for f in optim.swap_files(at.data)]
    # DeepSpeed saves every rank's swap folder, empty where no sub-group is swapped
    folders = tuple(f"{N.OFFLOADED_TENSORS_DIR}/{N.offloaded_rank_dir(at.data)}" for at in ranks) if optim.swaps else ()
    files = tuple(plan_model_states(state, target, layout) + optim_files + swap_files)
    return CheckpointPlan(tag or state.index.source_tag, target, layout, files, folders=folders)


def plan_model_states(state: TrainingState, target: Target, layout: ZeroLayout) -> list[AnyPlannedFile]:
    """The model_states file(s) of the target run: one per rank for ZeRO-3 (each built when
    written), else one."""
    models = ModelPlanner(state, target, layout)
    if target.stage == 3:
        return [
            LazyFile(
                N.rank_model_states_name(3, at), functools.partial(models.file, at.data), at.data, models.alike(at.data)
            )
            for at in target.topology.data_ranks()
        ]
    return [PlannedFile(N.rank_model_states_name(target.stage, RankCoords()), models.file(None), None)]


# --- tensors -------------------------------------------------------------------------------------
def copied_file(path: str) -> RawFile:
    """A file of the input written again as its bytes (a pipeline layer file, an expert file)."""
    size = os.path.getsize(path)
    return RawFile(OutTensor(UINT8, (size,), (Copy(Segment(path, 0, size), UINT8),)))


def tensor_of(source: TensorSource, dtype: DType | None = None, shape: tuple[int, ...] | None = None) -> OutTensor:
    """A whole source as an output tensor, converted to `dtype` if given."""
    parts = tuple(Copy(s, source.dtype) for s in source.segments)
    return OutTensor(dtype or source.dtype, source.shape if shape is None else shape, parts)


def _flat(pieces: list, sources: list[TensorSource], numel: int, dtype: DType) -> OutTensor:
    """A rank's flat tensor of `numel` elements: the pieces at their offsets, zeros between."""
    parts: list = []
    position = 0
    for piece in pieces:
        if piece.flat_offset >= numel:
            break
        if piece.flat_offset > position:
            parts.append(Zeros(piece.flat_offset - position))
        source = sources[piece.param]
        length = min(piece.length, numel - piece.flat_offset)
        parts.extend(Copy(s, source.dtype) for s in slice_segments(source, piece.param_offset, length))
        position = piece.flat_offset + length
    if position < numel:
        parts.append(Zeros(numel - position))
    return OutTensor(dtype, (numel,), tuple(parts))


def carry(obj: Any) -> Any:
    """An object read by zckpt's unpickler, made writable again, so that torch.load reads back
    what it would have read from the input: tensors, read instances of any class (DeepSpeed's,
    Megatron's ``args``) with their state, enum members, class references, torch.Size and
    torch.device, numpy arrays, dtypes and scalars (pickled by numpy's own reduce)."""
    if isinstance(obj, TensorRef):
        from ..io.reading import source_of

        return tensor_of(source_of(obj))
    if isinstance(obj, PickledObject):
        return PickledInstance(
            GlobalName(obj.original_module, obj.original_name),
            carry(obj.pickle_state),
            carry(obj.pickle_args),
            carry(obj.pickle_kwargs) or None,
            carry(obj.pickle_list_items),
            [(carry(k), carry(v)) for k, v in obj.pickle_dict_items],
        )
    if (name := global_name(obj)) is not None:  # a class or function held by name, never called
        return GlobalName(*name)
    if isinstance(obj, PickledEnumMember):
        return PickledEnum(GlobalName(*obj.original_class.rsplit(".", 1)), obj.value)
    if isinstance(obj, IntEnum):
        return PickledEnum(ZERO_STAGE_ENUM, int(obj))
    if isinstance(obj, TorchSize):
        return torch_size(tuple(obj))
    if isinstance(obj, TorchDevice):
        return PickledReduce(GlobalName("torch", "device"), obj.args)
    if isinstance(obj, OrderedDict):
        out = OrderedDict((k, carry(v)) for k, v in obj.items())
        vars(out).update(carry(vars(obj)))  # a state_dict's _metadata
        return out
    if isinstance(obj, dict):
        return {k: carry(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [carry(v) for v in obj]
    if type(obj) in (tuple, set, frozenset):
        return type(obj)(carry(v) for v in obj)
    return obj


def scalar_of(scalar: ScalarState) -> Any:
    return tensor_of(scalar.tensor) if scalar.tensor is not None else scalar.value


# --- optim_states --------------------------------------------------------------------------------
class OptimPlanner:
    def __init__(self, state: TrainingState, target: Target, layout: ZeroLayout) -> None:
        self.state, self.target, self.layout = state, target, layout
        by_name = {p.name: p for p in state.params}
        self.params = [by_name[p.name] for p in layout.params]
        self.masters = [p.master for p in self.params]
        # per optimizer state, every param's source in layout order (built once, used per rank)
        self.state_sources = {key: [p.states.get(key, p.master) for p in self.params] for key in state.state_names}
        self.by_rank = layout.by_rank()
        self.version_at_least_018 = N.version_tuple(target.ds_version) >= (0, 18)
        # what param_slice_mappings describe: the stored layout, or (round-robin) DeepSpeed's own
        self.slice_mappings = slice_mapping_layout(layout, target.round_robin) if layout.stage != 3 else layout
        # ZeRO-3 sub-groups whose master and per-element states live in offloaded_tensors/
        swap = target.swap if layout.stage == 3 else None
        self.swaps = swap is not None
        self.swapped = frozenset(
            f for f, g in enumerate(layout.flat_groups) if swap is not None and swap.swapped(g.partition)
        )
        self.ds_ids = _ds_ids(state) if layout.stage == 3 else {}
        # an elastic_checkpoint input keeps no group hyperparameters: ZeRO-1/2 is written in its
        # layout, which holds none either (.elastic)
        self.elastic_in = elastic_input(state)
        self.elastic_out = self.elastic_in and elastic_output(target.ds_config, target.stage, target.bf16_optimizer)

    def file(self, rank: int) -> dict:
        inner = self._zero3(rank) if self.target.stage == 3 else self._zero12(rank)
        return {
            N.OPTIMIZER_STATE_DICT: inner,
            N.DS_CONFIG: carry(self.target.ds_config),
            N.DS_VERSION: self.target.ds_version,
        }

    def _element_states(self, flat: int) -> list[str]:
        """The per-element optimizer states of a flat group (exp_avg, ...), in saved key order."""
        group = self.layout.flat_groups[flat]
        saved = self.state.groups[group.param_group]
        keys = saved.state_keys or list(saved.scalars) + self.state.state_names
        return [k for k in keys if k not in saved.scalars and all(k in self.params[i].states for i in group.params)]

    def _torch_state(self, rank: int, universal: bool = False) -> dict:
        """The torch optimizer's state_dict over this rank's flat groups."""
        return {"state": self._flat_states(rank), "param_groups": self._param_groups(universal)}

    def _flat_states(self, rank: int, lean: bool = False) -> dict[int, dict]:
        """Each flat group's optimizer state on this rank; `lean`: each per-element state cut to
        the partition less its padding, as elastic_checkpoint saves it (.elastic)."""
        state: dict[int, dict] = {}
        for flat, group in enumerate(self.layout.flat_groups):
            saved = self.state.groups[group.param_group]
            pieces = self.by_rank.get((rank, flat), [])
            element_states = self._element_states(flat)
            entry: dict[str, Any] = {}
            for key in saved.state_keys or list(saved.scalars) + self.state.state_names:
                if key in saved.scalars:
                    entry[key] = scalar_of(saved.scalars[key])
                elif key in element_states and flat in self.swapped:
                    # swapped out: an emptied tensor that keeps the swapper's ds_id (names its file)
                    entry[key] = OutTensor(FP32, (0,), (), attributes={"ds_id": f"{key}-{self._sub_group_id(flat)}"})
                elif key in element_states and muon.whole_param_state(
                    saved.hyperparams,
                    key,
                    self.layout.stage,
                    muon.momentum_per_element(self.target.bf16_optimizer, self.target.optimizer_offload),
                ):
                    if buffer := self._whole_param_buffer(key, pieces):
                        entry[key] = buffer
                elif key in element_states:
                    sources = self.state_sources[key]
                    entry[key] = _flat(
                        pieces,
                        sources,
                        group.saved[rank] if lean else group.partition,
                        sources[group.params[0]].dtype if group.params else FP32,
                    )
            if entry:
                state[flat] = entry
        return state

    def _whole_param_buffer(self, key: str, pieces: list) -> OutTensor | None:
        """A rank's Muon momentum_buffer (ZeRO-1/2): the full state of every param its partition
        touches, end to end in flat order, in the state's dtype (:mod:`.muon`); None when the
        partition touches no param (DeepSpeed then creates none)."""
        touched = muon.touched(self.layout, pieces)
        if not touched:
            return None
        sources = [self.state_sources[key][param] for param, _ in touched]
        parts = tuple(Copy(s, source.dtype) for source in sources for s in source.segments)
        return OutTensor(sources[0].dtype, (sum(s.numel for s in sources),), parts)

    def _sub_group_ids(self, flat: int) -> tuple[int, int]:
        """The ds_ids of a ZeRO-3 sub-group's first and last params: they name it (``0_7``)."""
        group = self.layout.flat_groups[flat]
        return self.ds_ids[self.layout.params[group.params[0]].name], self.ds_ids[
            self.layout.params[group.params[-1]].name
        ]

    def _sub_group_id(self, flat: int) -> str:
        """A ZeRO-3 sub-group's ``ds_id`` attribute (``0_7``)."""
        return "{}_{}".format(*self._sub_group_ids(flat))

    def swap_files(self, rank: int) -> list[PlannedFile]:
        """This rank's NVMe swap files, as the engine copies its swap folder into
        ``offloaded_tensors/rankRR/``: per swapped sub-group the fp32 master and each
        per-element state, raw fp32 in the flat layout, zero-padded to the I/O alignment."""
        swap = self.target.swap
        files = []
        for flat in sorted(self.swapped):
            assert swap is not None
            group = self.layout.flat_groups[flat]
            pieces = self.by_rank.get((rank, flat), [])
            length = swap.file_numel(group.partition)
            padding = (Zeros(length - group.partition),) if length > group.partition else ()
            folder = f"{N.OFFLOADED_TENSORS_DIR}/{N.offloaded_rank_dir(rank)}"
            for key, sources in [(None, self.masters)] + [
                (k, self.state_sources[k]) for k in self._element_states(flat)
            ]:
                raw = OutTensor(FP32, (length,), _flat(pieces, sources, group.partition, FP32).parts + padding)
                name = N.swap_file_name(
                    *self._sub_group_ids(flat), key, self.state.index.tag_dir
                )  # key: a name from the input
                files.append(PlannedFile(f"{folder}/{name}", RawFile(raw), rank))
        return files

    def _param_groups(self, universal: bool = False) -> list[dict]:
        """The torch optimizer's param groups: hyperparameters, and the flat groups as params.
        An elastic_checkpoint input whose config does not tell its groups' hyperparameters has
        each group's saved ``step`` only: a universal folder keeps just that, as DeepSpeed's
        universal loaders set only the keys a group holds (runtime/base_optimizer.py:377-380,
        zero/stage3.py:3685-3691) and the engine keeps the training script's groups; the other
        layouts that hold groups (ZeRO-3, rigid ZeRO-1/2) are refused (.elastic)."""
        if self.elastic_in and not universal:
            what = "a ZeRO-3 optimizer file" if self.target.stage == 3 else "a rigid ZeRO-1/2 optimizer file"
            refusal = missing_hyperparameters(self.state, what)
            if refusal is not None:
                raise refusal
        param_groups = []
        for g, saved in enumerate(self.state.groups):
            members = [f for f, group in enumerate(self.layout.flat_groups) if group.param_group == g]
            param_groups.append({**carry(saved.hyperparams), "params": members})
        return param_groups

    def _zero12(self, rank: int, universal: bool = False) -> dict:
        world = self.target.world_size
        fp32, paddings, mappings = [], [], []
        for flat, group in enumerate(self.layout.flat_groups):
            pieces = self.by_rank.get((rank, flat), [])
            fp32.append(_flat(pieces, self.masters, group.saved[rank], FP32))
            padding_start = sum(self.layout.params[i].numel for i in group.params) + sum(group.alignment_paddings)
            left = rank * group.partition
            paddings.append(max(0, min(group.partition, left + group.partition - max(padding_start, left))))
            mapping = OrderedDict()
            described = (
                self.slice_mappings.by_rank().get((rank, flat), [])
                if self.slice_mappings is not self.layout
                else pieces
            )
            for piece in sorted(described, key=lambda p: p.param):  # DeepSpeed lists them in param group order
                mapping[self.slice_mappings.params[piece.param].name] = PickledInstance(
                    FRAGMENT_ADDRESS, {"numel": piece.length, "start": piece.flat_offset}
                )
            mappings.append(mapping)
        extras = dict(self.state.optimizer_extras)
        if N.CLIP_GRAD not in extras:  # ZeRO-3 files keep none: the engine saves its configured value
            extras[N.CLIP_GRAD] = self.target.clip_grad
        count = [world] * len(self.layout.flat_groups)
        if self.target.bf16_optimizer:
            out: dict[str, Any] = {N.CLIP_GRAD: extras[N.CLIP_GRAD]}
            out.update(
                {
                    N.BASE_OPTIMIZER_STATE: self._torch_state(rank, universal),
                    N.SINGLE_PARTITION_OF_FP32_GROUPS: fp32,
                    N.GROUP_PADDINGS: paddings,
                    N.PARTITION_COUNT: count,
                    N.DS_VERSION: self.target.ds_version,
                    N.PARAM_SLICE_MAPPINGS: mappings,
                }
            )
            return out
        out = {N.LOSS_SCALER: self._loss_scaler()}
        for key in (N.DYNAMIC_LOSS_SCALE, N.OVERFLOW):
            out[key] = extras.get(key, False)
        out[N.CLIP_GRAD] = extras[N.CLIP_GRAD]
        if self.elastic_out:
            lean = self._flat_states(rank, lean=True)
            out.update(
                elastic_base_state(
                    [lean.get(f, {}) for f in range(len(self.layout.flat_groups))],
                    [g.hyperparams for g in self.state.groups],
                )
            )
        else:
            out[N.BASE_OPTIMIZER_STATE] = self._torch_state(rank, universal)
        out[N.SINGLE_PARTITION_OF_FP32_GROUPS] = fp32
        out[N.ZERO_STAGE] = PickledEnum(ZERO_STAGE_ENUM, self.target.stage)
        out[N.GROUP_PADDINGS] = paddings
        if self.version_at_least_018:
            out[N.PARAM_ALIGNMENT_PADDINGS] = [list(g.alignment_paddings) for g in self.layout.flat_groups]
        out[N.PARTITION_COUNT] = count
        out[N.DS_VERSION] = self.target.ds_version
        out[N.PARAM_SLICE_MAPPINGS] = mappings
        return out

    def _zero3(self, rank: int, universal: bool = False) -> dict:
        extras = self.state.optimizer_extras
        fp32 = []
        for flat, group in enumerate(self.layout.flat_groups):
            # swapped to NVMe: saved empty (the master is in offloaded_tensors/)
            tensor = (
                _flat(self.by_rank.get((rank, flat), []), self.masters, group.partition, FP32)
                if flat not in self.swapped
                else OutTensor(FP32, (0,), ())
            )
            # saved as the optimizer's own flat params: requires_grad set, ds_id naming the sub-group
            fp32.append(
                OutTensor(
                    tensor.dtype,
                    tensor.shape,
                    tensor.parts,
                    attributes={"ds_id": self._sub_group_id(flat)},
                    requires_grad=True,
                )
            )
        return {
            N.ZERO_STAGE: PickledEnum(ZERO_STAGE_ENUM, 3),
            N.LOSS_SCALER: self._loss_scaler(),
            N.DYNAMIC_LOSS_SCALE: extras.get(N.DYNAMIC_LOSS_SCALE, False),
            N.OVERFLOW: extras.get(N.OVERFLOW, False),
            N.PARTITION_COUNT: self.target.world_size,
            N.OPTIMIZER_STATE_DICT: self._torch_state(rank, universal),
            N.FP32_FLAT_GROUPS: fp32,
        }

    def universal_state(self) -> dict:
        """``zero/optimizer_state.pt`` of a universal checkpoint: rank 0's optimizer file without
        its partitions, plus the param groups, as ``ds_to_universal`` writes it. For ZeRO-3 the
        torch state keeps only the per-group scalars (``step``, which the loader reads); rank 0's
        partitions, which ds_to_universal also copies in, are left out."""
        param_groups = self._param_groups(universal=True)
        if self.target.stage == 3:
            out = self._zero3(0, universal=True)
            del out[N.FP32_FLAT_GROUPS]
            out[N.OPTIMIZER_STATE_DICT] = {"state": self._scalar_state(), "param_groups": param_groups}
        else:
            dropped = (
                N.BASE_OPTIMIZER_STATE,
                BASE_OPTIMIZER_STATE_STEP,
                N.PARAM_SLICE_MAPPINGS,
                N.SINGLE_PARTITION_OF_FP32_GROUPS,
            )
            out = {k: v for k, v in self._zero12(0, universal=True).items() if k not in dropped}
            # scalar states beside the step (NAdam's mu_product) have no file in this flavour and
            # DeepSpeed's loader restores none (ops/universal says so first); kept here, in the
            # ZeRO-3 flavour's place, so that zckpt reading the folder keeps them
            others = {
                flat: {k: v for k, v in scalars.items() if k != N.UNIVERSAL_STEP}
                for flat, scalars in self._scalar_state().items()
            }
            if any(others.values()):
                out[N.OPTIMIZER_STATE_DICT] = {"state": {flat: v for flat, v in others.items() if v}}
        out[N.PARAM_GROUPS] = param_groups
        return out

    def _scalar_state(self) -> dict:
        """Each flat group's scalar states (``step``), in the saved key order."""
        state = {}
        for flat, group in enumerate(self.layout.flat_groups):
            saved = self.state.groups[group.param_group]
            keys = [k for k in saved.state_keys or list(saved.scalars) if k in saved.scalars]
            if keys:
                state[flat] = {k: scalar_of(saved.scalars[k]) for k in keys}
        return state

    def _loss_scaler(self) -> Any:
        if self.state.loss_scaler is not None:
            return carry(self.state.loss_scaler)
        # BF16_Optimizer files keep no scaler; bf16 and fp32 runs use a static scale of 1
        return static_loss_scaler()


# --- model_states --------------------------------------------------------------------------------
class ModelPlanner:
    def __init__(self, state: TrainingState, target: Target, layout: ZeroLayout) -> None:
        self.state, self.target, self.layout = state, target, layout
        index = state.index
        self.entries = {e.name: e for e in index.entries}
        self.trainable = [p.name for p in state.params]
        self.frozen = [e.name for e in index.entries if e.kind == "frozen"]
        self.tied = {e.name: e.alias_of for e in index.entries if e.kind == "tied"}
        self.template = self._template()

    def _template(self) -> dict:
        """Tensors shared by every rank's model_states, built once (one object per name, so a
        tied alias pickles as a reference to its source's tensor, as in DeepSpeed's files)."""
        index = self.state.index
        module: dict[str, OutTensor] = OrderedDict()
        sources: dict[str, OutTensor] = {}
        params = set(self.trainable) | set(self.frozen)
        # the 16-bit copies the input saved (ZeRO-1/2 module weights): carried as saved rather than
        # recomputed. They are the masters rounded in DeepSpeed's optimizers (verify checks it),
        # but not under ZenFlow, whose saved weights are the live engine's
        saved = {copy.name: copy.source for copy, _ in index.rounded_copies}
        for name in self.state.module_names:
            origin = self.tied.get(name, name)
            if origin in sources:
                module[name] = sources[origin]
                continue
            entry = self.entries.get(origin)
            if entry is None:
                continue
            # the dtype the module held it in (a LoRA run keeps fp32 adapters beside a bf16 base)
            dtype = BY_SHORT.get(self.state.module_dtype_names.get(origin, ""), index.dtype)
            if origin in params and self.target.stage == 3:
                tensor = OutTensor(dtype, (0,), ())  # ZeRO-3 saves empty placeholders for params
            elif origin in saved and saved[origin].dtype == dtype and saved[origin].shape == entry.source.shape:
                tensor = tensor_of(saved[origin])
            elif origin in params:
                tensor = tensor_of(entry.source, dtype=dtype)  # 16-bit weights = the masters rounded
            else:  # a buffer
                tensor = tensor_of(entry.source)
            sources[origin] = module[name] = tensor
        self.module = module
        return module

    @property
    def _frozen_recorded(self) -> bool:
        """Whether the files record frozen params, as DeepSpeed's do at ZeRO-2/3 (``save_frozen_param``
        in engine._save_checkpoint). Not where the input recorded none and the files hold none
        (saved with exclude_frozen_parameters): an empty record would make DeepSpeed's load look up
        every frozen param of the model in it (load_module_state_dict: KeyError); None keeps the
        model's own, as the run's own files do."""
        return self.target.stage != 1 and (bool(self.frozen) or self.state.frozen_recorded)

    def _frozen_fragments(self, rank: int | None) -> Any:
        stage = self.target.stage
        if not self._frozen_recorded:
            return None
        fragments = OrderedDict()
        for name in self.frozen:
            entry = self.entries[name]
            if stage == 2:
                fragments[name] = self.module.get(name) or tensor_of(entry.source, dtype=self.state.index.dtype)
                continue
            assert rank is not None
            numel = entry.source.numel
            share = zero3_partition(numel, self.target.world_size)[0]
            start = min(numel, rank * share)
            length = max(0, min(share, numel - start))
            parts = tuple(Copy(s, entry.source.dtype) for s in slice_segments(entry.source, start, length))
            if length < share:
                parts += (Zeros(share - length),)
            fragments[name] = OutTensor(
                self.state.index.dtype if entry.source.dtype.is_floating else entry.source.dtype, (share,), parts
            )
        return fragments

    def _param_shapes(self) -> list:
        return [
            OrderedDict(
                (self.layout.params[i].name, torch_size(self.entries[self.layout.params[i].name].source.shape))
                for i in group.params
            )
            for group in self.layout.flat_groups
        ]

    def alike(self, rank: int) -> object | None:
        """A ZeRO-3 rank file's `alike` key (:class:`LazyFile`): the files of ranks other than 0
        that keep no buffers of their own differ in what their frozen fragments' bytes are, not in
        their pickles or sizes (rank 0's alone lists the tied params)."""
        own = self.state.rank_buffers[rank] if rank < len(self.state.rank_buffers) else {}
        return None if rank == 0 or own else self

    def _module(self, rank: int | None) -> dict:
        """The module state dict; a ZeRO-3 rank gets the buffers that rank had (if it existed)."""
        own = self.state.rank_buffers[rank] if rank is not None and rank < len(self.state.rank_buffers) else {}
        if not own or rank == 0:
            return self.module
        return OrderedDict((n, tensor_of(own[n]) if n in own else t) for n, t in self.module.items())

    def file(self, rank: int | None) -> dict:
        state = self.state
        values: dict[str, Any] = {
            N.MODULE: self._module(rank),
            N.PARAM_SHAPES: self._param_shapes(),
            N.FROZEN_PARAM_SHAPES: OrderedDict((n, torch_size(self.entries[n].source.shape)) for n in self.frozen)
            if self._frozen_recorded
            else None,
            N.FROZEN_PARAM_FRAGMENTS: self._frozen_fragments(rank),
            N.LR_SCHEDULER: carry(state.lr_scheduler),
            N.SKIPPED_STEPS: state.skipped_steps,
            N.GLOBAL_STEPS: state.global_steps,
            N.GLOBAL_SAMPLES: state.global_samples,
            N.DP_WORLD_SIZE: self.target.world_size,
            N.MP_WORLD_SIZE: 1,
            N.DS_CONFIG: carry(self.target.ds_config),
            N.DS_VERSION: self.target.ds_version,
        }
        out: dict[str, Any] = {}
        for key in _model_state_keys(self.target.ds_version):
            if key in values:
                out[key] = values[key]
            elif key == N.BUFFER_NAMES:
                out[key] = [e.name for e in state.index.entries if e.kind == "buffer"]
            elif key == N.SHARED_PARAMS:  # engine._get_shared_params fills it on global rank 0 only
                out[key] = dict(self.tied) if not rank else {}
            elif key in state.engine_extras:
                out[key] = carry(state.engine_extras[key])
            else:
                out[key] = _default_engine_value(key)
        for key in LATE_ENGINE_KEYS:  # a mixture-of-experts or AutoTP run's, saved after the common ones
            if key in state.engine_extras:
                out[key] = carry(state.engine_extras[key])
        out.update(carry(state.client_state))
        return out


# engine keys some runs add after the common ones (engine._save_moe_checkpoint, _save_checkpoint)
LATE_ENGINE_KEYS = (N.NUM_EXPERTS, N.UNIVERSAL_CHECKPOINT_INFO, N.DS_AUTOEP_LAYERS)


def _model_state_keys(version: str) -> tuple[str, ...]:
    """engine._save_checkpoint's keys in its order (a release-dependent one in the middle)."""
    middle = (N.SPARSE_TENSOR_MODULE_NAMES,) if N.version_tuple(version) < (0, 15) else ()
    late = (N.CHECKPOINT_PARALLEL_DIMENSIONS,) if N.version_tuple(version) >= (0, 15) else ()
    return (
        N.MODULE,
        N.BUFFER_NAMES,
        N.OPTIMIZER,
        N.PARAM_SHAPES,
        N.FROZEN_PARAM_SHAPES,
        N.SHARED_PARAMS,
        N.FROZEN_PARAM_FRAGMENTS,
        N.LR_SCHEDULER,
        N.DATA_SAMPLER,
        N.RANDOM_LTD,
        *middle,
        N.SKIPPED_STEPS,
        N.GLOBAL_STEPS,
        N.GLOBAL_SAMPLES,
        N.DP_WORLD_SIZE,
        N.MP_WORLD_SIZE,
        *late,
        N.DS_CONFIG,
        N.DS_VERSION,
    )


def _default_engine_value(key: str) -> Any:
    if key == N.SPARSE_TENSOR_MODULE_NAMES:
        return set()
    if key == N.CHECKPOINT_PARALLEL_DIMENSIONS:
        return {"pp_degree": 1, "tp_degree": 1}
    return None


def _ds_ids(state: TrainingState) -> dict[str, int]:
    """DeepSpeed's param ids: params numbered in module order, each tied param once."""
    skip = {e.name for e in state.index.entries if e.kind in ("buffer", "tied")}
    return {name: i for i, name in enumerate(n for n in state.module_names if n not in skip)}
