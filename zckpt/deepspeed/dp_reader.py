"""One data-parallel set of rank files read into a :class:`~.survey.Survey` (:func:`read_ranks`):
the files loaded, their pickles checked against what the reader relies on (:mod:`.rank_checks`),
the model described (:mod:`.model_states`), every param located as file segments and the training
state built (:mod:`.partitions`), and a live swap folder judged (:mod:`.live_swap`). A whole
data-parallel checkpoint is one such set; a pipeline run is one per stage (:mod:`.pipeline`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from ..core.errors import ZckptError
from ..core.index import CheckpointIndex
from ..core.topology import Topology
from ..io.reading import FileReader
from ..torchfile.reader import TensorRef
from . import names as N
from . import swap_folder as swap
from .elastic import rigid_views
from .features import feature_notes, feature_refusal
from .live_swap import check_swap_folder, report_swap_folder
from .model_states import declare, describe, describe_readable, module_entries, rounded_copies, tied_entries
from .partitions import Partitions
from .rank_checks import check_file_kinds, check_same_run, check_steps, check_world
from .rank_files import LoadedRanks, RankFiles, load
from .schema import MODEL_SCHEMA, schema_problems
from .survey import Survey
from .zero0 import check_optimizer, is_zero0, read_zero0


def read_ranks(
    result: Survey,
    files: RankFiles,
    swap_folder: swap.SwapFolder | None = None,
    modules: dict[int | None, dict] | None = None,
    mp_world: int = 1,
    view: Callable[[str, int | None, Any], Any] | None = None,
) -> None:
    """Read one data-parallel set of rank files (a whole data-parallel checkpoint, or one
    pipeline stage) into `result`. `modules`: the module state dict of each model-states file
    where the file holds none (a pipeline stage's, rebuilt from its layer files). `view`: what
    the reader sees of each loaded file ("model" or "optim", its rank, its state): one part of
    it (a mixture-of-experts run's dense or expert param groups)."""
    location = result.location
    assert location is not None
    tag_dir = location.tag_dir
    result.files = files.paths
    shared = _SharedMetadata(files.first) if modules is None and view is None else None
    models = {rank: _shared_model(shared, rank, load(result, p)) for rank, p in files.model.items()}
    if modules is not None:
        models = {rank: _with_module(m, modules.get(rank)) for rank, m in models.items()}
    optims = {rank: _shared_optim(shared, load(result, p)) for rank, (_, p) in files.optim.items()}
    if view is not None:
        models = {rank: view("model", rank, m) for rank, m in models.items()}
        optims = {rank: view("optim", rank, o) for rank, o in optims.items()}
    model0 = models.get(files.first)
    if not files.optim and is_zero0(model0):  # the torch optimizer's state dict is in the model-states file
        path, problems = files.model[files.first], len(result.problems)
        optimizer = check_optimizer(result, model0, path)
        if len(result.problems) == problems:
            read_zero0(result, model0, optimizer, path, path, mp_world)
        return
    if isinstance(model0, dict) and not schema_problems(model0, MODEL_SCHEMA):
        declare(result, model0)
    if any(v is None for v in list(models.values()) + list(optims.values())) or not check_file_kinds(
        result, models, optims, files.model, files.optim, tag_dir, files.mp_rank
    ):
        describe_readable(result, models, optims, files.optim, files.zero3, tag_dir, files.mp_rank)
        return
    # elastic_checkpoint's per-group states read as the rigid layout's (.elastic)
    inner, refusal, elastic_notes = rigid_views(
        {rank: optims[rank][N.OPTIMIZER_STATE_DICT] for rank in optims},
        model0.get(N.DS_CONFIG) if isinstance(model0, dict) else None,
        {rank: path for rank, (_, path) in files.optim.items()},
    )
    if refusal is not None:
        result.problems.append(refusal)
        return
    result.notes.extend(elastic_notes)
    ranks = LoadedRanks(
        models=models,
        optims=optims,
        inner=inner,
        model_paths=files.model,
        optim_files=files.optim,
        zero3=files.zero3,
        mp_rank=files.mp_rank,
        mp_world=mp_world,
    )
    run_config = describe(result, ranks.model0, ranks.inner[0], ranks.optim_files[0][0], ranks.zero3, ranks.model0_path)
    refusal = feature_refusal(ranks.model0, ranks.inner, ranks.zero3, ranks.model0_path, ranks.optim_files[0][1])
    if refusal is not None:  # a DeepSpeed feature whose files zckpt does not read, named (.features)
        result.problems.append(refusal)
        return
    result.notes.extend(feature_notes(ranks.model0))
    if not check_world(result, ranks, tag_dir):
        return
    if swap_folder is not None and not check_swap_folder(result, swap_folder, ranks.zero3):
        return
    check_same_run(result, models, optims, ranks.model_paths, ranks.optim_files)
    with FileReader() as reader:
        check_steps(result, reader, ranks.inner, ranks.optim_files)
    if result.problems:
        return
    world = result.world_size
    assert world is not None
    partitions = Partitions(result, tag_dir, run_config, swap_folder)
    entries = module_entries(result, models, ranks.model_paths, ranks.zero3, world)
    if entries is None:
        return
    params = partitions.entries(ranks, world)
    if params is None or result.problems:
        return
    entries += params
    entries += tied_entries(ranks.model0, entries)
    assert result.dtype is not None
    result.index = CheckpointIndex(
        checkpoint_dir=location.checkpoint_dir,
        tag=location.tag,
        tag_dir=tag_dir,
        tags=location.tags,
        zero_stage=result.zero_stage or 0,
        world_size=world,
        topology=Topology.data_parallel(world),
        dtype=result.dtype,
        ds_version=result.ds_version,
        offload=result.offload,
        entries=tuple(entries),
        files=tuple(result.files),
        notes=tuple(result.notes),
        rounded_copies=() if ranks.zero3 else tuple(rounded_copies(ranks.model0.get(N.MODULE), params)),
    )
    try:
        result.state = partitions.training_state(result.index, ranks)
    except ZckptError as exc:
        result.problems.append(exc)
        result.index = None
        return
    if swap_folder is not None:
        report_swap_folder(result, swap_folder, partitions)


class _SharedMetadata:
    """Metadata kept once, not per rank file: every ZeRO-3 rank saves the whole model's
    ``param_shapes``, its ``ds_config`` and a placeholder tensor for every param in ``module``
    (hundreds of KB a file at a few hundred params; GBs at thousands of ranks). As each file is
    loaded, what equals rank 0's is replaced by rank 0's object, and a later rank's placeholders
    (numel 0, not buffers) are dropped: only rank 0's module names the params, a later rank's
    module is read for its buffers alone (``module_buffers``). A file is compacted only when it
    and rank 0's are sound (:data:`MODEL_SCHEMA`), so every check later reads the same values
    and says the same."""

    _SHARED_KEYS = (N.PARAM_SHAPES, N.DS_CONFIG, N.DS_VERSION, N.BUFFER_NAMES, N.FROZEN_PARAM_SHAPES)

    def __init__(self, first: int | None) -> None:
        self.first = first
        self.reference: dict | None = None  # rank 0's model states, when sound

    def model(self, rank: int | None, state: Any) -> Any:
        if not _sound_model(state):
            return state
        if rank == self.first:
            self.reference = state
            return state
        if self.reference is None:
            return state
        self._share(state, self._SHARED_KEYS)
        module, buffers = state[N.MODULE], set(state.get(N.BUFFER_NAMES) or ())
        if type(module) in (dict, OrderedDict):
            state[N.MODULE] = type(module)(
                (name, ref)
                for name, ref in module.items()
                if name in buffers or not (isinstance(ref, TensorRef) and ref.numel == 0)
            )
        return state

    def optim(self, state: Any) -> Any:
        if isinstance(state, dict) and self.reference is not None:
            self._share(state, (N.DS_CONFIG, N.DS_VERSION))
        return state

    def _share(self, state: dict, keys: tuple[str, ...]) -> None:
        reference = self.reference
        assert reference is not None
        for key in keys:
            if key in state and key in reference and state[key] is not reference[key]:
                if type(state[key]) is type(reference[key]) and state[key] == reference[key]:
                    state[key] = reference[key]


def _sound_model(state: Any) -> bool:
    return (
        isinstance(state, dict)
        and N.PARAM_SHAPES in state
        and isinstance(state.get(N.MODULE), dict)
        and not schema_problems(state, MODEL_SCHEMA)
    )


def _shared_model(shared: _SharedMetadata | None, rank: int | None, state: Any) -> Any:
    return state if shared is None else shared.model(rank, state)


def _shared_optim(shared: _SharedMetadata | None, state: Any) -> Any:
    return state if shared is None else shared.optim(state)


def _with_module(model: object, module: dict | None) -> object:
    """A model-states dict whose ``module`` (None in a pipeline run's files) is `module`."""
    if module is None or not isinstance(model, dict) or model.get(N.MODULE) is not None:
        return model
    return {**model, N.MODULE: module}
