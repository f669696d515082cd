"""Pipeline-parallel checkpoints (DeepSpeed's ``PipelineModule``, ZeRO-0/1): read as one model.

What such a run saves (DeepSpeed 0.19.8, see ``sample_ckpts/FORMAT_OBSERVED.md``):

* per stage, ``mp_rank_{stage:02d}_model_states.pt`` with ``module=None``: the stage's trainable
  param names and shapes (``<layer>.<name>``, ``tied_modules.<key>.<name>``), its buffer names,
  the counters, ``checkpoint_parallel_dimensions`` ({pp_degree, tp_degree});
* per stage and data rank, its ZeRO-1 optimizer file: each stage is its own ZeRO partitioning
  over its own data-parallel group (the arithmetic zckpt already has, applied per stage);
* per layer, ``layer_{index:02d}-model_states.pt``: the layer's own ``state_dict()`` (local
  names): the only place frozen params and buffers are. A tied layer's file holds the tied
  module's state (``weight``, not ``0.weight``); a function layer has none.

:func:`read_pipeline` rebuilds each stage's module state dict from its layer files, reads each
stage with the data-parallel reader (:func:`~.dp_reader.read_ranks`), then merges the stages
under the names the model's ``state_dict()`` has when built as one stage: ``tied_modules.*``
first, then the layers in order. A tied param that several stages hold is written once; the
other stages' copies that DeepSpeed keeps in step (:func:`_copies_out_of_step`) are kept as
``replicas`` for verify, which checks them equal.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..core.errors import CheckpointNotFoundError, CorruptFileError, LayoutError, ZckptError
from ..core.index import CheckpointIndex, Entry, TensorRef, merged_index
from ..core.state import ParamState, PipelineStage, TrainingState
from ..core.topology import Topology
from ..io.materialize import all_zero
from ..io.reading import FileReader, read_range
from . import names as N
from .dp_reader import read_ranks
from .rank_files import RankFiles, load
from .survey import Survey
from .tensor_parallel import merge_rules_label, read_tensor_parallel
from .zero0 import name_optimizer_params, normalized_optimizer, optimizer_params

TIED_PREFIX = "tied_modules."


@dataclass(frozen=True)
class StageDeclaration:
    """What a stage's model-states file names: its trainable params and its buffers."""

    stage: int
    path: str
    trainable: tuple[str, ...]
    buffers: tuple[str, ...]

    @property
    def names(self) -> set[str]:
        return set(self.trainable) | set(self.buffers)

    @property
    def layers(self) -> set[int]:
        """The indices of the (untied) layers whose names the stage lists."""
        return {layer for name in self.names if (layer := N.layer_of(name)) is not None}


@dataclass(frozen=True)
class LayerFile:
    """One layer's saved state: its global index, its file and its tensors under global names."""

    index: int
    path: str
    tensors: dict[str, TensorRef]  # global name -> tensor, in the file's order
    stage: int
    local_names: tuple[str, ...] = ()  # the file's own names of `tensors`, in order


def read_pipeline(result: Survey, files: RankFiles, tp_rules: dict[str, Any] | None = None) -> None:
    """Read a pipeline-parallel tag folder into `result`: each stage as the data-parallel ZeRO
    checkpoint it is (with tensor ranks, the tensor-parallel one, merged by `tp_rules` where
    given), merged into one index and one training state."""
    location = result.location
    assert location is not None
    layer_states: dict[str, Any] = {}  # a ZeRO-0 run's layer files, read to name its params, then for their tensors
    declarations = _declarations(result, files, layer_states)
    if declarations is None:
        return
    stages = len(declarations)
    tp = files.layer_tensor_ranks
    by_tensor = [_layer_files(result, files, declarations, t, layer_states) for t in range(tp)]
    if any(layers is None for layers in by_tensor):
        return
    layers = by_tensor[0]
    assert layers is not None
    surveys: list[Survey] = []
    for stage in range(stages):
        modules = [
            {name: ref for layer in tensor_layers if layer.stage == stage for name, ref in layer.tensors.items()}
            for tensor_layers in by_tensor
            if tensor_layers is not None
        ]
        sub = Survey(result.path, location=location)
        if tp == 1:
            read_ranks(sub, files.stage(stage), modules={None: modules[0]}, mp_world=stages)
        else:  # each stage a tensor-parallel checkpoint of its layers
            read_tensor_parallel(sub, files.stage(stage), modules=modules, mp_world=stages * tp, tp_rules=tp_rules)
        surveys.append(sub)
    first = surveys[0]
    layer_paths = (layer.path for tensor_layers in by_tensor if tensor_layers for layer in tensor_layers)
    # the stages' notes, less where frozen params came from and how tensor ranks merged (said below, for all)
    whole = result.take_parts(
        surveys, layer_paths, lambda n: "frozen params read from" not in n and not n.startswith("tensor-parallel (")
    )
    result.declared = [d for sub in surveys for d in sub.declared]
    result.declared_dtypes = {k: v for sub in surveys for k, v in sub.declared_dtypes.items()}
    dp_sizes = {sub.world_size for sub in surveys}
    result.world_size = stages * first.world_size if first.world_size else None
    if not whole:
        return
    if len(dp_sizes) > 1:
        odd = next(s for s, sub in enumerate(surveys) if sub.world_size != first.world_size)
        result.add(
            LayoutError,
            declarations[odd].path,
            f"stage {odd} has {surveys[odd].world_size} data-parallel ranks, stage 0 {first.world_size}: "
            "files of different runs are mixed",
        )
        return
    _check_counters(result, declarations, surveys)
    if result.problems:
        return
    assert first.index is not None
    dp = first.index.topology.dp
    order = _module_order(declarations, layers)
    stage_states = [sub.state for sub in surveys if sub.state is not None]
    try:
        idle, own = _copies_out_of_step(stage_states)
    except ZckptError as exc:  # a moment unreadable, or failing its file's CRC-32
        result.problems.append(exc)
        return
    unused = {name: idle.get(name, set()) | own.get(name, set()) for name in {*idle, *own}}
    entries, replicas = merged_entries([sub.index.entries for sub in surveys if sub.index is not None], order, unused)
    for held, why in (
        (idle, "never received a gradient in stage(s) {stages} (every optimizer moment zero)"),
        (
            own,
            "were trained on their own in stage(s) {stages} (optimizer moments not the kept copy's, as coupled "
            "weight decay gives a copy no gradient reaches)",
        ),
    ):
        if held:
            names = sorted(held, key=lambda n: order.get(n, len(order)))
            stages_of = ", ".join(map(str, sorted({s for stages in held.values() for s in stages})))
            result.notes.append(
                f"{len(names)} param(s) of a tied module ({', '.join(names[:3])}{', ...' * (len(names) > 3)}) "
                + why.format(stages=stages_of)
                + ": DeepSpeed keeps only a tied module's tied_weight_attr params in step between stages, so those "
                "copies are not compared; the copy of the first stage that trained them is the model's"
            )
    megatron = first.state is not None and bool(first.state.tensor_merge_rules)
    tensors = f" x {tp} tensor ranks ({merge_rules_label(megatron, tp_rules is not None)})" if tp > 1 else ""
    result.notes.append(
        f"pipeline-parallel: {stages} stage{'s' * (stages != 1)}{tensors} x {dp} data-parallel rank{'s' * (dp != 1)}, "
        f"{len(layers) * tp} layer files (frozen params and buffers read from them)"
        + (
            f"; {len({r.name for r in replicas})} tied param(s) held by several stages, written once"
            if replicas
            else ""
        )
    )
    replicas += [  # the tensor ranks' copies, less those of a stage's copy out of step
        r
        for stage, sub in enumerate(surveys)
        if sub.index is not None
        for r in sub.index.replicas
        if stage not in unused.get(r.name, ())
    ]
    index0 = first.index
    assert index0 is not None
    result.index = merged_index(
        index0,
        Topology(pp=stages, tp=tp, dp=dp),
        entries,
        tuple(result.files),
        tuple(result.notes),
        replicas,
        _stage_placements([sub.index for sub in surveys if sub.index is not None]),
        [pair for sub in surveys if sub.index is not None for pair in sub.index.rounded_copies],
    )
    try:
        result.state = _merged_state(
            result.index, stage_states, order, declarations, [t for t in by_tensor if t is not None], unused
        )
    except LayoutError as exc:
        result.problems.append(exc)
        result.index = None


def _declarations(result: Survey, files: RankFiles, layer_states: dict[str, Any]) -> list[StageDeclaration] | None:
    """Each stage's model-states file read for its names; every stage of the run there."""
    tag_dir = files.tag_dir
    heads: dict[int, tuple[str, dict]] = {}
    for stage in files.stages:
        model = files.stage(stage).tensor_rank(0).model  # a stage's names: its tensor ranks name alike
        if None not in model:
            result.add(
                CheckpointNotFoundError,
                os.path.join(tag_dir, N.model_states_name(1, 0, stage)),
                f"missing (the model states of pipeline stage {stage})",
            )
            continue
        state = load(result, model[None])
        if state is None:
            continue
        zero0 = isinstance(state, dict) and state.get(N.PARAM_SHAPES) is None
        if zero0 and normalized_optimizer(state.get(N.OPTIMIZER)) is None:
            result.add(
                LayoutError,
                model[None],
                "a ZeRO-0 pipeline stage without an optimizer state zckpt reads (a fused FP16_Optimizer's flat "
                "groups, or none)",
            )
            continue
        if not zero0 and (not isinstance(state, dict) or not isinstance(state.get(N.PARAM_SHAPES), (list, dict))):
            result.add(CorruptFileError, model[None], "not a DeepSpeed model-states file (no 'param_shapes')")
            continue
        heads[stage] = (model[None], state)
    if result.problems:
        return None
    if not heads:
        result.add(CheckpointNotFoundError, tag_dir, "no mp_rank_*_model_states.pt file in the tag folder")
        return None
    declared_stages = {_stage_count(state) for _, state in heads.values()} - {None}
    stages = max([*declared_stages, max(heads) + 1])
    for stage in range(stages):
        if stage not in heads:
            result.add(
                CheckpointNotFoundError,
                os.path.join(tag_dir, N.model_states_name(1, 0, stage)),
                f"missing (pipeline stage {stage} of {stages})",
            )
    if len(declared_stages) > 1:
        result.add(
            LayoutError, tag_dir, f"the stages' files record different pipeline degrees {sorted(declared_stages)}"
        )
    if result.problems:
        return None
    named: dict[int, list[str]] = {}
    if any(state.get(N.PARAM_SHAPES) is None for _, state in heads.values()):
        found = _zero0_trainable(result, files, heads, layer_states)
        if found is None:
            return None
        named = found
    declarations = []
    for stage in range(stages):
        path, state = heads[stage]
        if stage in named:
            trainable = tuple(named[stage])
        else:
            shapes = state[N.PARAM_SHAPES]
            groups = [shapes] if isinstance(shapes, dict) else shapes
            trainable = tuple(str(name) for group in groups if isinstance(group, dict) for name in group)
        buffers = tuple(str(name) for name in state.get(N.BUFFER_NAMES) or [])
        declarations.append(StageDeclaration(stage, path, trainable, buffers))
    return declarations


def _zero0_trainable(
    result: Survey, files: RankFiles, heads: dict[int, tuple[str, dict]], layer_states: dict[str, Any]
) -> dict[int, list[str]] | None:
    """A ZeRO-0 pipeline run's stages name no params: each stage's torch optimizer holds its
    params by index. Stages hold consecutive layers, so every way to cut the layer files into
    the stages is tried: a stage's optimizer must match its layers' params in module order (by
    shape, uniquely: :func:`~.zero0.name_optimizer_params`) and hold the layers of the buffers
    its file lists. The trainable names of each stage when exactly one cut fits (None, a problem
    listed, otherwise: a tied module, whose key no file records, fits none)."""
    tag_dir = files.tag_dir
    first_path = heads[min(heads)][0]
    if files.layer_tensor_ranks > 1 or any(state.get(N.PARAM_SHAPES) is not None for _, state in heads.values()):
        result.add(LayoutError, first_path, "a ZeRO-0 pipeline x tensor run, or stages of ZeRO-0 and ZeRO-1 runs mixed")
        return None
    layers: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for index, path in files.layers.items():
        state = load(result, path, layer_states)
        if not isinstance(state, dict) or not all(isinstance(v, TensorRef) for v in state.values()):
            if state is not None:
                result.add(CorruptFileError, path, "not a pipeline layer file (a state dict of tensors)")
            return None
        layers[index] = [(f"{index}.{name}", tuple(ref.shape)) for name, ref in state.items() if ref.numel]
    params: dict[int, tuple[list[int], dict[int, Any]]] = {}
    for stage, (path, state) in sorted(heads.items()):
        try:
            params[stage] = optimizer_params(normalized_optimizer(state[N.OPTIMIZER]), path)
        except ZckptError as exc:
            result.problems.append(exc)
            return None
    stages, order = len(heads), sorted(layers)
    buffers = {stage: {str(b) for b in state.get(N.BUFFER_NAMES) or []} for stage, (_, state) in heads.items()}
    fits: list[dict[int, list[str]]] = []
    for cuts in itertools.combinations(range(1, len(order)), stages - 1):
        runs = [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))]
        named: dict[int, list[str]] = {}
        for stage, run in enumerate(runs):
            held = set(run)
            if any((layer := N.layer_of(b)) is not None and layer not in held for b in buffers[stage]):
                break
            candidates = [(n, shape) for index in run for n, shape in layers[index] if n not in buffers[stage]]
            names = name_optimizer_params(*params[stage], candidates)
            if isinstance(names, str):
                break
            named[stage] = names
        else:
            fits.append(named)
    if len(fits) != 1:
        result.add(
            LayoutError,
            first_path,
            f"a ZeRO-0 pipeline run: its stages' optimizers (params by index) match {len(fits) or 'no'} "
            f"way{'s' * (len(fits) > 1)} of cutting the {len(order)} layer files of {tag_dir} into {stages} stages "
            "by the params' shapes"
            + ("" if fits else " (a tied module, whose key no file records, or params passed out of module order)"),
        )
        return None
    return fits[0]


def _stage_count(state: dict) -> int | None:
    """The pipeline degree a stage's file records (``checkpoint_parallel_dimensions``, or the
    model-parallel world size of a run with one tensor rank)."""
    dims = state.get(N.CHECKPOINT_PARALLEL_DIMENSIONS)
    if isinstance(dims, dict) and isinstance(dims.get("pp_degree"), int):
        return dims["pp_degree"]
    mp = state.get(N.MP_WORLD_SIZE)
    return mp if isinstance(mp, int) and mp > 0 else None


def _layer_files(
    result: Survey,
    files: RankFiles,
    declarations: list[StageDeclaration],
    tensor: int = 0,
    layer_states: dict[str, Any] | None = None,
) -> list[LayerFile] | None:
    """Every layer file (of tensor rank `tensor`), its tensors under the one-stage model's names
    and the stage it is in (`layer_states`: the files already read, by path)."""
    trainable = {name for d in declarations for name in d.trainable}
    declared = {name for d in declarations for name in d.names}
    tied = sorted(name for name in trainable if name.startswith(TIED_PREFIX))
    owner = {layer: d.stage for d in declarations for layer in d.layers}
    starts = {d.stage: min(d.layers) for d in declarations if d.layers}
    layers: list[LayerFile] = []
    for index, path in files.tensor_layers(tensor).items():
        state = load(result, path, layer_states)
        if state is None:
            continue
        if not isinstance(state, dict) or not all(isinstance(v, TensorRef) for v in state.values()):
            result.add(CorruptFileError, path, "not a pipeline layer file (a state dict of tensors)")
            continue
        local = {str(k): v for k, v in state.items()}
        if any(f"{index}.{name}" in declared for name in local):
            names = {name: f"{index}.{name}" for name in local}
        else:
            key = _tied_key(local, tied, path, result)
            if key is False:
                continue
            names = {name: (f"{TIED_PREFIX}{key}.{name}" if key else f"{index}.{name}") for name in local}
        # a layer listed by a stage is in that stage; a tied or all-frozen one in the stage whose
        # layers start at or before it (stages hold consecutive layers)
        stage = owner.get(index, max((s for s, start in starts.items() if start <= index), default=0))
        layers.append(LayerFile(index, path, {names[k]: v for k, v in local.items()}, stage, tuple(local)))
    if result.problems:
        return None
    held = {name for layer in layers for name in layer.tensors}
    for d in declarations:
        missing = [name for name in (*d.trainable, *d.buffers) if name not in held and N.layer_of(name) is not None]
        if missing:
            layer = N.layer_of(missing[0])
            assert layer is not None
            result.add(
                CheckpointNotFoundError,
                os.path.join(
                    files.tag_dir, N.layer_states_name(layer, tensor if files.layer_tensor_ranks > 1 else None)
                ),
                f"missing: stage {d.stage} lists {missing[0]}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                + " (the layer's weights and buffers are only in its layer file)",
            )
            return None
    return layers


def _tied_key(local: dict[str, TensorRef], tied: list[str], path: str, result: Survey) -> str | None | bool:
    """The key of the tied module a layer file holds (its trainable tensors are all
    ``tied_modules.<key>.<name>``), None for a layer of no declared name (all frozen), False
    when two tied modules fit (a problem listed)."""
    keys = set()
    for name in tied:
        rest = name[len(TIED_PREFIX) :]
        for local_name in local:
            if rest.endswith("." + local_name):
                keys.add(rest[: -len(local_name) - 1])
    fitting = [
        key
        for key in sorted(keys)
        if all(n[len(TIED_PREFIX) + len(key) + 1 :] in local for n in tied if n.startswith(f"{TIED_PREFIX}{key}."))
    ]
    if len(fitting) > 1:
        result.add(LayoutError, path, f"holds the state of a tied module, but tied modules {fitting} all fit it")
        return False
    return fitting[0] if fitting else None


def _check_counters(result: Survey, declarations: list[StageDeclaration], surveys: list[Survey]) -> None:
    """Every stage saved at the same step (one save of one run). Guarantee: every rank's engine
    counts ``global_steps`` alike (deepspeed/runtime/engine.py:3558); the stages' equal
    data-parallel sizes (checked above) come from the pipe x data (x model) grid,
    ``PipeModelDataParallelTopology`` (runtime/pipe/topology.py), a cartesian product."""
    steps = [sub.state.global_steps if sub.state else None for sub in surveys]
    for d, step in zip(declarations, steps):
        if step != steps[0]:
            result.add(
                LayoutError,
                d.path,
                f"stage {d.stage} is at global step {step}, stage 0 at {steps[0]}: files of different saves are mixed",
            )


def _module_order(declarations: list[StageDeclaration], layers: list[LayerFile]) -> dict[str, int]:
    """The position of each name in the state dict of the model built as one stage:
    ``tied_modules`` first (PipelineModule creates it before its layers), then layer by layer."""
    names: list[str] = []
    for d in declarations:
        names.extend(n for n in d.trainable if n.startswith(TIED_PREFIX))
    for layer in sorted(layers, key=lambda f: f.index):
        names.extend(n for n in layer.tensors if n.startswith(TIED_PREFIX))
    for layer in sorted(layers, key=lambda f: f.index):
        names.extend(n for n in layer.tensors if not n.startswith(TIED_PREFIX))
    for d in declarations:
        names.extend(d.trainable)
    return {name: position for position, name in enumerate(dict.fromkeys(names))}


def _stage_placements(indexes: list[CheckpointIndex]) -> dict[str, str]:
    """Which stage held each tensor ("stages 0, 1" for a tied param every one of them kept), and
    how the stage's tensor ranks held it (a stage's own placement)."""
    held: dict[str, list[int]] = {}
    within: dict[str, str] = {}
    for stage, index in enumerate(indexes):
        for entry in index.entries:
            held.setdefault(entry.name, []).append(stage)
        for name, placement in index.placements.items():
            within.setdefault(name, placement)
    return {
        name: (f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))} (tied copies)")
        + (f"; {within[name]}" if name in within else "")
        for name, stages in held.items()
    }


_ZERO_CHECK_CHUNK = 1 << 22  # elements of a moment read at a time when looking for a nonzero one


def _copies_out_of_step(states: list[TrainingState]) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """For each param several stages keep (a tied module's), the stages whose copy DeepSpeed did
    not keep in step with the copy the model takes (the first stage's whose moments are not all
    zero): (idle, own), the copies with every moment zero and those trained on their own.

    What DeepSpeed guarantees: it builds a tied module in every stage that holds one of its
    layers and keeps in step only its ``tied_weight_attr`` params, broadcast from the first
    such stage at start (``PipelineModule._synchronize_tied_weights``,
    deepspeed/runtime/pipe/module.py:472-479) and given one all-reduced gradient
    (``allreduce_tied_weight_gradients``, module.py:457-462, from ``PipelineEngine.
    _exec_reduce_tied_grads``): their copies get the same masters and the same optimizer
    moments. Any other param of the module (Megatron's position embeddings, a LayerNorm in the
    head's stage) is each stage's own; no file records which params are tied. So a copy whose
    moments equal the kept copy's is one DeepSpeed kept in step (compared: a difference is
    damage), and one whose moments differ was trained on its own (not compared). Zero moments
    mark a copy no gradient reached (a zero gradient, ``set_none_gradients_to_zero``,
    zero/stage_1_and_2.py:2352-2356; observed in the tied samples) only
    with decoupled weight decay: coupled decay (torch Adam or SGD with ``weight_decay``) makes
    the decay that copy's gradient, hence the moment comparison. One state is compared, read in
    chunks up to its first difference (a copy kept in step is read whole)."""
    holders: dict[str, list[tuple[int, ParamState]]] = {}
    for stage, state in enumerate(states):
        for param in state.params:
            holders.setdefault(param.name, []).append((stage, param))
    idle_copies: dict[str, set[int]] = {}
    own_copies: dict[str, set[int]] = {}
    with FileReader() as reader:
        for name, copies in holders.items():
            if len(copies) < 2:
                continue
            idle = {
                stage
                for stage, param in copies
                if param.states and all(all_zero(reader, s, _ZERO_CHECK_CHUNK) for s in param.states.values())
            }
            if len(idle) == len(copies):
                continue  # no stage trained it: compared
            kept = next(param for stage, param in copies if stage not in idle)
            own = {
                stage
                for stage, param in copies
                if stage not in idle and param is not kept and not _same_moment(reader, kept, param)
            }
            if idle:
                idle_copies[name] = idle
            if own:
                own_copies[name] = own
    return idle_copies, own_copies


def _same_moment(reader: FileReader, kept: ParamState, other: ParamState) -> bool:
    """Whether `other`'s first optimizer state holds the same bits as `kept`'s (the copies got the
    same gradients), read `_ZERO_CHECK_CHUNK` elements at a time up to the first difference."""
    key = next((k for k in kept.states if k in other.states), None)
    if key is None:
        return not kept.states and not other.states
    left, right = kept.states[key], other.states[key]
    if left.numel != right.numel or left.dtype != right.dtype:
        return False
    for start in range(0, left.numel, _ZERO_CHECK_CHUNK):
        count = min(_ZERO_CHECK_CHUNK, left.numel - start)
        a, b = np.empty(count, dtype=left.dtype.numpy_raw), np.empty(count, dtype=right.dtype.numpy_raw)
        read_range(reader, left, start, a)
        read_range(reader, right, start, b)
        if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):  # bits: NaN payloads, -0.0
            return False
    return True


def merged_entries(
    stage_entries: list[tuple[Entry, ...]], order: dict[str, int], unused: dict[str, set[int]]
) -> tuple[list[Entry], list[Entry]]:
    """The stages' entries, each name once (the first stage's that holds it in step), in module
    order; the later stages' copies of a name (tied params) as replicas, less those `unused`."""
    kept: dict[str, Entry] = {}
    replicas: list[Entry] = []
    for stage, entries in enumerate(stage_entries):
        for entry in entries:
            if stage in unused.get(entry.name, ()):
                continue
            if entry.name in kept:
                replicas.append(entry)
            else:
                kept[entry.name] = entry
    return sorted(kept.values(), key=lambda e: order.get(e.name, len(order))), replicas


def _merged_state(
    index: CheckpointIndex,
    states: list[TrainingState],
    order: dict[str, int],
    declarations: list[StageDeclaration],
    layers: list[list[LayerFile]],
    unused: dict[str, set[int]],
) -> TrainingState:
    """One training state of the stages' (:func:`joined_states`) and what each stage held."""
    first = joined_states(states, order, unused, index.tag_dir)
    stages = tuple(
        PipelineStage(
            params=tuple(p.name for p in state.params),
            buffers=declaration.buffers,
            layer_files=tuple(
                layer.path for tensor_layers in layers for layer in tensor_layers if layer.stage == declaration.stage
            ),
            tensor_shards=state.tensor_shards,
            layer_names=tuple(
                (layer.index, tuple(zip(layer.local_names, layer.tensors)))
                for layer in layers[0]
                if layer.stage == declaration.stage
            ),
            own_params=tuple(p for p in state.params if number in unused.get(p.name, ())),
        )
        for number, (state, declaration) in enumerate(zip(states, declarations))
    )
    return replace(first, index=index, stages=stages, tensor_shards=())  # each stage's shards: its PipelineStage


def joined_states(
    states: list[TrainingState], order: dict[str, int], unused: dict[str, set[int]], tag_dir: str
) -> TrainingState:
    """The stages' training states (or one tensor rank's of each stage) as one: their params, a
    tied one once (the copy of the first stage that keeps it in step: `unused` names the stages
    that do not), their param groups joined group by group in `order` (the one-stage model's,
    its optimizer's), their module names and dtypes, the counters and the rest from the first
    stage (checked alike)."""
    first = states[0]
    counts = {len(s.groups) for s in states}
    if len(counts) > 1:
        raise LayoutError(tag_dir, f"the stages' optimizers have different numbers of param groups {sorted(counts)}")
    params: dict[str, ParamState] = {}
    for stage, state in enumerate(states):
        for param in state.params:
            if stage not in unused.get(param.name, ()):
                params.setdefault(param.name, param)
    groups = []
    for g, group in enumerate(first.groups):
        members = sorted(
            dict.fromkeys(name for state in states for name in state.groups[g].params),
            key=lambda n: order.get(n, len(order)),
        )
        groups.append(replace(group, params=tuple(members)))
    module_names = sorted({n for s in states for n in s.module_names}, key=lambda n: order.get(n, len(order)))
    return replace(
        first,
        params=tuple(params[name] for group in groups for name in group.params),
        groups=tuple(groups),
        module_names=tuple(module_names),
        module_dtype_names={k: v for s in states for k, v in s.module_dtype_names.items()},
    )
