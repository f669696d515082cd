"""Mixture-of-experts checkpoints written (:func:`plan_moe_checkpoint`): the training state of a
native-MoE run laid out for another number of data-parallel ranks at the same expert-parallel
degree, as DeepSpeed saves it, so a plain ``load_checkpoint`` of the new run reads it.

As the reader (:mod:`.moe`) does, the writer works on views the data-parallel writer
(:func:`~.writer.plan_checkpoint`) already lays out: the dense groups over all W ranks, and each
expert rank's experts (under their local ids) over its W / E expert data-parallel ranks. Rank
``r`` gets the dense part ``r`` and part ``r // E`` of expert rank ``r % E``'s experts, merged
group by group into one optimizer file. The expert files hold each expert's module tensors under
its global id, whatever the data-parallel size: they are copied as they are.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from ..core.errors import LayoutError, UsageError
from ..core.index import TensorSource
from ..core.state import ParamState, TrainingState
from ..core.topology import Topology
from ..torchfile.pickler import PickledReduce
from . import names as N
from .writer import AnyPlannedFile, CheckpointPlan, PlannedFile, Target, copied_file, derived_file, plan_checkpoint


def expert_group_indices(state: TrainingState) -> list[int]:
    """The param groups DeepSpeed marked ``moe: True``."""
    return [g for g, group in enumerate(state.groups) if group.hyperparams.get("moe")]


def plan_moe_checkpoint(state: TrainingState, target: Target, expert_parallel: int | None = None) -> CheckpointPlan:
    """Every file of the mixture-of-experts checkpoint for `target` (its data-parallel size and
    ZeRO-1/2 stage) at the input's expert-parallel degree or at `expert_parallel`; pure.

    Another degree moves experts between expert ranks: expert rank e of the new run holds global
    experts ``e * per_rank .. (e + 1) * per_rank - 1`` under local ids, its expert groups
    partitioned over its W / E ranks and named ``ep_size_E`` as DeepSpeed names them; the expert
    files (one per global expert) are the same at any degree, and DeepSpeed's loader reads each
    rank's experts from them by global id."""
    ep = expert_parallel or state.index.topology.ep
    if state.index.universal:
        raise UsageError(
            state.index.tag_dir,
            "a mixture-of-experts universal folder holds no expert files, which a plain MoE checkpoint needs: load it "
            "with load_universal (at its expert-parallel degree), or reshard the checkpoint it was made from",
        )
    if target.stage not in (1, 2):
        raise UsageError(None, f"--stage {target.stage}: DeepSpeed runs native mixture-of-experts at ZeRO-0/1/2 only")
    if target.world_size % ep:
        raise UsageError(
            None,
            f"--world-size {target.world_size}: a multiple of the expert-parallel degree {ep} "
            "(each expert rank's experts are partitioned over world size / degree ranks)",
        )
    expert = expert_group_indices(state)
    dense = [g for g in range(len(state.groups)) if g not in expert]
    per_rank = _experts_per_rank(state, expert, ep)
    if ep != state.index.topology.ep:
        state = _renamed_expert_groups(state, expert, state.index.topology.ep, ep)
    dense_plan = plan_checkpoint(_view(state, dense, lambda name: name), target)
    expert_target = replace(target, world_size=target.world_size // ep)
    expert_plans = [
        plan_checkpoint(
            _view(state, expert, lambda name, e=e: _local_name(name, e, per_rank), per_rank=per_rank, ep_rank=e),
            expert_target,
        )
        for e in range(ep)
    ]
    optim = {f.rank: f for f in dense_plan.files if N.OPTIM_STATES_RE.match(f.name)}
    experts_optim = [{f.rank: f for f in plan.files if N.OPTIM_STATES_RE.match(f.name)} for plan in expert_plans]
    files: list[AnyPlannedFile] = []
    for f in dense_plan.files:
        if f.rank in optim and f is optim[f.rank]:
            assert f.rank is not None
            part = experts_optim[f.rank % ep][f.rank // ep]
            files.append(derived_file(f, lambda obj, part=part: _merged_optim(obj, part.obj, dense, expert)))
        else:
            expert_model = next(p for p in expert_plans[0].files if N.MODEL_STATES_RE.match(p.name))
            files.append(derived_file(f, lambda obj, m=expert_model: _merged_model(obj, m.obj, dense, expert, state)))
    for path in sorted(p for p in state.index.files if N.EXPERT_STATES_RE.match(os.path.basename(p))):
        files.append(PlannedFile(os.path.basename(path), copied_file(path), None))
    return replace(dense_plan, files=tuple(files))


def _experts_per_rank(state: TrainingState, expert: list[int], ep: int) -> dict[str, int]:
    """Experts per expert rank, per MoE module (the name before ``deepspeed_experts.<id>``).
    Raises UsageError when a module's experts do not divide over `ep` expert ranks."""
    ids: dict[str, set[int]] = {}
    for g in expert:
        for name in state.groups[g].params:
            found = N.expert_id(name)
            if found is not None:
                ids.setdefault(found[0], set()).add(found[1])
    for prefix, found in ids.items():
        if len(found) % ep:
            raise UsageError(
                None,
                f"--expert-parallel {ep}: {prefix.rstrip('.')} has {len(found)} experts, which do not divide over "
                f"{ep} expert ranks",
            )
    return {prefix: len(found) // ep for prefix, found in ids.items()}


def _renamed_expert_groups(state: TrainingState, expert: list[int], old: int, new: int) -> TrainingState:
    """The expert groups under the name a run at expert-parallel degree `new` gives them
    (``ep_size_<degree>``, DeepSpeed's ``MoE.expert_group_name``, which its loader restores)."""
    groups = list(state.groups)
    for g in expert:
        name = groups[g].hyperparams.get("name")
        if name == f"{N.EXPERT_GROUP_PREFIX}{old}":
            groups[g] = replace(
                groups[g], hyperparams={**groups[g].hyperparams, "name": f"{N.EXPERT_GROUP_PREFIX}{new}"}
            )
    return replace(state, groups=tuple(groups))


def _local_name(name: str, ep_rank: int, per_rank: dict[str, int]) -> str:
    found = N.expert_id(name)
    if found is None:
        return name
    prefix, expert = found
    return N.with_expert_id(name, expert - ep_rank * per_rank[prefix])


def _view(
    state: TrainingState,
    keep: list[int],
    rename: Any,
    per_rank: dict[str, int] | None = None,
    ep_rank: int = 0,
) -> TrainingState:
    """The state of the param groups `keep` (renumbered from 0), for the experts of `ep_rank`
    only when `per_rank` is given, under the names `rename` gives; a data-parallel state."""

    def mine(name: str) -> bool:
        found = N.expert_id(name)
        if per_rank is None or found is None:
            return True
        prefix, expert = found
        return ep_rank * per_rank[prefix] <= expert < (ep_rank + 1) * per_rank[prefix]

    groups = [state.groups[g] for g in keep]
    members = {name for group in groups for name in group.params if mine(name)}
    others = {n for g in range(len(state.groups)) if g not in keep for n in state.groups[g].params}

    def kept(name: str) -> bool:
        """The expert view holds its experts only; the dense view everything but the experts."""
        return name in members if per_rank is not None else name not in others

    params = tuple(
        replace(p, name=rename(p.name), group=keep.index(p.group)) for p in state.params if p.name in members
    )
    entries = tuple(replace(e, name=rename(e.name)) for e in state.index.entries if kept(e.name))
    index = replace(state.index, entries=entries, topology=Topology.data_parallel(state.index.world_size), replicas=())
    return replace(
        state,
        index=index,
        params=params,
        groups=tuple(replace(g, params=tuple(rename(n) for n in g.params if mine(n))) for g in groups),
        module_names=tuple(rename(n) for n in state.module_names if kept(n)),
    )


def _merge_lists(dense: Any, expert: Any, dense_groups: list[int], expert_groups: list[int]) -> Any:
    count = len(dense_groups) + len(expert_groups)
    merged: list[Any] = [None] * count
    for new, g in enumerate(dense_groups):
        merged[g] = dense[new]
    for new, g in enumerate(expert_groups):
        merged[g] = expert[new]
    return merged


def _merged_optim(dense_file: dict, expert_file: dict, dense: list[int], expert: list[int]) -> dict:
    """One rank's optimizer file: its dense groups' part and its expert groups' part."""
    a, b = dense_file[N.OPTIMIZER_STATE_DICT], expert_file[N.OPTIMIZER_STATE_DICT]
    inner: dict[str, Any] = {}
    for key, value in a.items():
        if key in N.ZERO12_PER_GROUP_KEYS and isinstance(value, list):
            inner[key] = _merge_lists(value, b[key], dense, expert)
        elif key == N.BASE_OPTIMIZER_STATE:
            state = {}
            for new, g in enumerate(dense):
                if new in value["state"]:
                    state[g] = value["state"][new]
            for new, g in enumerate(expert):
                if new in b[key]["state"]:
                    state[g] = b[key]["state"][new]
            groups = _merge_lists(value["param_groups"], b[key]["param_groups"], dense, expert)
            inner[key] = {
                "state": dict(sorted(state.items())),
                "param_groups": [{**group, "params": [g]} for g, group in enumerate(groups)],
            }
        else:
            inner[key] = value
    return {**dense_file, N.OPTIMIZER_STATE_DICT: inner}


def _merged_model(
    dense_file: dict, expert_file: dict, dense: list[int], expert: list[int], state: TrainingState
) -> dict:
    """The model-states file: the dense module and shapes, the expert groups' shapes under expert
    rank 0's local names (the writer adds the engine's MoE keys)."""
    out = OrderedDict(dense_file)
    shapes = _merge_lists(dense_file[N.PARAM_SHAPES], expert_file[N.PARAM_SHAPES], dense, expert)
    # a MoE run's engine saves its shapes as plain tuples, not torch.Size (FORMAT_OBSERVED.md)
    out[N.PARAM_SHAPES] = [
        OrderedDict((n, v.args[0] if isinstance(v, PickledReduce) else v) for n, v in group.items()) for group in shapes
    ]
    return dict(out)


def expert_universal_params(
    state: TrainingState, expert_parallel: int | None = None
) -> tuple[TrainingState, list[ParamState], dict[str, dict[str, Any]]]:
    """A mixture-of-experts run's state, params as its universal folder holds them for a loading
    run at expert-parallel degree `expert_parallel` (default: the run's own), and what each file
    holds beside the tensor. DeepSpeed's universal loader finds a param's folder by the loading
    rank's own (local) name, and the expert ranks of a native MoE give different experts the
    same local names; an expert param's folder therefore holds its copies on every expert rank
    of that degree stacked on a new dim 0 (expert rank e's is global expert ``e * per_rank +
    local``), marked ``is_expert_param`` with ``ep_num_experts`` = the degree, and the loader
    takes row ``ep_rank`` (DeepSpeed's EP slicing, one expert per local name and rank). Such a
    folder loads at that degree only, over any number of data ranks. At degree 1 local names are
    global ones and the loader slices nothing: each expert's folder holds it alone, unmarked.
    Dense params are as they are. The state's expert groups take the name a run at that degree
    gives them (``ep_size_<degree>``): DeepSpeed restores the saved name, and its next save looks
    the expert group up by it. Raises UsageError when the experts do not divide over the degree."""
    expert = expert_group_indices(state)
    ep = expert_parallel or state.index.topology.ep
    per_rank = _experts_per_rank(state, expert, ep)
    if ep != state.index.topology.ep:
        state = _renamed_expert_groups(state, expert, state.index.topology.ep, ep)
    if ep == 1:
        return state, list(state.params), {}
    stacks: dict[str, list[ParamState | None]] = {}
    for param in state.params:
        found = N.expert_id(param.name)
        if param.group not in expert or found is None:
            continue
        rank = found[1] // per_rank[found[0]]
        stacks.setdefault(_local_name(param.name, rank, per_rank), [None] * ep)[rank] = param
    params: list[ParamState] = []
    keys: dict[str, dict[str, Any]] = {}
    done: set[str] = set()
    for param in state.params:
        found = N.expert_id(param.name)
        if param.group not in expert or found is None:
            params.append(param)
            continue
        local = _local_name(param.name, found[1] // per_rank[found[0]], per_rank)
        if local in done:
            continue
        done.add(local)
        copies = stacks[local]
        if any(c is None for c in copies):
            raise LayoutError(state.index.tag_dir, f"{local}: not every expert rank holds an expert of that name")
        stacked = [c for c in copies if c is not None]
        params.append(
            ParamState(
                local,
                (ep, *param.shape),
                param.group,
                _stacked([c.master for c in stacked]),
                {k: _stacked([c.states[k] for c in stacked]) for k in param.states},
            )
        )
        keys[local] = {N.UNIVERSAL_CAT_DIM: 0, N.EP_IS_EXPERT_PARAM: True, N.EP_NUM_EXPERTS: ep}
    return state, params, keys


def _stacked(sources: list[TensorSource]) -> TensorSource:
    dtypes = {s.dtype for s in sources}
    if len(dtypes) != 1:
        raise LayoutError(None, "an expert's copies differ in dtype")
    return TensorSource(
        sources[0].dtype, (len(sources), *sources[0].shape), tuple(g for s in sources for g in s.segments)
    )
