"""One data-parallel set of rank files read into a :class:`~.survey.Survey` (:func:`read_ranks`):
the files loaded, their pickles checked against what the reader relies on (:mod:`.rank_checks`),
the model described (:mod:`.model_states`), every param located as file segments and the training
state built (:mod:`.partitions`), and a live swap folder judged (:mod:`.live_swap`). A whole
data-parallel checkpoint is one such set; a pipeline run is one per stage (:mod:`.pipeline`).
"""

from __future__ import annotations

from typing import Any, Callable

from ..core.errors import ZckptError
from ..core.index import CheckpointIndex
from ..core.topology import Topology
from ..io.reading import FileReader
from . import names as N
from . import swap_folder as swap
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
    models = {rank: load(result, p) for rank, p in files.model.items()}
    if modules is not None:
        models = {rank: _with_module(m, modules.get(rank)) for rank, m in models.items()}
    optims = {rank: load(result, p) for rank, (_, p) in files.optim.items()}
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
    ranks = LoadedRanks(
        models=models,
        optims=optims,
        inner={rank: optims[rank][N.OPTIMIZER_STATE_DICT] for rank in optims},
        model_paths=files.model,
        optim_files=files.optim,
        zero3=files.zero3,
        mp_rank=files.mp_rank,
        mp_world=mp_world,
    )
    run_config = describe(result, ranks.model0, ranks.inner[0], ranks.optim_files[0][0], ranks.zero3, ranks.model0_path)
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


def _with_module(model: object, module: dict | None) -> object:
    """A model-states dict whose ``module`` (None in a pipeline run's files) is `module`."""
    if module is None or not isinstance(model, dict) or model.get(N.MODULE) is not None:
        return model
    return {**model, N.MODULE: module}
