"""Pipeline-parallel checkpoints written (:func:`plan_pipeline_checkpoint`): the training state of a
pipeline run laid out for another number of data-parallel ranks, at the same number of stages,
as one stage or cut into the stages of a layer partition, and a pipeline x tensor run's at its
tensor ranks or another degree, as DeepSpeed's ``PipelineEngine`` saves it, so a plain
``load_checkpoint`` of the new run reads it.

Each stage is an ordinary ZeRO-1 checkpoint over its data ranks (with tensor ranks, each rank's),
so the data-parallel writer (:func:`~.writer.plan_checkpoint`) plans it from the stage's share of
the state; its files take the stage's ``mp_rank`` and its model-states file the pipeline form
(``module=None``, the stage's buffer names, the pipeline degree). The layer files hold each
layer's own state under global layer numbers, whatever the stage count: they are copied as they
are, or, at another tensor-parallel degree, written again from each rank's slices.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from ..core.dtypes import BY_SHORT
from ..core.errors import LayoutError, UsageError
from ..core.state import PipelineStage, TrainingState
from ..core.topology import Topology
from . import names as N
from .pipeline import joined_states, merged_entries
from .tensor_parallel_writer import tensor_ranks_state
from .writer import (
    AnyPlannedFile,
    CheckpointPlan,
    PlannedFile,
    Target,
    at_model_parallel_rank,
    copied_file,
    plan_checkpoint,
    tensor_of,
)


def pipeline_stages(
    state: TrainingState, stages: int | None, layer_partition: tuple[int, ...] | None = None
) -> tuple[PipelineStage, ...]:
    """The stages of the output: the input's (`stages` None or the same number), one stage
    holding every param in the one-stage model's order, or the stages `layer_partition` cuts
    the layers into. Other stage counts need that partition: the checkpoint does not record
    how the model split its layers (function layers leave no file)."""
    source = state.stages
    if layer_partition is not None:
        return _partitioned_stages(state, stages, layer_partition)
    if stages is None or stages == len(source):
        return source
    if stages == 1:
        return (_stage_of_layers(state, None),)
    raise UsageError(
        None,
        f"--pipeline-stages {stages}: at a stage count other than its own {len(source)} or 1, zckpt needs the new "
        "run's split of the layers, which the checkpoint does not record: pass --layer-partition (the first layer "
        "of each stage, then the layer count, as PipelineModule's `parts`)",
    )


def _stage_of_layers(state: TrainingState, layers: range | None) -> PipelineStage:
    """A stage holding the layers in `layers` (every layer: None): their trainable params in the
    one-stage model's order (the order the stage's module registers them), their buffers and
    layer files."""

    def held(name: str) -> bool:
        return layers is None or N.layer_of(name) in layers

    params = [name for group in state.groups for name in group.params if held(name)]
    by_module = {name: i for i, name in enumerate(state.module_names)}
    files = [f for stage in state.stages for f in stage.layer_files]
    return PipelineStage(
        params=tuple(sorted(params, key=lambda n: by_module.get(n, len(by_module)))),
        buffers=tuple(b for stage in state.stages for b in stage.buffers if held(b)),
        layer_files=tuple(f for f in files if layers is None or layer_file_index(f) in layers),
    )


def _partitioned_stages(state: TrainingState, stages: int | None, parts: tuple[int, ...]) -> tuple[PipelineStage, ...]:
    """The stages DeepSpeed's ``PipelineModule`` builds from its ``parts`` (stage s holds layers
    ``parts[s]`` to ``parts[s+1] - 1``), checked against what the checkpoint holds."""
    label = "--layer-partition " + ",".join(map(str, parts))
    count = len(parts) - 1
    if count < 1 or parts[0] != 0 or any(b <= a for a, b in zip(parts, parts[1:])):
        raise UsageError(
            None,
            f"{label}: increasing layer numbers from 0 are expected: each stage's first layer, then the layer count",
        )
    if stages is not None and stages != count:
        raise UsageError(None, f"{label} cuts {count} stage(s) but --pipeline-stages is {stages}")
    tied = sorted({name for name in state.module_names if N.layer_of(name) is None})
    if tied and count > 1:
        raise UsageError(
            None,
            f"{label}: the model ties {tied[0]} between stages; which new stages hold it depends on where its "
            "tied layers sit, which the checkpoint does not record (--pipeline-stages 1 takes it)",
        )
    layers = {N.layer_of(n) for n in state.module_names} | {
        layer_file_index(f) for stage in state.stages for f in stage.layer_files
    }
    last = max((layer for layer in layers if layer is not None), default=-1)
    if last >= parts[-1]:
        raise UsageError(None, f"{label}: the checkpoint has layer {last}, beyond its layer count {parts[-1]}")
    if count == 1:
        return (_stage_of_layers(state, None),)  # tied modules too
    out = tuple(_stage_of_layers(state, range(a, b)) for a, b in zip(parts, parts[1:]))
    for number, (stage, a, b) in enumerate(zip(out, parts, parts[1:])):
        if not stage.params:
            raise UsageError(
                None,
                f"{label}: stage {number} (layers {a}-{b - 1}) would hold no trainable param; "
                "DeepSpeed's optimizer cannot run a stage without one",
            )
    return out


def layer_file_index(path: str) -> int | None:
    """The global layer number a layer file's name carries."""
    return N.layer_states_index(os.path.basename(path))


def plan_pipeline_checkpoint(
    state: TrainingState,
    target: Target,
    stages: int | None = None,
    layer_partition: tuple[int, ...] | None = None,
    tensor_parallel: int | None = None,
) -> CheckpointPlan:
    """Every file of the pipeline checkpoint for `target` (its data-parallel size and ZeRO stage)
    at `stages` pipeline stages (default: the input's) or the stages of `layer_partition`; a
    pipeline x tensor run at its tensor ranks or at `tensor_parallel` (each rank's slices, layer
    files included, cut by its merge rules at that degree); pure."""
    if target.stage != 1:
        raise UsageError(None, f"--stage {target.stage}: DeepSpeed's pipeline engine runs ZeRO-0/1 only")
    out_stages = pipeline_stages(state, stages, layer_partition)
    tp = len(state.stages[0].tensor_shards)
    layer_files = [PlannedFile(os.path.basename(f), copied_file(f), None) for f in _layer_files(state)]
    if tensor_parallel is not None and tensor_parallel != tp:
        # each stage cut from the model's tensors, its own copies of params out of step included
        model = _cut_tensor_ranks(state, None, tensor_parallel)
        by_stage = [_cut_tensor_ranks(state, s, tensor_parallel) if s.own_params else model for s in out_stages]
        same = out_stages is state.stages  # else no stage has copies of its own: any stage's cut is the model's
        layer_files = _cut_layer_files(state, by_stage if same else [by_stage[0]] * len(state.stages))
        out_stages = tuple(
            replace(stage, tensor_shards=tuple(stage_state(rank, stage) for rank in ranks))
            for stage, ranks in zip(out_stages, by_stage)
        )
    elif out_stages is not state.stages and tp:
        ranks = [tensor_rank_state(state, t) for t in range(tp)]
        out_stages = tuple(
            replace(stage, tensor_shards=tuple(stage_state(rank, stage) for rank in ranks)) for stage in out_stages
        )
    files: list[AnyPlannedFile] = []
    plans = []
    for number, stage in enumerate(out_stages):
        if stage.tensor_shards:  # each tensor rank of the stage its own data-parallel checkpoint
            tp = len(stage.tensor_shards)
            for t, shard in enumerate(stage.tensor_shards):
                plan = plan_checkpoint(shard, target)
                plans.append(plan)
                files.extend(_as_stage_file(p, number, len(out_stages), stage, t, tp) for p in plan.files)
            continue
        plan = plan_checkpoint(stage_state(state, stage), target)
        plans.append(plan)
        for planned in plan.files:
            files.append(_as_stage_file(planned, number, len(out_stages), stage))
    files.extend(layer_files)
    first = plans[0]
    return CheckpointPlan(first.tag, first.target, first.layout, tuple(files), folders=first.folders)


def stage_state(state: TrainingState, stage: PipelineStage) -> TrainingState:
    """One stage's share of the state: its params, its groups' members, its buffers, as the
    state of a data-parallel run (the stage's own data-parallel ranks)."""
    own = set(stage.params) | set(stage.buffers)
    by_name = {p.name: p for p in state.params} | {p.name: p for p in stage.own_params}
    index = replace(
        state.index,
        entries=tuple(e for e in state.index.entries if e.name in own),
        replicas=(),
        topology=Topology.data_parallel(state.index.topology.dp),
    )
    members = [set(g.params) for g in state.groups]
    groups = tuple(
        replace(g, params=tuple(n for n in stage.params if n in own)) for g, own in zip(state.groups, members)
    )
    return replace(
        state,
        index=index,
        params=tuple(by_name[name] for name in stage.params),
        groups=groups,
        module_names=tuple(n for n in state.module_names if n in own),
        stages=(),
    )


def tensor_rank_state(state: TrainingState, tensor: int) -> TrainingState:
    """Tensor rank `tensor`'s shards of every stage of a pipeline x tensor run, joined as the
    reader joins the stages (:func:`~.pipeline.joined_states`; a tied module's copy the first
    stage's that keeps it in step), which :func:`stage_state` cuts into the stages of another
    layout."""
    shards = [stage.tensor_shards[tensor] for stage in state.stages]
    order = {name: i for i, name in enumerate(state.module_names)}
    unused: dict[str, set[int]] = {}
    for number, stage in enumerate(state.stages):
        for param in stage.own_params:
            unused.setdefault(param.name, set()).add(number)
    joined = joined_states(shards, order, unused, state.index.tag_dir)
    entries, _ = merged_entries([shard.index.entries for shard in shards], order, unused)
    return replace(joined, index=replace(joined.index, entries=tuple(entries)), rank_buffers=(), stages=())


def _layer_files(state: TrainingState) -> list[str]:
    return sorted({f for stage in state.stages for f in stage.layer_files})


def _cut_tensor_ranks(state: TrainingState, stage: PipelineStage | None, tp: int) -> list[TrainingState]:
    """Each of `tp` tensor ranks' state of the model, cut by its merge rules at `tp` ranks, with
    `stage`'s own copies of params it keeps out of step in place of the model's."""
    own = {p.name: p for p in stage.own_params} if stage is not None else {}
    base = replace(state, params=tuple(own.get(p.name, p) for p in state.params)) if own else state
    return [replace(rank, stages=()) for rank in tensor_ranks_state(base, tp).tensor_shards]


def _cut_layer_files(state: TrainingState, ranks_by_stage: list[list[TrainingState]]) -> list[PlannedFile]:
    """Every layer file at each of the new tensor ranks (the cut of the stage that saved it):
    the names the run's file has, in its order (a tied module's own names in the file of the
    layer that holds it), each the rank's slice (a weight its master rounded to the dtype the
    module held it in, as the data-parallel writer writes a module)."""
    dtype = state.index.dtype
    files = []
    for stage, ranks in zip(state.stages, ranks_by_stage):
        for layer, names in stage.layer_names:
            for t, rank in enumerate(ranks):
                entries = {e.name: e for e in rank.index.entries}
                module = OrderedDict()
                for own, name in names:
                    if name not in entries:
                        raise LayoutError(
                            state.index.tag_dir, f"{name}: a tensor of layer {layer}'s file with no value"
                        )
                    saved = BY_SHORT.get(state.module_dtype_names.get(name, ""), dtype)
                    module[own] = tensor_of(entries[name].source, saved)
                files.append(PlannedFile(N.layer_states_name(layer, t), module, None))
    return files


def one_stage_state(state: TrainingState) -> TrainingState:
    """A pipeline run's whole state as that of the model built as one stage, data-parallel over
    the stages' data-parallel ranks: names, order and values the one-stage model has."""
    one = stage_state(state, pipeline_stages(state, 1)[0])
    # every tensor of the module, frozen params too (a stage's share holds its trainable params
    # and buffers; the frozen ones are in its layer files, which a one-stage module replaces)
    return replace(one, index=replace(one.index, entries=state.index.entries), module_names=state.module_names)


def _as_stage_file(
    planned: AnyPlannedFile, stage: int, stages: int, held: PipelineStage, tensor: int = 0, tp: int = 1
) -> AnyPlannedFile:
    """A file the data-parallel writer planned, as pipeline stage `stage` (tensor rank `tensor`
    of `tp`) names and holds it: model-parallel rank ``stage * tp + tensor``."""

    def values(obj: dict) -> dict[str, Any]:
        out: dict[str, Any] = {
            N.MODULE: None,  # the weights are in the layer files
            N.BUFFER_NAMES: list(held.buffers),
            N.SHARED_PARAMS: {},
            N.MP_WORLD_SIZE: stages * tp,
        }
        if N.CHECKPOINT_PARALLEL_DIMENSIONS in obj:
            out[N.CHECKPOINT_PARALLEL_DIMENSIONS] = {"pp_degree": stages, "tp_degree": tp}
        return out

    return at_model_parallel_rank(planned, stage * tp + tensor, values)
