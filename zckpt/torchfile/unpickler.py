"""The restricted unpickler: a pickle read as data, with nothing from it ever called.

Why: ``torch.load(weights_only=False)`` calls whatever a pickle names (``os.system``...), and
``weights_only=True`` refuses the classes real checkpoints hold (DeepSpeed's loss scaler,
Megatron's ``args`` Namespace, numpy RNG state). Here:

- **Allowlisted globals** (torch's tensor and storage rebuilds, dtypes, ``torch.Size``,
  ``torch.device``, ``OrderedDict``, ``set``, numpy arrays, dtypes and scalars, a few enums)
  resolve to rebuild functions zckpt implements itself; they validate their arguments and read
  no tensor data (a tensor becomes a :class:`TensorRef`).
- **Any other global** resolves to a :class:`PickledGlobal`: a stand-in that knows only its
  name and is never imported. Instantiated the way pickle builds instances of plain classes
  (NEWOBJ, NEWOBJ_EX, ``copyreg`` reconstructors) it gives a :class:`PickledObject`: the class
  name, the arguments, and the state BUILD gives it, kept as data; no ``__setstate__`` runs.
  Called (REDUCE, INST, OBJ) it raises :class:`~zckpt.core.errors.UnsafePickleError` naming it: that
  is how a payload (``os.system``, ``eval``, ``subprocess.Popen``) would run.
- Every object the pickle can reach refuses BUILD (a pickle could otherwise rewrite a
  :class:`TensorRef`'s path, or the shared ``DType`` objects, through their ``__setstate__``),
  and copyreg's extension registry (EXT opcodes) is never consulted.

The C unpickler does the parsing (speed); the guarantees come from what ``find_class`` and
``persistent_load`` hand it: no real class or function from outside zckpt ever reaches its stack.
"""

from __future__ import annotations

import _compat_pickle
import copyreg
import io
import math
import pickle
import re
import types
from collections import OrderedDict
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any, Callable, ClassVar

import numpy as np

from ..core.dtypes import BY_NAME, BY_STORAGE, DType
from ..core.errors import CorruptFileError, UnsafePickleError, ZckptError
from ..core.index import TensorRef

__all__ = [
    "ENUM_CLASSES", "PickledEnumMember", "PickledGlobal", "PickledObject", "TensorRef", "TorchDevice", "TorchSize",
    "ZeroStageEnum", "global_name", "unpickle", "walk_tensor_refs",
]


class _NoState:
    """Mixin: objects the unpickler hands out refuse BUILD (their state is fixed when made)."""

    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        raise CorruptFileError(None, f"corrupted pickle: BUILD applied to {type(self).__name__}")


# ---------------------------------------------------------------------------------------------
# What the data becomes (a tensor: core.index.TensorRef, a leaf type the I/O layer reads by)


class PickledObject:
    """An instance of a class zckpt does not import, read as plain data.

    ``original_class`` is the class's ``module.qualname``; ``vars(obj)`` (and attribute access)
    gives the attributes its BUILD state set. Everything the pickle gave it is kept, so a writer
    can pickle it back the same way: ``pickle_args``/``pickle_kwargs`` (NEWOBJ arguments: a
    namedtuple's fields), ``pickle_state`` (BUILD's argument, whatever its form),
    ``pickle_list_items`` and ``pickle_dict_items`` (APPENDS and SETITEMS of list and dict
    subclasses). No method of the original class ever runs.
    """

    __slots__ = ("pickle_args", "pickle_kwargs", "pickle_state", "pickle_list_items", "pickle_dict_items", "_built")
    original_module: ClassVar[str] = "builtins"
    original_name: ClassVar[str] = "object"  # may hold dots: protocol 4 names nested classes so
    original_class: ClassVar[str] = "builtins.object"  # module.name

    def __init__(self, args: tuple = (), kwargs: dict | None = None, state: Any = None) -> None:
        self.pickle_args = args
        self.pickle_kwargs = kwargs or {}
        self.pickle_state = state
        self.pickle_list_items: list = []
        self.pickle_dict_items: list[tuple[Any, Any]] = []
        self._built = state is not None

    # What the unpickler calls on it: BUILD, APPENDS, SETITEMS. Defined here so that no
    # attribute from the pickled state can stand in for them.
    def __setstate__(self, state: Any) -> None:
        if self._built:
            raise CorruptFileError(None, f"corrupted pickle: {self.original_class} object built twice")
        _refuse_special_attributes(self.original_class, state)
        self.pickle_state, self._built = state, True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # REDUCE on an instance (functools.partial's way)
        raise UnsafePickleError(None, f"pickle calls an instance of {self.original_class}, which is not on zckpt's allowlist; refusing to load it (a payload?)")

    def append(self, item: Any) -> None:
        self.pickle_list_items.append(item)

    def extend(self, items: Any) -> None:
        self.pickle_list_items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.pickle_dict_items.append((key, value))

    def add(self, item: Any) -> None:  # ADDITEMS: only sets; would otherwise find a state attribute
        raise CorruptFileError(None, f"corrupted pickle: ADDITEMS applied to a {self.original_class} object")

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        """The attributes: BUILD's dict, or its (dict, slots) pair merged; empty for other states."""
        state = self.pickle_state
        if isinstance(state, dict):
            return state
        if isinstance(state, tuple) and len(state) == 2 and all(isinstance(s, dict) or s is None for s in state):
            return {**(state[0] or {}), **(state[1] or {})}
        return {}

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            attributes = self.__dict__
            if name in attributes:
                return attributes[name]
        raise AttributeError(f"{self.original_class} object read from a pickle has no attribute {name!r}")

    def _fields(self) -> tuple:
        return (self.pickle_args, self.pickle_kwargs, self.pickle_state, self.pickle_list_items, self.pickle_dict_items)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PickledObject):
            return NotImplemented
        return self.original_class == other.original_class and self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"<{self.original_class} {fields}>"

    def __reduce__(self) -> tuple:  # copy.deepcopy and stdlib pickling: rebuilt by zckpt, as data
        return (_restore_object, (self.original_module, self.original_name, *self._fields()))


def _refuse_special_attributes(owner: str, state: Any) -> None:
    """A global stored under a special name (``__setstate__``, ``__reduce__``...) is how a
    pickle makes the real unpickler call it on the next BUILD or pickling: a payload."""
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    for part in parts:
        if isinstance(part, dict):
            for key, value in part.items():
                if isinstance(key, str) and key.startswith("__") and (name := global_name(value)):
                    raise UnsafePickleError(None, f"pickle sets attribute {key} of its {owner} object to {'.'.join(name)}; refusing to load it (a payload?)")


def _restore_object(module: str, name: str, args: tuple, kwargs: dict, state: Any, items: list, dict_items: list) -> PickledObject:
    obj = record_class(module, name)(args, kwargs, state)
    obj.pickle_list_items, obj.pickle_dict_items = list(items), list(dict_items)
    return obj


_MAX_CACHED_CLASSES = 4096
_record_classes: dict[tuple[str, str], type[PickledObject]] = {}


def record_class(module: str, name: str) -> type[PickledObject]:
    """The PickledObject subclass standing for class `name` of `module` (one per name, so records
    of one class share a type; past a bound, files naming ever more classes get fresh ones)."""
    cls = _record_classes.get((module, name))
    if cls is None:
        namespace = {"__slots__": (), "original_module": module, "original_name": name, "original_class": f"{module}.{name}"}
        cls = type(name.rsplit(".", 1)[-1], (PickledObject,), namespace)
        if len(_record_classes) < _MAX_CACHED_CLASSES:
            _record_classes[(module, name)] = cls
    return cls


class PickledGlobal(type):
    """The metaclass of the stand-ins for globals that are not allowlisted.

    A stand-in knows its name (``module``, ``name``) and nothing else: the module is never
    imported. NEWOBJ builds a :class:`PickledObject` from it; any call is refused; as a plain
    value (a class stored in client state) it stays a reference by name.
    """

    module: str
    name: str

    @property
    def qualified_name(cls) -> str:
        return f"{cls.module}.{cls.name}"

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:  # REDUCE, INST, OBJ: how a payload runs
        raise UnsafePickleError(None, f"pickle calls {cls.qualified_name}, which is not on zckpt's allowlist; refusing to load it (a payload?)")

    def __setstate__(cls, state: object) -> None:  # would set attributes of the real class
        raise UnsafePickleError(None, f"pickle modifies {cls.qualified_name} (BUILD on a global), which zckpt does not allow; refusing to load it (a payload?)")

    def __eq__(cls, other: object) -> bool:
        return isinstance(other, PickledGlobal) and (other.module, other.name) == (cls.module, cls.name)

    def __hash__(cls) -> int:
        return hash(("PickledGlobal", cls.module, cls.name))

    def __repr__(cls) -> str:
        return f"<pickled global {cls.qualified_name}>"


class _Unresolved(metaclass=PickledGlobal):
    """Base of the stand-ins; see :class:`PickledGlobal`."""

    module = "builtins"
    name = "object"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # NEWOBJ / NEWOBJ_EX: an inert instance
        return record_class(cls.module, cls.name)(args, kwargs)

    def __getinitargs__(self) -> tuple:  # its presence makes INST and OBJ call the class (refused)
        return ()


_stand_ins: dict[tuple[str, str], PickledGlobal] = {}


def stand_in(module: str, name: str) -> PickledGlobal:
    """The stand-in for global `name` of `module`: one per name while fewer than a bound
    (a stand-in cannot be changed: BUILD on it is refused), fresh ones past it."""
    found = _stand_ins.get((module, name))
    if found is None:
        found = PickledGlobal(name, (_Unresolved,), {"module": module, "name": name, "__slots__": ()})
        if len(_stand_ins) < _MAX_CACHED_CLASSES:
            _stand_ins[(module, name)] = found
    return found


class ZeroStageEnum(IntEnum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3

    def __setstate__(self, state: object) -> None:
        raise CorruptFileError(None, "corrupted pickle: BUILD applied to ZeroStageEnum")


class PickledEnumMember(_NoState):
    """A member of an allowlisted Enum (:data:`ENUM_CLASSES`): the class name and the value."""

    __slots__ = ("original_class", "value")

    def __init__(self, original_class: str, value: int | str) -> None:
        object.__setattr__(self, "original_class", original_class)
        object.__setattr__(self, "value", value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PickledEnumMember is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PickledEnumMember) and (self.original_class, self.value) == (other.original_class, other.value)

    def __hash__(self) -> int:
        return hash((self.original_class, self.value))

    def __repr__(self) -> str:
        return f"<{self.original_class}({self.value!r})>"

    def __reduce__(self) -> tuple:
        return (PickledEnumMember, (self.original_class, self.value))


# Enums that real checkpoints pickle (``cls(value)``, a call, so each must be named here):
# Megatron-DeepSpeed saves its ``args`` with ``position_embedding_type`` and ``model_type``.
ENUM_CLASSES = tuple(
    f"{module}.{name}"
    for module, names in (
        ("megatron.model.enums", ("ModelType", "LayerType", "AttnType", "AttnMaskType", "PositionEmbeddingType")),
        ("megatron.core.enums", ("ModelType",)),
        ("megatron.core.transformer.enums", ("ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend")),
    )
    for name in names
)


class TorchSize(tuple):
    """A ``torch.Size`` as read: a tuple of ints that remembers it was a Size."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Size({list(self)})"

    def __reduce__(self) -> tuple:
        return (TorchSize, (tuple(self),))


class TorchDevice(str):
    """A ``torch.device`` as read: its string ("cpu", "cuda:0"), remembering it was a device."""

    __slots__ = ()

    @property
    def args(self) -> tuple:
        """The arguments torch pickles it with: ("cuda", 0) or ("cpu",)."""
        kind, _, index = str(self).partition(":")
        return (kind, int(index)) if index else (kind,)

    def __reduce__(self) -> tuple:
        return (TorchDevice, (str(self),))


# ---------------------------------------------------------------------------------------------
# numpy: arrays and dtypes are built in two steps (a call, then BUILD with the state), and
# numpy's own __setstate__ must not see a pickle's state. Placeholders take both steps here and
# are swapped for the real objects once the whole pickle is read.

_NUMPY_NAME = re.compile(r"[biufcSU][0-9]{1,5}")  # numeric, bytes and str dtypes: never objects, records, dates


def _numpy_refused(what: str) -> UnsafePickleError:
    return UnsafePickleError(None, f"pickle holds numpy data of {what}, which zckpt does not read (numeric and string arrays only)")


class _PendingDType(_NoState):
    """A numpy dtype being unpickled: np.dtype(name, align, copy), then BUILD (byte order...)."""

    __slots__ = ("value", "_built")

    def __init__(self, name: Any) -> None:
        if not isinstance(name, str) or not _NUMPY_NAME.fullmatch(name):
            raise _numpy_refused(f"dtype {name!r:.40}")
        self.value: np.dtype = np.dtype(name)
        self._built = False

    def __setstate__(self, state: Any) -> None:
        if self._built or not isinstance(state, tuple) or len(state) not in (8, 9) or state[0] not in (3, 4):
            raise CorruptFileError(None, f"corrupted pickle: bad numpy dtype state {state!r:.80}")
        _, order, subarray, names, fields, elsize, alignment, flags, *metadata = state
        if (subarray, names, fields) != (None, None, None) or any(m is not None for m in metadata):
            raise _numpy_refused("a structured or annotated dtype")
        if order not in ("<", ">", "|", "=") or not all(type(v) is int for v in (elsize, alignment, flags)):
            raise CorruptFileError(None, f"corrupted pickle: bad numpy dtype state {state!r:.80}")
        value = self.value.newbyteorder(order) if order in "<>" and self.value.itemsize > 1 else self.value
        if elsize not in (-1, value.itemsize):
            raise CorruptFileError(None, f"corrupted pickle: numpy dtype {value} of {elsize} bytes")
        self.value, self._built = value, True


def _numpy_dtype(value: Any) -> np.dtype:
    if not isinstance(value, _PendingDType):
        raise CorruptFileError(None, f"corrupted pickle: numpy data with dtype {value!r:.60}")
    return value.value


class _PendingArray(_NoState):
    """A numpy array being unpickled: _reconstruct(ndarray, (0,), b'b'), then BUILD."""

    __slots__ = ("value", "_built")
    __hash__ = None  # type: ignore[assignment]  # arrays are unhashable; so is their placeholder

    def __init__(self, value: np.ndarray | None = None) -> None:
        self.value = np.empty((0,), np.int8) if value is None else value  # what _reconstruct alone gives
        self._built = value is not None

    def __setstate__(self, state: Any) -> None:
        if self._built or not isinstance(state, tuple) or len(state) not in (4, 5):
            raise CorruptFileError(None, f"corrupted pickle: bad numpy array state {state!r:.80}")
        shape, dtype, fortran, raw = state[-4:]
        if len(state) == 5 and state[0] != 1:
            raise CorruptFileError(None, f"corrupted pickle: numpy array state version {state[0]!r:.20}")
        self.value, self._built = _array_from_bytes(raw, _numpy_dtype(dtype), shape, "F" if fortran else "C"), True


def _array_from_bytes(raw: Any, dtype: np.dtype, shape: Any, order: Any) -> np.ndarray:
    """A writable array holding a copy of `raw`, after checking it is exactly `shape` of `dtype`."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise CorruptFileError(None, f"corrupted pickle: numpy array data of type {type(raw).__name__}")
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape) or order not in ("C", "F"):
        raise CorruptFileError(None, f"corrupted pickle: bad numpy array shape {shape!r:.60}")
    raw = memoryview(raw).cast("B")
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise CorruptFileError(None, f"corrupted pickle: {len(raw)} bytes for a numpy array of shape {list(shape)} and dtype {dtype}")
    array = np.frombuffer(raw, dtype=dtype).reshape(shape, order=order)
    # numpy (2.x) gives unpickled arrays its native byte order, values unchanged: so does zckpt.
    return array.astype(dtype.newbyteorder("="), order=order) if not dtype.isnative else array.copy(order=order)


def _np_reconstruct(subtype: Any, shape: Any, code: Any) -> _PendingArray:
    if not (isinstance(subtype, _AllowedGlobal) and subtype.role == "ndarray"):
        _refuse_stand_in(subtype, "as a numpy array class")
        raise CorruptFileError(None, f"corrupted pickle: numpy array of type {subtype!r:.60}")
    if shape != (0,) or code not in (b"b", "b"):
        raise CorruptFileError(None, "corrupted pickle: unexpected numpy _reconstruct arguments")
    return _PendingArray()


def _np_frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any) -> _PendingArray:
    """Protocol 5's array rebuild (numpy._core.numeric._frombuffer), the data in band."""
    if isinstance(buffer, pickle.PickleBuffer):
        buffer = buffer.raw()
    return _PendingArray(_array_from_bytes(buffer, _numpy_dtype(dtype), shape, order))


def _np_new_dtype(name: Any, *_: Any) -> _PendingDType:
    return _PendingDType(name)


def _np_scalar(dtype: Any, data: Any = None) -> np.generic:
    """A numpy scalar from its bytes (numpy's own scalar rebuild, for numeric dtypes only)."""
    value = _numpy_dtype(dtype)
    if not isinstance(data, bytes) or len(data) != value.itemsize:
        raise CorruptFileError(None, f"corrupted pickle: numpy {value} scalar from {data!r:.40}")
    return np.frombuffer(data, dtype=value)[0]


# ---------------------------------------------------------------------------------------------
# torch: storages and tensors


@dataclass(frozen=True, slots=True)
class _Storage:
    """A storage record of the archive: data/<key> at `offset`, `nbytes` long."""

    path: str
    offset: int
    nbytes: int
    dtype: DType | None  # None: an UntypedStorage (bytes), typed by the tensor that views it

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize if self.dtype else self.nbytes

    def __setstate__(self, state: object) -> None:  # a pickle must not repoint it at another file
        raise CorruptFileError(None, "corrupted pickle: BUILD applied to a storage")


def _tensor_ref(storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: DType, extra: tuple) -> TensorRef:
    """The TensorRef of a tensor view of `storage`, checked to lie inside it."""
    if not isinstance(storage, _Storage):
        _refuse_stand_in(storage, "as a tensor's storage")
        raise CorruptFileError(None, f"corrupted pickle: tensor without a storage ({storage!r:.60})")
    metadata = extra[2] if len(extra) > 2 else None  # (requires_grad, backward_hooks, metadata)
    if metadata:  # torch's conj and neg bits: the bytes alone would give other values
        raise CorruptFileError(storage.path, f"tensor saved as a view with {metadata!r:.60} (conjugate or negative bit): not supported")
    shape, steps = _ints(storage.path, "shape", size), _ints(storage.path, "stride", stride)
    if type(storage_offset) is not int or storage_offset < 0 or len(shape) != len(steps):
        raise CorruptFileError(storage.path, "corrupted pickle: inconsistent tensor geometry")
    if math.prod(shape) > 0:
        end = (storage_offset + sum((n - 1) * s for n, s in zip(shape, steps)) + 1) * dtype.itemsize
        if end > storage.nbytes:
            raise CorruptFileError(storage.path, f"tensor of shape {list(shape)} reaches past its storage")
    return TensorRef(storage.path, storage.offset + storage_offset * dtype.itemsize, dtype, shape, steps)


def _ints(path: str, what: str, values: Any) -> tuple[int, ...]:
    if type(values) is list:
        values = tuple(values)
    if type(values) is tuple:
        for value in values:
            if type(value) is not int or value < 0:
                break
        else:
            return values
    raise CorruptFileError(path, f"corrupted pickle: bad tensor {what} {values!r:.60}")


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *extra: Any) -> TensorRef:
    dtype = storage.dtype if isinstance(storage, _Storage) and storage.dtype else BY_NAME["uint8"]  # untyped: bytes
    return _tensor_ref(storage, storage_offset, size, stride, dtype, extra)


def _rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False, hooks: Any = None, dtype: Any = None, *metadata: Any) -> TensorRef:
    """torch's rebuild for the dtypes it pickles untyped (uint16-64, float8, complex32...)."""
    if not isinstance(dtype, DType):
        _refuse_stand_in(dtype, "as a tensor dtype")
        raise CorruptFileError(None, f"corrupted pickle: tensor of dtype {dtype!r:.60}")
    return _tensor_ref(storage, storage_offset, size, stride, dtype, (requires_grad, hooks, *metadata))


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    if not isinstance(data, TensorRef):
        raise CorruptFileError(None, "corrupted pickle: a parameter without a tensor")
    return data


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
    """torch's rebuild of a tensor with Python attributes; torch calls func(*args) and
    new_type's code, so anything but a plain tensor rebuild there is refused."""
    _refuse_stand_in(func, "through torch._tensor._rebuild_from_type_v2")
    _refuse_stand_in(new_type, "as a tensor subclass")
    if func not in (_ALLOWED[("torch._utils", "_rebuild_tensor_v2")], _ALLOWED[("torch._utils", "_rebuild_tensor_v3")]):
        raise CorruptFileError(None, "corrupted pickle: unsupported tensor rebuild")
    if not (isinstance(new_type, _AllowedGlobal) and new_type.role == "tensor type") or not isinstance(args, tuple):
        raise CorruptFileError(None, "corrupted pickle: unsupported tensor subclass")
    ref = func(*args)
    attributes = state if isinstance(state, dict) else {}
    if isinstance(state, tuple) and len(state) == 2 and all(isinstance(s, dict) or s is None for s in state):
        attributes = {**(state[0] or {}), **(state[1] or {})}
    return replace(ref, attributes=dict(attributes)) if attributes else ref


# ---------------------------------------------------------------------------------------------
# builtins and copyreg


def _refuse_stand_in(value: Any, role: str) -> None:
    """A global that is not allowlisted, met where it would be called or subclassed: a payload."""
    if isinstance(value, PickledGlobal):
        raise UnsafePickleError(None, f"pickle uses {value.qualified_name} {role}, which is not on zckpt's allowlist; refusing to load it (a payload?)")


def _collection(kind: type) -> Callable[..., Any]:
    def build(items: Any = ()) -> Any:
        if not isinstance(items, (list, tuple, set, frozenset)):
            raise CorruptFileError(None, f"corrupted pickle: {kind.__name__} from {type(items).__name__}")
        return kind(items)

    return build


def _bytes_like(kind: type) -> Callable[..., Any]:
    """bytes/bytearray from their pickled forms only (never from a size: no huge allocations)."""

    def build(data: Any = b"", encoding: Any = None) -> Any:
        if isinstance(data, str) and encoding in ("latin1", "latin-1"):
            return kind(data.encode("latin1"))
        if isinstance(data, (bytes, bytearray)) and encoding is None:
            return kind(data)
        raise CorruptFileError(None, f"corrupted pickle: {kind.__name__} from {type(data).__name__}")

    return build


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # Protocol-2 pickles store bytes objects as _codecs.encode(str, "latin1").
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CorruptFileError(None, "corrupted pickle: unexpected _codecs.encode call")
    return text.encode("latin1")


def _slice(*args: Any) -> slice:
    if len(args) > 3 or not all(a is None or type(a) is int for a in args):
        raise CorruptFileError(None, "corrupted pickle: bad slice")
    return slice(*args)


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(type(v) in (int, float) for v in (real, imag)):
        raise CorruptFileError(None, "corrupted pickle: bad complex number")
    return complex(real, imag)


def _new_record(cls: Any, args: tuple, kwargs: dict | None = None) -> PickledObject:
    if not isinstance(cls, PickledGlobal):
        raise CorruptFileError(None, f"corrupted pickle: instance of {cls!r:.60}")
    return record_class(cls.module, cls.name)(args, kwargs)


def _copyreg_newobj(cls: Any, *args: Any) -> PickledObject:
    return _new_record(cls, args)


def _copyreg_newobj_ex(cls: Any, args: Any, kwargs: Any) -> PickledObject:
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise CorruptFileError(None, "corrupted pickle: bad copyreg.__newobj_ex__ arguments")
    return _new_record(cls, args, kwargs)


def _copyreg_reconstructor(cls: Any, base: Any, state: Any) -> PickledObject:
    """Protocols 0 and 1 build plain instances as copyreg._reconstructor(cls, object, None)."""
    if not (isinstance(base, PickledGlobal) and base.qualified_name == "builtins.object"):
        _refuse_stand_in(base, "as the base of copyreg._reconstructor")
        raise CorruptFileError(None, "corrupted pickle: copyreg._reconstructor of a builtin type")
    if state is not None:
        raise CorruptFileError(None, "corrupted pickle: copyreg._reconstructor with a base state")
    return _new_record(cls, ())


def _torch_size(values: Any = ()) -> TorchSize:
    if not isinstance(values, (tuple, list)) or not all(type(v) is int for v in values):
        raise CorruptFileError(None, "corrupted pickle: bad torch.Size")
    return TorchSize(values)


def _torch_device(kind: Any, index: Any = None) -> TorchDevice:
    if not isinstance(kind, str) or not (index is None or type(index) is int) or ":" in kind and index is not None:
        raise CorruptFileError(None, "corrupted pickle: bad torch.device")
    return TorchDevice(kind if index is None else f"{kind}:{index}")


def _zero_stage(value: Any) -> ZeroStageEnum:
    if type(value) is not int:
        raise CorruptFileError(None, "corrupted pickle: bad ZeroStageEnum value")
    return ZeroStageEnum(value)


def _enum_member(qualified: str) -> Callable[[Any], PickledEnumMember]:
    def build(value: Any) -> PickledEnumMember:
        if type(value) not in (int, str):
            raise CorruptFileError(None, f"corrupted pickle: bad {qualified} value")
        return PickledEnumMember(qualified, value)

    return build


# ---------------------------------------------------------------------------------------------
# The allowlist


def _refuse_build(qualified: str) -> Callable[[object], None]:
    def refuse(state: object) -> None:
        raise UnsafePickleError(None, f"pickle modifies {qualified} (BUILD on a global), which zckpt does not allow; refusing to load it (a payload?)")

    return refuse


def _rebuild(module: str, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """An allowlisted callable global: a copy of zckpt's `function`, one object per name. The
    C unpickler calls it directly; BUILD on it finds its own __setstate__, which refuses."""
    named = types.FunctionType(function.__code__, function.__globals__, name, function.__defaults__, function.__closure__)
    named.__kwdefaults__ = function.__kwdefaults__
    named.__setstate__ = _refuse_build(f"{module}.{name}")  # type: ignore[attr-defined]
    named.pickled_global = (module, name)  # type: ignore[attr-defined]
    return named


class _AllowedGlobal:
    """An allowlisted global that is only ever an argument of a rebuild, never called (``role``:
    "ndarray" for numpy.ndarray, "tensor type" for torch.Tensor and Parameter, "storage" for
    torch's storage classes, with their `dtype`, None for UntypedStorage)."""

    __slots__ = ("module", "name", "role", "dtype")

    def __init__(self, module: str, name: str, role: str, dtype: DType | None = None) -> None:
        self.module, self.name, self.role, self.dtype = module, name, role, dtype

    def __call__(self, *args: Any) -> Any:
        raise CorruptFileError(None, f"corrupted pickle: {self.module}.{self.name} called")

    def __setstate__(self, state: object) -> None:
        _refuse_build(f"{self.module}.{self.name}")(state)

    def __repr__(self) -> str:
        return f"<allowlisted global {self.module}.{self.name}>"


def global_name(obj: Any) -> tuple[str, str] | None:
    """(module, name) of a class or function a pickle holds as a value (not called), whether
    allowlisted or a stand-in; None for anything else. How a writer names it again."""
    if isinstance(obj, (PickledGlobal, _AllowedGlobal)):
        return (obj.module, obj.name)
    if type(obj) is types.FunctionType:
        return obj.__dict__.get("pickled_global")
    return None


def _allowed_globals() -> dict[tuple[str, str], Any]:
    functions: dict[str, Callable[..., Any]] = {
        "builtins.set": _collection(set),
        "builtins.frozenset": _collection(frozenset),
        "builtins.bytes": _bytes_like(bytes),
        "builtins.bytearray": _bytes_like(bytearray),
        "builtins.slice": _slice,
        "builtins.complex": _complex,
        "_codecs.encode": _codecs_encode,
        "copyreg._reconstructor": _copyreg_reconstructor,
        "copyreg.__newobj__": _copyreg_newobj,
        "copyreg.__newobj_ex__": _copyreg_newobj_ex,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type,
        "torch.Size": _torch_size,
        "torch.device": _torch_device,
        "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
        "numpy.dtype": _np_new_dtype,
    }
    for core in ("numpy.core", "numpy._core"):
        functions[f"{core}.multiarray._reconstruct"] = _np_reconstruct
        functions[f"{core}.multiarray.scalar"] = _np_scalar
        functions[f"{core}.numeric._frombuffer"] = _np_frombuffer
    for name in dir(np.dtypes):
        if name.endswith("DType"):
            functions[f"numpy.dtypes.{name}"] = _np_new_dtype
    for qualified in ENUM_CLASSES:
        functions[qualified] = _enum_member(qualified)
    table: dict[tuple[str, str], Any] = {}
    for qualified, function in functions.items():
        module, name = qualified.rsplit(".", 1)
        table[(module, name)] = _rebuild(module, name, function)
    names = [_AllowedGlobal("numpy", "ndarray", "ndarray"), _AllowedGlobal("torch.storage", "UntypedStorage", "storage")]
    names += [_AllowedGlobal("torch", "Tensor", "tensor type"), _AllowedGlobal("torch.nn.parameter", "Parameter", "tensor type")]
    names += [_AllowedGlobal("torch", storage, "storage", dtype) for storage, dtype in BY_STORAGE.items()]
    table.update({(n.module, n.name): n for n in names})
    for dtype in BY_NAME.values():
        table[("torch", dtype.name)] = dtype
    return table


_ALLOWED = _allowed_globals()


# ---------------------------------------------------------------------------------------------
# The unpickler


_MAX_GLOBALS = 10_000  # distinct unknown globals in one file; real files name a handful


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: str, storages: dict[str, tuple[int, int]]) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path
        self._storages = storages
        self._unknown: set[tuple[str, str]] = set()
        self.numpy_seen = False  # numpy placeholders may need swapping once the tree is read
        self.ordered_dicts: list[OrderedDict] = []  # to check the attributes BUILD gave them
        made = self.ordered_dicts

        def ordered_dict(items: Any = ()) -> OrderedDict:  # collections.OrderedDict, remembered
            if not isinstance(items, (list, tuple)):
                raise CorruptFileError(None, "corrupted pickle: OrderedDict from a non-list")
            made.append(OrderedDict(items))
            return made[-1]

        self._ordered_dict = _rebuild("collections", "OrderedDict", ordered_dict)

    def find_class(self, module: str, name: str) -> Any:
        # Protocol-2 pickles spell some globals the Python 2 way (__builtin__.set): map them
        # as pickle's own find_class does before looking them up.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        if (module, name) == ("collections", "OrderedDict"):
            return self._ordered_dict
        found = _ALLOWED.get((module, name))
        if found is not None:
            self.numpy_seen = self.numpy_seen or module.startswith("numpy")
            return found
        self._unknown.add((module, name))
        if len(self._unknown) > _MAX_GLOBALS:
            raise CorruptFileError(self._path, f"pickle names more than {_MAX_GLOBALS} different classes")
        return stand_in(module, name)

    def persistent_load(self, pid: Any) -> _Storage:
        storage_type = pid[1] if type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" else None
        if not (isinstance(storage_type, _AllowedGlobal) and storage_type.role == "storage"):
            for part in pid if isinstance(pid, tuple) else ():
                _refuse_stand_in(part, "in a storage record")
            raise CorruptFileError(self._path, f"corrupted pickle: unknown persistent id {pid!r:.80}")
        _, _, key, location, numel = pid
        if type(numel) is not int or numel < 0 or not isinstance(location, str):
            for part in pid:
                _refuse_stand_in(part, "in a storage record")
            raise CorruptFileError(self._path, f"corrupted pickle: bad storage record {pid!r:.80}")
        if not isinstance(key, str) or key not in self._storages:
            raise CorruptFileError(self._path, f"storage record data/{key} is missing from the archive")
        offset, nbytes = self._storages[key]
        dtype = storage_type.dtype
        if nbytes != numel * (dtype.itemsize if dtype else 1):
            expected = f"{numel} x {dtype}" if dtype else f"{numel} bytes"
            raise CorruptFileError(self._path, f"storage data/{key} holds {nbytes} bytes, the pickle expects {expected}")
        return _Storage(self._path, offset, nbytes, dtype)


def unpickle(data: bytes, path: str, storages: dict[str, tuple[int, int]] | None = None) -> Any:
    """Read `data` (the data.pkl of an archive at `path`) as data; see the module docstring.

    `storages` maps each storage key to (byte offset in `path`, byte length).
    """
    _refuse_extensions(data, path)
    try:
        unpickler = _RestrictedUnpickler(data, path, storages or {})
        tree = unpickler.load()
        _check_ordered_dicts(unpickler.ordered_dicts)
        return _Resolver().resolve(tree) if unpickler.numpy_seen else tree
    except ZckptError as exc:
        if exc.path is None:
            raise type(exc)(path, exc.problem) from None
        raise
    except ValueError as exc:
        if str(exc).startswith("unregistered extension code"):
            raise UnsafePickleError(path, f"pickle uses copyreg's extension registry ({exc}), which zckpt does not allow") from None
        raise CorruptFileError(path, f"corrupted pickle (ValueError: {exc})") from None
    except Exception as exc:  # any unpickling failure of a garbled stream
        raise CorruptFileError(path, f"corrupted pickle ({type(exc).__name__}: {exc})") from None


def _refuse_extensions(data: bytes, path: str) -> None:
    """EXT opcodes name globals through copyreg's registry, and the C unpickler takes a cached
    entry without asking find_class: where this process has any, a pickle using them is refused."""
    if not (copyreg._extension_registry or copyreg._extension_cache):  # type: ignore[attr-defined]
        return  # an EXT opcode then fails as unregistered, reported by unpickle
    import pickletools

    try:
        for opcode, argument, _ in pickletools.genops(data):
            if opcode.name.startswith("EXT"):
                named = ".".join(copyreg._inverted_registry.get(argument, ()))  # type: ignore[attr-defined]
                named = f": {named}" if named else ""
                raise UnsafePickleError(path, f"pickle names a global through copyreg's extension registry (EXT code {argument}{named}), which zckpt does not allow")
    except ZckptError:
        raise
    except Exception:
        return  # garbled: the unpickler reports it


def _check_ordered_dicts(made: list[OrderedDict]) -> None:
    """BUILD may give an OrderedDict attributes (torch's state_dict keeps ``_metadata`` there);
    one named like a method (``items``) would change what the dict does for its reader."""
    for ordered in made:
        for name in vars(ordered):
            if not isinstance(name, str) or name.startswith("__") or hasattr(OrderedDict, name):
                raise CorruptFileError(None, f"corrupted pickle: OrderedDict attribute {name!r:.40}")


class _Resolver:
    """Swaps numpy placeholders for the arrays and dtypes they hold, everywhere in the tree,
    keeping shared objects shared (a memo by identity; lists and dicts are edited in place)."""

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}

    def resolve(self, obj: Any) -> Any:
        if isinstance(obj, (_PendingArray, _PendingDType)):
            return obj.value
        if isinstance(obj, TensorRef) and obj.attributes:
            return replace(obj, attributes=self.resolve(obj.attributes))
        if isinstance(obj, (str, bytes, int, float, type(None), TensorRef, DType)):
            return obj
        done = self.memo.get(id(obj))
        if done is not None:
            return done[1]
        self.memo[id(obj)] = (obj, obj)  # keeps `obj` alive so its id is not reused
        out = self._resolve_inside(obj)
        self.memo[id(obj)] = (obj, out)
        return out

    def _resolve_inside(self, obj: Any) -> Any:
        resolve = self.resolve
        if isinstance(obj, dict):
            items = [(resolve(k), resolve(v)) for k, v in obj.items()]
            obj.clear()
            obj.update(items)
            if isinstance(obj, OrderedDict):
                vars(obj).update({k: resolve(v) for k, v in vars(obj).items()})
        elif isinstance(obj, list):
            obj[:] = [resolve(v) for v in obj]
        elif type(obj) is tuple:
            values = tuple(resolve(v) for v in obj)
            return obj if all(a is b for a, b in zip(values, obj)) else values
        elif isinstance(obj, (set, frozenset)):
            values = {resolve(v) for v in obj}
            if isinstance(obj, frozenset):
                return frozenset(values)
            obj.clear()
            obj.update(values)
        elif isinstance(obj, PickledObject):
            obj.pickle_args = resolve(obj.pickle_args)
            obj.pickle_kwargs = resolve(obj.pickle_kwargs)
            obj.pickle_state = resolve(obj.pickle_state)
            obj.pickle_list_items = resolve(obj.pickle_list_items)
            obj.pickle_dict_items = [(resolve(k), resolve(v)) for k, v in obj.pickle_dict_items]
        return obj


def walk_tensor_refs(obj: Any, visit: Callable[[TensorRef], None]) -> None:
    """Call `visit` on every TensorRef inside nested dicts, lists, tuples and read objects."""
    if isinstance(obj, TensorRef):
        visit(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            walk_tensor_refs(value, visit)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            walk_tensor_refs(value, visit)
    elif isinstance(obj, PickledObject):
        for value in (obj.pickle_args, obj.pickle_kwargs, obj.pickle_state, obj.pickle_list_items, obj.pickle_dict_items):
            walk_tensor_refs(value, visit)
