"""Tensor-parallel checkpoints written (:func:`plan_tensor_parallel_checkpoint`): the training
state of an AutoTP or Megatron-style run laid out for another number of data-parallel ranks (and
ZeRO stage) at the same tensor ranks, as DeepSpeed saves it, so a plain ``load_checkpoint`` of the
new run reads it; at one tensor rank (:func:`one_tensor_rank_state`): the unsharded model's; or,
for a Megatron-style run, at another number of tensor ranks (:func:`tensor_ranks_state`): each
rank's slices cut from the merged tensors by the run's merge rules at that degree (the reader's
pieces, :func:`~.megatron_rules.megatron_specs`, taken the other way: :func:`~.tensor_parallel.cut`).

Each tensor rank is an ordinary ZeRO checkpoint of its shards over its data ranks, so the
data-parallel writer (:func:`~.writer.plan_checkpoint`) plans it from that rank's own state (kept
by the reader, :mod:`.tensor_parallel`); its files take the rank's ``mp_rank`` and its
model-states file the tensor-parallel world size. The shards' ``universal_checkpoint_info`` and
``checkpoint_parallel_dimensions`` are carried as saved (at another degree, as that run records them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..core.errors import UsageError
from ..core.index import TensorSource
from ..core.state import TrainingState
from ..core.topology import Topology
from . import names as N
from .megatron_rules import has_merge_patterns, megatron_specs, merge_rule, rules_at_tensor_ranks, shard_shapes
from .tensor_parallel import cut
from .writer import AnyPlannedFile, CheckpointPlan, Target, at_model_parallel_rank, plan_checkpoint


def plan_tensor_parallel_checkpoint(state: TrainingState, target: Target) -> CheckpointPlan:
    """Every file of the tensor-parallel checkpoint for `target` (its data-parallel size and ZeRO
    stage) at the input's tensor ranks; pure."""
    if target.stage not in (1, 2, 3):
        raise UsageError(None, f"--stage {target.stage}: zckpt writes tensor-parallel checkpoints at ZeRO-1/2/3 only")
    tp = len(state.tensor_shards)
    files: list[AnyPlannedFile] = []
    plans = [plan_checkpoint(shard, target) for shard in state.tensor_shards]
    for rank, plan in enumerate(plans):
        files.extend(at_model_parallel_rank(planned, rank, {N.MP_WORLD_SIZE: tp}) for planned in plan.files)
    return replace(plans[0], files=tuple(files))


def unsharded_state(state: TrainingState) -> TrainingState:
    """A tensor-parallel run's state as that of the unsharded model over its data ranks: every
    param and module tensor the full tensor the reader assembled (what a universal checkpoint
    holds; the loading run cuts its own shards)."""
    index = replace(state.index, topology=Topology.data_parallel(state.index.topology.dp), replicas=())
    return replace(state, index=index, tensor_shards=())


def one_tensor_rank_state(state: TrainingState, padded_vocab_size: int | None = None) -> TrainingState:
    """A tensor-parallel run's state as a run of the same model at one tensor rank saves it: every
    tensor whole (a Megatron vocabulary at ``original_vocab_size`` rows, or `padded_vocab_size`
    where the state was read with the rules of :func:`vocabulary_rules`), the parallel dimensions
    one tensor rank, and the merge rules a Megatron-style model records at one rank (AutoTP's
    ``affine_map`` describes the old ranks' pieces: a run without AutoTP records none)."""
    extras = dict(state.engine_extras)
    dims = extras.get(N.CHECKPOINT_PARALLEL_DIMENSIONS)
    if isinstance(dims, dict):
        extras[N.CHECKPOINT_PARALLEL_DIMENSIONS] = {**dims, "tp_degree": 1}
    info = extras.get(N.UNIVERSAL_CHECKPOINT_INFO)
    if isinstance(info, dict) and N.AFFINE_MAP in info:
        del extras[N.UNIVERSAL_CHECKPOINT_INFO]
    elif has_merge_patterns(info):
        extras[N.UNIVERSAL_CHECKPOINT_INFO] = rules_at_tensor_ranks(info, 1, padded_vocab_size)
    return replace(unsharded_state(state), engine_extras=extras)


def tensor_ranks_state(state: TrainingState, tp: int) -> TrainingState:
    """A Megatron-style run's state as a run of the same model at `tp` tensor ranks saves it: each
    rank's slice of every tensor cut from the merged one by the merge rules at `tp` ranks (the
    rules the state was read by; a vocabulary at the rows it was read with, see
    :func:`vocabulary_rules`), each rank's state a ZeRO checkpoint of its slices that
    :func:`plan_tensor_parallel_checkpoint` lays out; the parallel dimensions and the recorded
    rules those of `tp` ranks. AutoTP's cut at another degree is its engine's (head counts,
    alignment), recorded in no rule: refused."""
    read_by = state.tensor_merge_rules
    if not has_merge_patterns(read_by) or N.AFFINE_MAP in read_by:
        raise UsageError(
            None,
            f"--tensor-parallel {tp}: an AutoTP run is cut at another degree by its engine (head counts, alignment), "
            "which no rule records; zckpt writes it at its own tensor ranks or at 1 (a universal folder takes any "
            "degree: to-universal)",
        )
    rows = read_by.get(N.ORIGINAL_VOCAB_SIZE)  # the vocabulary's rows as read: the new run's padded ones
    padded = rows if isinstance(rows, int) and read_by.get(N.VOCABULARY_PARAMETER_PATTERNS) else None
    cut_by = rules_at_tensor_ranks(read_by, tp, padded)
    trainable = {p.name for p in state.params}
    whole = unsharded_state(state)
    entries = [e for e in whole.index.entries if e.kind != "tied"]
    shapes = {e.name: shard_shapes(cut_by, e.name, e.source.shape, e.name in trainable, tp) for e in entries}
    specs = megatron_specs(cut_by, shapes, trainable)

    def sliced(name: str, source: TensorSource, t: int) -> TensorSource:
        spec = specs.get(name)
        return source if spec is None else cut(name, source, spec, t)

    extras = dict(state.engine_extras)
    dims = extras.get(N.CHECKPOINT_PARALLEL_DIMENSIONS)
    if isinstance(dims, dict):
        extras[N.CHECKPOINT_PARALLEL_DIMENSIONS] = {**dims, "tp_degree": tp}
    info = extras.get(N.UNIVERSAL_CHECKPOINT_INFO)
    if has_merge_patterns(info):
        extras[N.UNIVERSAL_CHECKPOINT_INFO] = rules_at_tensor_ranks(info, tp, padded)
    shards = []
    for t in range(tp):
        index = replace(
            whole.index,
            entries=tuple(
                e if e.kind == "tied" else replace(e, source=sliced(e.name, e.source, t)) for e in whole.index.entries
            ),
        )
        params = []
        for param in whole.params:
            master = sliced(param.name, param.master, t)
            states = {key: sliced(param.name, value, t) for key, value in param.states.items()}
            params.append(replace(param, shape=master.shape, master=master, states=states))
        shards.append(replace(whole, index=index, params=tuple(params), engine_extras=extras, rank_buffers=()))
    index = replace(whole.index, topology=Topology(tp=tp, dp=whole.index.topology.dp))
    return replace(whole, index=index, engine_extras=extras, tensor_shards=tuple(shards))


def vocabulary_rules(state: TrainingState, info: dict[str, Any] | None, padded_vocab_size: int) -> dict[str, Any]:
    """Merge rules (`info`, the run's Megatron-style ones) that keep `padded_vocab_size` rows of
    each vocabulary param instead of ``original_vocab_size``: the rows a run at one tensor rank
    that pads its vocabulary to that size has (Megatron pads to a multiple of
    ``make_vocab_size_divisible_by`` x the tensor ranks, so fewer ranks pad less). Read the
    checkpoint with them. Refused where the rows were not saved, or would cut the vocabulary."""
    label = f"--padded-vocab-size {padded_vocab_size}"
    if not has_merge_patterns(info) or N.AFFINE_MAP in info or not info.get(N.VOCABULARY_PARAMETER_PATTERNS):
        raise UsageError(
            None, f"{label}: for a Megatron-style tensor-parallel run whose merge rules name its vocabulary"
        )
    original = info.get(N.ORIGINAL_VOCAB_SIZE)
    found = saved_vocabulary_rows(state, info)
    if found is None:
        raise UsageError(None, f"{label}: no param of this checkpoint matches its vocabulary patterns")
    name, rows = found
    if isinstance(original, int) and padded_vocab_size < original:
        raise UsageError(None, f"{label}: smaller than the vocabulary ({original} rows, original_vocab_size)")
    if padded_vocab_size > rows:
        raise UsageError(
            None,
            f"{label}: {name} holds {rows} rows over its tensor ranks (its padded vocabulary); more would be rows "
            "the run never had (a universal folder pads with zeros on load: to-universal)",
        )
    return {**info, N.ORIGINAL_VOCAB_SIZE: padded_vocab_size}


def saved_vocabulary_rows(state: TrainingState, info: dict[str, Any] | None) -> tuple[str, int] | None:
    """The vocabulary param with the fewest rows over its tensor ranks (its padded vocabulary, as
    saved) and those rows, by Megatron-style rules `info`; None where they name no vocabulary."""
    if not has_merge_patterns(info) or N.AFFINE_MAP in info or not info.get(N.VOCABULARY_PARAMETER_PATTERNS):
        return None
    saved: dict[str, int] = {}
    # each pipeline stage's tensor ranks (a tied vocabulary in two stages: each stage's copy whole)
    groups = [state.tensor_shards] if state.tensor_shards else [stage.tensor_shards for stage in state.stages]
    for shards in groups:
        rows_of: dict[str, int] = {}
        for shard in shards:
            for entry in shard.index.entries:
                rule = merge_rule(info, entry.name, entry.kind == "param")
                if rule.vocabulary and entry.source.shape:
                    rows = entry.source.shape[0]  # the rank's rows: joined on dim 0, or a copy
                    joined = rule.kind not in ("replicated", "averaged", "copies")
                    rows_of[entry.name] = rows_of.get(entry.name, 0) + rows if joined else rows
        saved.update(rows_of)
    return min(saved.items(), key=lambda item: item[1]) if saved else None
