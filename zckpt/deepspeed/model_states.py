"""What rank 0's model-states file says of the model and the run: the params, buffers, frozen
params and tied aliases it declares (:func:`declare`), the run's stage, world size, dtype and
offload (:func:`describe`), and the entries that come from the model-states files themselves
(buffers, frozen params: :func:`module_entries`; aliases: :func:`tied_entries`). Shared by the
ZeRO reader and the universal reader; the trainable params come from elsewhere in each.
"""

from __future__ import annotations

import os

from ..core.dtypes import BF16, FP16, FP32
from ..core.errors import LayoutError, ZckptError
from ..core.index import Entry, Segment, TensorRef, TensorSource
from ..io.reading import source_of
from . import names as N
from .partition import zero3_partition
from .rank_checks import check_not_copies
from .run_config import RunConfig, read_run_config
from .schema import MODEL_SCHEMA, OPTIM_SCHEMA, as_shape, numel_of, sound
from .survey import Survey


def param_shapes_of(model0: dict) -> list[dict]:
    """The trainable params' shapes, one {name: shape} dict per param group (older files hold
    one dict)."""
    shapes = model0[N.PARAM_SHAPES]
    return [shapes] if isinstance(shapes, dict) else shapes


def declare(result: Survey, model0: dict) -> None:
    """Record the params, buffers and tied names rank 0's model states declare, with the
    dtypes the module state dict stores them in (buffers and frozen params keep theirs)."""
    declared = result.declared
    module = model0.get(N.MODULE) if isinstance(model0.get(N.MODULE), dict) else {}
    buffers = list(model0.get(N.BUFFER_NAMES) or [])
    for name in buffers:
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            declared.append((name, ref.shape, "buffer"))
    frozen = {name: as_shape(shape) for name, shape in (model0.get(N.FROZEN_PARAM_SHAPES) or {}).items()}
    shapes = model0.get(N.PARAM_SHAPES) or []
    trainable = [
        (name, as_shape(shape))
        for group in ([shapes] if isinstance(shapes, dict) else shapes)
        for name, shape in group.items()
    ]
    tied = {str(k): str(v) for k, v in (model0.get(N.SHARED_PARAMS) or {}).items()}
    if not frozen:  # ZeRO-1 records no frozen_param_shapes: its frozen params are only in the module
        known = {n for n, _ in trainable} | set(buffers) | set(tied)
        frozen = {
            n: ref.shape for n, ref in module.items() if n not in known and isinstance(ref, TensorRef) and ref.numel
        }
    declared.extend((name, shape, "frozen") for name, shape in frozen.items())
    declared.extend((name, shape, "param") for name, shape in trainable)
    result.declared_dtypes = {
        n: ref.dtype for n, ref in module.items() if isinstance(ref, TensorRef) and (n in frozen or n in buffers)
    }
    result.tied = tied


def describe(result: Survey, model0: dict, inner0: dict | None, prefix: str, zero3: bool, model_path: str) -> RunConfig:
    """Fill stage, world size, dtype, version and offload from rank 0's files (`inner0`:
    None when no optimizer file is readable; the config then says the stage). The saved
    ds_config is read as DeepSpeed read it (and returned); a value DeepSpeed refuses is a
    problem."""
    try:
        run = read_run_config(model0.get(N.DS_CONFIG) or {}, model_path, saved=True)
    except ZckptError as exc:
        result.problems.append(exc)
        run = read_run_config({}, saved=True)
    stage = inner0.get(N.ZERO_STAGE) if inner0 is not None else run.stage if run.stage_set else None
    if stage is None and inner0 is not None:  # BF16_Optimizer layout (bf16 + ZeRO-1 in some releases) has no stage key
        stage = run.stage or 1
        result.notes.append("optimizer state written by DeepSpeed's BF16_Optimizer (ZeRO-1 layout)")
    result.zero_stage = 3 if zero3 else int(stage) if stage is not None else None
    count = (inner0 or {}).get(N.PARTITION_COUNT)
    result.world_size = max(count) if isinstance(count, (list, tuple)) else int(count) if count is not None else None
    result.ds_version = str(model0.get(N.DS_VERSION)) if model0.get(N.DS_VERSION) is not None else None
    result.dtype = BF16 if prefix == N.BF16_PREFIX or run.dtype == "bf16" else FP16 if run.dtype == "fp16" else FP32
    devices = {run.device(N.CONFIG_OFFLOAD_OPTIMIZER), run.device(N.CONFIG_OFFLOAD_PARAM)}  # cpu_offload: true is "cpu"
    result.offload = (
        N.OFFLOAD_DEVICE_NVME if N.OFFLOAD_DEVICE_NVME in devices else "cpu" if "cpu" in devices else "none"
    )
    return run


def describe_readable(
    result: Survey, models: dict, optims: dict, optim_files: dict, zero3: bool, tag_dir: str, mp_rank: int = 0
) -> RunConfig:
    """Where some files cannot be read, describe the checkpoint from those that can (rank 0's
    first), rather than leave stage, world size and dtype unknown."""
    rank, model = next(
        ((r, m) for r, m in sorted(models.items(), key=lambda kv: kv[0] or 0) if sound(m, N.DS_CONFIG, MODEL_SCHEMA)),
        (None, None),
    )
    inner = next(
        (
            o[N.OPTIMIZER_STATE_DICT]
            for _, o in sorted(optims.items())
            if isinstance(o, dict) and sound(o.get(N.OPTIMIZER_STATE_DICT), N.PARTITION_COUNT, OPTIM_SCHEMA)
        ),
        None,
    )
    if model is None and inner is None:
        return read_run_config({}, saved=True)
    prefix = optim_files[min(optim_files)][0] if optim_files else ""
    run = describe(
        result,
        model or {},
        inner,
        prefix,
        zero3,
        os.path.join(tag_dir, N.model_states_name(3 if zero3 else 1, rank or 0, mp_rank)),
    )
    dp = (model or {}).get(N.DP_WORLD_SIZE)
    if result.world_size is None and isinstance(dp, int) and dp > 0:
        result.world_size = dp
    return run


def ds_ids(model0: dict) -> dict[str, int]:
    """DeepSpeed's param ids: params numbered in module order, each tied param once and frozen
    params included (the order of model.parameters(), which is the state dict's order less
    buffers and aliases; checked against a real run, see sample_ckpts/FORMAT_OBSERVED.md)."""
    skip = set(model0.get(N.BUFFER_NAMES) or []) | set(model0.get(N.SHARED_PARAMS) or {})
    params = [name for name in model0.get(N.MODULE) or {} if name not in skip]
    return {name: index for index, name in enumerate(params)}


def whole(result: Survey, ref: TensorRef) -> TensorSource:
    """The whole of a tensor in a pickle (an empty source, with the problem listed, when its
    storage is damaged)."""
    try:
        return source_of(ref)
    except ZckptError as exc:
        result.problems.append(exc)
        return TensorSource(ref.dtype, ref.shape, ())


def module_entries(
    result: Survey, models: dict, model_paths: dict, zero3: bool, world: int, note_frozen: bool = True
) -> list[Entry] | None:
    """The buffers and frozen params, from the model-states files (None: a problem listed).
    `note_frozen`: say where the frozen params of a run that records none came from, and that
    zero_to_fp32.py drops them (a ZeRO-0 run's, where that tool fails altogether, need no note).

    Guarantee: ``buffer_names`` lists the module's persistent buffers (``_get_buffer_names``,
    deepspeed/runtime/engine.py:5406-5420), and at ZeRO-2/3 ``frozen_param_shapes`` every param
    the optimizer does not own (engine.py:5383, :5433-5445; runtime/utils.py:815-825). A param
    that is neither (trainable, but left out of the optimizer's ``model_parameters``) is named
    as such and not read: at ZeRO-3 its values are in no file."""
    first = 0 if zero3 else None
    model0, model0_path = models[first], model_paths[first]
    module = model0[N.MODULE]
    entries: list[Entry] = []

    buffer_names = list(model0.get(N.BUFFER_NAMES) or [])
    for name in buffer_names:
        if name in module:
            ref = module[name]
            if isinstance(ref, TensorRef):
                entries.append(Entry(name, "buffer", whole(result, ref)))
        else:  # DeepSpeed lists the persistent buffers only, all of them in the state dict
            result.add(
                LayoutError,
                model0_path,
                f"buffer {name} is listed in buffer_names but missing from the module state dict",
            )
            return None

    trainable_names = {name for group in param_shapes_of(model0) for name in group}
    shared = dict(model0.get(N.SHARED_PARAMS) or {})
    frozen_shapes = model0.get(N.FROZEN_PARAM_SHAPES)
    if frozen_shapes is not None:
        # ZeRO-2/3 record their frozen params: the module holds nothing else than those, the
        # trainable ones, buffers, tied aliases and modules' extra state (torch's `_extra_state`)
        known = trainable_names | set(frozen_shapes) | set(buffer_names) | set(shared)
        unknown = [
            n
            for n, ref in module.items()
            if n not in known and isinstance(ref, TensorRef) and not n.endswith("_extra_state")
        ]
        if unknown:
            result.add(
                LayoutError,
                model0_path,
                f"param {unknown[0]} is in the module but neither trainable, recorded as frozen, a buffer nor a tied alias "
                "(a trainable param the optimizer does not own, left out of model_parameters?): zckpt does not read it",
            )
            return None
    fragments = {rank: list((m.get(N.FROZEN_PARAM_FRAGMENTS) or {}).values()) for rank, m in models.items()}
    if zero3 and not check_not_copies(result, model_paths, fragments, "frozen-param partitions"):
        return None  # each rank's file holds its own partition of the frozen params
    if frozen_shapes:
        for name, shape in frozen_shapes.items():
            source = _frozen_source(result, name, as_shape(shape), models, model_paths, zero3, world)
            if source is None:
                return None
            entries.append(Entry(name, "frozen", source))
    else:
        # ZeRO-1 runs record no frozen_param_shapes; the values are only in `module`.
        known = trainable_names | set(buffer_names) | set(shared)
        recovered = [n for n, ref in module.items() if n not in known and isinstance(ref, TensorRef)]
        for name in recovered:
            ref = module[name]
            if zero3 or ref.numel == 0:
                result.add(
                    LayoutError,
                    model0_path,
                    f"param {name} is in the module but neither trainable nor recorded as frozen (a trainable param "
                    "the optimizer does not own, left out of model_parameters?): zckpt does not read it",
                )
                return None
            entries.append(Entry(name, "frozen", whole(result, ref)))
        if recovered and note_frozen:
            result.notes.append(
                f"{len(recovered)} frozen params read from the module state dict (zero_to_fp32.py drops them)"
            )
    return entries


def rounded_copies(weights: object, masters: list[Entry]) -> list[tuple[Entry, Entry]]:
    """Each saved copy in `weights` (name -> tensor: a ZeRO-1/2 model-states file's module, whose
    16-bit weights ZeRO-3 does not save there; an expert file) beside the master of its name among
    `masters`. A copy whose storage cannot be located is left out: what reads the file (verify's
    checksums) names it."""
    if not isinstance(weights, dict):
        return []
    pairs = []
    for master in masters:
        ref = weights.get(master.name)
        if master.kind == "param" and isinstance(ref, TensorRef) and ref.numel and ref.shape == master.source.shape:
            try:
                pairs.append((Entry(master.name, "param", source_of(ref)), master))
            except ZckptError:
                continue
    return pairs


def tied_entries(model0: dict, entries: list[Entry]) -> list[Entry]:
    """The tied aliases of the entries read, each with its source param's bytes."""
    present = {e.name: e for e in entries}
    shared = dict(model0.get(N.SHARED_PARAMS) or {})
    return [
        Entry(alias, "tied", present[name].source, alias_of=name) for alias, name in shared.items() if name in present
    ]


def _frozen_source(
    result: Survey, name: str, shape: tuple[int, ...], models: dict, model_paths: dict, zero3: bool, world: int
) -> TensorSource | None:
    numel = numel_of(shape)
    if not zero3:
        ref = (models[None].get(N.FROZEN_PARAM_FRAGMENTS) or {}).get(name)
        if not isinstance(ref, TensorRef) or ref.numel != numel:
            result.add(LayoutError, model_paths[None], f"frozen param {name} has no full fragment of {numel} elements")
            return None
        return TensorSource(ref.dtype, shape, whole(result, ref).segments)
    segments: list[Segment] = []
    dtype = None
    share = zero3_partition(numel, world)[0]
    for rank in range(world):
        ref = (models[rank].get(N.FROZEN_PARAM_FRAGMENTS) or {}).get(name)
        if not isinstance(ref, TensorRef) or ref.numel != share:
            result.add(LayoutError, model_paths[rank], f"frozen param {name}: expected a partition of {share} elements")
            return None
        dtype = ref.dtype
        segments.extend(whole(result, ref).segments)
    assert dtype is not None
    return TensorSource(dtype, shape, tuple(_truncate(segments, numel)))


def _truncate(segments: list[Segment], numel: int) -> list[Segment]:
    """The first `numel` elements of a run of segments (drops ZeRO-3 padding)."""
    kept: list[Segment] = []
    remaining = numel
    for segment in segments:
        if remaining <= 0:
            break
        take = min(segment.numel, remaining)
        kept.append(Segment(segment.path, segment.offset, take))
        remaining -= take
    if remaining:
        raise LayoutError(
            segments[0].path if segments else None, f"only {numel - remaining} of {numel} elements available"
        )
    return kept
