"""torch.distributed.checkpoint's ``.metadata``, written without torch.

Why our own: torch's writer plans it from a state dict of tensors, which costs importing torch and
torch.distributed.checkpoint (2-3 s of CPU and 230 MB, more than the rest of ``to-dcp`` on a
small checkpoint) and puts its own planner between zckpt and the bytes it lays out. The file is a
plain pickle (protocol 4, as torch's ``FileSystemWriter.finish`` dumps it) of torch's dataclasses;
:func:`metadata_bytes` emits the same objects from plain descriptions through zckpt's pickler,
referring to torch's classes by name, so nothing is imported. torch's reader checks it
(tests/test_ops/test_dcp.py: equal to what torch's own save writes for the same state).

What goes where follows torch 2.13's ``DefaultSavePlanner`` with ``flatten_state_dict``:
:func:`flatten` turns the nested state dict into dotted names and their paths, every tensor is one
chunk at offset 0 (a full, unsharded tensor), every other value a BYTE_IO item.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..core.dtypes import DType
from .pickler import GlobalName, PickledEnum, PickledInstance, PickledReduce, pickle_object, torch_size

DCP_VERSION = "1.0.0"  # torch 2.13's CURRENT_DCP_VERSION
METADATA_FILE = ".metadata"
_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"

ObjPath = tuple[str | int, ...]


@dataclass(frozen=True)
class TensorMeta:
    """What ``.metadata`` says of a full tensor: its dtype and shape."""

    dtype: DType
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StoredItem:
    """One item of a DCP checkpoint and where its bytes are: a tensor (`tensor` set: one chunk,
    the whole tensor, stored as the torch.save archive of it) or any other value (``None``:
    BYTE_IO, the torch.save archive of the object). `path` is its place in the nested state dict,
    the name (`fqn`) its parts joined with dots."""

    path: ObjPath
    tensor: TensorMeta | None
    file: str  # the data file, relative to the folder
    offset: int
    length: int

    @property
    def fqn(self) -> str:
        return ".".join(map(str, self.path))


def flatten(state: Mapping[str, Any], is_tensor: Callable[[Any], bool]) -> Iterator[tuple[ObjPath, Any]]:
    """(path, leaf) of a nested state dict, in order, as torch's ``traverse_state_dict`` visits
    it: a mapping is entered (keys as strings), a list only where it holds a tensor, a mapping or
    such a list (items by index), anything else is a leaf. An empty mapping has no leaves."""

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(
            (isinstance(entry, (Mapping, list)) and not terminal(entry)) or is_tensor(entry) for entry in value
        )

    def visit(path: ObjPath, value: Any) -> Iterator[tuple[ObjPath, Any]]:
        if isinstance(value, Mapping):
            for key, item in value.items():
                yield from visit((*path, str(key)), item)
        elif terminal(value):
            yield path, value
        else:  # a list (torch would also enter a tuple here; a tuple is always terminal above)
            for i, item in enumerate(value):
                yield from visit((*path, i), item)

    for key, value in state.items():
        yield from visit((str(key),), value)


def _name(name: str, module: str = _METADATA) -> GlobalName:
    return GlobalName(module, name)


_CLASSES = {
    n: _name(n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
    )
}
_STORAGE_INFO = _name("_StorageInfo", _FILESYSTEM)
_LAYOUT = _name("_get_layout", "torch.serialization")
_MEM_FORMAT = _name("_MEM_FORMAT_ENCODING")
_CONTIGUOUS_FORMAT = 0  # _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT


def _instance(cls: str, state: Any) -> PickledInstance:
    return PickledInstance(_CLASSES[cls], state)


def _tensor_metadata(meta: TensorMeta) -> PickledInstance:
    """TensorStorageMetadata of a full contiguous CPU tensor, its one chunk the whole tensor.
    TensorProperties pickles its own state: (dtype, layout, requires_grad, memory_format, pin_memory)."""
    strided = PickledReduce(_LAYOUT, ("torch.strided",))
    contiguous = PickledEnum(_MEM_FORMAT, _CONTIGUOUS_FORMAT)
    properties = PickledInstance(_CLASSES["TensorProperties"], (meta.dtype, strided, False, contiguous, False))
    chunk = _instance(
        "ChunkStorageMetadata", {"offsets": torch_size((0,) * len(meta.shape)), "sizes": torch_size(meta.shape)}
    )
    return _instance(
        "TensorStorageMetadata", {"properties": properties, "size": torch_size(meta.shape), "chunks": [chunk]}
    )


def metadata_bytes(items: Sequence[StoredItem], checkpoint_id: str, save_id: str | None = None) -> bytes:
    """The ``.metadata`` file of a checkpoint of `items`, as torch's ``FileSystemWriter`` writes
    it: Metadata(state_dict_metadata, planner_data, storage_data, storage_meta, version). Pure.

    `checkpoint_id`: the folder (torch records the path it was given); `save_id`: a fresh UUID
    unless given. ValueError for two items of one name (torch refuses a state dict that
    flattens to a name twice)."""
    state_dict_metadata: dict[str, Any] = {}
    planner_data: dict[str, ObjPath] = {}
    storage_data: dict[Any, Any] = {}
    for item in items:
        fqn = item.fqn
        if fqn in state_dict_metadata:
            raise ValueError(f"two items are named {fqn!r} in the checkpoint")
        if item.offset < 0 or item.length < 0:
            raise ValueError(f"{fqn}: bad place {item.offset}+{item.length}")
        if item.tensor is None:
            state_dict_metadata[fqn] = _instance("BytesStorageMetadata", None)
            index = _instance("MetadataIndex", {"fqn": fqn, "offset": None, "index": None})
        else:
            state_dict_metadata[fqn] = _tensor_metadata(item.tensor)
            offset = torch_size((0,) * len(item.tensor.shape))
            index = _instance("MetadataIndex", {"fqn": fqn, "offset": offset, "index": 0})
        planner_data[fqn] = tuple(item.path)
        place = {
            "relative_path": item.file,
            "offset": item.offset,
            "length": item.length,
            "transform_descriptors": None,
        }
        storage_data[index] = PickledInstance(_STORAGE_INFO, place)
    storage_meta = _instance(
        "StorageMeta",
        {"checkpoint_id": checkpoint_id, "save_id": save_id or str(uuid.uuid4()), "load_id": None, "modules": []},
    )
    metadata = _instance(
        "Metadata",
        {
            "state_dict_metadata": state_dict_metadata,
            "planner_data": planner_data,
            "storage_data": storage_data,
            "storage_meta": storage_meta,
            "version": DCP_VERSION,
        },
    )
    return pickle_object(metadata, protocol=4)


__all__ = ["DCP_VERSION", "METADATA_FILE", "ObjPath", "StoredItem", "TensorMeta", "flatten", "metadata_bytes"]
