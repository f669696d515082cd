"""The named tensors of any input zckpt reads, as lazy file segments: one view for comparing.

A ZeRO checkpoint (any stage or world size, a tag folder, a Trainer ``checkpoint-N`` folder), a
universal folder, or a weights output (safetensors or torch ``.bin``/``.pt``, one file or shards
with their ``.index.json``) all become the same thing: names mapped to
:class:`~zckpt.core.index.TensorSource` (where the bytes lie), plus, for training checkpoints, the
optimizer states and scalars. Only headers and pickles are parsed here; tensor bytes are read
later, a range at a time (:func:`~zckpt.io.reading.read_range`), so two inputs can be walked side by side with
memory bounded by a buffer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from ..core.errors import CheckpointNotFoundError, CorruptFileError
from ..core.index import Segment, TensorRef, TensorSource
from ..core.state import ScalarState, TrainingState
from ..core.untrusted import path_component
from ..deepspeed.locate import tag_named_in
from ..deepspeed.reader import open_checkpoint, open_training_state
from ..hf.safetensors import read_header
from ..io.reading import source_of
from ..torchfile import reader as torchfile
from .classify import Kind, classify

InputKind = Literal["zero_checkpoint", "universal_checkpoint", "safetensors", "torch"]


@dataclass(frozen=True)
class NamedTensors:
    """What one input holds, by name; no tensor data.

    `states` and `scalars` are None when the input keeps no optimizer state (a weights file), or
    when they were not asked for.
    """

    path: str
    kind: InputKind
    tensors: dict[str, TensorSource]  # weights, in the input's order
    states: dict[str, TensorSource] | None = None  # "<param>.<state>" (exp_avg, ...), full shape
    scalars: dict[str, ScalarState] | None = None  # per-group steps and hyperparameters, counters
    tag: str | None = None
    zero_stage: int | None = None
    world_size: int | None = None
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def is_checkpoint(self) -> bool:
        """A training checkpoint, which keeps optimizer states (a weights file does not)."""
        return self.kind in ("zero_checkpoint", "universal_checkpoint")


def open_tensors(path: str | os.PathLike[str], *, states: bool = False) -> NamedTensors:
    """The named tensors of a checkpoint or weights output at `path` (see the module docstring).

    With `states`, a training checkpoint's optimizer states and scalars are read too (the whole
    optimizer state is validated, which costs its pickles).
    """
    path = os.fspath(path)
    found = classify(path)
    if found.kind is Kind.MISSING:
        raise CheckpointNotFoundError(path, "no such file or directory")
    if os.path.isdir(path):
        if found.weights_file is not None:  # a weights folder; else a Trainer output folder, or nothing (locate says)
            return _weights(found.weights_file)
        return _checkpoint(path, None, states)
    if found.kind is Kind.LATEST_FILE:
        return _checkpoint(found.checkpoint_dir, tag_named_in(path), states)
    return _weights(path)


def _checkpoint(path: str, tag: str | None, states: bool) -> NamedTensors:
    training: TrainingState | None = open_training_state(path, tag) if states else None
    index = training.index if training else open_checkpoint(path, tag)
    return NamedTensors(
        path=path,
        kind="universal_checkpoint" if index.universal else "zero_checkpoint",
        tensors={e.name: e.source for e in index.entries},
        states=_state_tensors(training) if training else None,
        scalars=_scalars(training) if training else None,
        tag=index.tag,
        zero_stage=index.zero_stage,
        world_size=index.world_size,
        files=index.files,
        notes=index.notes,
    )


def _state_tensors(training: TrainingState) -> dict[str, TensorSource]:
    """Every per-element optimizer state as ``<param>.<state>`` (the names iter_tensors uses).
    The fp32 master is not repeated: it is the param's weight already."""
    found = {f"{p.name}.{key}": source for p in training.params for key, source in p.states.items()}
    for g, group in enumerate(training.groups):  # a per-group state of more than one element
        for key, scalar in group.scalars.items():
            if scalar.tensor is not None and scalar.tensor.numel != 1:
                found[f"param_groups.{g}.{key}"] = scalar.tensor
    return found


def _scalars(training: TrainingState) -> dict[str, ScalarState]:
    """Per-group scalars (step), numeric hyperparameters (lr, betas, amsgrad, ...), engine counters."""
    found: dict[str, ScalarState] = {}
    for g, group in enumerate(training.groups):
        for key, scalar in group.scalars.items():
            if scalar.tensor is None or scalar.tensor.numel == 1:
                found[f"param_groups.{g}.{key}"] = scalar
        for key, value in group.hyperparams.items():
            if _plain(value):
                found[f"param_groups.{g}.{key}"] = ScalarState(value=value)
    for key in ("global_steps", "global_samples", "skipped_steps"):
        found[key] = ScalarState(value=getattr(training, key))
    return found


def _plain(value: Any) -> bool:
    """A number, a flag or a tuple of numbers (betas); not None or names, which loaders fill in."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_plain(v) for v in value)
    return isinstance(value, (bool, int, float))


def _weights(path: str) -> NamedTensors:
    """A weights file, or the shards an ``.index.json`` names."""
    if path.endswith(".index.json"):
        return _sharded(path)
    kind: InputKind = "torch" if _is_torch_file(path) else "safetensors"
    tensors = _torch_file(path) if kind == "torch" else _safetensors_file(path)
    return NamedTensors(path=path, kind=kind, tensors=tensors, files=(path,))


def _is_torch_file(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise CorruptFileError(path, f"cannot read: {exc.strerror or exc}") from None
    return magic == b"PK\x03\x04" or torchfile.is_legacy_torch_file(path)


def _safetensors_file(path: str) -> dict[str, TensorSource]:
    header = read_header(path)
    return {
        t.name: TensorSource(
            t.dtype, t.shape, (Segment(path, header.data_start + t.begin, t.numel),) if t.numel else ()
        )
        for t in header.tensors
    }


def _torch_file(path: str) -> dict[str, TensorSource]:
    # a non-contiguous tensor is refused by source_of, by name of the file
    return {name: source_of(ref) for name, ref in torch_state_refs(path)}


def torch_state_refs(path: str) -> list[tuple[str, TensorRef]]:
    """The tensors of a torch.save state dict (nested dicts give dotted names), in pickle order,
    read with the restricted unpickler: nothing in the pickle runs."""
    state = torchfile.load(path)
    if not isinstance(state, dict):
        raise CorruptFileError(path, "is not a state dict (a dict of tensors)")
    found: list[tuple[str, TensorRef]] = []

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, TensorRef):
            found.append((prefix, obj))
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)

    walk("", state)
    return found


def _sharded(path: str) -> NamedTensors:
    """Shards listed by a Hugging Face index; every tensor must be where the index says."""
    folder = os.path.dirname(path)
    try:
        with open(path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("weight_map is not a {name: file} object")
    except OSError as exc:
        raise CorruptFileError(path, f"cannot read: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(path, f"not a weights index ({type(exc).__name__}: {exc})") from None
    kind: InputKind = "safetensors" if path.endswith(".safetensors.index.json") else "torch"
    tensors: dict[str, TensorSource] = {}
    files = []
    for name in dict.fromkeys(weight_map.values()):  # in the index's order, each file once
        shard = os.path.join(folder, path_component(name, path, "shard name"))
        files.append(shard)
        held = _safetensors_file(shard) if kind == "safetensors" else _torch_file(shard)
        for tensor_name, source in held.items():
            if weight_map.get(tensor_name) != name:
                raise CorruptFileError(shard, f"holds {tensor_name}, which {os.path.basename(path)} does not map to it")
            tensors[tensor_name] = source
        for tensor_name in (n for n, f in weight_map.items() if f == name and n not in held):
            raise CorruptFileError(shard, f"lacks {tensor_name}, which {os.path.basename(path)} maps to it")
    return NamedTensors(path=path, kind=kind, tensors=tensors, files=tuple(files))
