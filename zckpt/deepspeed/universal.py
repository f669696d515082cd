"""Lay a TrainingState out as DeepSpeed's universal checkpoint, for a run of any ZeRO stage.

A universal checkpoint is what ``ds_to_universal`` writes and what a run with
``"checkpoint": {"load_universal": true}`` loads at any world size: one folder per trainable
param, ``zero/<name>/<state>.pt`` holding the full tensor of its fp32 master (``fp32.pt``) and of
each optimizer state, ``zero/optimizer_state.pt`` (loss scaler, param groups, ...) and the
model_states files (lr scheduler, counters, client state, frozen params and buffers).

DeepSpeed's loaders read two flavours, and only their own: ZeRO-1/2 (``load_hp_checkpoint_state``)
wants every per-param file to be ``{"cat_dim": 0, "param": <full-shape tensor>}`` and the
group's step in ``step.pt``, and finds the model_states as ``mp_rank_00_model_states.pt``; ZeRO-3
(``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) reads flat tensors, takes the step from
``optimizer_state.pt`` and finds ``zero_pp_rank_0_mp_rank_00_model_states.pt``. The flavour
written here follows the target stage, so a checkpoint crosses ZeRO stages; the model_states
files come from the same planner as :mod:`~zckpt.deepspeed.writer`'s, at the input's world size.
Pure: no tensor byte is read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

from ..core.errors import UsageError
from ..core.index import TensorSource
from ..core.state import ParamState, TrainingState
from ..core.topology import Topology
from ..torchfile.save import OutTensor
from . import muon
from . import names as N
from .megatron_rules import has_merge_patterns, universal_keys
from .moe_writer import expert_group_indices, expert_universal_params
from .pipeline_writer import one_stage_state
from .tensor_parallel_writer import one_tensor_rank_state, unsharded_state
from .writer import (
    AnyPlannedFile,
    CheckpointPlan,
    LazyFile,
    OptimPlanner,
    PlannedFile,
    plan_model_states,
    plan_target,
    require_data_parallel,
    scalar_of,
    target_layout,
    tensor_of,
)

# What DeepSpeed 0.19.8's universal loaders restore of an optimizer's state:
# - ZeRO-3 (runtime/zero/stage3.py, _load_universal_checkpoint): the files fp32, exp_avg and
#   exp_avg_sq of each param (a fixed list: any other state is not read; a missing one fails the
#   load) and the step of optimizer_state.pt's first sub-group (KeyError without one);
# - ZeRO-1/2 (checkpoint/universal_checkpoint.py, load_hp_checkpoint_state): every <state>.pt in a
#   param's folder and its step.pt; a scalar state other than the step has no file it reads.
ZERO3_UNIVERSAL_STATES = (N.UNIVERSAL_EXP_AVG, N.UNIVERSAL_EXP_AVG_SQ)


@dataclass(frozen=True)
class UniversalLoss:
    """What DeepSpeed's universal loader of a ZeRO-`stage` run cannot restore of a training state:
    per-element states it does not read (`states`), scalar states it has no file for
    (`scalars`), and what it needs and the run's optimizer does not keep (`missing`: the load
    then fails)."""

    stage: int
    states: tuple[str, ...] = ()
    scalars: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    # states the ZeRO-1/2 loader lays out per element of the partition that the optimizer keeps
    # per whole param (DeepSpeed's Muon momentum_buffer, :mod:`.muon`): restored wrongly
    per_param: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.states or self.scalars or self.missing or self.per_param)

    def describe(self) -> str:
        """One sentence: what is lost, and why."""
        if self.stage == 3:
            reads = "DeepSpeed's ZeRO-3 universal loader reads fp32, exp_avg, exp_avg_sq and a step only"
        else:
            reads = "DeepSpeed's ZeRO-1/2 universal loader reads each param's per-element states and step only"
        parts = []
        if self.states or self.scalars:
            parts.append(f"{', '.join((*self.states, *self.scalars))} would not be restored")
        if self.missing:
            parts.append(f"its load fails, this checkpoint holding no {', '.join(self.missing)}")
        if self.per_param:
            parts.append(
                f"it lays Muon's {', '.join(self.per_param)} out per element of the partition, while Muon keeps "
                "the full momentum of each param the partition touches, so the step after the load misreads it "
                "(or fails)"
            )
        return f"{reads}: {'; '.join(parts)}"


def universal_loss(state: TrainingState, target_stage: int, per_element: bool = False) -> UniversalLoss:
    """What a universal folder for a ZeRO-`target_stage` run would not carry back into
    DeepSpeed (see ZERO3_UNIVERSAL_STATES); `per_element`: that run keeps Muon's momentum per
    element (BF16_Optimizer, an offloaded optimizer: :func:`.muon.momentum_per_element`), as its
    loader lays it out. Pure."""
    names = state.state_names
    scalars = list(dict.fromkeys(k for g in state.groups for k in g.scalars if k != N.UNIVERSAL_STEP))
    if target_stage != 3:
        per_param = dict.fromkeys(
            key
            for p in state.params
            for key in p.states
            if muon.whole_param_state(state.groups[p.group].hyperparams, key, target_stage, per_element)
        )
        return UniversalLoss(target_stage, states=tuple(per_param), scalars=tuple(scalars), per_param=tuple(per_param))
    # a step per sub-group, and each of ZeRO3_UNIVERSAL_STATES for every param (a Muon group has none)
    has_step = all(N.UNIVERSAL_STEP in g.scalars for g in state.groups)
    return UniversalLoss(
        3,
        states=tuple(n for n in names if n not in ZERO3_UNIVERSAL_STATES),
        scalars=tuple(scalars),
        missing=tuple(n for n in ZERO3_UNIVERSAL_STATES if any(n not in p.states for p in state.params))
        + (() if has_step else (N.UNIVERSAL_STEP,)),
    )


def plan_universal(
    state: TrainingState,
    *,
    target_stage: int | None = None,
    expert_parallel: int | None = None,
    tensor_parallel: int | None = None,
) -> CheckpointPlan:
    """Every file of the universal folder ``<tag>_universal`` as an object tree.

    `target_stage`: the ZeRO stage of the run that will load it (default: the input's; ZeRO-1 for
    a ZeRO-0 run, whose torch optimizer has no universal loader).

    A pipeline run's state is written as the model built as one stage: its params are named as
    ``PipelineModule`` names them at any stage count (``<global layer>.<name>``,
    ``tied_modules.<key>.<name>``), which is how DeepSpeed's universal loader finds each stage's
    params at any pipeline degree; the model_states file holds the one-stage module (DeepSpeed's
    pipeline engine does not read it from a universal folder; zckpt does, for frozen params and
    buffers), so the folder is whole on its own. An AutoTP run's is written unsharded: DeepSpeed's
    loader cuts each tensor rank's piece by the loading model's own ``affine_map``, at any
    tensor-parallel degree (ZeRO-3's from DeepSpeed's dict files only, which its folder holds, as
    ``ds_to_universal`` writes them: runtime/zero/stage3.py ``load_hp_checkpoint_state``). A
    Megatron-style run's is unsharded too, each param's files holding the merge rule
    ``ds_to_universal`` writes beside the tensor (``cat_dim``, sub-params, ``vocab_tensor``), which
    DeepSpeed's ZeRO-1/2 loader cuts the loading rank's slice by (its ZeRO-3 loader cuts none).

    `tensor_parallel` 1: a tensor-parallel run's folder as the unsharded model's run at one tensor
    rank saves it (:func:`~.tensor_parallel_writer.one_tensor_rank_state`: no rules of the old
    ranks; ZeRO-3's files flat), for a run without tensor parallelism, at any stage. Another
    degree: the default folder, which DeepSpeed's loader cuts for any.

    `expert_parallel`: a mixture-of-experts run's folder for a loading run at that expert-parallel
    degree (default: the run's own; :func:`~.moe_writer.expert_universal_params`): DeepSpeed's
    loader finds experts by their local ids at the loading run's degree.
    """
    tensor_parallel = _tensor_parallel(state, tensor_parallel)
    sharded = state.index.topology.tp > 1
    info = state.engine_extras.get(N.UNIVERSAL_CHECKPOINT_INFO)
    autotp = sharded and isinstance(info, dict) and N.AFFINE_MAP in info  # AutoTP's map of each rank's pieces
    keys = _megatron_keys(state) if sharded else {}
    params = list(state.params)
    experts = bool(expert_group_indices(state))
    if expert_parallel is not None and (expert_parallel < 1 or not experts):
        raise UsageError(
            None,
            f"--expert-parallel {expert_parallel}: "
            + ("at least 1" if expert_parallel < 1 else "for mixture-of-experts checkpoints; this one has no experts"),
        )
    if experts:
        state, params, keys = expert_universal_params(state, expert_parallel)
        state = replace(state, index=replace(state.index, topology=Topology.data_parallel(state.index.topology.dp)))
    pipeline = bool(state.stages)
    if pipeline:
        state = one_stage_state(state)  # with tensor ranks: every param already merged
        params = list(state.params)
    elif sharded:
        state = one_tensor_rank_state(state) if tensor_parallel == 1 else unsharded_state(state)
        params = list(state.params)
    require_data_parallel(state, "to-universal")
    if target_stage is None and state.index.zero_stage == 0:  # DeepSpeed's universal loader is ZeRO-1/2/3's
        target_stage = 1
    target = plan_target(state, state.index.topology.dp, target_stage)
    if experts and target.stage == 3:
        raise UsageError(None, "--target-stage 3: DeepSpeed runs native mixture-of-experts at ZeRO-0/1/2 only")
    if sharded and target.stage == 3 and tensor_parallel != 1 and (pipeline or not autotp):
        raise UsageError(
            None,
            "--target-stage 3: zckpt writes the universal folder of a tensor-parallel run for DeepSpeed's ZeRO-1/2 "
            "loader, which cuts each tensor rank's slice (its ZeRO-3 loader cuts AutoTP params only): pass "
            "--target-stage 1 or 2, --tensor-parallel 1 for a ZeRO-3 run without tensor parallelism, or "
            "`zckpt reshard --stage 3` for a ZeRO-3 run at the same tensor ranks",
        )
    layout = target_layout(state, target)
    files = plan_model_states(state, target, layout)
    files.append(
        PlannedFile(
            f"{N.UNIVERSAL_ZERO_DIR}/{N.UNIVERSAL_OPTIMIZER_STATE}",
            OptimPlanner(state, target, layout).universal_state(),
            None,
        )
    )
    zero3 = target.stage == 3
    # an AutoTP run's ZeRO-3 folder in DeepSpeed's dicts, as ds_to_universal writes it (merge_tp_slices)
    flat = zero3 and not (autotp and tensor_parallel != 1)
    for param in params:
        files.extend(_param_files(state, param, zero3, keys.get(param.name), flat))
    return CheckpointPlan(
        N.universal_tag(state.index.source_tag), target, layout, tuple(files), latest_file=N.LATEST_UNIVERSAL_FILE
    )


def _tensor_parallel(state: TrainingState, tensor_parallel: int | None) -> int | None:
    """`tensor_parallel` checked against the state: 1 for any run, another degree for a
    tensor-parallel one only (its folder loads at any degree: the default)."""
    if tensor_parallel is None or tensor_parallel == 1:
        return tensor_parallel
    if tensor_parallel < 1:
        raise UsageError(None, f"--tensor-parallel {tensor_parallel}: at least 1")
    if state.index.topology.tp == 1:
        raise UsageError(
            None,
            f"--tensor-parallel {tensor_parallel}: for tensor-parallel checkpoints; this one has none "
            "(1 writes it as it is)",
        )
    return tensor_parallel


def _megatron_keys(state: TrainingState) -> dict[str, dict[str, Any]]:
    """Per trainable param of a Megatron-style tensor-parallel run, what its universal files hold
    beside the tensor (:func:`~.megatron_rules.universal_keys`, by the rules its tensor ranks were
    merged by); empty for AutoTP, whose loader cuts by the loading model's own map."""
    info = state.tensor_merge_rules
    if not has_merge_patterns(info):
        return {}
    return {param.name: universal_keys(info, param.name) for param in state.params}


def _param_files(
    state: TrainingState, param: ParamState, zero3: bool, keys: dict[str, Any] | None = None, flat: bool | None = None
) -> list[AnyPlannedFile]:
    """The param's folder: its name and its states' names come from the checkpoint (its tag
    folder is named when one cannot be a file name). `keys`: what the files hold beside the
    tensor (a Megatron-style param's merge rule), else ``cat_dim`` 0. `flat` (default: `zero3`):
    each file the bare flat tensor, else DeepSpeed's dict of the full-shape tensor."""
    flat = zero3 if flat is None else flat
    where = state.index.tag_dir
    sources = {N.UNIVERSAL_FP32: param.master, **param.states}
    files: list[AnyPlannedFile] = []
    for key, source in sources.items():
        # built when written: a ZeRO-3 input's tensor is a part per rank that holds a piece of it
        build = functools.partial(_state_file, source, (source.numel,) if flat else param.shape, flat, keys)
        files.append(LazyFile(N.universal_state_file(param.name, key, where), build, None))
    step = state.groups[param.group].scalars.get(N.UNIVERSAL_STEP)
    if step is not None and not zero3:
        files.append(PlannedFile(N.universal_state_file(param.name, N.UNIVERSAL_STEP, where), scalar_of(step), None))
    return files


def _state_file(source: TensorSource, shape: tuple[int, ...], flat: bool, keys: dict[str, Any] | None) -> Any:
    """A param's state file: its whole tensor at `shape` (:func:`_wrapped`)."""
    return _wrapped(tensor_of(source, shape=shape), flat, keys)


def _wrapped(tensor: OutTensor, flat: bool, keys: dict[str, Any] | None) -> Any:
    """ZeRO-3's loader takes the bare flat tensor (or the dict, of which it cuts an AutoTP param's
    tensor rank's piece); ZeRO-1/2's wants DeepSpeed's dict (its key order: ``cat_dim`` or the
    other merge keys first, as ``merge_tp_slices`` fills it)."""
    if flat:
        return tensor
    return {**(keys if keys is not None else {N.UNIVERSAL_CAT_DIM: 0}), N.UNIVERSAL_PARAM: tensor}
