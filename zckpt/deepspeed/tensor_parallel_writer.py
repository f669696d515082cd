"""Tensor-parallel checkpoints written (:func:`plan_tensor_parallel_checkpoint`): the training
state of an AutoTP or Megatron-style run laid out for another number of data-parallel ranks (and
ZeRO stage) at the same tensor ranks, as DeepSpeed saves it, so a plain ``load_checkpoint`` of the
new run reads it; or at one tensor rank (:func:`one_tensor_rank_state`): the unsharded model's.

Each tensor rank is an ordinary ZeRO checkpoint of its shards over its data ranks, so the
data-parallel writer (:func:`~.writer.plan_checkpoint`) plans it from that rank's own state (kept
by the reader, :mod:`.tensor_parallel`); its files take the rank's ``mp_rank`` and its
model-states file the tensor-parallel world size. The shards' ``universal_checkpoint_info`` and
``checkpoint_parallel_dimensions`` are carried as saved.
"""

from __future__ import annotations

from dataclasses import replace

from ..core.errors import UsageError
from ..core.state import TrainingState
from ..core.topology import Topology
from . import names as N
from .megatron_rules import has_merge_patterns, rules_at_one_rank
from .writer import CheckpointPlan, PlannedFile, Target, at_model_parallel_rank, plan_checkpoint


def plan_tensor_parallel_checkpoint(state: TrainingState, target: Target) -> CheckpointPlan:
    """Every file of the tensor-parallel checkpoint for `target` (its data-parallel size and ZeRO
    stage) at the input's tensor ranks; pure."""
    if target.stage not in (1, 2, 3):
        raise UsageError(None, f"--stage {target.stage}: zckpt writes tensor-parallel checkpoints at ZeRO-1/2/3 only")
    tp = len(state.tensor_shards)
    files: list[PlannedFile] = []
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


def one_tensor_rank_state(state: TrainingState) -> TrainingState:
    """A tensor-parallel run's state as a run of the same model at one tensor rank saves it: every
    tensor whole (a Megatron vocabulary at ``original_vocab_size`` rows), the parallel dimensions
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
        extras[N.UNIVERSAL_CHECKPOINT_INFO] = rules_at_one_rank(info)
    return replace(unsharded_state(state), engine_extras=extras)
