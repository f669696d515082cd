"""The pickle half of a ``torch.save`` archive: data.pkl for a tree of plain descriptions.

Why our own pickler: DeepSpeed's files pickle DeepSpeed classes and torch tensors, and writing
them must neither import DeepSpeed nor hold tensors. Callers describe those objects instead
(:class:`GlobalName`, :class:`PickledInstance`, :class:`PickledEnum`, :class:`OutTensor`...), and
the pure-Python pickler, protocol 2 as torch.save uses, emits exactly the opcodes torch's pickler
emits for the real objects, memo references included, so the bytes are the same.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import io
import math
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ..core.dtypes import DType
from ..core.index import Segment

# ---------------------------------------------------------------------------------------------
# What callers put in the object tree.


@dataclass(frozen=True)
class GlobalName:
    """A class or function referenced by name in the pickle (GLOBAL opcode); nothing is imported."""

    module: str
    name: str


@dataclass(frozen=True, eq=False)
class PickledInstance:
    """An instance of a plain class, pickled as protocol 2 does: GLOBAL cls, args, NEWOBJ, then
    its list items (APPENDS), dict items (SETITEMS) and state (BUILD), as Python's pickler
    writes what ``__reduce_ex__`` gives (zckpt's reader keeps each part: :class:`PickledObject`).

    Compared by identity, like the object it stands for: two equal instances are two objects.
    """

    cls: GlobalName
    state: Any  # BUILD's argument, usually its __dict__; None or {} means no BUILD, as Python pickles an empty __dict__
    args: tuple = ()  # NEWOBJ's arguments (a namedtuple's fields)
    kwargs: dict | None = None  # NEWOBJ_EX's keyword arguments (protocol 4's opcode, which torch.load reads)
    list_items: tuple | list = ()  # a list subclass's items
    dict_items: tuple | list = ()  # a dict subclass's (key, value) pairs


@dataclass(frozen=True)
class PickledEnum:
    """An Enum member: GLOBAL cls, (value,), REDUCE. Equal members pickle as one object, as
    members are singletons."""

    cls: GlobalName
    value: int | str


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
        if isinstance(part, (Copy, Zeros)):
            if part.numel < 0:
                raise ValueError(f"negative element count in {part!r}")
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
# The pickler.


@dataclass(frozen=True, eq=False)
class _StorageRef:
    """Stands for a storage while pickling; persistent_id turns it into torch's storage tuple."""

    pid: tuple


_REBUILD_TENSOR = GlobalName("torch._utils", "_rebuild_tensor_v2")
_REBUILD_TENSOR_V3 = GlobalName("torch._utils", "_rebuild_tensor_v3")  # dtypes torch pickles untyped
_UNTYPED_STORAGE = GlobalName("torch.storage", "UntypedStorage")
_REBUILD_FROM_TYPE = GlobalName("torch._tensor", "_rebuild_from_type_v2")
_TENSOR = GlobalName("torch", "Tensor")
_PLAIN = (
    dict,
    OrderedDict,
    list,
    tuple,
    str,
    int,
    float,
    bool,
    type(None),
    bytes,
    set,
    frozenset,
    bytearray,
    complex,
    slice,
)
_ALLOWED = frozenset(_PLAIN) | {GlobalName, DType, PickledInstance, PickledEnum, PickledReduce, OutTensor, _StorageRef}
_TUPLE_CODES = {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}
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

    def __init__(self, file: io.BytesIO, protocol: int = 2) -> None:
        super().__init__(file, protocol=protocol)
        self.storages: dict[str, OutStorage] = {}
        self._keys: dict[int, str] = {}  # id(storage) -> its key; the same str object each time, as torch
        self._canonical: dict[tuple, object] = {}  # value key -> the object first memoized for it
        self._globals: dict[tuple[str, str], int] = {}  # (module, name) as asked -> its memo index

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _StorageRef else None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        kind = type(obj)
        if not (kind in _ALLOWED or id(obj) in _INTERNAL or _is_numpy(obj)):
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
        hit = self._globals.get((module, name))
        if hit is not None:  # emitted before: the same memo reference _memo_get would write
            self.write(self.get(hit))
            return
        spelled = module, name
        for text in (module, name):  # GLOBAL is newline-terminated ASCII: nothing else may slip in
            if not text or not text.isascii() or not text.isprintable() or " " in text:
                raise ValueError(f"bad global name {module!r}.{name!r}")
        if self.proto < 3 and (module, name) in _compat_pickle.REVERSE_NAME_MAPPING:  # as pickle's fix_imports
            module, name = _compat_pickle.REVERSE_NAME_MAPPING[(module, name)]
        elif self.proto < 3 and module in _compat_pickle.REVERSE_IMPORT_MAPPING:
            module = _compat_pickle.REVERSE_IMPORT_MAPPING[module]
        canon, hit = self._memo_get(("global", module, name), GlobalName(module, name))
        if hit:
            return
        if self.proto >= 4:  # as Python's save_global: the two names as memoized strings, STACK_GLOBAL
            self.save(module)
            self.save(name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode("ascii") + b"\n" + name.encode("ascii") + b"\n")
        self.memoize(canon)
        self._globals[spelled] = self.memo[id(canon)][0]

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
        self.save(tuple(obj.args))
        if obj.kwargs:
            self.save(dict(obj.kwargs))
            self.write(pickle.NEWOBJ_EX)
        else:
            self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self._batched(list(obj.list_items), pickle.APPEND, pickle.APPENDS, lambda item: self.save(item))
        self._batched(
            list(obj.dict_items), pickle.SETITEM, pickle.SETITEMS, lambda pair: (self.save(pair[0]), self.save(pair[1]))
        )
        if obj.state is not None and not (isinstance(obj.state, dict) and not obj.state):
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _batched(self, items: list, one: bytes, many: bytes, save_item: Any) -> None:
        """Items in batches of 1000, as pickle's _batch_appends/_batch_setitems write them."""
        for start in range(0, len(items), self._BATCHSIZE):
            batch = items[start : start + self._BATCHSIZE]
            if len(batch) > 1:
                self.write(pickle.MARK)
            for item in batch:
                save_item(item)
            self.write(many if len(batch) > 1 else one)

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
                raise ValueError(
                    f"view [{offset}, {offset + numel}) reaches past its storage of {storage.numel} elements"
                )
        key = self._storage_key(storage)
        # Fresh tuples, as torch builds them per tensor (tuple(size), stride()): never memo hits.
        stride = _contiguous_stride(shape)
        geometry = (offset, tuple([*shape]), tuple([*stride]), bool(obj.requires_grad), OrderedDict())
        if obj.dtype.storage is None:  # uint16-64, float8, complex32...: an untyped storage (bytes) and the dtype
            pid = ("storage", _UNTYPED_STORAGE, key, _LOCATION, storage.nbytes)
            rebuild, args = _REBUILD_TENSOR_V3, (_StorageRef(pid), *geometry, obj.dtype)
        else:
            pid = ("storage", GlobalName("torch", obj.dtype.storage), key, _LOCATION, storage.numel)
            rebuild, args = _REBUILD_TENSOR, (_StorageRef(pid), *geometry)
        if obj.attributes:
            self._reduce(_REBUILD_FROM_TYPE, (rebuild, _TENSOR, args, obj.attributes), obj)
        elif rebuild is _REBUILD_TENSOR and self.proto < 4 and type(pid[4]) is int and type(offset) is int:
            self._save_rebuild_v2(pid, offset, shape, stride, bool(obj.requires_grad), obj)
        else:
            self._reduce(rebuild, args, obj)

    def _save_rebuild_v2(
        self, pid: tuple, offset: int, shape: tuple, stride: tuple, requires_grad: bool, obj: OutTensor
    ) -> None:
        """``self._reduce(_REBUILD_TENSOR, (_StorageRef(pid), offset, shape, stride, requires_grad,
        OrderedDict()), obj)`` written op by op, the same bytes without a ``save`` call per
        element: a ZeRO-3 rank file holds a placeholder tensor for every param of the model, so
        this runs ranks x params times in a reshard. The storage tuple's strings and globals go
        through ``save`` (memo hits but the first time); the fresh tuples, the ints, the bool and
        the empty OrderedDict (no object in the tree can be them) are written here and memoized
        under keys no object id takes, in the order pickle would memoize them."""
        write, save_long, memo_get = self.write, self.save_long, self.memo.get
        self.emit_global(_REBUILD_TENSOR.module, _REBUILD_TENSOR.name)
        write(pickle.MARK)
        write(pickle.MARK)  # the persistent id: ("storage", storage class, key, location, numel)
        for text in (pid[0], pid[1], pid[2], pid[3]):
            if type(text) is GlobalName:
                self.emit_global(text.module, text.name)  # what save() does for a GlobalName
            elif (hit := memo_get(id(text))) is not None:  # what save() does for a memoized str
                write(self.get(hit[0]))
            else:
                self.save(text)
        save_long(pid[4])
        write(pickle.TUPLE)
        self._memoize_fresh()
        write(pickle.BINPERSID)
        save_long(offset)
        self._save_fresh_ints(shape)
        self._save_fresh_ints(stride)
        write(pickle.NEWTRUE if requires_grad else pickle.NEWFALSE)
        self.emit_global("collections", "OrderedDict")  # OrderedDict(): its reduce, (), nothing to set
        write(pickle.EMPTY_TUPLE + pickle.REDUCE)
        self._memoize_fresh()
        write(pickle.TUPLE)  # the six arguments
        self._memoize_fresh()
        write(pickle.REDUCE)
        self.memoize(obj)

    def _save_fresh_ints(self, values: tuple) -> None:
        """A tuple of ints built for this tensor (never in the memo), as save_tuple writes it."""
        if not values:
            self.write(pickle.EMPTY_TUPLE)
            return
        if len(values) > 3:
            self.write(pickle.MARK)
        for value in values:
            self.save_long(value)
        self.write(pickle.TUPLE if len(values) > 3 else _TUPLE_CODES[len(values)])
        self._memoize_fresh()

    def _memoize_fresh(self) -> None:
        """memoize() for an object nothing else references: the next memo index is taken (and
        written) under a negative key, which no id() is."""
        index = len(self.memo)
        self.write(self.put(index))
        self.memo[-1 - index] = index, None

    dispatch[GlobalName] = save_global_name
    dispatch[DType] = save_dtype
    dispatch[PickledInstance] = save_instance
    dispatch[PickledEnum] = save_enum
    dispatch[PickledReduce] = save_reduce_object
    dispatch[OutTensor] = save_tensor


def _is_numpy(obj: Any) -> bool:
    """numpy scalars, dtypes and plain arrays (lr scheduler states hold np.float64, client state
    RNG states): pickled by numpy's own reduce, as torch.save pickles them. Object arrays are not."""
    if type(obj) is np.ndarray:
        return not obj.dtype.hasobject
    return isinstance(obj, (np.generic, np.dtype)) and not (obj.dtype if isinstance(obj, np.generic) else obj).hasobject


# Objects the pickler itself references, allowed by identity: OrderedDict and set reduce to their
# class, bytes to codecs.encode (protocol 2), numpy scalars to numpy's scalar() and np.dtype,
# numpy arrays to numpy's _reconstruct(np.ndarray, ...).
_INTERNAL_OBJECTS = (
    OrderedDict,
    set,
    frozenset,
    bytes,
    bytearray,
    complex,
    slice,
    codecs.encode,
    np.dtype,
    np.float64(0).__reduce__()[0],
    np.ndarray,
    np.empty(0).__reduce__()[0],
)
_INTERNAL = frozenset(id(o) for o in _INTERNAL_OBJECTS)


def pickle_object(obj: Any, protocol: int) -> bytes:
    """`obj` pickled as Python's pickler writes the objects it describes (no tensors: a file of
    plain pickle, such as torch.distributed.checkpoint's ``.metadata``, protocol 4)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol)
    pickler.dump(obj)
    if pickler.storages:
        raise TypeError("a plain pickle holds no tensor")
    return buffer.getvalue()


def pickle_tree(obj: Any) -> tuple[bytes, dict[str, OutStorage]]:
    """torch.save's data.pkl for `obj`, and its storages by key ("0", "1", ...)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.storages
