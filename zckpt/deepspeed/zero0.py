"""ZeRO-0 checkpoints (ZeRO off: DeepSpeed's engine around the script's torch optimizer).

What such a run saves (DeepSpeed 0.19.8, see ``sample_ckpts/FORMAT_OBSERVED.md``): no optimizer
files; rank 0's model-states file holds the module and, under ``optimizer``, the torch optimizer's
``state_dict()`` whole: ``state`` and ``param_groups`` keyed by *index*, in the order the script
passed its params, with ``param_shapes`` None. In an fp32 run the module's params are the masters;
a 16-bit run wraps the optimizer in DeepSpeed's FP16_UnfusedOptimizer, which saves each param's
fp32 master (``fp32_groups``) and the loss scale beside the torch state
(:func:`normalized_optimizer` makes both one form). A mixture-of-experts run saves each expert
rank's optimizer state in ``expp_rank_E_mp_rank_XX_optim_states.pt`` instead (:mod:`.moe`); a
pipeline stage's has no module, and :mod:`.pipeline` finds which layers are the stage's.

Nothing in the files names the indices; DeepSpeed's own resume relies on the new run passing its
params in the same order. zckpt names them in module order, the order ``model.parameters()``
passes them (:func:`name_optimizer_params`): the optimizer's params, group after group, must be
the module's params in that order, a param the optimizer does not hold being frozen, every saved
state's shape matching its param's, and the match must be the only one; anything else is refused
in one line (e.g. param groups that split the module's order, such as a weight-decay split).

The result is described as the ZeRO files are (:func:`with_declared_params`: ``param_shapes``
and ``shared_params`` as DeepSpeed's ZeRO runs record them), so the model-states code reads
buffers, frozen params and tied aliases as it does for ZeRO-1; :func:`read_zero0` then builds
the index and training state from the module and the optimizer's tensors.
"""

from __future__ import annotations

from typing import Any

from ..core.dtypes import FP16, FP32
from ..core.errors import CorruptFileError, LayoutError, ZckptError
from ..core.index import CheckpointIndex, Entry, TensorRef
from ..core.state import ParamGroupState, ParamState, ScalarState, TrainingState
from ..core.topology import Topology
from ..io.materialize import read_scalar
from ..io.reading import FileReader, source_of
from ..torchfile.records import PickledObject, record_class
from . import names as N
from .engine_config import DYNAMIC_LOSS_SCALER, LOSS_SCALER
from .features import feature_notes
from .model_states import declare, describe, module_entries, rounded_copies, tied_entries, whole
from .optim_state import saved_run_state
from .survey import Survey

# what a torch optimizer's state_dict() holds, and nothing else
TORCH_OPTIMIZER_KEYS = {"state", "param_groups"}
STEP = "step"  # torch's per-param step counter: one value per group


def is_zero0(model: Any) -> bool:
    """A ZeRO-0 run's model-states file: ZeRO runs record ``param_shapes``, ZeRO-0 saves None
    there and its optimizer's state (or None) beside the module."""
    return isinstance(model, dict) and N.OPTIMIZER in model and model.get(N.PARAM_SHAPES) is None


def torch_optimizer_state(value: Any) -> bool:
    """A torch optimizer's ``state_dict()``: ``state`` by index, ``param_groups`` listing indices."""
    return (
        isinstance(value, dict)
        and set(value) == TORCH_OPTIMIZER_KEYS
        and isinstance(value["state"], dict)
        and isinstance(value["param_groups"], list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in value["param_groups"])
    )


# DeepSpeed's FP16_UnfusedOptimizer (a 16-bit ZeRO-0 run with a torch optimizer): the torch state
# under this key, beside each param's fp32 master and the loss scaler's values
INNER_STATE = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"
SCALER_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")
MASTERS = "masters"  # zckpt's own key of a normalized state: the fp32 master of each param index
SCALER = "scaler"  # and the loss scaler's saved values


def normalized_optimizer(optimizer: Any) -> dict | None:
    """The optimizer state of a ZeRO-0 run in one form: a torch optimizer's ``state_dict()`` as it
    is (fp32 run: the module's params are the masters), or DeepSpeed's FP16_UnfusedOptimizer's
    (a bf16/fp16 run) as its inner torch state plus each param index's fp32 master (``fp32_groups``,
    in the groups' order) and the loss scaler's values. None for anything else (the fused
    FP16_Optimizer's flat groups)."""
    if torch_optimizer_state(optimizer):
        return optimizer
    if not isinstance(optimizer, dict) or not torch_optimizer_state(optimizer.get(INNER_STATE)):
        return None
    inner, groups = optimizer[INNER_STATE], optimizer.get(FP32_GROUPS)
    if not isinstance(groups, list) or len(groups) != len(inner["param_groups"]):
        return None
    masters: dict[Any, TensorRef] = {}
    for tensors, group in zip(groups, inner["param_groups"]):
        if not isinstance(tensors, list) or len(tensors) != len(group["params"]):
            return None
        if not all(isinstance(t, TensorRef) for t in tensors):
            return None
        masters.update(zip(group["params"], tensors))
    return {**inner, MASTERS: masters, SCALER: {k: optimizer[k] for k in SCALER_KEYS if k in optimizer}}


def _check_structure(optimizer: dict, path: str) -> None:
    """The optimizer state dict holds what torch writes: each group's params distinct integer
    indices, each param's state a dict of named tensors and numbers. Raises CorruptFileError."""
    seen: set[int] = set()
    for g, group in enumerate(optimizer["param_groups"]):
        for index in group["params"]:
            if not isinstance(index, int) or isinstance(index, bool) or index in seen:
                raise CorruptFileError(path, f"param group {g} lists {index!r}: not a param index, or one listed twice")
            seen.add(index)
    for index, entry in optimizer["state"].items():
        if not (
            isinstance(entry, dict)
            and all(isinstance(k, str) for k in entry)
            and all(v is None or isinstance(v, (TensorRef, int, float)) for v in entry.values())
        ):
            raise CorruptFileError(
                path, f"the optimizer state of param {index!r} is not a dict of named tensors and numbers"
            )


def _state_shape(entry: dict, index: int, path: str) -> tuple[int, ...] | None:
    """The shape of a param's per-element states (its shape); None when it has none (a
    scalar-only state). Raises CorruptFileError when they disagree."""
    shapes = {tuple(v.shape) for k, v in entry.items() if isinstance(v, TensorRef) and k != STEP}
    if len(shapes) > 1:
        raise CorruptFileError(path, f"the states of param {index} have different shapes {sorted(shapes)}")
    return shapes.pop() if shapes else None


def name_optimizer_params(
    indices: list[int], shapes: dict[int, tuple[int, ...] | None], candidates: list[tuple[str, tuple[int, ...]]]
) -> list[str] | str:
    """The names of the optimizer's params `indices` (group after group), matched in order to a
    subsequence of `candidates` (the module's params in order, name and shape) by the shape of
    each one's saved states (None: no per-element state, any shape). The names, or why not: no
    match, or more than one (shapes cannot tell which module params were left out)."""
    n, m = len(indices), len(candidates)
    if n > m:
        return f"the optimizer holds {n} params, the module {m}"

    def fits(i: int, j: int) -> bool:
        shape = shapes.get(indices[i])
        return shape is None or shape == candidates[j][1]

    # ways[i][j]: matches of indices[i:] into candidates[j:], counted up to 2
    ways = [[0] * (m + 1) for _ in range(n + 1)]
    for j in range(m + 1):
        ways[n][j] = 1
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            ways[i][j] = min(2, ways[i][j + 1] + (ways[i + 1][j + 1] if fits(i, j) else 0))
    if ways[0][0] == 0:
        first = next((i for i in range(min(n, m)) if not fits(i, i)), None)
        where = (
            f"; param {indices[first]}'s states have shape {list(shapes.get(indices[first]) or ())}, "
            f"module param {candidates[first][0]} {list(candidates[first][1])}"
            if first is not None
            else ""
        )
        return f"its {n} params, group after group, are not the module's params in module order{where}"
    if ways[0][0] > 1:
        return (
            f"its {n} params match the module's {m} in order in more than one way "
            "(the shapes do not tell which module params it left out)"
        )
    names, j = [], 0
    for i in range(n):
        while not (fits(i, j) and ways[i + 1][j + 1] >= 1):
            j += 1
        names.append(candidates[j][0])
        j += 1
    return names


def tied_aliases(module: dict, buffers: set[str]) -> dict[str, str]:
    """Module params stored as the same tensor as an earlier one (torch.save keeps the sharing of
    tied weights): alias -> the first name, as ZeRO runs record ``shared_params``."""
    first: dict[tuple, str] = {}
    aliases = {}
    for name, ref in module.items():
        if not isinstance(ref, TensorRef) or name in buffers or not ref.numel:
            continue
        key = (ref.path, ref.offset, ref.dtype, ref.shape, ref.stride)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def _module_params(model: dict, path: str) -> tuple[dict[str, str], list[tuple[str, tuple[int, ...]]]]:
    """The module's tied aliases, and its params (less buffers and aliases) in order with shapes."""
    module = model.get(N.MODULE)
    if not isinstance(module, dict):
        raise CorruptFileError(path, "not a DeepSpeed model-states file (no 'module')")
    buffers = set(model.get(N.BUFFER_NAMES) or [])
    aliases = tied_aliases(module, buffers)
    candidates = [
        (name, tuple(ref.shape))
        for name, ref in module.items()
        if isinstance(ref, TensorRef) and name not in buffers and name not in aliases and ref.numel
    ]
    return aliases, candidates


def weights_only(model: dict, path: str) -> dict:
    """The model-states dict declaring every module param (less buffers and aliases) as one
    group: what consolidation needs, the module being the weights, when the optimizer's params
    cannot be named."""
    aliases, candidates = _module_params(model, path)
    return {**model, N.PARAM_SHAPES: [dict(candidates)], N.SHARED_PARAMS: aliases}


def optimizer_params(optimizer: dict, path: str) -> tuple[list[int], dict[int, tuple[int, ...] | None]]:
    """The optimizer's param indices, group after group, and the shape of each one's states.
    Raises CorruptFileError for a damaged state dict, LayoutError where a param has no state
    (saved before its first step: nothing to carry)."""
    _check_structure(optimizer, path)
    indices = [i for g in optimizer["param_groups"] for i in g["params"]]
    state = optimizer["state"]
    masters = optimizer.get(MASTERS)
    if masters is not None:  # each param's fp32 master: its shape, which its states must have
        for i in indices:
            moments = _state_shape(state.get(i) or {}, i, path)
            if moments is not None and moments != tuple(masters[i].shape):
                raise CorruptFileError(
                    path,
                    f"the states of param {i} have shape {list(moments)}, its fp32 master {list(masters[i].shape)}",
                )
    missing = [i for i in indices if not state.get(i)]
    if missing:
        raise LayoutError(
            path,
            f"the optimizer holds no state for param {missing[0]} ({len(missing)} of {len(indices)}): saved before "
            "their first step, so there are no optimizer states to carry",
        )
    if masters is not None:
        return indices, {i: tuple(masters[i].shape) for i in indices}
    return indices, {i: _state_shape(state[i], i, path) for i in indices}


def with_declared_params(model: dict, optimizer: dict, path: str, optimizer_path: str) -> dict:
    """The model-states dict with ``param_shapes`` (one {name: shape} per optimizer param group)
    and ``shared_params`` filled in as ZeRO runs record them. Raises LayoutError naming
    `optimizer_path` when the optimizer's params cannot be named (see :func:`name_optimizer_params`)."""
    aliases, candidates = _module_params(model, path)
    indices, shapes_by_index = optimizer_params(optimizer, optimizer_path)
    groups = [list(g["params"]) for g in optimizer["param_groups"]]
    named = name_optimizer_params(indices, shapes_by_index, candidates)
    if isinstance(named, str):
        raise LayoutError(
            optimizer_path,
            f"ZeRO-0 saves the torch optimizer's state by index, and {named}: zckpt names them in module order "
            "(model.parameters()) only",
        )
    by_index = dict(zip(indices, named))
    shapes = dict(candidates)
    param_shapes = [{by_index[i]: shapes[by_index[i]] for i in g} for g in groups]
    return {**model, N.PARAM_SHAPES: param_shapes, N.SHARED_PARAMS: aliases}


def _masters_by_name(model: dict, optimizer: dict) -> dict[str, TensorRef]:
    """Each named param's fp32 master (a 16-bit run's), by the names its group's indices got."""
    return {
        name: optimizer[MASTERS][index]
        for group, shapes in zip(optimizer["param_groups"], model[N.PARAM_SHAPES])
        for index, name in zip(group["params"], shapes)
    }


def read_zero0(
    result: Survey, model: dict, optimizer: dict | None, path: str, optimizer_path: str, mp_world: int = 1
) -> None:
    """Read a ZeRO-0 model-states dict (its module whole, `optimizer` the torch optimizer's
    state dict, saved in `optimizer_path`; None: saved without one) into `result`: index and
    training state (the weights only, the reason kept, when the optimizer's params cannot be named)."""
    location = result.location
    assert location is not None
    try:
        if optimizer is None:
            raise LayoutError(path, "saved without optimizer state (a ZeRO-0 run's 'optimizer' is None)")
        model = with_declared_params(model, optimizer, path, optimizer_path)
    except LayoutError as exc:  # the weights are still the module's: consolidation needs no names
        result.state_problem = exc
        result.notes.append(f"the training state is not read: {exc.problem}")
        try:
            model = weights_only(model, path)
        except ZckptError as damage:
            result.problems.append(damage)
            return
    except ZckptError as exc:
        result.problems.append(exc)
        return
    declare(result, model)
    run = describe(result, model, None, "", False, path)
    world = model.get(N.DP_WORLD_SIZE)
    result.world_size = world if isinstance(world, int) and world >= 1 else 1
    recorded = model.get(N.MP_WORLD_SIZE)
    if isinstance(recorded, int) and recorded != mp_world:
        result.add(LayoutError, path, f"records {recorded} model-parallel ranks; the folder's files name {mp_world}")
    masters = (optimizer or {}).get(MASTERS)
    if masters is not None and result.state_problem is not None:  # the masters need the names: none to give
        result.problems.append(result.state_problem)
        result.state_problem = None
        return
    if result.dtype != FP32 and masters is None:
        result.add(
            LayoutError,
            path,
            f"a ZeRO-0 {result.dtype.short if result.dtype else ''} run whose fp32 masters are not saved beside "
            "its optimizer state (DeepSpeed's FP16_UnfusedOptimizer keeps them; this file has none)",
        )
    if result.problems:
        return
    entries = module_entries(result, {None: model}, {None: path}, False, result.world_size, note_frozen=False)
    if entries is None:
        return
    module = model[N.MODULE]
    names = [name for group in model[N.PARAM_SHAPES] for name in group]
    by_name = _masters_by_name(model, optimizer) if masters is not None and result.state_problem is None else {}
    params = [Entry(name, "param", whole(result, by_name.get(name, module[name]))) for name in names]
    entries += params + tied_entries(model, entries + params)
    result.notes.append(
        (
            "ZeRO-0 (ZeRO off): the module's fp32 params are the masters"
            if masters is None
            else f"ZeRO-0 (ZeRO off, {result.dtype.short if result.dtype else ''}): the fp32 masters saved beside the "
            "optimizer state (DeepSpeed's FP16_UnfusedOptimizer), the module's weights their rounded copies"
        )
        + (
            ""
            if result.state_problem
            else "; the torch optimizer's state, saved by index, named in module order (each state's shape checked)"
        )
    )
    result.notes.extend(feature_notes(model))  # torch_autocast's unsaved GradScaler (.features)
    if result.problems:
        return
    result.index = CheckpointIndex(
        checkpoint_dir=location.checkpoint_dir,
        tag=location.tag,
        tag_dir=location.tag_dir,
        tags=location.tags,
        zero_stage=0,
        world_size=result.world_size,
        topology=Topology.data_parallel(result.world_size),
        dtype=result.dtype or FP32,
        ds_version=result.ds_version,
        offload=result.offload,
        entries=tuple(entries),
        files=tuple(result.files),
        notes=tuple(result.notes),
        rounded_copies=tuple(rounded_copies(module, params)) if masters is not None else (),
    )
    if result.state_problem is not None:
        return
    try:
        result.state = _training_state(result.index, model, optimizer, by_name, optimizer_path, run.gradient_clipping)
    except ZckptError as exc:
        result.problems.append(exc)
        result.index = None


def _training_state(
    index: CheckpointIndex,
    model: dict,
    optimizer: dict,
    masters: dict[str, TensorRef],
    path: str,
    clip: float | None,
) -> TrainingState:
    """Each trainable param's master (`masters`' tensor of its name: a 16-bit run's; else the
    module's) and states (the optimizer's, by index), the param groups with their
    hyperparameters and step (checked equal across each group)."""
    module, state = model[N.MODULE], optimizer["state"]
    params: list[ParamState] = []
    groups: list[ParamGroupState] = []
    with FileReader() as reader:
        for g, (group, shapes) in enumerate(zip(optimizer["param_groups"], model[N.PARAM_SHAPES])):
            scalars: dict[str, ScalarState] = {}
            first_values: dict[str, Any] = {}
            element_keys: list[str] | None = None
            for index_, name in zip(group["params"], shapes):
                entry, shape = state[index_], tuple(shapes[name])
                per_element = {}
                for key, value in entry.items():
                    if isinstance(value, TensorRef) and tuple(value.shape) == shape and key != STEP:
                        per_element[key] = source_of(value)
                        continue
                    if isinstance(value, TensorRef) and value.numel != 1:
                        raise CorruptFileError(
                            path,
                            f"param {index_} ({name}): its {key} has shape {list(value.shape)}, the param {list(shape)}",
                        )
                    saved = (
                        ScalarState(tensor=source_of(value))
                        if isinstance(value, TensorRef)
                        else ScalarState(value=value)
                    )
                    seen = read_scalar(reader, saved.tensor) if saved.tensor is not None else value
                    if key not in first_values:
                        first_values[key], scalars[key] = seen, saved
                    elif seen != first_values[key]:
                        raise LayoutError(
                            path,
                            f"param {index_} ({name}) is at {key} {seen}, its group's first at {first_values[key]}",
                        )
                if element_keys is None:
                    element_keys = list(per_element)
                elif list(per_element) != element_keys:
                    raise CorruptFileError(
                        path,
                        f"param {index_} ({name}) has states {list(per_element)}, its group's first {element_keys}",
                    )
                params.append(ParamState(name, shape, g, source_of(masters.get(name, module[name])), per_element))
            keys = tuple(state[group["params"][0]]) if group["params"] else ()
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append(ParamGroupState(hyper, scalars, tuple(shapes), keys))
    run = saved_run_state(model, optimizer)
    version = N.version_tuple(index.ds_version or "0.0.0")
    run["optimizer_extras"] = {N.CLIP_GRAD: clip if clip is not None else N.default_gradient_clipping(version)}
    run["optimizer_kind"] = "zero"
    if index.dtype == FP16 and optimizer.get(SCALER):
        run["loss_scaler"] = loss_scaler(optimizer[SCALER], run["ds_config"])
        run["optimizer_extras"][N.DYNAMIC_LOSS_SCALE] = bool(optimizer[SCALER].get("dynamic_loss_scale"))
    return TrainingState(index=index, params=tuple(params), groups=tuple(groups), **run)


def loss_scaler(saved: dict[str, Any], ds_config: dict[str, Any]) -> PickledObject:
    """The loss scaler a ZeRO optimizer file keeps (as zckpt reads one: DeepSpeed's object as
    plain data), from what an fp16 ZeRO-0 run's FP16_UnfusedOptimizer saved (the scale, its
    iteration counters and, when dynamic, the growth settings) and the run's ``fp16`` config for
    the rest, which that optimizer does not save and a resumed DeepSpeed run takes from its
    config again (minimum scale, hysteresis)."""
    fp16 = ds_config.get("fp16") if isinstance(ds_config.get("fp16"), dict) else {}
    if not saved.get("dynamic_loss_scale"):
        return record_class(LOSS_SCALER.module, LOSS_SCALER.name)(
            state={"cur_scale": saved.get("cur_scale", 1.0), "dynamic": False}
        )
    hysteresis = fp16.get("hysteresis", 2)
    values = {
        "cur_scale": saved["cur_scale"],
        "dynamic": True,
        "cur_iter": saved.get("cur_iter", 0),
        "last_overflow_iter": saved.get("last_overflow_iter", -1),
        "scale_factor": saved.get("scale_factor", 2.0),
        "scale_window": saved.get("scale_window", fp16.get("loss_scale_window", 1000)),
        "min_scale": fp16.get("min_loss_scale", 1),
        "delayed_shift": hysteresis,
        "cur_hysteresis": hysteresis,
        "consecutive_hysteresis": fp16.get("consecutive_hysteresis", False),
        "raise_error_at_min_scale": True,
        "dtype": FP16,
    }
    return record_class(DYNAMIC_LOSS_SCALER.module, DYNAMIC_LOSS_SCALER.name)(state=values)


def check_optimizer(result: Survey, holder: Any, path: str, required: bool = False) -> dict | None:
    """The torch optimizer state dict a file holds under ``optimizer`` (a ZeRO-0 model-states or
    ``expp_rank`` file), with any problem listed: another optimizer's layout (DeepSpeed's
    FP16_Optimizer), or none saved where `required`. None: none saved, or a problem."""
    optimizer = holder.get(N.OPTIMIZER) if isinstance(holder, dict) else None
    if optimizer is None:
        if required:
            result.add(CorruptFileError, path, "holds no optimizer state (a ZeRO-0 run's optimizer file)")
        return None
    normalized = normalized_optimizer(optimizer)
    if normalized is None:
        keys = sorted(optimizer)[:5] if isinstance(optimizer, dict) else type(optimizer).__name__
        result.add(
            LayoutError,
            path,
            f"a ZeRO-0 optimizer state of another layout (keys {keys}; DeepSpeed's fused FP16_Optimizer keeps flat "
            "groups): zckpt reads a torch optimizer's state_dict() and DeepSpeed's FP16_UnfusedOptimizer's",
        )
        return None
    return normalized
