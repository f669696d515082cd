"""Safe, lazy reader of files written by ``torch.save`` (the zip format).

Why not ``torch.load``: DeepSpeed pickles its own classes, so stock loading needs DeepSpeed
installed and ``weights_only=False``, which runs whatever a pickle says. Here the pickle is read
by an unpickler that resolves only allowlisted globals, maps DeepSpeed classes to inert local
stand-ins, and turns every tensor into a :class:`TensorRef` (file, byte offset, dtype, shape)
without reading a byte of tensor data. Data is read later, only where it is needed.

The zip layout is validated first, as safetensors does for its header: every storage record
must be stored uncompressed, lie inside the file, and be exactly as long as the pickle says.
"""

from __future__ import annotations

import _compat_pickle
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, Callable

from .dtypes import BY_NAME, BY_STORAGE, DType
from .errors import CheckpointNotFoundError, CorruptFileError, UnsafePickleError


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a tensor's elements lie in a file; holds no data."""

    path: str
    offset: int  # byte offset in `path` of element 0
    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    # Python attributes pickled with the tensor (DeepSpeed's ZeRO-3 flat groups carry `ds_id`).
    attributes: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and step != expected:
                return False
            expected *= size
        return True

    @classmethod
    def flat(cls, path: str, offset: int, dtype: DType, numel: int) -> "TensorRef":
        """A 1-D contiguous run of `numel` elements at byte `offset` (e.g. in a raw swap file)."""
        return cls(path, offset, dtype, (numel,), (1,))


# ---------------------------------------------------------------------------------------------
# Inert stand-ins for the non-torch classes DeepSpeed pickles. Creating them runs no code of the
# original class: the unpickler makes a bare instance and fills its __dict__ (or calls an enum).


class ZeroStageEnum(IntEnum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class PickledObject:
    """An object read as plain data: the original class name plus its attributes."""

    original_class = "object"

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"<{self.original_class} {fields}>"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]


def _stand_in(qualified_name: str) -> type[PickledObject]:
    return type(qualified_name.rsplit(".", 1)[1], (PickledObject,), {"original_class": qualified_name})


# ---------------------------------------------------------------------------------------------
# Markers and rebuild functions for torch's own globals.


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: DType


@dataclass(frozen=True, slots=True)
class _Storage:
    path: str
    offset: int
    dtype: DType
    numel: int


class _TensorType:
    """Marker for torch.Tensor / torch.nn.Parameter in _rebuild_from_type_v2."""


def _check_ints(path: str, what: str, values: Any) -> tuple[int, ...]:
    if not isinstance(values, tuple) or not all(isinstance(v, int) and v >= 0 for v in values):
        raise CorruptFileError(path, f"corrupted pickle: bad tensor {what} {values!r}")
    return values


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *_: Any) -> TensorRef:
    if not isinstance(storage, _Storage):
        raise CorruptFileError(None, f"corrupted pickle: tensor without a storage ({storage!r})")
    path = storage.path
    shape = _check_ints(path, "shape", tuple(size) if isinstance(size, (tuple, list)) else size)
    steps = _check_ints(path, "stride", tuple(stride) if isinstance(stride, (tuple, list)) else stride)
    if not isinstance(storage_offset, int) or storage_offset < 0 or len(shape) != len(steps):
        raise CorruptFileError(path, "corrupted pickle: inconsistent tensor geometry")
    if math.prod(shape) > 0:
        last = storage_offset + sum((n - 1) * s for n, s in zip(shape, steps))
        if last >= storage.numel:
            raise CorruptFileError(path, f"tensor of shape {list(shape)} reaches past its storage")
    return TensorRef(path, storage.offset + storage_offset * storage.dtype.itemsize, storage.dtype, shape, steps)


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func is not _rebuild_tensor or new_type is not _TensorType or not isinstance(args, tuple):
        raise CorruptFileError(None, "corrupted pickle: unsupported tensor subclass")
    ref = func(*args)
    return replace(ref, attributes=dict(state)) if isinstance(state, dict) and state else ref


def _size(values: Any = ()) -> tuple:
    return tuple(values)


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # Protocol-2 pickles store bytes objects as _codecs.encode(str, "latin1").
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CorruptFileError(None, "corrupted pickle: unexpected _codecs.encode call")
    return text.encode("latin1")


def _numpy_globals() -> dict[tuple[str, str], Any]:
    """numpy scalars and dtypes (lr schedulers and client state often hold np.float64)."""
    import numpy as np
    from numpy.core.multiarray import scalar  # type: ignore[attr-defined]

    def safe_scalar(dtype: Any, data: Any = None) -> Any:
        if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
            raise CorruptFileError(None, "corrupted pickle: unsupported numpy scalar")
        return scalar(dtype, data)

    def safe_dtype(name: Any, *_: Any) -> Any:
        dtype = np.dtype(name)
        if dtype.hasobject:
            raise CorruptFileError(None, "corrupted pickle: numpy object dtype")
        return dtype

    table: dict[tuple[str, str], Any] = {}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(module, "scalar")] = safe_scalar
    table[("numpy", "dtype")] = safe_dtype
    for kind in ("Float64DType", "Float32DType", "Int64DType", "Int32DType", "BoolDType"):
        table[("numpy.dtypes", kind)] = safe_dtype
    return table


# DeepSpeed classes seen in real checkpoints (0.14 - 0.19), read as plain data.
DEEPSPEED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): bytearray,
        ("_codecs", "encode"): _codecs_encode,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
        ("torch", "Tensor"): _TensorType,
        ("torch.nn.parameter", "Parameter"): _TensorType,
        ("torch", "Size"): _size,
        ("torch", "device"): _device,
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStageEnum,
    }
    for dtype in BY_NAME.values():
        table[("torch", dtype.storage)] = _StorageType(dtype)
        table[("torch", dtype.name)] = dtype
    for qualified in DEEPSPEED_CLASSES:
        module, name = qualified.rsplit(".", 1)
        table[(module, name)] = _stand_in(qualified)
    table.update(_numpy_globals())
    return table


_ALLOWED = _allowed_globals()


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: str, storages: dict[str, tuple[int, int]]) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self._path = path
        self._storages = storages

    def find_class(self, module: str, name: str) -> Any:
        # Protocol-2 pickles spell some globals the Python 2 way (__builtin__.set): map them
        # as pickle's own find_class does before looking them up.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                self._path, f"pickle references {module}.{name}, which is not on zckpt's allowlist; refusing to load it"
            ) from None

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptFileError(self._path, f"corrupted pickle: unknown persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(numel, int):
            raise CorruptFileError(self._path, f"corrupted pickle: bad storage record {pid!r:.80}")
        if key not in self._storages:
            raise CorruptFileError(self._path, f"storage record data/{key} is missing from the archive")
        offset, nbytes = self._storages[key]
        if nbytes != numel * storage_type.dtype.itemsize:
            raise CorruptFileError(
                self._path, f"storage data/{key} holds {nbytes} bytes, the pickle expects {numel} x {storage_type.dtype}"
            )
        return _Storage(self._path, offset, storage_type.dtype, numel)


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"


def _record_data_offset(handle: Any, info: zipfile.ZipInfo, path: str) -> int:
    handle.seek(info.header_offset)
    header = handle.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL_MAGIC:
        raise CorruptFileError(path, f"zip record {info.filename} has a damaged header")
    fields = _LOCAL_HEADER.unpack(header)
    return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]


def load(path: str | os.PathLike[str]) -> Any:
    """Unpickle a torch.save zip archive into plain Python objects and :class:`TensorRef` s.

    Raises a :class:`~zckpt.errors.ZckptError` naming `path` for anything that is not a sound,
    safe torch archive: missing, truncated, garbled, compressed, or referencing a global that is
    not allowlisted.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(path, "file not found")
    file_size = os.path.getsize(path)
    try:
        with open(path, "rb") as handle, zipfile.ZipFile(handle) as archive:
            infos = archive.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(pickles) != 1:
                raise CorruptFileError(path, "not a torch.save archive (no single <name>/data.pkl record)")
            prefix = pickles[0].filename[: -len("data.pkl")]
            byteorder = prefix + "byteorder"
            if byteorder in archive.NameToInfo and archive.read(byteorder) not in (b"little", b"little\n"):
                raise CorruptFileError(path, "big-endian torch archives are not supported")
            storages: dict[str, tuple[int, int]] = {}
            data_prefix = prefix + "data/"
            for info in infos:
                if not info.filename.startswith(data_prefix):
                    continue
                if info.compress_type != zipfile.ZIP_STORED:
                    raise CorruptFileError(path, f"zip record {info.filename} is compressed; torch never writes that")
                offset = _record_data_offset(handle, info, path)
                if offset + info.file_size > file_size:
                    raise CorruptFileError(path, f"truncated: record {info.filename} ends past the end of the file")
                storages[info.filename[len(data_prefix) :]] = (offset, info.file_size)
            data = archive.read(pickles[0])
    except zipfile.BadZipFile as exc:
        if is_legacy_torch_file(path):  # not damaged: an older format, which deserves its own words
            raise CorruptFileError(path, LEGACY_PROBLEM) from None
        raise CorruptFileError(path, f"truncated or not a torch checkpoint ({exc})") from None
    except CorruptFileError:
        raise
    except OSError as exc:
        raise CorruptFileError(path, f"cannot read: {exc.strerror or exc}") from None
    except Exception as exc:  # zipfile trips over garbled headers in many ways (bad names, versions)
        raise CorruptFileError(path, f"damaged zip structure ({type(exc).__name__}: {exc})") from None
    return unpickle(data, path, storages)


# torch.save's format before 1.6 (still written with _use_new_zipfile_serialization=False): a bare
# pickle stream that opens with this magic number, as LONG1 (pickle protocol >= 2) or as text.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_MARKS = (b"\x8a\x0a" + _LEGACY_MAGIC.to_bytes(10, "little"), b"L%dL\n" % _LEGACY_MAGIC)
LEGACY_PROBLEM = "a legacy (pre-1.6) torch.save file: not supported, re-save it with torch.save"


def is_legacy_torch_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a pre-zip torch.save file, so that it is named as one rather than called
    truncated. Only the first bytes are read: the magic number comes first in the stream."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(32)
    except OSError:
        return False
    return any(mark in head for mark in _LEGACY_MARKS)


def verify_checksums(path: str | os.PathLike[str]) -> str | None:
    """Read every record of a torch archive and check its CRC-32; the problem found, or None.

    Catches silent corruption inside tensor data, which parsing alone cannot see. Reads the
    whole file, so it costs a full pass over the checkpoint.
    """
    path = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except Exception as exc:
        if is_legacy_torch_file(path):
            return f"{path}: {LEGACY_PROBLEM}"
        return f"{path}: damaged zip structure ({type(exc).__name__}: {exc})"
    return f"{path}: record {bad} fails its CRC-32 check: the data is corrupted" if bad else None


def unpickle(data: bytes, path: str, storages: dict[str, tuple[int, int]] | None = None) -> Any:
    """Run the restricted unpickler over `data` (the data.pkl of an archive at `path`)."""
    try:
        return _RestrictedUnpickler(data, path, storages or {}).load()
    except (UnsafePickleError, CorruptFileError) as exc:
        if exc.path is None:
            raise type(exc)(path, exc.problem) from None
        raise
    except Exception as exc:  # any unpickling failure of a garbled stream
        raise CorruptFileError(path, f"corrupted pickle ({type(exc).__name__}: {exc})") from None


def walk_tensor_refs(obj: Any, visit: Callable[[TensorRef], None]) -> None:
    """Call `visit` on every TensorRef inside nested dicts, lists and tuples."""
    if isinstance(obj, TensorRef):
        visit(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            walk_tensor_refs(value, visit)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            walk_tensor_refs(value, visit)
