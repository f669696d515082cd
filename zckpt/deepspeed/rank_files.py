"""The inventory of a tag folder's rank files: which model-states and optimizer-states files are
there, by rank, and what is wrong with the listing (:func:`scan_rank_files`). Then the files
loaded, as one value the later steps share (:class:`LoadedRanks`) instead of five arguments.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

from ..core.errors import CheckpointNotFoundError, LayoutError, ZckptError
from ..core.topology import RankCoords, Topology
from ..torchfile import reader as torchfile
from . import names as N
from .locate import natural_key
from .survey import Survey


@dataclass(frozen=True)
class RankFile:
    """One rank file: where it is, its rank's coordinates, and what it holds."""

    path: str
    coords: RankCoords
    kind: Literal["model", "optim"]
    per_rank: bool = True  # a model-states file named with its dp rank (ZeRO-3); ZeRO-1/2 keep one
    prefix: str = ""  # an optimizer file's bf16_ prefix


@dataclass(frozen=True)
class RankFiles:
    """What a tag folder lists, keyed by rank coordinates. `problems` are reported and reading
    goes on (so inspect can still describe the rest); a `fatal` problem stops the reading."""

    tag_dir: str
    files: tuple[RankFile, ...] = ()
    problems: tuple[ZckptError, ...] = ()
    fatal: ZckptError | None = None

    @property
    def model(self) -> dict[int | None, str]:
        """The model-states paths by dp rank (None: ZeRO-1/2's one file), by rank."""
        found = {f.coords.data if f.per_rank else None: f.path for f in self.files if f.kind == "model"}
        return dict(sorted(found.items(), key=lambda kv: kv[0] or 0))

    @property
    def optim(self) -> dict[int, tuple[str, str]]:
        """(bf16_ prefix or "", path) of the optimizer files, by dp rank."""
        return dict(sorted((f.coords.data, (f.prefix, f.path)) for f in self.files if f.kind == "optim"))

    @property
    def topology(self) -> Topology:
        """The degrees the files' coordinates span (a data-parallel run: (1, 1, 1, ranks))."""
        coords = [f.coords for f in self.files] or [RankCoords()]
        return Topology(*(max(getattr(c, axis) for c in coords) + 1 for axis in ("pipe", "tensor", "expert", "data")))

    @property
    def zero3(self) -> bool:
        """ZeRO-3 keeps one model-states file per dp rank, named with it."""
        return any(f.per_rank for f in self.files if f.kind == "model")

    @property
    def first(self) -> int | None:
        """The key of rank 0's model-states file."""
        return 0 if self.zero3 else None

    @property
    def paths(self) -> list[str]:
        """Every rank file, model states first (the order a survey lists its files in)."""
        return sorted(self.model.values()) + sorted(p for _, p in self.optim.values())


def scan_rank_files(tag_dir: str, folder_kind: str) -> RankFiles:
    """The model-states files and the optimizer files (with their bf16_ prefix) by rank
    coordinates; expert and model-parallel files are listed problems."""
    try:
        listing = sorted(os.listdir(tag_dir), key=natural_key)
    except OSError as exc:
        return RankFiles(tag_dir, fatal=CheckpointNotFoundError(tag_dir, f"cannot list {folder_kind} ({exc.strerror})"))
    files: dict[tuple[str, RankCoords, bool], RankFile] = {}
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
            per_rank = model_match["dp"] is not None
            coords = RankCoords.dp(int(model_match["dp"]) if per_rank else 0)
            files[("model", coords, per_rank)] = RankFile(path, coords, "model", per_rank)
        elif optim_match:
            coords = RankCoords.dp(int(optim_match["dp"]))
            if (key := ("optim", coords, True)) in files:
                other = files[key].path
                problems.append(LayoutError(path, f"two optimizer files for rank {coords.data} (also {os.path.basename(other)}): files of a bf16 and a non-bf16 run are mixed"))
                continue
            files[key] = RankFile(path, coords, "optim", prefix=optim_match["prefix"] or "")
    return RankFiles(tag_dir, tuple(files.values()), tuple(problems))


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
    return dataclasses.replace(files, fatal=fatal)


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
