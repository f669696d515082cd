"""The inventory of a tag folder's rank files: which model-states and optimizer-states files are
there, by rank, and what is wrong with the listing (:func:`scan_rank_files`). Then the files
loaded, as one value the later steps share (:class:`LoadedRanks`) instead of five arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..core.errors import CheckpointNotFoundError, LayoutError, ZckptError
from ..torchfile import reader as torchfile
from . import names as N
from .locate import natural_key
from .survey import Survey


@dataclass(frozen=True)
class RankFiles:
    """What a tag folder lists. `problems` are reported and reading goes on (so inspect can
    still describe the rest); a `fatal` problem stops the reading."""

    tag_dir: str
    model: dict[int | None, str]  # model-states paths by dp rank (None: ZeRO-1/2's one file), by rank
    optim: dict[int, tuple[str, str]]  # (bf16_ prefix or "", path) of the optimizer files, by rank
    problems: tuple[ZckptError, ...] = ()
    fatal: ZckptError | None = None

    @property
    def zero3(self) -> bool:
        """ZeRO-3 keeps one model-states file per dp rank, named with it."""
        return any(rank is not None for rank in self.model)

    @property
    def first(self) -> int | None:
        """The key of rank 0's model-states file."""
        return 0 if self.zero3 else None

    @property
    def paths(self) -> list[str]:
        """Every rank file, model states first (the order a survey lists its files in)."""
        return sorted(self.model.values()) + sorted(p for _, p in self.optim.values())


def scan_rank_files(tag_dir: str, folder_kind: str) -> RankFiles:
    """The model-states files by dp rank and the optimizer files by rank (with their bf16_
    prefix); expert and model-parallel files are listed problems."""
    try:
        listing = sorted(os.listdir(tag_dir), key=natural_key)
    except OSError as exc:
        return RankFiles(tag_dir, {}, {}, fatal=CheckpointNotFoundError(tag_dir, f"cannot list {folder_kind} ({exc.strerror})"))
    model: dict[int | None, str] = {}
    optim: dict[int, tuple[str, str]] = {}
    problems: list[ZckptError] = []
    for name in listing:
        path = os.path.join(tag_dir, name)
        model_match, optim_match = N.MODEL_STATES_RE.match(name), N.OPTIM_STATES_RE.match(name)
        match = model_match or optim_match
        if N.EXPERT_STATES_RE.match(name):
            problems.append(LayoutError(path, "mixture-of-experts checkpoints (expert files) are not supported"))
        elif match and int(match["mp"]) != 0:
            problems.append(LayoutError(path, "tensor/pipeline-parallel checkpoints (mp_rank > 0) are not supported"))
        elif model_match:
            model[int(model_match["dp"]) if model_match["dp"] is not None else None] = path
        elif optim_match:
            rank = int(optim_match["dp"])
            if rank in optim:
                other = optim[rank][1]
                problems.append(LayoutError(path, f"two optimizer files for rank {rank} (also {os.path.basename(other)}): files of a bf16 and a non-bf16 run are mixed"))
                continue
            optim[rank] = (optim_match["prefix"] or "", path)
    model = dict(sorted(model.items(), key=lambda kv: kv[0] or 0))
    return RankFiles(tag_dir, model, dict(sorted(optim.items())), tuple(problems))


def zero_rank_files(tag_dir: str) -> RankFiles:
    """The rank files of a ZeRO tag folder, with a fatal problem when they cannot make one
    checkpoint (no model or optimizer files, or both ZeRO-1/2 and ZeRO-3 model files)."""
    files = scan_rank_files(tag_dir, "tag folder")
    if files.fatal is not None:
        return files
    fatal = None
    if not files.model:
        fatal = CheckpointNotFoundError(tag_dir, "no *_model_states.pt file in the tag folder")
    elif not files.optim:
        fatal = CheckpointNotFoundError(tag_dir, "no *_optim_states.pt files: saved without ZeRO optimizer state, nothing to consolidate from")
    elif None in files.model and len(files.model) > 1:
        fatal = LayoutError(tag_dir, "holds both ZeRO-1/2 (mp_rank_00_model_states.pt) and ZeRO-3 (zero_pp_rank_*_model_states.pt) model files: two runs are mixed")
    return RankFiles(files.tag_dir, files.model, files.optim, files.problems, fatal)


def load(result: Survey, path: str) -> Any | None:
    """A pickle's content (tensors as TensorRefs), or None with the problem listed."""
    try:
        return torchfile.load(path)
    except ZckptError as exc:
        result.problems.append(exc)
        return None


@dataclass(frozen=True)
class LoadedRanks:
    """The loaded rank files of a checkpoint whose file kinds were checked: the model states
    and the optimizer files (outer and inner state dicts), with their paths, by rank."""

    models: dict[int | None, dict]
    optims: dict[int, dict]
    inner: dict[int, dict]  # each optimizer file's optimizer_state_dict
    model_paths: dict[int | None, str]
    optim_files: dict[int, tuple[str, str]]  # (prefix, path)
    zero3: bool

    @property
    def first(self) -> int | None:
        return 0 if self.zero3 else None

    @property
    def model0(self) -> dict:
        return self.models[self.first]

    @property
    def model0_path(self) -> str:
        return self.model_paths[self.first]

    @property
    def optim_paths(self) -> dict[int, str]:
        return {rank: path for rank, (_, path) in self.optim_files.items()}
