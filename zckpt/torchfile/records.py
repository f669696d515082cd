"""What a pickle becomes when zckpt reads it: inert records, never the real objects.

Why apart from the unpickler: these are the types a reader of a checkpoint meets (and a writer
pickles back), while the restricted unpickler (:mod:`zckpt.torchfile.unpickler`) and its allowlist
(:mod:`zckpt.torchfile.rebuilds`) are how they are made. A tensor becomes a
:class:`~zckpt.core.index.TensorRef`; an instance of a class zckpt does not import a
:class:`PickledObject`; a class or function that is not allowlisted a :class:`PickledGlobal`
stand-in, known by name only; an allowlisted class held as a value an ``_AllowedGlobal``.
None of them runs code from the pickle, and each refuses BUILD where its state is fixed.
"""

from __future__ import annotations

import types
from enum import IntEnum
from typing import Any, Callable, ClassVar

from ..core.dtypes import DType
from ..core.errors import CorruptFileError, UnsafePickleError
from ..core.index import TensorRef

__all__ = [
    "NoState",
    "PickledEnumMember",
    "PickledGlobal",
    "PickledObject",
    "TorchDevice",
    "TorchSize",
    "ZeroStageEnum",
    "global_name",
    "record_class",
    "refuse_build",
    "stand_in",
    "walk_tensor_refs",
]


class NoState:
    """Mixin: objects the unpickler hands out refuse BUILD (their state is fixed when made)."""

    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        raise CorruptFileError(None, f"corrupted pickle: BUILD applied to {type(self).__name__}")


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
        raise UnsafePickleError(
            None,
            f"pickle calls an instance of {self.original_class}, which is not on zckpt's allowlist; refusing to load it (a payload?)",
        )

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
                    raise UnsafePickleError(
                        None,
                        f"pickle sets attribute {key} of its {owner} object to {'.'.join(name)}; refusing to load it (a payload?)",
                    )


def _restore_object(
    module: str, name: str, args: tuple, kwargs: dict, state: Any, items: list, dict_items: list
) -> PickledObject:
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
        namespace = {
            "__slots__": (),
            "original_module": module,
            "original_name": name,
            "original_class": f"{module}.{name}",
        }
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
        raise UnsafePickleError(
            None,
            f"pickle calls {cls.qualified_name}, which is not on zckpt's allowlist; refusing to load it (a payload?)",
        )

    def __setstate__(cls, state: object) -> None:  # would set attributes of the real class
        raise UnsafePickleError(
            None,
            f"pickle modifies {cls.qualified_name} (BUILD on a global), which zckpt does not allow; refusing to load it (a payload?)",
        )

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


def refuse_build(qualified: str) -> Callable[[object], None]:
    """The ``__setstate__`` of an allowlisted global: BUILD on it would change it for every reader."""

    def refuse(state: object) -> None:
        raise UnsafePickleError(
            None,
            f"pickle modifies {qualified} (BUILD on a global), which zckpt does not allow; refusing to load it (a payload?)",
        )

    return refuse


class _AllowedGlobal:
    """An allowlisted global that is only ever an argument of a rebuild, never called (``role``:
    "ndarray" for numpy.ndarray, "tensor type" for torch.Tensor and Parameter, "storage" for
    torch's storage classes, with their `dtype`, None for UntypedStorage).

    Its name, underscore included, stays as it was: the C unpickler's own messages name the type
    ("NEWOBJ class argument must be a type, not _AllowedGlobal"), and zckpt reports them.
    """

    __slots__ = ("module", "name", "role", "dtype")

    def __init__(self, module: str, name: str, role: str, dtype: DType | None = None) -> None:
        self.module, self.name, self.role, self.dtype = module, name, role, dtype

    def __call__(self, *args: Any) -> Any:
        raise CorruptFileError(None, f"corrupted pickle: {self.module}.{self.name} called")

    def __setstate__(self, state: object) -> None:
        refuse_build(f"{self.module}.{self.name}")(state)

    def __repr__(self) -> str:
        return f"<allowlisted global {self.module}.{self.name}>"


def global_name(obj: Any) -> tuple[str, str] | None:
    """(module, name) of a class or function a pickle holds as a value (not called), whether
    allowlisted or a stand-in; None for anything else. How a writer names it again. (An
    allowlisted function carries its name as ``pickled_global``: see
    :func:`zckpt.torchfile.rebuilds.named_rebuild`.)"""
    if isinstance(obj, (PickledGlobal, _AllowedGlobal)):
        return (obj.module, obj.name)
    if type(obj) is types.FunctionType:
        return obj.__dict__.get("pickled_global")
    return None


class ZeroStageEnum(IntEnum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3

    def __setstate__(self, state: object) -> None:
        raise CorruptFileError(None, "corrupted pickle: BUILD applied to ZeroStageEnum")


class PickledEnumMember(NoState):
    """A member of an allowlisted Enum (:data:`~zckpt.torchfile.rebuilds.ENUM_CLASSES`): its class name and value."""

    __slots__ = ("original_class", "value")

    def __init__(self, original_class: str, value: int | str) -> None:
        object.__setattr__(self, "original_class", original_class)
        object.__setattr__(self, "value", value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PickledEnumMember is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PickledEnumMember) and (self.original_class, self.value) == (
            other.original_class,
            other.value,
        )

    def __hash__(self) -> int:
        return hash((self.original_class, self.value))

    def __repr__(self) -> str:
        return f"<{self.original_class}({self.value!r})>"

    def __reduce__(self) -> tuple:
        return (PickledEnumMember, (self.original_class, self.value))


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
        for value in (
            obj.pickle_args,
            obj.pickle_kwargs,
            obj.pickle_state,
            obj.pickle_list_items,
            obj.pickle_dict_items,
        ):
            walk_tensor_refs(value, visit)
