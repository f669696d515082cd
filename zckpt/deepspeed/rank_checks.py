"""The checks that the rank files of a ZeRO checkpoint belong together: of the right kind, one
world size, one run and save, one step; and that each file holds its own rank's partition (the
slice mappings, no file a copy of another; the name each file was saved under is checked where
it is loaded, :func:`.rank_files.check_saved_name`). Each lists its problems in the
:class:`~.survey.Survey` and says whether reading can go on.
"""

from __future__ import annotations

import os
from typing import Any

from ..core.errors import CheckpointNotFoundError, CorruptFileError, LayoutError
from ..core.index import TensorRef
from ..io.checksums import repeated_ranks
from ..io.materialize import read_scalar
from ..io.reading import FileReader, source_of
from . import names as N
from .layout import ZeroLayout
from .optim_state import slice_mapping_layout
from .rank_files import LoadedRanks
from .schema import MODEL_SCHEMA, OPTIM_SCHEMA, schema_problems
from .survey import Survey

_MAX_MISSING_RANKS = 4096  # beyond this many absent rank files, a world size is taken as damage


def check_file_kinds(
    result: Survey, models: dict, optims: dict, model_paths: dict, optim_files: dict, tag_dir: str, mp_rank: int = 0
) -> bool:
    """Every model file a model-states pickle, every optimizer file a ZeRO optimizer's, each
    key as DeepSpeed writes it, and rank 0's optimizer file there.

    Guarantee: every model-states file is ``_common_checkpoint_state``'s dict, with ``module``
    and ``param_shapes`` (deepspeed/runtime/engine.py:5017-5038), every optimizer file
    ``_save_zero_checkpoint``'s (engine.py:5549-5564) around the optimizer's ``state_dict``,
    which holds ``single_partition_of_fp32_groups`` (ZeRO-1/2, zero/stage_1_and_2.py:3388) or
    ``fp32_flat_groups`` (ZeRO-3, zero/stage3.py:3444); each rank of the optimizer's
    data-parallel group writes its own (engine.py:1921, 4934-4935), rank 0 too."""
    ok = True
    for rank, state in models.items():
        if not isinstance(state, dict) or N.PARAM_SHAPES not in state or N.MODULE not in state:
            result.add(
                CorruptFileError, model_paths[rank], "not a DeepSpeed model-states file (no 'module'/'param_shapes')"
            )
            ok = False
        elif problems := schema_problems(state, MODEL_SCHEMA):
            result.add(CorruptFileError, model_paths[rank], problems[0])
            ok = False
    for rank, state in optims.items():
        inner = state.get(N.OPTIMIZER_STATE_DICT) if isinstance(state, dict) else None
        if not isinstance(inner, dict) or not (
            N.FP32_FLAT_GROUPS in inner or N.SINGLE_PARTITION_OF_FP32_GROUPS in inner
        ):
            result.add(
                CorruptFileError,
                optim_files[rank][1],
                "not a DeepSpeed ZeRO optimizer-states file (no fp32 partitions)",
            )
            ok = False
        elif problems := schema_problems(inner, OPTIM_SCHEMA):
            result.add(CorruptFileError, optim_files[rank][1], problems[0])
            ok = False
    if 0 not in optims:
        bf16 = any(p for p, _ in optim_files.values())
        result.add(
            CheckpointNotFoundError,
            os.path.join(tag_dir, N.optim_states_name(0, mp_rank, bf16=bf16)),
            "missing (rank 0 optimizer states)",
        )
        ok = False
    return ok


def check_world(result: Survey, ranks: LoadedRanks, tag_dir: str) -> bool:
    """One world size (partition_count) in every file, and a file for every rank of it.

    Guarantee: ``partition_count`` is the size of the optimizer's data-parallel group, one per
    param group at ZeRO-1/2 (zero/stage_1_and_2.py:294, saved at :3394; MoE expert groups
    their own, set later), one number at ZeRO-3 (zero/stage3.py:369, saved at :3437); the
    model states' ``dp_world_size`` is that group's size too (``seq_dp_world_size``,
    engine.py:5034), ``mp_world_size`` the model-parallel degree (engine.py:5035)."""
    world = result.world_size
    inner, optim_files, models, model_paths = ranks.inner, ranks.optim_files, ranks.models, ranks.model_paths
    path0 = optim_files[0][1]
    if not isinstance(world, int) or world < 1:
        result.add(CorruptFileError, path0, f"bad partition_count {world!r}")
        return False
    if world > len(inner) + _MAX_MISSING_RANKS:  # listing every missing rank would never end
        result.add(
            CorruptFileError,
            path0,
            f"partition_count {world}, but {len(inner)} optimizer files are here: damaged, or nearly all rank files are missing",
        )
        return False
    ok = True
    for rank, state in inner.items():
        counts = state.get(N.PARTITION_COUNT)  # ZeRO-1/2: one per param group; ZeRO-3: one
        count = max(counts) if isinstance(counts, (list, tuple)) else counts
        if count != world:
            result.add(
                LayoutError,
                optim_files[rank][1],
                f"was written by a run of world size {count}, rank 0's by one of world size {world}: files of different runs are mixed",
            )
            ok = False
        elif (
            isinstance(counts, (list, tuple))
            and (odd := next((g for g, c in enumerate(counts) if c != world), None)) is not None
        ):
            result.add(
                LayoutError,
                optim_files[rank][1],
                f"param group {odd} is partitioned over {counts[odd]} ranks, not all {world}: zckpt reads checkpoints whose every param group spans all data-parallel ranks",
            )
            ok = False
    missing = [r for r in range(world) if r not in inner]
    bf16 = optim_files[0][0] == N.BF16_PREFIX
    for rank in missing:
        result.add(
            CheckpointNotFoundError,
            os.path.join(tag_dir, N.optim_states_name(rank, ranks.mp_rank, bf16=bf16)),
            f"missing (world size {world} needs ranks 0-{world - 1})",
        )
        ok = False
    for rank in sorted(set(inner) - set(range(world))):
        result.add(
            LayoutError,
            optim_files[rank][1],
            f"rank {rank} does not belong to a checkpoint of world size {world}: files of different runs are mixed",
        )
        ok = False
    prefixes = {prefix for prefix, _ in optim_files.values()}
    if len(prefixes) > 1:
        odd = next(p for r, (pre, p) in sorted(optim_files.items()) if pre != optim_files[0][0])
        result.add(LayoutError, odd, "bf16_ and plain optimizer files are mixed: files of different runs")
        ok = False
    if ranks.zero3:
        for rank in range(world):
            if rank not in models:
                result.add(
                    CheckpointNotFoundError,
                    os.path.join(tag_dir, N.model_states_name(3, rank, ranks.mp_rank)),
                    f"missing (world size {world} needs ranks 0-{world - 1})",
                )
                ok = False
        for rank in sorted(r for r in models if r >= world):
            result.add(
                LayoutError, model_paths[rank], f"rank {rank} does not belong to a checkpoint of world size {world}"
            )
            ok = False
    for rank, state in models.items():
        dp = state.get(N.DP_WORLD_SIZE)
        if dp is not None and dp != world:
            result.add(
                LayoutError,
                model_paths[rank],
                f"says dp_world_size {dp}, optimizer files say {world}: files of different runs are mixed",
            )
            ok = False
        mp = state.get(N.MP_WORLD_SIZE)
        if mp not in (None, ranks.mp_world):
            result.add(
                LayoutError,
                model_paths[rank],
                f"model-parallel world size {mp} is not supported"
                if ranks.mp_world == 1
                else f"records model-parallel world size {mp}, the folder holds {ranks.mp_world} pipeline stages: files of different runs are mixed",
            )
            ok = False
    return ok


def check_same_run(result: Survey, models: dict, optims: dict, model_paths: dict, optim_files: dict) -> None:
    """Every model-states file of one save carries the same step counter and param shapes; a
    ds_config or DeepSpeed version that differs between files is noted, not a problem.

    Guarantee: every rank counts ``global_steps`` alike (``DeepSpeedEngine._take_model_step``,
    engine.py:3558, on every rank at each step) and saves it (engine.py:5032); ``param_shapes``
    are the one model's (``_get_zero_param_shapes``, engine.py:5448-5477). Not guaranteed:
    ``ds_config`` is the config each rank passed to ``deepspeed.initialize`` (``self.config``,
    engine.py:544; saved at :5037 and :5551), which a launcher may write per rank (a
    node-local path), and ``ds_version`` each rank's own install; zckpt reads rank 0's. What a
    config says of the layout (:func:`layout_settings`: the stage, round-robin gradients, the
    training dtype, the optimizer) every rank must share, or its collectives would not match:
    a file whose config differs there is of another run."""
    first_model = next(iter(models))
    reference = models[first_model]
    reference_path = model_paths[first_model]
    for key, what in ((N.GLOBAL_STEPS, "global step"), (N.PARAM_SHAPES, "param shapes")):
        for rank, state in models.items():
            if key in state and key in reference and state[key] != reference[key]:
                result.add(
                    LayoutError,
                    model_paths[rank],
                    f"{what} differs from {os.path.basename(reference_path)}'s: files of different runs are mixed",
                )
    files = [(model_paths[rank], state) for rank, state in models.items()]
    files += [(optim_files[rank][1], state) for rank, state in sorted(optims.items())]
    settings = layout_settings(reference.get(N.DS_CONFIG))
    for path, state in files:  # what every rank of one run shares, or its collectives would not match
        theirs = layout_settings(state.get(N.DS_CONFIG)) if N.DS_CONFIG in state else settings
        if theirs != settings:
            key = next(k for k in settings if settings[k] != theirs.get(k))
            result.add(
                LayoutError,
                path,
                f"its DeepSpeed config says {key} = {theirs.get(key)!r}, {os.path.basename(reference_path)}'s "
                f"{settings[key]!r}: files of different runs are mixed",
            )
            return
    for key, what in ((N.DS_CONFIG, "DeepSpeed config"), (N.DS_VERSION, "DeepSpeed version")):
        odd = [path for path, state in files if key in state and key in reference and state[key] != reference[key]]
        if odd:
            result.notes.append(
                f"the {what} saved in {len(odd)} rank file(s) ({os.path.basename(odd[0])}"
                f"{', ...' * (len(odd) > 1)}) differs from {os.path.basename(reference_path)}'s: DeepSpeed saves each "
                f"rank's own; zckpt reads {os.path.basename(reference_path)}'s"
            )


# ds_config keys every rank of a run shares: they decide how each rank partitions, reduces and
# steps, and DeepSpeed's collectives (all-gathers and reduce-scatters of equal-sized partitions,
# zero/stage_1_and_2.py and stage3.py) only work when every rank agrees on them
_LAYOUT_SETTINGS = (
    ("zero_optimization", "stage"),
    ("zero_optimization", "round_robin_gradients"),
    ("zero_optimization", "sub_group_size"),
    ("zero_optimization", "stage3_sub_group_size"),
    ("zero_optimization", "parameter_alignment"),
    ("bf16", "enabled"),
    ("fp16", "enabled"),
    ("optimizer", "type"),
)


def layout_settings(config: object) -> dict[str, Any]:
    """The settings of a ds_config that every rank of one run shares (dotted key -> value)."""
    config = config if isinstance(config, dict) else {}
    values = {}
    for section, key in _LAYOUT_SETTINGS:
        block = config.get(section)
        values[f"{section}.{key}"] = block.get(key) if isinstance(block, dict) else None
    return values


def check_steps(result: Survey, reader: FileReader, inner: dict, optim_files: dict) -> None:
    """The optimizer's step counters must agree across ranks (cheap: a few scalars).

    Guarantee: every rank steps its flat partitions together or skips together: an overflow
    is all-reduced over the data-parallel group before the step (zero/stage_1_and_2.py:3237-3242,
    ``step`` at :3013-3060 skipping every group), and each group's partition is given its
    gradient before ``_optimizer_step`` (:3139-3145), so torch's per-param ``step`` advances on
    every rank alike. Optimizers that keep no ``step`` (SGD, Muon) are not judged."""
    steps: dict[int, Any] = {}
    for rank, state in sorted(inner.items()):
        try:
            step = _first_step(reader, state)
            reader.verify_now()  # a damaged counter is damage, not a sign of mixed runs
        except CorruptFileError as exc:
            result.add(CorruptFileError, exc.path, exc.problem)
            continue
        if step is not None:
            steps[rank] = step
    if len(set(steps.values())) > 1:
        rank0_step = steps.get(0)
        for rank, step in steps.items():
            if step != rank0_step:
                result.add(
                    LayoutError,
                    optim_files[rank][1],
                    f"optimizer is at step {step}, rank 0's at step {rank0_step}: files of different runs or saves are mixed",
                )


def check_rank_identity(result: Survey, layout: ZeroLayout, inner: dict, optim_files: dict, round_robin: bool) -> bool:
    """Each ZeRO-1/2 optimizer file's param_slice_mappings must name the params (and
    offsets) of the rank its file name says: swapped or copied rank files are caught here,
    where equal partition sizes hide them. The mappings follow the param group's order even
    under round-robin gradients (sample_ckpts/FORMAT_OBSERVED.md).

    Guarantee: DeepSpeed saves each rank's own mappings (``state_dict``,
    zero/stage_1_and_2.py:3397), built from the fragment of each param that rank's fp32
    partition holds (``_create_param_mapping``, :806-816, set at :747;
    ``get_hp_fragment_address``, utils/tensor_fragment.py:49)."""
    described = slice_mapping_layout(layout, round_robin)
    by_rank = described.by_rank()

    def mapping_of(rank: int, flat: int) -> dict:
        return {described.params[p.param].name: (p.length, p.flat_offset) for p in by_rank.get((rank, flat), [])}

    for rank, state in sorted(inner.items()):
        mappings = state.get(N.PARAM_SLICE_MAPPINGS)
        if not isinstance(mappings, list) or len(mappings) != len(layout.flat_groups):
            continue  # older files without them: nothing to tell by
        for flat, mapping in enumerate(mappings):
            expected = mapping_of(rank, flat)
            found = (
                {name: (getattr(a, "numel", None), getattr(a, "start", None)) for name, a in mapping.items()}
                if isinstance(mapping, dict)
                else None
            )
            if found != expected:
                owner = next((r for r in range(layout.world_size) if found == mapping_of(r, flat)), None)
                said = (
                    f"; they are rank {owner}'s: rank files swapped or copied"
                    if owner is not None and owner != rank
                    else ""
                )
                result.add(
                    LayoutError,
                    optim_files[rank][1],
                    f"param group {flat}: its param_slice_mappings do not match rank {rank}'s partition{said}",
                )
                return False
    return True


def check_not_copies(result: Survey, paths: dict[int, str], partitions: dict[int, list[TensorRef]], what: str) -> bool:
    """No ZeRO-3 rank file may repeat another rank's partitions (`what`) byte for byte: one
    file was copied over another (told by the sizes and CRC-32s in the zip directories).
    Only the partitions are judged, small ones too: buffers and counters are alike on every
    honest rank. Where nothing tells (checksums.RepeatedRank), the survey says so.

    Guarantee: each rank holds its own slice of every param, elements ``[rank * size, (rank
    + 1) * size)`` (``_partition_param``, zero/partition_parameters.py:1778-1830), so two
    ranks' partitions hold the same bytes only where the values repeat (told apart above)."""
    files = {
        rank: (
            path,
            [
                (ref.offset, ref.dtype.itemsize)
                for ref in partitions.get(rank, [])
                if isinstance(ref, TensorRef) and ref.path == path and ref.numel
            ],
        )
        for rank, path in paths.items()
    }
    ok = True
    for repeat in repeated_ranks(files):
        if repeat.telling:
            result.add(
                LayoutError,
                repeat.path,
                f"its {what} are byte-identical to rank {repeat.other}'s: one rank's file was copied over another's",
            )
            ok = False
        elif repeat.partitioned:
            result.untold_copies.append(
                f"{repeat.path}: its {what} are byte-identical to rank {repeat.other}'s, each one value repeated "
                "(as honest ranks' slices of constant params are): cannot tell whether one rank's file was copied over another's"
            )
        else:
            result.untold_copies.append(
                f"{repeat.path} holds the same tensors as {os.path.basename(repeat.other_path)} and none of its own (no {what}, "
                "only state alike on every rank, such as buffers): cannot tell whether one rank's file was copied over another's"
            )
    return ok


def _first_step(reader: FileReader, inner: dict) -> Any:
    """The Adam step of the first param (group) with state, or None."""
    for key in (N.BASE_OPTIMIZER_STATE, N.OPTIMIZER_STATE_DICT):
        state = inner.get(key)
        if isinstance(state, dict) and isinstance(state.get("state"), dict):
            for per_param in state["state"].values():
                if isinstance(per_param, dict) and "step" in per_param:
                    step = per_param["step"]
                    if isinstance(step, TensorRef):
                        if step.numel != 1:
                            return None
                        return read_scalar(reader, source_of(step))
                    return step
        if isinstance(state, list):  # ZeRO-1/2 elastic layout: one state dict per group
            for group in state:
                if isinstance(group, dict) and "step" in group:
                    step = group["step"]
                    return (
                        read_scalar(reader, source_of(step))
                        if isinstance(step, TensorRef) and step.numel == 1
                        else step
                    )
    return None
