"""Streaming, deterministic writer of ``torch.save`` archives, without torch tensors in memory.

Why not ``torch.save``: it needs every tensor in memory and pickles real objects, so writing a
DeepSpeed ``optim_states`` file would mean holding a rank's whole optimizer state and having
DeepSpeed's classes importable. Here the pickle is produced from plain descriptions (classes
named by :class:`GlobalName`, tensors as :class:`OutTensor` lists of file segments, zeros and
inline bytes), the archive is planned with every offset known (so free space can be checked
first), and tensor bytes are then streamed through one reused buffer, read from their source
exactly once, CRC-32 computed on the way.

The output is byte-identical to what ``torch.save`` (2.x) writes for the same objects, except
the content of ``.data/serialization_id``, which torch fills with a random number and this
writer derives from a hash of the pickle and the record sizes, so the same input always gives
the same file.
"""

from __future__ import annotations

import _compat_pickle
import hashlib
import io
import math
import os
import pickle
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

import numpy as np

from . import ziparchive
from .dtypes import DType
from .index import Segment
from .materialize import CHUNK_BYTES, convert, write_all
from .reading import FileReader

# ---------------------------------------------------------------------------------------------
# What callers put in the object tree.


@dataclass(frozen=True)
class GlobalName:
    """A class or function referenced by name in the pickle (GLOBAL opcode); nothing is imported."""

    module: str
    name: str


@dataclass(frozen=True, eq=False)
class PickledInstance:
    """An instance of a plain class, pickled as protocol 2 does: GLOBAL cls, (), NEWOBJ, state, BUILD.

    Compared by identity, like the object it stands for: two equal instances are two objects.
    """

    cls: GlobalName
    state: dict  # its __dict__; empty means no BUILD, as Python pickles an empty __dict__


@dataclass(frozen=True)
class PickledEnum:
    """An Enum member: GLOBAL cls, (value,), REDUCE. Equal members pickle as one object, as
    members are singletons."""

    cls: GlobalName
    value: int


@dataclass(frozen=True, eq=False)
class PickledReduce:
    """Any ``func(*args)`` object: GLOBAL func, args, REDUCE (e.g. ``torch.Size``, see :func:`torch_size`)."""

    func: GlobalName
    args: tuple


def torch_size(shape: tuple[int, ...]) -> PickledReduce:
    """A ``torch.Size`` as torch pickles it (DeepSpeed's model_states hold shapes as Sizes)."""
    return PickledReduce(GlobalName("torch", "Size"), (tuple(shape),))


@dataclass(frozen=True)
class Copy:
    """`segment.numel` elements read from a file, stored as `source_dtype`; converted to the
    tensor's dtype with torch's rounding when the two differ."""

    segment: Segment
    source_dtype: DType

    @property
    def numel(self) -> int:
        return self.segment.numel


@dataclass(frozen=True)
class Zeros:
    """`numel` zero elements (padding)."""

    numel: int


@dataclass(frozen=True)
class Inline:
    """Small in-memory data (a step counter, a scalar): raw little-endian bytes of the tensor's dtype."""

    data: bytes


Part = Union[Copy, Zeros, Inline]


def _count(dtype: DType, parts: tuple[Part, ...]) -> int:
    """Elements held by `parts` (ValueError for parts that are not whole elements)."""
    total = 0
    for part in parts:
        if isinstance(part, Copy):
            total += part.segment.numel
        elif isinstance(part, Zeros):
            if part.numel < 0:
                raise ValueError(f"negative zero padding {part.numel}")
            total += part.numel
        elif isinstance(part, Inline):
            if len(part.data) % dtype.itemsize:
                raise ValueError(f"inline data of {len(part.data)} bytes is not a whole number of {dtype} elements")
            total += len(part.data) // dtype.itemsize
        else:
            raise TypeError(f"unknown tensor part {part!r}")
    return total


@dataclass(frozen=True, eq=False)
class OutStorage:
    """A storage several tensors view (DeepSpeed's ZeRO-1/2 module params are views of one flat
    buffer), or one larger than its only tensor (a last rank's padded partition). Written once."""

    dtype: DType
    parts: tuple[Part, ...]

    @property
    def numel(self) -> int:
        return _count(self.dtype, self.parts)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class OutTensor:
    """A contiguous CPU tensor to write: its elements are the concatenation of `parts`.

    Each OutTensor object gets a storage of its own, unless it views a shared `storage` (then
    `parts` is empty and the tensor is elements [storage_offset, storage_offset + numel) of it).
    The same object placed twice in the tree is pickled once and referenced again, exactly as
    torch does for one tensor object.
    """

    dtype: DType
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    # Python attributes pickled with the tensor (ZeRO-3 flat groups carry {"ds_id": ...}); when
    # set, torch pickles the tensor through torch._tensor._rebuild_from_type_v2.
    attributes: dict | None = None
    requires_grad: bool = False
    storage: OutStorage | None = None
    storage_offset: int = 0  # in elements, into `storage`

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# ---------------------------------------------------------------------------------------------
# The plan.


@dataclass(frozen=True)
class Record:
    """One zip record of the planned archive."""

    name: str  # full name in the zip, e.g. "model/data/0"
    size: int
    header_offset: int
    data_offset: int  # where its first byte lands (64-byte aligned)
    content: bytes | None  # small records' bytes; None for a tensor storage
    storage_key: str | None = None  # "0", "1", ... for tensor storages


@dataclass(frozen=True)
class ArchivePlan:
    """Everything about an archive but the tensor bytes: pickle, records, offsets, file size."""

    archive_name: str
    pickle: bytes
    records: tuple[Record, ...]
    total_size: int  # bytes of the finished file
    storages: Mapping[str, OutStorage] = field(repr=False)  # storage key -> storage, in pickling order

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data (what `progress` counts up to)."""
        return sum(s.nbytes for s in self.storages.values())


FORMAT_VERSION = b"1"
VERSION = b"3\n"
BYTEORDER = b"little"


def archive_name_for(path: str | os.PathLike[str]) -> str:
    """The archive name torch.save gives a file at `path`: its base name up to the last dot.

    A non-ASCII path makes torch write through a Python stream, and then the name is "archive".
    Pass the final name when writing to a temporary path that is renamed afterwards.
    """
    text = os.fspath(path)
    if not text.isascii():
        return "archive"
    base = text.replace("\\", "/").rsplit("/", 1)[-1]
    stem = base.rsplit(".", 1)[0] if "." in base else base
    if not stem:
        raise ValueError(f"torch cannot name an archive after {text!r}")
    return stem


def plan_archive(obj: Any, archive_name: str) -> ArchivePlan:
    """Pickle `obj` as torch.save would and lay out every record. Pure: reads no tensor bytes.

    Raises ValueError for a tensor whose parts do not add up to its shape, TypeError for an
    object the writer cannot pickle.
    """
    if not archive_name or not archive_name.isascii() or "/" in archive_name or "\\" in archive_name:
        raise ValueError(f"bad archive name {archive_name!r}")
    data, storages = pickle_tree(obj)
    prefix = archive_name + "/"
    small = [
        ("data.pkl", data),
        (".format_version", FORMAT_VERSION),
        (".storage_alignment", str(ziparchive.ALIGNMENT).encode()),
        ("byteorder", BYTEORDER),
    ]
    entries: list[tuple[str, int, bytes | None, str | None]] = [(prefix + n, len(c), c, None) for n, c in small]
    entries += [(f"{prefix}data/{key}", storage.nbytes, None, key) for key, storage in storages.items()]
    entries.append((prefix + "version", len(VERSION), VERSION, None))
    digest = hashlib.sha256(data)
    for name, size, _, _ in entries:
        digest.update(f"{name}\0{size}\n".encode())
    h = digest.digest()
    serialization_id = f"{int.from_bytes(h[:8], 'little'):020d}{int.from_bytes(h[8:16], 'little'):020d}".encode()
    entries.append((prefix + ".data/serialization_id", len(serialization_id), serialization_id, None))

    layouts = ziparchive.layout([(name, size) for name, size, _, _ in entries])
    records = tuple(
        Record(lay.name, lay.size, lay.header_offset, lay.data_offset, content, key)
        for lay, (_, _, content, key) in zip(layouts, entries)
    )
    total = layouts[-1].end_offset + ziparchive.directory_size(layouts)
    return ArchivePlan(archive_name, data, records, total, storages)


def write_archive(
    path: str | os.PathLike[str], plan: ArchivePlan, reader: FileReader, progress: Callable[[int], None] | None = None
) -> None:
    """Write the planned archive at `path` (created or truncated), streaming tensor bytes.

    `progress` is called with the number of tensor bytes written since its last call. Memory
    stays one reused buffer (materialize.CHUNK_BYTES) whatever the tensor sizes. OSErrors
    propagate; the caller owns temporary names, fsync and renaming.
    """
    report = progress or (lambda _n: None)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        stream = _TensorStream(fd, reader, report)
        layouts = ziparchive.layout([(r.name, r.size) for r in plan.records])
        crcs = []
        pending = bytearray()  # small writes are gathered into one system call
        for record, lay in zip(plan.records, layouts):
            if (lay.header_offset, lay.data_offset) != (record.header_offset, record.data_offset):
                raise ValueError(f"plan record {record.name} does not match the zip layout")
            pending += ziparchive.local_header(lay)
            if record.content is not None:
                crc = zlib.crc32(record.content)
                pending += record.content
            else:
                write_all(fd, pending)
                pending.clear()
                crc = stream.write(plan.storages[record.storage_key or ""])
            pending += ziparchive.data_descriptor(lay, crc)
            crcs.append(crc)
        pending += ziparchive.directory(layouts, crcs)
        write_all(fd, pending)
        written = os.lseek(fd, 0, os.SEEK_CUR)
        if written != plan.total_size:
            raise AssertionError(f"wrote {written} bytes, planned {plan.total_size}")
    finally:
        os.close(fd)


def save(obj: Any, path: str | os.PathLike[str], reader: FileReader | None = None) -> None:
    """Plan and write `obj` at `path`, named as torch.save would name it."""
    plan = plan_archive(obj, archive_name_for(path))
    if reader is not None:
        write_archive(path, plan, reader)
        return
    with FileReader() as own:
        write_archive(path, plan, own)


class _TensorStream:
    """Writes tensors' parts through one reused buffer, returning each storage's CRC-32."""

    def __init__(self, fd: int, reader: FileReader, progress: Callable[[int], None]) -> None:
        self.fd, self.reader, self.progress = fd, reader, progress
        self._buffer: np.ndarray | None = None

    def _scratch(self, nbytes: int) -> memoryview:
        if self._buffer is None:
            self._buffer = np.empty(CHUNK_BYTES, dtype=np.uint8)
        return memoryview(self._buffer)[:nbytes]

    def _emit(self, data: memoryview | bytes, crc: int) -> int:
        write_all(self.fd, data)
        self.progress(len(data))
        return zlib.crc32(data, crc)

    def write(self, storage: OutStorage) -> int:
        crc = 0
        size = storage.dtype.itemsize
        for part in storage.parts:
            if isinstance(part, Inline):
                if part.data:
                    crc = self._emit(part.data, crc)
            elif isinstance(part, Zeros):
                left = part.numel * size
                while left:
                    view = self._scratch(min(left, CHUNK_BYTES))
                    np.frombuffer(view, dtype=np.uint8).fill(0)
                    crc = self._emit(view, crc)
                    left -= len(view)
            else:
                crc = self._copy(part, storage.dtype, crc)
        return crc

    def _copy(self, part: Copy, dtype: DType, crc: int) -> int:
        segment, source = part.segment, part.source_dtype
        in_size = source.itemsize
        if source == dtype:
            step = CHUNK_BYTES // in_size  # elements per read
        else:  # conversion allocates its output (and numpy temporaries): keep chunks smaller
            step = CHUNK_BYTES // 4 // max(in_size, dtype.itemsize)
        done = 0
        while done < segment.numel:
            count = min(step, segment.numel - done)
            view = self._scratch(count * in_size)
            self.reader.read_into(segment.path, segment.offset + done * in_size, view)
            if source == dtype:
                crc = self._emit(view, crc)
            else:
                raw = np.frombuffer(view, dtype=np.dtype(source.numpy_raw))
                out = np.ascontiguousarray(convert(raw, source, dtype))
                crc = self._emit(memoryview(out).cast("B"), crc)
            done += count
        return crc


# ---------------------------------------------------------------------------------------------
# The pickle.


@dataclass(frozen=True, eq=False)
class _StorageRef:
    """Stands for a storage while pickling; persistent_id turns it into torch's storage tuple."""

    pid: tuple


_REBUILD_TENSOR = GlobalName("torch._utils", "_rebuild_tensor_v2")
_REBUILD_FROM_TYPE = GlobalName("torch._tensor", "_rebuild_from_type_v2")
_TENSOR = GlobalName("torch", "Tensor")
_PLAIN = (dict, OrderedDict, list, tuple, str, int, float, bool, type(None), bytes, set, frozenset)
_ALLOWED = frozenset(_PLAIN) | {GlobalName, DType, PickledInstance, PickledEnum, PickledReduce, OutTensor, _StorageRef}
_LOCATION = "cpu"  # torch's location tag; one (interned) object, so torch's pickle memoizes it


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's contiguous strides (a 0-length dimension counts as 1: (3, 0) -> (1, 1))."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class _Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler (protocol 2, as torch.save uses), taught the writer's types.

    Globals are memoized by name, not by object, so a class spelled as GlobalName in one place
    and met as a real object (OrderedDict) elsewhere is emitted once, as torch's pickler does
    for the one class object.
    """

    dispatch = pickle._Pickler.dispatch.copy()  # type: ignore[attr-defined]

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.storages: dict[str, OutStorage] = {}
        self._keys: dict[int, str] = {}  # id(storage) -> its key; the same str object each time, as torch
        self._canonical: dict[tuple, object] = {}  # value key -> the object first memoized for it

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _StorageRef else None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        kind = type(obj)
        if not (kind in _ALLOWED or obj in _INTERNAL or _is_numpy(obj)):
            raise TypeError(f"cannot pickle {kind.__module__}.{kind.__qualname__} into a torch archive")
        super().save(obj, save_persistent_id)

    def _memo_get(self, key: tuple, obj: Any) -> tuple[Any, bool]:
        """The canonical object for `key`; True (and a BINGET written) if already pickled."""
        canon = self._canonical.setdefault(key, obj)
        hit = self.memo.get(id(canon))
        if hit is not None:
            self.write(self.get(hit[0]))
            return canon, True
        return canon, False

    def emit_global(self, module: str, name: str) -> None:
        if (module, name) in _compat_pickle.REVERSE_NAME_MAPPING:  # as pickle's fix_imports does
            module, name = _compat_pickle.REVERSE_NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.REVERSE_IMPORT_MAPPING:
            module = _compat_pickle.REVERSE_IMPORT_MAPPING[module]
        canon, hit = self._memo_get(("global", module, name), GlobalName(module, name))
        if not hit:
            self.write(pickle.GLOBAL + module.encode("ascii") + b"\n" + name.encode("ascii") + b"\n")
            self.memoize(canon)

    def save_global(self, obj: Any, name: str | None = None) -> None:  # real classes (OrderedDict, set)
        name = name or obj.__qualname__
        self.emit_global(pickle.whichmodule(obj, name), name)

    def _reduce(self, func: GlobalName, args: tuple, obj: Any) -> None:
        self.save(func)
        self.save(args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    def save_global_name(self, obj: GlobalName) -> None:
        self.emit_global(obj.module, obj.name)

    def save_dtype(self, obj: DType) -> None:
        self.emit_global("torch", obj.name)

    def save_instance(self, obj: PickledInstance) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state:
            self.save(obj.state)
            self.write(pickle.BUILD)

    def save_enum(self, obj: PickledEnum) -> None:
        canon, hit = self._memo_get(("enum", obj.cls.module, obj.cls.name, obj.value), obj)
        if not hit:
            self._reduce(obj.cls, (obj.value,), canon)

    def save_reduce_object(self, obj: PickledReduce) -> None:
        if not isinstance(obj.args, tuple):
            raise TypeError(f"PickledReduce args must be a tuple, not {type(obj.args).__name__}")
        self._reduce(obj.func, obj.args, obj)

    def _storage_key(self, storage: OutStorage) -> str:
        key = self._keys.get(id(storage))
        if key is None:
            key = self._keys[id(storage)] = str(len(self.storages))
            self.storages[key] = storage
        return key

    def save_tensor(self, obj: OutTensor) -> None:
        shape = tuple(obj.shape)
        if not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"bad tensor shape {obj.shape!r}")
        numel = math.prod(shape)
        if obj.storage is None:
            storage = OutStorage(obj.dtype, tuple(obj.parts))
            if storage.numel != numel:
                raise ValueError(f"tensor parts hold {storage.numel} elements, its shape {list(shape)} needs {numel}")
            offset = 0
        else:
            storage, offset = obj.storage, obj.storage_offset
            if obj.parts or storage.dtype != obj.dtype:
                raise ValueError("a tensor viewing a storage has no parts of its own and the storage's dtype")
            if not (type(offset) is int and offset >= 0 and offset + numel <= storage.numel):
                raise ValueError(f"view [{offset}, {offset + numel}) reaches past its storage of {storage.numel} elements")
        key = self._storage_key(storage)
        pid = ("storage", GlobalName("torch", obj.dtype.storage), key, _LOCATION, storage.numel)
        # Fresh tuples, as torch builds them per tensor (tuple(size), stride()): never memo hits.
        stride = _contiguous_stride(shape)
        args = (_StorageRef(pid), offset, tuple([*shape]), tuple([*stride]), bool(obj.requires_grad), OrderedDict())
        if obj.attributes:
            self._reduce(_REBUILD_FROM_TYPE, (_REBUILD_TENSOR, _TENSOR, args, obj.attributes), obj)
        else:
            self._reduce(_REBUILD_TENSOR, args, obj)

    dispatch[GlobalName] = save_global_name
    dispatch[DType] = save_dtype
    dispatch[PickledInstance] = save_instance
    dispatch[PickledEnum] = save_enum
    dispatch[PickledReduce] = save_reduce_object
    dispatch[OutTensor] = save_tensor


def _is_numpy(obj: Any) -> bool:
    """numpy scalars and dtypes (lr scheduler states hold np.float64); pickled by their reduce."""
    return isinstance(obj, (np.generic, np.dtype)) and not (obj.dtype if isinstance(obj, np.generic) else obj).hasobject


def _internal() -> tuple:
    import codecs

    # Callables the pickler itself references: OrderedDict and set reduce to their class,
    # bytes to codecs.encode (protocol 2), numpy scalars to numpy's reconstructors.
    items: list[Any] = [OrderedDict, set, frozenset, bytes, codecs.encode, np.dtype]
    scalar_reduce = np.float64(0).__reduce__()[0]
    items.append(scalar_reduce)
    items.extend(type(d) for d in (np.dtype("f8"), np.dtype("f4"), np.dtype("i8"), np.dtype("i4"), np.dtype("bool")))
    return tuple(items)


class _Internal:
    """Membership by identity (``in`` on a tuple would compare with ==, calling __eq__)."""

    def __init__(self, items: tuple) -> None:
        self._ids = {id(i) for i in items}
        self._items = items

    def __contains__(self, obj: object) -> bool:
        return id(obj) in self._ids


_INTERNAL = _Internal(_internal())


def pickle_tree(obj: Any) -> tuple[bytes, dict[str, OutStorage]]:
    """torch.save's data.pkl for `obj`, and its storages by key ("0", "1", ...)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.storages
