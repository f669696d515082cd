"""Mixture-of-experts checkpoints (DeepSpeed's native ``deepspeed.moe.layer.MoE``, ZeRO-1/2): read
as the model built with every expert on one rank.

What such a run saves (DeepSpeed 0.19.8, see ``sample_ckpts/FORMAT_OBSERVED.md``): one model-states
file without the expert params, ``param_shapes`` listing the dense groups and then the expert
groups under rank 0's *local* expert ids; per rank, an optimizer file whose dense groups are
partitioned over all ranks and whose expert groups (``moe: True``) over the rank's
expert-data-parallel group only (the group's ``partition_count`` is that group's size); per global
expert, ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` with its 16-bit weights under global ids.

DeepSpeed's default grouping ("E + D", ``groups._create_expert_and_data_parallel``): with W ranks
and expert-parallel degree E, rank r holds the experts of expert rank ``r % E``, and its expert
partitions are part ``r // E`` of those experts' flat groups. Local expert l of expert rank e is
global expert ``e * experts_per_rank + l`` (engine ``_save_moe_checkpoint``).

:func:`read_moe` reads the checkpoint as views the data-parallel reader
(:func:`~.dp_reader.read_ranks`) already knows: the dense groups over all W ranks, then, for each
expert rank, its expert groups over its D = W / E ranks under global names; and merges them.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from ..core.errors import CheckpointNotFoundError, CorruptFileError, LayoutError
from ..core.index import CheckpointIndex, Entry, TensorRef, merged_index
from ..core.state import TrainingState
from ..core.topology import RankCoords, Topology
from ..io.materialize import read_scalar
from ..io.reading import FileReader, source_of
from . import names as N
from .dp_reader import read_ranks
from .model_states import rounded_copies
from .optim_state import flat_states
from .rank_files import RankFiles, load
from .survey import Survey
from .zero0 import MASTERS, check_optimizer, read_zero0


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """Which param groups hold experts, the expert-parallel degree, and experts per rank per
    MoE module (keyed by the name prefix before ``deepspeed_experts.<id>``)."""

    world: int
    groups: tuple[int, ...]  # indices of the expert param groups
    ep: int
    per_rank: dict[str, int]

    @property
    def dense(self) -> list[int]:
        return [g for g in range(self.count) if g not in self.groups]

    count: int = 0  # param groups in all

    def global_name(self, name: str, ep_rank: int) -> str:
        """An expert param's name at expert rank `ep_rank` under its global expert id."""
        found = N.expert_id(name)
        if found is None:
            return name
        prefix, local = found
        return N.with_expert_id(name, ep_rank * self.per_rank[prefix] + local)


def expert_groups(result: Survey, files: RankFiles) -> ExpertGroups | None:
    """The expert groups, read from rank 0's files; None (a problem listed) when they do not add up."""
    optim0 = files.optim.get(0)
    model_path = files.model.get(None)
    if optim0 is None or model_path is None:
        return None  # the data-parallel reader names what is missing
    inner = (load(result, optim0[1]) or {}).get(N.OPTIMIZER_STATE_DICT)
    model = load(result, model_path)
    if not isinstance(inner, dict) or not isinstance(model, dict):
        return None
    counts = inner.get(N.PARTITION_COUNT)
    param_groups = flat_states(inner).get("param_groups")
    shapes = model.get(N.PARAM_SHAPES)
    if not (isinstance(counts, list) and isinstance(param_groups, list) and isinstance(shapes, list)):
        return None
    world = max(counts)
    moe = tuple(g for g, group in enumerate(param_groups) if isinstance(group, dict) and group.get("moe"))
    sizes = {counts[g] for g in moe if g < len(counts)}
    if not moe or len(sizes) != 1 or world % next(iter(sizes)):
        result.add(
            LayoutError,
            optim0[1],
            f"expert param groups {list(moe)} partitioned over {sorted(sizes)} of {world} ranks: not one expert-parallel degree (a run whose MoE layers have several ep_size values), which zckpt does not read",
        )
        return None
    per_rank: dict[str, int] = {}
    for g in moe:
        for name in shapes[g] if g < len(shapes) and isinstance(shapes[g], dict) else {}:
            found = N.expert_id(name)
            if found is None:
                result.add(LayoutError, model_path, f"param {name} of expert group {g} names no expert")
                return None
            prefix, local = found
            per_rank[prefix] = max(per_rank.get(prefix, 0), local + 1)
    ep = world // next(iter(sizes))
    return ExpertGroups(world, moe, ep, per_rank, count=len(counts))


def read_moe(result: Survey, files: RankFiles) -> None:
    """Read a mixture-of-experts tag folder into `result`: the dense groups over every rank, each
    expert rank's expert groups over its own ranks, merged into one index and training state.

    Guarantee: native MoE is refused by DeepSpeed at ZeRO-3 (only AutoEP runs there,
    deepspeed/runtime/engine.py:2214-2218), each expert's params are saved in its own
    ``layer_L_expert_E`` file by ``_save_moe_checkpoint`` (engine.py:5040-5140), each MoE param
    group partitioned over its expert data-parallel group (``partition_count``,
    zero/stage_1_and_2.py:294, set per group after), and every rank steps together (its dense
    groups' step equal to expert rank 0's)."""
    location = result.location
    assert location is not None
    if files.zero3:
        result.add(
            LayoutError,
            files.tag_dir,
            f"expert files ({files.expert_paths[0].rsplit('/', 1)[-1]} ...) beside ZeRO-3 files: a ZeRO-3 "
            "mixture-of-experts run (DeepSpeed's AutoEP; native mixture-of-experts runs at ZeRO-0/1/2 only), which "
            "zckpt does not read",
        )
        return
    if not files.optim:  # ZeRO-0: each expert rank's torch optimizer state in its expp_rank file
        _read_moe_zero0(result, files)
        return
    experts = expert_groups(result, files)
    if experts is None:
        if not result.problems:
            result.add(LayoutError, files.tag_dir, "a mixture-of-experts checkpoint without expert param groups")
        return
    dense = Survey(result.path, location=location)
    read_ranks(dense, files, view=lambda kind, rank, state: _dense_view(kind, state, experts))
    surveys = [dense]
    for ep_rank in range(experts.ep):
        own = _expert_rank_files(files, ep_rank, experts.ep)
        sub = Survey(result.path, location=location)
        read_ranks(sub, own, view=lambda kind, rank, state, e=ep_rank: _expert_view(kind, state, experts, e))
        surveys.append(sub)
    _merge_views(result, files, experts, surveys)


def _merge_views(
    result: Survey,
    files: RankFiles,
    experts: ExpertGroups,
    surveys: list[Survey],
    expert_states: dict[str, Any] | None = None,
) -> None:
    """One index and training state from the dense view's survey and each expert rank's
    (`expert_states`: the expert files already read, by path)."""
    dense = surveys[0]
    whole = result.take_parts(surveys, files.expert_paths)
    result.declared = [d for sub in surveys for d in sub.declared]
    result.declared_dtypes = dense.declared_dtypes
    result.world_size = dense.world_size
    if not whole:
        return
    assert dense.index is not None and dense.state is not None
    expert_names = {p.name for sub in surveys[1:] if sub.state is not None for p in sub.state.params}
    expert_weights = _check_expert_files(result, files, expert_names, expert_states)
    if expert_weights is None:
        return
    order = _module_order(dense.state.module_names, [s.state for s in surveys[1:] if s.state is not None])
    entries = sorted(
        (e for sub in surveys if sub.index is not None for e in sub.index.entries), key=lambda e: order[e.name]
    )
    experts_total = sum(n * experts.ep for n in experts.per_rank.values())
    result.notes.append(
        f"mixture-of-experts: {experts_total} experts in {len(experts.per_rank)} MoE layer(s), expert-parallel "
        f"degree {experts.ep} over {experts.world} ranks (expert data-parallel groups of {experts.world // experts.ep})"
    )
    result.index = merged_index(
        dense.index,
        Topology(ep=experts.ep, dp=experts.world),
        entries,
        tuple(result.files),
        tuple(result.notes),
        placements=_expert_placements(entries, experts),
        rounded_copies=[
            *(pair for sub in surveys if sub.index is not None for pair in sub.index.rounded_copies),
            *(rounded_copies(expert_weights, entries) if dense.index.zero_stage else ()),  # ZeRO-0: the masters
        ],
    )
    try:
        result.state = _merged_state(result.index, dense.state, surveys[1:], experts, order)
    except LayoutError as exc:
        result.problems.append(exc)
        result.index = None


def _read_moe_zero0(result: Survey, files: RankFiles) -> None:
    """A ZeRO-0 mixture-of-experts run: rank 0's model states hold the dense module; expert rank
    e's ``expp_rank_e`` file its torch optimizer's state dict (dense groups, replicated on every
    expert rank, then its experts' ``moe`` groups, local ids in module order); the expert files
    the experts' fp32 params under global ids. Read as the same views as ZeRO-1/2's: the dense
    groups with rank 0's optimizer, each expert rank's groups with its experts' weights."""
    location = result.location
    assert location is not None
    model_path = files.model.get(None)
    optim_files = {f.coords.expert: f.path for f in files.files if f.kind == "expert_optim"}
    if model_path is None:
        result.add(
            CheckpointNotFoundError, files.tag_dir, "no mp_rank_00_model_states.pt (the dense module) in the tag folder"
        )
        return
    if 0 not in optim_files:
        result.add(
            CheckpointNotFoundError,
            os.path.join(files.tag_dir, N.expert_optim_states_name(0)),
            "missing (the optimizer state of expert rank 0)",
        )
        return
    model = load(result, model_path)
    optimizers = {
        e: check_optimizer(result, load(result, path) or {}, path, required=True) for e, path in optim_files.items()
    }
    layers = [f for f in files.files if f.kind == "expert"]
    expert_states: dict[str, Any] = {}  # read here for the experts' weights, then checked with the names
    weights = _expert_weights(result, layers, expert_states)
    if not isinstance(model, dict) or weights is None or result.problems or any(o is None for o in optimizers.values()):
        return
    groups = optimizers[0]["param_groups"]
    moe = tuple(g for g, group in enumerate(groups) if group.get("moe"))
    counts = model.get(N.NUM_EXPERTS)
    held = sum(len(groups[g]["params"]) for g in moe)  # expert rank 0's expert params: the degree follows
    ep = len(weights) // held if held and len(weights) % held == 0 else 0
    totals = counts if isinstance(counts, list) and all(isinstance(c, int) for c in counts) else None
    if not moe or not ep or totals is None or len(layers) != sum(totals) or any(c % ep for c in totals):
        result.add(
            LayoutError,
            optim_files[0],
            f"{len(moe)} expert param groups of {held} params, {len(layers)} expert files of {len(weights)} tensors, "
            f"num_experts {counts}: these do not make one mixture-of-experts run",
        )
        return
    missing = [e for e in range(ep) if e not in optim_files]
    extra = [e for e in optim_files if e >= ep]
    if missing or extra:
        e = (missing or extra)[0]
        result.add(
            CheckpointNotFoundError if missing else LayoutError,
            os.path.join(files.tag_dir, N.expert_optim_states_name(e)),
            f"missing (the optimizer state of expert rank {e} of {ep})"
            if missing
            else f"an expert rank {e} beyond the run's expert-parallel degree {ep}: files of another run are mixed",
        )
        return
    if not _check_dense_replicas(result, optimizers, [g for g in range(len(groups)) if g not in moe], optim_files):
        return
    per_rank = {N.expert_id(name)[0]: count // ep for name, count in zip(_expert_prefixes(weights), totals)}
    world = model.get(N.DP_WORLD_SIZE) if isinstance(model.get(N.DP_WORLD_SIZE), int) else ep
    experts = ExpertGroups(world, moe, ep, per_rank, count=len(groups))

    def part(optimizer: dict, keep: list[int]) -> dict:
        """The param groups `keep` of an optimizer state, with their params' states (and a 16-bit
        run's fp32 masters and loss scaler values)."""
        kept = [optimizer["param_groups"][g] for g in keep]
        held = {i for group in kept for i in group["params"]}
        out = {**optimizer, "state": {i: v for i, v in optimizer["state"].items() if i in held}, "param_groups": kept}
        if MASTERS in optimizer:
            out[MASTERS] = {i: v for i, v in optimizer[MASTERS].items() if i in held}
        return out

    dense = Survey(result.path, location=location)
    read_zero0(dense, model, part(optimizers[0], experts.dense), model_path, optim_files[0])
    surveys = [dense]
    for e in range(ep):
        own = OrderedDict(
            (name, ref)
            for name, ref in weights.items()
            if (found := N.expert_id(name)) is not None and found[1] // per_rank[found[0]] == e
        )
        view = {**model, N.MODULE: own, N.BUFFER_NAMES: [], N.DP_WORLD_SIZE: world // ep}
        sub = Survey(result.path, location=location)
        read_zero0(sub, view, part(optimizers[e], list(moe)), model_path, optim_files[e])
        surveys.append(sub)
    _merge_views(result, files, experts, surveys, expert_states)


def _check_dense_replicas(result: Survey, optimizers: dict[int, dict], dense: list[int], paths: dict[int, str]) -> bool:
    """Every expert rank's file holds the same dense param groups (their params and settings)
    at the same step as expert rank 0's: files of one save (a problem listed where not)."""
    first = optimizers[0]
    with FileReader() as reader:

        def steps(optimizer: dict) -> list[Any]:
            found = []
            for g in dense:
                params = optimizer["param_groups"][g]["params"]
                entry = optimizer["state"].get(params[0]) if params else None
                step = entry.get("step") if isinstance(entry, dict) else None
                found.append(read_scalar(reader, source_of(step)) if isinstance(step, TensorRef) else step)
            return found

        expected = steps(first)
        for e, optimizer in sorted(optimizers.items()):
            groups = optimizer["param_groups"]
            if len(groups) != len(first["param_groups"]) or any(
                {k: v for k, v in groups[g].items() if k != "params"}
                != {k: v for k, v in first["param_groups"][g].items() if k != "params"}
                or len(groups[g]["params"]) != len(first["param_groups"][g]["params"])
                for g in dense
            ):
                result.add(LayoutError, paths[e], "its dense param groups differ from expert rank 0's")
                return False
            found = steps(optimizer)
            if found != expected:
                result.add(
                    LayoutError,
                    paths[e],
                    f"its dense groups are at step {found}, expert rank 0's at {expected}: files of different saves are mixed",
                )
                return False
    return True


def _expert_weights(result: Survey, layers: list, expert_states: dict[str, Any]) -> dict[str, TensorRef] | None:
    """Every expert file's tensors under their global names, by layer and expert id (the module's
    order); each file read into `expert_states`."""
    weights: dict[str, TensorRef] = {}
    for f in sorted(layers, key=lambda f: (f.layer or 0, f.coords.expert)):
        state = load(result, f.path, expert_states)
        if not isinstance(state, dict) or not all(isinstance(v, TensorRef) for v in state.values()):
            if state is not None:
                result.add(CorruptFileError, f.path, "not an expert file (a state dict of tensors)")
            return None
        weights.update(state)
    return weights


def _expert_prefixes(weights: dict[str, TensorRef]) -> list[str]:
    """One name per MoE layer (the first of each layer's expert prefix), in order."""
    seen: dict[str, str] = {}
    for name in weights:
        found = N.expert_id(name)
        if found is not None:
            seen.setdefault(found[0], name)
    return list(seen.values())


def _expert_placements(entries: list[Entry], experts: ExpertGroups) -> dict[str, str]:
    """Each expert tensor's expert and the expert rank that held it (rank r holds expert rank
    r % ep's experts: DeepSpeed's default grouping), over how many data-parallel ranks."""
    placements = {}
    for entry in entries:
        found = N.expert_id(entry.name)
        if found is None or found[0] not in experts.per_rank:
            continue
        prefix, expert = found
        rank = expert // experts.per_rank[prefix]
        replicas = experts.world // experts.ep
        placements[entry.name] = (
            f"expert {expert} on expert rank {rank} of {experts.ep} (data-parallel over {replicas} rank{'s' * (replicas != 1)})"
        )
    return placements


def _check_expert_files(
    result: Survey, files: RankFiles, expert_names: set[str], expert_states: dict[str, Any] | None = None
) -> dict[str, TensorRef] | None:
    """Each expert file parses as a state dict of its own expert's params, and together they hold
    every expert param once: each one's weights by name (None: a problem listed). The writers copy
    these files byte for byte: one that is not what its name says (a link to anything else) must
    not reach an output."""
    held: dict[str, str] = {}
    weights: dict[str, TensorRef] = {}
    for f in files.files:
        if f.kind != "expert":
            continue
        state = load(result, f.path, expert_states)
        if state is None:
            continue
        if not isinstance(state, dict) or not all(isinstance(v, TensorRef) for v in state.values()):
            result.add(CorruptFileError, f.path, "not an expert file (a state dict of tensors)")
            continue
        for name in state:
            found = N.expert_id(str(name))
            if name not in expert_names or found is None or found[1] != f.coords.expert:
                result.add(
                    LayoutError,
                    f.path,
                    f"holds {name}, not a trainable param of expert {f.coords.expert} "
                    "(frozen expert params and expert buffers are not read yet)",
                )
                break
            if name in held:
                result.add(LayoutError, f.path, f"holds {name}, which {os.path.basename(held[name])} holds too")
                break
            held[name] = f.path
            weights[name] = state[name]
    missing = sorted(expert_names - set(held))
    if missing and not result.problems:
        result.add(
            CheckpointNotFoundError,
            files.tag_dir,
            f"no expert file holds {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
        )
    return None if result.problems else weights


def _expert_rank_files(files: RankFiles, ep_rank: int, ep: int) -> RankFiles:
    """The files of the ranks holding expert rank `ep_rank`'s experts, numbered within its expert
    data-parallel group; the one model-states file with them."""
    own = []
    for f in files.files:
        if f.kind == "optim" and f.coords.data % ep == ep_rank:
            own.append(dataclasses.replace(f, coords=RankCoords.dp(f.coords.data // ep)))
        elif f.kind == "model":
            own.append(f)
    return RankFiles(files.tag_dir, tuple(own))


def _pick(values: Any, keep: list[int]) -> Any:
    return [values[g] for g in keep] if isinstance(values, list) else values


def _inner_view(inner: Any, keep: list[int], rename: Any = None) -> Any:
    """An optimizer file's inner dict with only the param groups `keep`, renumbered from 0, and
    the slice mappings' names passed through `rename`."""
    if not isinstance(inner, dict):
        return inner
    view = dict(inner)
    for key in N.ZERO12_PER_GROUP_KEYS:
        if key in view:
            view[key] = _pick(view[key], keep)
    if rename is not None and isinstance(view.get(N.PARAM_SLICE_MAPPINGS), list):
        view[N.PARAM_SLICE_MAPPINGS] = [
            OrderedDict((rename(n), a) for n, a in m.items()) if isinstance(m, dict) else m
            for m in view[N.PARAM_SLICE_MAPPINGS]
        ]
    base = view.get(N.BASE_OPTIMIZER_STATE)
    if isinstance(base, dict) and isinstance(base.get("state"), dict):
        groups = base.get("param_groups")
        view[N.BASE_OPTIMIZER_STATE] = {
            **base,
            "state": {new: base["state"][old] for new, old in enumerate(keep) if old in base["state"]},
            "param_groups": [{**groups[old], "params": [new]} for new, old in enumerate(keep)]
            if isinstance(groups, list) and all(isinstance(groups[g], dict) for g in keep if g < len(groups))
            else groups,
        }
    return view


def _dense_view(kind: str, state: Any, experts: ExpertGroups) -> Any:
    """A file as the dense groups' data-parallel checkpoint sees it."""
    if not isinstance(state, dict):
        return state
    if kind == "model":
        return {**state, N.PARAM_SHAPES: _pick(state.get(N.PARAM_SHAPES), experts.dense)}
    return {**state, N.OPTIMIZER_STATE_DICT: _inner_view(state.get(N.OPTIMIZER_STATE_DICT), experts.dense)}


def _expert_view(kind: str, state: Any, experts: ExpertGroups, ep_rank: int) -> Any:
    """A file as expert rank `ep_rank`'s expert groups see it: their params under global ids, no
    dense module (its buffers and frozen params are the dense view's)."""
    if not isinstance(state, dict):
        return state

    def rename(name: str) -> str:
        return experts.global_name(name, ep_rank)

    if kind == "model":
        shapes = _pick(state.get(N.PARAM_SHAPES), list(experts.groups))
        if isinstance(shapes, list):
            shapes = [OrderedDict((rename(n), s) for n, s in g.items()) if isinstance(g, dict) else g for g in shapes]
        empty = {
            key: ({} if state.get(key) is not None else None)
            for key in (N.FROZEN_PARAM_SHAPES, N.FROZEN_PARAM_FRAGMENTS)
        }
        return {
            **state,
            N.MODULE: OrderedDict(),
            N.PARAM_SHAPES: shapes,
            N.BUFFER_NAMES: [],
            N.SHARED_PARAMS: {},
            N.DP_WORLD_SIZE: experts.world // experts.ep,
            **empty,
        }
    return {
        **state,
        N.OPTIMIZER_STATE_DICT: _inner_view(state.get(N.OPTIMIZER_STATE_DICT), list(experts.groups), rename),
    }


def _module_order(dense_names: tuple[str, ...], expert_states: list[TrainingState]) -> dict[str, int]:
    """The state dict order of the model with every expert on one rank: each MoE module's
    experts (by global id) right after its gate, as ``MOELayer`` registers them."""
    experts: dict[str, list[tuple[int, str]]] = {}
    for state in expert_states:
        for param in state.params:
            prefix, expert = N.expert_id(param.name) or ("", 0)
            experts.setdefault(prefix, []).append((expert, param.name))
    after: dict[int, list[str]] = {}  # position in the dense order -> the experts that follow it
    for prefix, members in experts.items():
        gate = prefix.replace("experts.deepspeed_experts.", "gate.")
        last = max((i for i, n in enumerate(dense_names) if n.startswith(gate)), default=len(dense_names) - 1)
        after.setdefault(last, []).extend(name for _, name in sorted(members, key=lambda m: m[0]))
    names: list[str] = []
    for i, name in enumerate(dense_names):
        names.append(name)
        names.extend(after.get(i, []))
    if not dense_names:
        names.extend(n for members in after.values() for n in members)
    return {name: i for i, name in enumerate(names)}


def _merged_state(
    index: CheckpointIndex,
    dense: TrainingState,
    expert_states: list[Survey],
    experts: ExpertGroups,
    order: dict[str, int],
) -> TrainingState:
    """One training state: the dense view's, with each expert group's params from every expert
    rank under its original group index."""
    states = [s.state for s in expert_states if s.state is not None]
    groups: list[Any] = [None] * experts.count
    for new, old in enumerate(experts.dense):
        groups[old] = dense.groups[new]
    params = [replace(p, group=experts.dense[p.group]) for p in dense.params]
    for new, old in enumerate(experts.groups):
        members = [name for state in states for name in state.groups[new].params]
        groups[old] = replace(states[0].groups[new], params=tuple(members))
        params += [replace(p, group=old) for state in states for p in state.params if p.group == new]
    if any(g is None for g in groups):
        raise LayoutError(index.tag_dir, "the expert and dense views do not cover every param group")
    by_name = {p.name: p for p in params}
    module_names = sorted([*dense.module_names, *(p.name for s in states for p in s.params)], key=lambda n: order[n])
    return replace(
        dense,
        index=index,
        params=tuple(by_name[name] for group in groups for name in group.params),
        groups=tuple(groups),
        module_names=tuple(module_names),
    )
