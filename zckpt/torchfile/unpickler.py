"""The restricted unpickler: a pickle read as data, with nothing from it ever called.

Why: ``torch.load(weights_only=False)`` calls whatever a pickle names (``os.system``...), and
``weights_only=True`` refuses the classes real checkpoints hold (DeepSpeed's loss scaler,
Megatron's ``args`` Namespace, numpy RNG state). Here:

- **Allowlisted globals** (torch's tensor and storage rebuilds, dtypes, ``torch.Size``,
  ``torch.device``, ``OrderedDict``, ``set``, numpy arrays, dtypes and scalars, a few enums)
  resolve to rebuild functions zckpt implements itself; they validate their arguments and read
  no tensor data (a tensor becomes a :class:`~zckpt.core.index.TensorRef`).
- **Any other global** resolves to a :class:`~zckpt.torchfile.records.PickledGlobal`: a stand-in that knows only its
  name and is never imported. Instantiated the way pickle builds instances of plain classes
  (NEWOBJ, NEWOBJ_EX, ``copyreg`` reconstructors) it gives a :class:`~zckpt.torchfile.records.PickledObject`: the class
  name, the arguments, and the state BUILD gives it, kept as data; no ``__setstate__`` runs.
  Called (REDUCE, INST, OBJ) it raises :class:`~zckpt.core.errors.UnsafePickleError` naming it: that
  is how a payload (``os.system``, ``eval``, ``subprocess.Popen``) would run.
- Every object the pickle can reach refuses BUILD (a pickle could otherwise rewrite a
  :class:`~zckpt.core.index.TensorRef`'s path, or the shared ``DType`` objects, through their ``__setstate__``),
  and copyreg's extension registry (EXT opcodes) is never consulted.

The C unpickler does the parsing (speed); the guarantees come from what ``find_class`` and
``persistent_load`` hand it: no real class or function from outside zckpt ever reaches its stack.
This module is that machine (the lookups, their limits, the errors); what each allowlisted global
becomes is :mod:`zckpt.torchfile.rebuilds`, the types the tree holds :mod:`zckpt.torchfile.records`.
"""

from __future__ import annotations

import _compat_pickle
import copyreg
import io
import pickle
from collections import OrderedDict
from typing import Any

from ..core.errors import CorruptFileError, UnsafePickleError, ZckptError
from .rebuilds import _Storage, allowed, named_rebuild, resolve_placeholders, storage_id, storage_record
from .records import stand_in

__all__ = ["storage_sizes", "unpickle"]


_MAX_GLOBALS = 10_000  # distinct unknown globals in one file; real files name a handful


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: str, storages: dict[str, tuple[int, int]], legacy: bool = False) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path
        self._storages = storages
        self._legacy = legacy
        self._unknown: set[tuple[str, str]] = set()
        self.numpy_seen = False  # numpy placeholders may need swapping once the tree is read
        self.ordered_dicts: list[OrderedDict] = []  # to check the attributes BUILD gave them
        made = self.ordered_dicts

        def ordered_dict(items: Any = ()) -> OrderedDict:  # collections.OrderedDict, remembered
            if not isinstance(items, (list, tuple)):
                raise CorruptFileError(None, "corrupted pickle: OrderedDict from a non-list")
            made.append(OrderedDict(items))
            return made[-1]

        self._ordered_dict = named_rebuild("collections", "OrderedDict", ordered_dict)

    def find_class(self, module: str, name: str) -> Any:
        # Protocol-2 pickles spell some globals the Python 2 way (__builtin__.set): map them
        # as pickle's own find_class does before looking them up.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        if (module, name) == ("collections", "OrderedDict"):
            return self._ordered_dict
        found = allowed(module, name)
        if found is not None:
            self.numpy_seen = self.numpy_seen or module.startswith("numpy")
            return found
        self._unknown.add((module, name))
        if len(self._unknown) > _MAX_GLOBALS:
            raise CorruptFileError(self._path, f"pickle names more than {_MAX_GLOBALS} different classes")
        return stand_in(module, name)

    def persistent_load(self, pid: Any) -> Any:  # a storage record, checked against the archive
        return storage_record(pid, self._path, self._storages, self._legacy)


class _SizeProbe(_RestrictedUnpickler):
    """The unpickler taking note of each storage's size (a legacy file's data lies after its
    pickle, laid out by those sizes): every storage is placed at offset 0, the tree dropped."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(data, path, {}, legacy=True)
        self.sizes: dict[str, tuple[int, int]] = {}

    def persistent_load(self, pid: Any) -> Any:
        key, dtype, numel = storage_id(pid, self._path, legacy=True)
        size = (numel, dtype.itemsize if dtype else 1)
        if not isinstance(key, str) or self.sizes.setdefault(key, size) != size:
            raise CorruptFileError(self._path, f"corrupted pickle: storage {key!r:.40} recorded with two sizes")
        return _Storage(self._path, 0, numel * size[1], dtype)


def unpickle(
    data: bytes, path: str, storages: dict[str, tuple[int, int]] | None = None, *, legacy: bool = False
) -> Any:
    """Read `data` (the data.pkl of an archive at `path`) as data; see the module docstring.

    `storages` maps each storage key to (byte offset in `path`, byte length); `legacy`: `data`
    is the main pickle of a legacy (non-zip) torch.save file, whose storage records say more.
    """
    return _load(_RestrictedUnpickler(data, path, storages or {}, legacy), data, path)


def storage_sizes(data: bytes, path: str) -> dict[str, tuple[int, int]]:
    """(elements, element size) of each storage the main pickle of a legacy torch.save file at
    `path` records, by key: read as :func:`unpickle` reads it (nothing called), the tree dropped."""
    probe = _SizeProbe(data, path)
    _load(probe, data, path)
    return probe.sizes


def _load(unpickler: _RestrictedUnpickler, data: bytes, path: str) -> Any:
    _refuse_extensions(data, path)
    try:
        tree = unpickler.load()
        _check_ordered_dicts(unpickler.ordered_dicts)
        return resolve_placeholders(tree) if unpickler.numpy_seen else tree
    except ZckptError as exc:
        if exc.path is None:
            raise type(exc)(path, exc.problem) from None
        raise
    except ValueError as exc:
        if str(exc).startswith("unregistered extension code"):
            raise UnsafePickleError(
                path, f"pickle uses copyreg's extension registry ({exc}), which zckpt does not allow"
            ) from None
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
                raise UnsafePickleError(
                    path,
                    f"pickle names a global through copyreg's extension registry (EXT code {argument}{named}), which zckpt does not allow",
                )
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
