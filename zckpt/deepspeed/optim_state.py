"""The training state of a DeepSpeed checkpoint beyond the weights: optimizer states per param,
param groups, loss scaler, lr scheduler, counters, config and client state.

Called by the reader once it has validated the files and built the layout, with the pickles it
loaded. Optimizer state tensors are located with the same layout pieces as the fp32 masters, so a
state is found wherever its master is (NVMe swap files included). Which keys are per-element
states is decided by size, never by name: any optimizer's state (Adam's ``exp_avg``, SGD's
``momentum_buffer``, ...) is carried.
"""

from __future__ import annotations

from typing import Callable

from ..core.errors import LayoutError
from ..core.index import CheckpointIndex, PackedSegments, Segment, TensorRef, TensorSource
from ..core.state import ParamGroupState, ParamState, ScalarState, TrainingState
from ..io.reading import source_of
from . import muon
from . import names as N
from .elastic import ELASTIC_VIEW
from .layout import FlatGroup, ZeroLayout, round_robin_order, zero12_layout

# model_states keys that the engine writes itself; anything else came from the training script
ENGINE_KEYS = (
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
    N.SPARSE_TENSOR_MODULE_NAMES,
    N.SKIPPED_STEPS,
    N.GLOBAL_STEPS,
    N.GLOBAL_SAMPLES,
    N.DP_WORLD_SIZE,
    N.MP_WORLD_SIZE,
    N.CHECKPOINT_PARALLEL_DIMENSIONS,
    N.DS_CONFIG,
    N.DS_VERSION,
    N.NUM_EXPERTS,
    N.DS_AUTOEP_LAYERS,
    N.UNIVERSAL_CHECKPOINT_INFO,
)
# engine keys carried as saved (the rest are rebuilt by a writer)
CARRIED_ENGINE_KEYS = (
    N.OPTIMIZER,
    N.DATA_SAMPLER,
    N.RANDOM_LTD,
    N.SPARSE_TENSOR_MODULE_NAMES,
    N.CHECKPOINT_PARALLEL_DIMENSIONS,
    N.NUM_EXPERTS,
    N.DS_AUTOEP_LAYERS,
    N.UNIVERSAL_CHECKPOINT_INFO,
)
# ZeRO optimizer keys that are neither layout nor per-param state
OPTIMIZER_EXTRA_KEYS = (N.DYNAMIC_LOSS_SCALE, N.OVERFLOW, N.CLIP_GRAD)

SwapPath = Callable[[int, int, TensorRef, ZeroLayout, FlatGroup, str, str], "str | None"]


def flat_states(inner: dict) -> dict:
    """The torch optimizer state dict inside a ZeRO optimizer file ({state, param_groups})."""
    for key in (N.BASE_OPTIMIZER_STATE, N.OPTIMIZER_STATE_DICT):
        value = inner.get(key)
        if isinstance(value, dict) and "state" in value:
            return value
    return {}


def build_training_state(
    index: CheckpointIndex,
    layout: ZeroLayout,
    models: dict,
    inner: dict[int, dict],
    optim_paths: dict[int, str],
    swap_path: SwapPath,
    round_robin: bool,
    optimizer_offload: bool = False,
) -> TrainingState:
    """Assemble the TrainingState (`round_robin`: the saved config's round_robin_gradients;
    `optimizer_offload`: ZeRO-1/2 with offload_optimizer, which keeps Muon's momentum per element);
    raises LayoutError when a state tensor does not fit the layout.

    Guarantee: DeepSpeed gives the torch optimizer one flat fp32 partition per param group
    (ZeRO-1/2: ``single_partition_of_fp32_groups``, zero/stage_1_and_2.py:577, the optimizer's
    params at :584; ZeRO-3: one per sub-group, zero/stage3.py:1081-1120), so an elementwise
    optimizer's states have the partition's size; not guaranteed for a state that is not
    elementwise (DeepSpeed's Muon keeps a momentum per whole param), which is refused by name."""
    zero3 = layout.stage == 3
    model0 = models[0 if zero3 else None]
    world = layout.world_size
    per_rank = {rank: flat_states(inner[rank]) for rank in range(world)}
    states0 = per_rank[0].get("state") or {}

    # per-element states of each (rank, flat group), located by size; the rest are scalars
    element_keys: list[str] = []
    tensors: dict[tuple[int, int, str], TensorRef] = {}
    saved_groups = per_rank[0].get("param_groups") or []
    by_rank: dict = {}  # layout.by_rank(), built when a Muon group needs it
    bf16_optimizer = not zero3 and N.ZERO_STAGE not in inner[0]  # its files have no stage key
    per_element = muon.momentum_per_element(bf16_optimizer, optimizer_offload)
    whole: set[tuple[int, str]] = set()  # (flat group, key) kept per whole param (DeepSpeed's Muon)
    elastic = not zero3 and bool(inner[0].get(ELASTIC_VIEW))  # states saved less the padding (.elastic)
    for rank in range(world):
        state = per_rank[rank].get("state") or {}
        for flat, group in enumerate(layout.flat_groups):
            hyper = saved_groups[group.param_group] if group.param_group < len(saved_groups) else None
            for key, value in (state.get(flat) or {}).items():
                if not isinstance(value, TensorRef) or len(value.shape) != 1:
                    continue
                if muon.whole_param_state(hyper, key, layout.stage, per_element):
                    by_rank = by_rank or layout.by_rank()
                    needed = muon.buffer_numel(layout, by_rank.get((rank, flat), []))
                    if value.numel != needed:
                        raise LayoutError(
                            optim_paths[rank],
                            f"Muon's {key} of group {flat} holds {value.numel} elements; DeepSpeed keeps the full momentum of each param the rank's partition touches, {needed} elements: truncated or mixed files",
                        )
                    ref = value
                    whole.add((flat, key))
                elif value.numel == group.partition or (elastic and value.numel == group.saved[rank]):
                    ref = value
                elif value.numel == 0 and group.partition and index.offload == "nvme":
                    path = swap_path(rank, flat, value, layout, group, optim_paths[rank], key)
                    if path is None:
                        raise LayoutError(
                            optim_paths[rank],
                            f"sub-group {flat}: {key} was offloaded to NVMe and its swap file is unusable",
                        )
                    ref = TensorRef.flat(path, 0, value.dtype, group.partition)
                else:
                    raise LayoutError(
                        optim_paths[rank],
                        f"optimizer state {key} of group {flat} holds {value.numel} elements, the partition {group.partition}: an optimizer state that is not one value per element of the partition (as DeepSpeed's Muon keeps one momentum_buffer per whole param), which zckpt does not read",
                    )
                tensors[(rank, flat, key)] = ref
                if key not in element_keys:
                    element_keys.append(key)

    params: list[ParamState] = []
    shapes = {e.name: e.source.shape for e in index.entries if e.kind == "param"}
    masters = {e.name: e.source for e in index.entries if e.kind == "param"}
    holders = muon.holders(layout) if whole else []
    copies: list[tuple[str, str, TensorSource]] = []
    for number, (param, pieces) in enumerate(zip(layout.params, layout.by_param())):
        states: dict[str, TensorSource] = {}
        flat = pieces[0].flat if pieces else None
        for key in element_keys:
            if (flat, key) in whole:
                # the full momentum, from the lowest rank that holds it; the others' copies are
                # kept for verify (DeepSpeed computes them alike: the module docstring of .muon)
                held = [
                    _whole_source(tensors[(rank, flat, key)], offset, shapes[param.name], param.numel)
                    for rank, offset in holders[number]
                    if (rank, flat, key) in tensors
                ]
                if held:
                    states[key] = held[0]
                    copies.extend((param.name, key, other) for other in held[1:])
                continue
            refs = [tensors.get((p.rank, p.flat, key)) for p in pieces]
            if any(r is None for r in refs):
                continue  # a group without this state (e.g. not stepped yet)
            segments = PackedSegments(
                Segment(r.path, r.offset + p.flat_offset * r.dtype.itemsize, p.length) for r, p in zip(refs, pieces)
            )
            states[key] = TensorSource(
                refs[0].dtype if refs else masters[param.name].dtype, shapes[param.name], segments
            )
        params.append(ParamState(param.name, shapes[param.name], param.group, masters[param.name], states))

    groups = _param_groups(layout, per_rank[0], states0, element_keys)
    order = optimizer_order(layout, params, round_robin)
    return TrainingState(
        index=index,
        params=tuple(params[i] for i in order),
        groups=groups,
        rank_buffers=tuple(module_buffers(models[rank]) for rank in range(world)) if zero3 else (),
        round_robin=not zero3 and round_robin,
        state_copies=tuple(copies),
        **saved_run_state(model0, inner[0]),
    )


def _whole_source(ref: TensorRef, offset: int, shape: tuple[int, ...], numel: int) -> TensorSource:
    """A param's full state at element `offset` of a flat per-param buffer (Muon's momentum)."""
    return TensorSource(ref.dtype, shape, (Segment(ref.path, ref.offset + offset * ref.dtype.itemsize, numel),))


def saved_run_state(model0: dict, optimizer: dict) -> dict:
    """The TrainingState fields that rank 0's model states and the optimizer's global keys hold
    (module names, counters, scheduler, scaler, config, client state), as keyword arguments."""
    module = model0.get(N.MODULE) or {}
    return dict(
        module_names=tuple(module),
        module_dtype_names={k: v.dtype.short for k, v in module.items() if isinstance(v, TensorRef)},
        loss_scaler=optimizer.get(N.LOSS_SCALER),
        lr_scheduler=model0.get(N.LR_SCHEDULER),
        global_steps=model0.get(N.GLOBAL_STEPS),
        global_samples=model0.get(N.GLOBAL_SAMPLES),
        skipped_steps=model0.get(N.SKIPPED_STEPS),
        ds_config=model0.get(N.DS_CONFIG) or {},
        client_state={k: v for k, v in model0.items() if k not in ENGINE_KEYS},
        engine_extras={k: model0[k] for k in CARRIED_ENGINE_KEYS if k in model0},
        optimizer_extras={k: optimizer[k] for k in OPTIMIZER_EXTRA_KEYS if k in optimizer},
        optimizer_kind="zero" if N.ZERO_STAGE in optimizer else "bf16_optimizer",
        frozen_recorded=isinstance(model0.get(N.FROZEN_PARAM_SHAPES), dict),
    )


def module_buffers(model: dict) -> dict[str, TensorSource]:
    module = model.get(N.MODULE) or {}
    return {n: source_of(module[n]) for n in model.get(N.BUFFER_NAMES) or [] if isinstance(module.get(n), TensorRef)}


def optimizer_order(layout: ZeroLayout, params: list[ParamState], round_robin: bool) -> list[int]:
    """Indices of the layout's params in optimizer order: the order of the user's param groups
    (ZeRO-1/2 with round-robin gradients store a reordering of it; ZeRO-3 sub-groups keep it)."""
    if layout.stage == 3 or not round_robin:
        return list(range(len(params)))
    order: list[int] = []
    for group in layout.flat_groups:
        flat = list(group.params)
        reorder = round_robin_order(len(flat), layout.world_size)
        original = [0] * len(flat)
        for position, source in enumerate(reorder):
            original[source] = flat[position]
        order.extend(original)
    return order


def slice_mapping_layout(layout: ZeroLayout, round_robin: bool) -> ZeroLayout:
    """The layout DeepSpeed's ZeRO-1/2 ``param_slice_mappings`` describe: the stored one, except
    under round-robin gradients, where DeepSpeed lays each group out in optimizer order instead
    of the stored (round-robin) order, with the same partition size (so the mappings do not say
    where the bytes are; sample_ckpts/FORMAT_OBSERVED.md). Readers check files against it and
    the writer writes it, as DeepSpeed does."""
    if not round_robin:
        return layout
    order = iter(optimizer_order(layout, list(layout.params), True))
    groups, paddings = [], []
    for group in layout.flat_groups:
        indices = [next(order) for _ in group.params]
        padding_of = dict(zip(group.params, group.alignment_paddings or [0] * len(group.params)))
        groups.append([layout.params[i] for i in indices])
        paddings.append([padding_of[i] for i in indices])
    return zero12_layout(groups, layout.world_size, alignment_paddings=paddings, stage=layout.stage)


def _param_groups(
    layout: ZeroLayout, saved: dict, states0: dict, element_keys: list[str]
) -> tuple[ParamGroupState, ...]:
    """One ParamGroupState per user param group (a ZeRO-3 group spans several sub-groups)."""
    saved_groups = saved.get("param_groups") or []
    count = max([g.param_group for g in layout.flat_groups] + [len(saved_groups) - 1]) + 1
    result = []
    for g in range(count):
        hyper = saved_groups[g] if g < len(saved_groups) and isinstance(saved_groups[g], dict) else {}
        flats = [f for f, group in enumerate(layout.flat_groups) if group.param_group == g]
        scalars: dict[str, ScalarState] = {}
        keys: tuple[str, ...] = ()
        if flats and isinstance(states0.get(flats[0]), dict):
            first = states0[flats[0]]
            keys = tuple(first)
            for key, value in first.items():
                if key in element_keys:
                    continue
                scalars[key] = (
                    ScalarState(tensor=source_of(value)) if isinstance(value, TensorRef) else ScalarState(value=value)
                )
        names = tuple(layout.params[i].name for f in flats for i in layout.flat_groups[f].params)
        result.append(ParamGroupState({k: v for k, v in hyper.items() if k != "params"}, scalars, names, keys))
    return tuple(result)
