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
from .features import fast_writer_refusal
from .locate import natural_key
from .survey import Survey


@dataclass(frozen=True)
class RankFile:
    """One rank file: where it is, its rank's coordinates, and what it holds: the model or
    optimizer states of a data-parallel rank, or a file of another layout (a pipeline layer,
    an expert, the experts' optimizer states), recorded so that the layout can be named."""

    path: str
    coords: RankCoords
    kind: Literal["model", "optim", "layer", "expert", "expert_optim"]
    per_rank: bool = True  # a model-states file named with its dp rank (ZeRO-3); ZeRO-1/2 keep one
    prefix: str = ""  # an optimizer file's bf16_ prefix
    layer: int | None = None  # the layer of a pipeline layer file or an expert file

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def data_parallel(self) -> bool:
        """A file of a data-parallel-only layout, which zckpt reads."""
        return self.kind in ("model", "optim") and self.coords.data_parallel_only


@dataclass(frozen=True)
class RankFiles:
    """What a tag folder lists, keyed by rank coordinates. `problems` are reported and reading
    goes on (so inspect can still describe the rest); a `fatal` problem stops the reading."""

    tag_dir: str
    files: tuple[RankFile, ...] = ()
    problems: tuple[ZckptError, ...] = ()
    fatal: ZckptError | None = None
    mp_rank: int = 0  # the model-parallel rank its model and optimizer files are named with

    @property
    def pipeline(self) -> bool:
        """A pipeline-parallel run: its layers saved one file each (``layer_NN-model_states.pt``)."""
        return any(f.kind == "layer" for f in self.files)

    @property
    def tensor_ranks(self) -> list[int]:
        """The tensor ranks that have model or optimizer files (a tensor-parallel run)."""
        return sorted({f.coords.tensor for f in self.files if f.kind in ("model", "optim")})

    @property
    def tensor_parallel(self) -> bool:
        return any(t > 0 for t in self.tensor_ranks) and not self.pipeline and not self.moe

    def tensor_rank(self, tensor: int) -> "RankFiles":
        """The model and optimizer files of one tensor rank: a data-parallel checkpoint of its
        shards, named with its model-parallel rank (a pipeline stage's: stage * tp + tensor)."""
        own = tuple(
            dataclasses.replace(f, coords=RankCoords.dp(f.coords.data))
            for f in self.files
            if f.kind in ("model", "optim") and f.coords.tensor == tensor
        )
        return RankFiles(self.tag_dir, own, mp_rank=self.mp_rank + tensor)

    @property
    def moe(self) -> bool:
        """A mixture-of-experts run: its experts saved one file each (``layer_L_expert_E_...``)."""
        return any(f.kind == "expert" for f in self.files)

    @property
    def expert_paths(self) -> list[str]:
        return sorted(f.path for f in self.files if f.kind == "expert")

    @property
    def layers(self) -> dict[int, str]:
        """The pipeline layer files by global layer index (tensor rank 0's)."""
        return self.tensor_layers(0)

    def tensor_layers(self, tensor: int) -> dict[int, str]:
        """One tensor rank's pipeline layer files (``layer_NN-model_TT-...``) by global layer index."""
        return dict(
            sorted(
                (f.layer, f.path)
                for f in self.files
                if f.kind == "layer" and f.layer is not None and f.coords.tensor == tensor
            )
        )

    @property
    def layer_tensor_ranks(self) -> int:
        """How many tensor ranks the layer files name (1: a pipeline run without tensor parallelism)."""
        return max((f.coords.tensor for f in self.files if f.kind == "layer"), default=0) + 1

    @property
    def stages(self) -> list[int]:
        """The pipeline stages that have model or optimizer files."""
        return sorted({f.coords.pipe for f in self.files if f.kind in ("model", "optim")})

    def stage(self, pipe: int) -> "RankFiles":
        """The model and optimizer files of one pipeline stage, as the data-parallel checkpoint
        each stage is (its own ZeRO partitioning over its own data-parallel group; with tensor
        ranks, one per tensor rank: see :meth:`tensor_rank`), named with the stage's first
        model-parallel rank (``stage * tp``)."""
        own = tuple(
            dataclasses.replace(f, coords=RankCoords(0, f.coords.tensor, 0, f.coords.data))
            for f in self.files
            if f.kind in ("model", "optim") and f.coords.pipe == pipe
        )
        return RankFiles(self.tag_dir, own, mp_rank=pipe * self.layer_tensor_ranks)

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


def parse_rank_file(path: str) -> RankFile | None:
    """The rank file a name in a tag folder is, with its coordinates; None: not a rank file.
    ``mp_rank_NN`` is the tensor rank (stage * tp + tensor rank in a pipeline run: the names
    alone do not tell), recorded as the tensor coordinate."""
    name = os.path.basename(path)
    if match := N.EXPERT_STATES_RE.match(name):
        layer = int(match["layer"]) if match["layer"] is not None else None
        return RankFile(path, RankCoords(0, int(match["mp"]), int(match["expert"]), 0), "expert", layer=layer)
    if match := N.EXPERT_OPTIM_STATES_RE.match(name):
        return RankFile(path, RankCoords(0, int(match["mp"]), int(match["ep"]), 0), "expert_optim")
    if match := N.LAYER_STATES_RE.match(name):
        return RankFile(path, RankCoords(0, int(match["tp"] or 0), 0, 0), "layer", layer=int(match["layer"]))
    if match := N.MODEL_STATES_RE.match(name):
        per_rank = match["dp"] is not None
        return RankFile(
            path, RankCoords(0, int(match["mp"]), 0, int(match["dp"]) if per_rank else 0), "model", per_rank
        )
    if match := N.OPTIM_STATES_RE.match(name):
        return RankFile(
            path, RankCoords(0, int(match["mp"]), 0, int(match["dp"])), "optim", prefix=match["prefix"] or ""
        )
    return None


def scan_rank_files(tag_dir: str, folder_kind: str) -> RankFiles:
    """The rank files of a folder by their coordinates. A folder holding files of a pipeline,
    tensor or expert parallel layout is refused here, in one line naming the layout."""
    try:
        listing = sorted(os.listdir(tag_dir), key=natural_key)
    except OSError as exc:
        return RankFiles(tag_dir, fatal=CheckpointNotFoundError(tag_dir, f"cannot list {folder_kind} ({exc.strerror})"))
    found = [f for f in (parse_rank_file(os.path.join(tag_dir, name)) for name in listing) if f is not None]
    if _pipeline_only(found):
        found = [_as_stage(f) for f in found]
    elif _pipeline_tensor(found):
        tp = max(f.coords.tensor for f in found if f.kind == "layer") + 1
        found = [_as_stage(f, tp) for f in found]
    refusal = layout_refusal(tag_dir, found)
    if refusal is not None:
        return RankFiles(tag_dir, tuple(found), fatal=refusal)
    files: dict[tuple[str, RankCoords, bool, int | None], RankFile] = {}
    problems: list[ZckptError] = []
    for file in found:
        key = (file.kind, file.coords, file.per_rank, file.layer)
        if file.kind == "optim" and key in files:
            other = files[key].name
            problems.append(
                LayoutError(
                    file.path,
                    f"two optimizer files for rank {file.coords.data} (also {other}): files of a bf16 and a non-bf16 run are mixed",
                )
            )
            continue
        files[key] = file
    return RankFiles(tag_dir, tuple(files.values()), tuple(problems))


def _pipeline_only(files: list[RankFile]) -> bool:
    """Layer files of one tensor rank and no expert files: a pipeline(-and-data)-parallel run,
    whose ``mp_rank_NN`` is the pipeline stage."""
    return (
        any(f.kind == "layer" for f in files)
        and all(f.coords.tensor == 0 for f in files if f.kind == "layer")
        and not any(f.kind in ("expert", "expert_optim") for f in files)
    )


def _pipeline_tensor(files: list[RankFile]) -> bool:
    """Layer files of several tensor ranks (``layer_NN-model_TT-...``) and no expert files: a
    pipeline x tensor parallel run, whose ``mp_rank_NN`` is ``stage * tp + tensor rank``."""
    return any(f.kind == "layer" and f.coords.tensor > 0 for f in files) and not any(
        f.kind in ("expert", "expert_optim") for f in files
    )


def _moe_only(files: list[RankFile]) -> bool:
    """Expert files beside ZeRO files of one model-parallel rank: a mixture-of-experts run over
    data-parallel ranks; at ZeRO-0, ``expp_rank_*`` optimizer files instead of ZeRO ones."""
    return (
        any(f.kind == "expert" for f in files)
        and not any(f.kind == "layer" for f in files)
        and not (any(f.kind == "expert_optim" for f in files) and any(f.kind == "optim" for f in files))
        and all(f.coords.tensor == 0 for f in files)
    )


def _tensor_only(files: list[RankFile]) -> bool:
    """Model and optimizer files of several model-parallel ranks and nothing else: a tensor-parallel
    run (its reader says whether it can merge the shards)."""
    return any(f.coords.tensor > 0 for f in files) and all(f.kind in ("model", "optim") for f in files)


def _as_stage(file: RankFile, tp: int = 1) -> RankFile:
    """A model or optimizer file of a pipeline run: its ``mp_rank`` is ``stage * tp + tensor rank``."""
    if file.kind not in ("model", "optim"):
        return file
    coords = file.coords
    return dataclasses.replace(file, coords=RankCoords(coords.tensor // tp, coords.tensor % tp, 0, coords.data))


def layout_refusal(tag_dir: str, files: list[RankFile]) -> LayoutError | None:
    """The one refusal of a folder holding files of a layout zckpt does not read (experts beside
    pipeline stages or tensor ranks, ZeRO-0 experts): which layouts and a file of each; None if
    there are none."""
    if _pipeline_only(files) or _pipeline_tensor(files) or _moe_only(files) or _tensor_only(files):
        return None
    layers = [f for f in files if f.kind == "layer"]
    model_parallel = [f for f in files if f.kind in ("model", "optim") and f.coords.tensor > 0]
    experts = [f for f in files if f.kind in ("expert", "expert_optim")]
    layouts, details = [], []
    if layers:
        tp = max(f.coords.tensor for f in layers) + 1  # layer files name the tensor rank, when there is one
        stages = (max((f.coords.tensor for f in files if f.kind == "model"), default=0) + 1) // tp
        layouts.append("pipeline-parallel" if tp == 1 else "pipeline- and tensor-parallel")
        details.append(
            f"{stages} stage{'s' * (stages != 1)}{f' x {tp} tensor ranks' if tp > 1 else ''}; {_count(layers, 'layer file')}: {_some(layers)}"
        )
    elif model_parallel:
        layouts.append("tensor/pipeline-parallel")
        details.append(f"mp_rank > 0: {_some(model_parallel)}")
    if experts:
        layouts.append("mixture-of-experts (expert-parallel)")
        details.append(f"{_count(experts, 'expert file')}: {_some(experts)}")
    if not layouts:
        return None
    return LayoutError(
        tag_dir,
        f"a {' and '.join(layouts)} checkpoint ({'; '.join(details)}): zckpt reads data-, pipeline- and tensor-parallel "
        "ZeRO checkpoints and mixture-of-experts ZeRO-1/2 checkpoints only (experts beside pipeline stages or tensor "
        "ranks, and ZeRO-0 experts, are not supported yet)",
    )


def _count(files: list[RankFile], what: str) -> str:
    return f"{len(files)} {what}{'s' * (len(files) != 1)}"


def _some(files: list[RankFile]) -> str:
    """The first file's name, and '...' for the others."""
    return files[0].name + (" ..." if len(files) > 1 else "")


def zero_rank_files(tag_dir: str) -> RankFiles:
    """The rank files of a ZeRO tag folder, with a fatal problem when they cannot make one
    checkpoint (no model files, or both ZeRO-1/2 and ZeRO-3 model files). Without optimizer files
    the reader looks for ZeRO-0's optimizer state in the model-states file (:mod:`.zero0`)."""
    files = scan_rank_files(tag_dir, "tag folder")
    if files.fatal is not None:
        return files
    fatal = None
    if not files.model:
        fatal = fast_writer_refusal(tag_dir) or CheckpointNotFoundError(
            tag_dir, "no *_model_states.pt file in the tag folder"
        )
    elif None in files.model and len(files.model) > 1:
        fatal = LayoutError(
            tag_dir,
            "holds both ZeRO-1/2 (mp_rank_00_model_states.pt) and ZeRO-3 (zero_pp_rank_*_model_states.pt) model files: two runs are mixed",
        )
    return dataclasses.replace(files, fatal=fatal)


def load(result: Survey, path: str, loaded: dict[str, Any] | None = None) -> Any | None:
    """A pickle's content (tensors as TensorRefs), or None with the problem listed. With
    `loaded`, a file one pass over a tag folder reads for two steps is read (and its problem
    listed) once: the content is kept there by path."""
    if loaded is not None and path in loaded:
        return loaded[path]
    try:
        content, archive = torchfile.load_archive(path)
    except ZckptError as exc:
        result.problems.append(exc)
        content = None
    else:
        check_saved_name(result, path, archive)
    if loaded is not None:
        loaded[path] = content
    return content


def check_saved_name(result: Survey, path: str, archive: str) -> None:
    """List a problem when the rank file at `path` was saved under another rank file's name.

    Why this tells rank identity: DeepSpeed saves every rank file with ``torch.save(state,
    path)`` (``TorchCheckpointEngine.save``, deepspeed/runtime/checkpoint_engine/
    torch_checkpoint_engine.py), and torch names the archive's folder after that path (the
    base name up to its last dot: ``PyTorchStreamWriter``'s ``archive_name_``,
    caffe2/serialize/inline_container.cc). Files swapped, or one copied over another, keep the
    name of the rank that wrote them. A file saved to a stream is named "archive", which tells
    nothing: it is listed in ``unnamed_archives``. (Optimizer state in the padding tells
    nothing either: ZeRO-3's flat fp32 partitions leave it uninitialised, ``torch.empty`` in
    ``partition_param``, deepspeed/runtime/zero/partition_parameters.py, and coupled weight
    decay turns that into nonzero moments.)"""
    here = parse_rank_file(path)
    saved = parse_rank_file(os.path.join(os.path.dirname(path), archive + ".pt"))
    if here is None:
        return
    if saved is None:
        result.unnamed_archives.append(path)
    elif dataclasses.replace(saved, path=path) == here:
        result.named_archives += 1
    else:
        result.add(
            LayoutError,
            path,
            f"was saved as {archive}.pt (the name torch.save recorded inside it): rank files swapped, copied or renamed, "
            "or files of different runs mixed",
        )


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
    mp_rank: int = 0  # the model-parallel rank the files are named with (a pipeline stage)
    mp_world: int = 1  # the model-parallel world size the files must record

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
