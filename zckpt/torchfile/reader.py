"""Safe, lazy reader of files written by ``torch.save`` (the zip format; the legacy one through
:mod:`zckpt.torchfile.legacy`).

Why not ``torch.load``: DeepSpeed pickles its own classes, so stock loading needs DeepSpeed
installed and ``weights_only=False``, which runs whatever a pickle says. Here the pickle is read
as data by :mod:`zckpt.torchfile.unpickler` (nothing from it is ever called; instances of classes zckpt
does not know become inert records), and every tensor becomes a :class:`TensorRef` (file, byte
offset, dtype, shape) without reading a byte of tensor data. Data is read later, only where it
is needed.

The zip layout is validated first, as safetensors does for its header: every storage record
must be stored uncompressed, lie inside the file, and be exactly as long as the pickle says.
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import Any

from ..core.errors import CheckpointNotFoundError, CorruptFileError
from ..core.index import TensorRef
from ..io.checksums import remember_records
from ..io.interrupts import uninterrupted
from .legacy import is_legacy_torch_file, load_legacy
from .records import (  # re-exported: what a pickle is read as
    PickledEnumMember,
    PickledGlobal,
    PickledObject,
    TorchDevice,
    TorchSize,
    ZeroStageEnum,
    global_name,
    walk_tensor_refs,
)
from .unpickler import unpickle

__all__ = [
    "PickledEnumMember",
    "PickledGlobal",
    "PickledObject",
    "TensorRef",
    "TorchDevice",
    "TorchSize",
    "ZeroStageEnum",
    "global_name",
    "is_legacy_torch_file",
    "load",
    "unpickle",
    "walk_tensor_refs",
]


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"


def _record_data_offset(handle: Any, info: zipfile.ZipInfo, path: str) -> int:
    handle.seek(info.header_offset)
    header = handle.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL_MAGIC:
        raise CorruptFileError(path, f"zip record {info.filename} has a damaged header")
    fields = _LOCAL_HEADER.unpack(header)
    return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]


def _check_record(handle: Any, info: zipfile.ZipInfo, path: str) -> int:
    """A record's directory entry against its own header: the header's signature and name, one
    disk, a stored record's two sizes equal. Returns the offset of its data."""
    offset = _record_data_offset(handle, info, path)
    handle.seek(info.header_offset + 26)
    name = handle.read(int.from_bytes(handle.read(2), "little") + 2)[2:]
    expected = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace")
    if (
        name != expected
        or info.volume != 0
        or (info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size)
    ):
        raise CorruptFileError(
            path, f"zip record {info.filename}: its directory entry and its header disagree (damaged)"
        )
    return offset


_END = struct.Struct("<4sHHHHIIH")  # end of central directory record
_LOCATOR = struct.Struct("<4sIQI")  # zip64 end of central directory locator
_END64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory record


def _check_end_records(handle: Any, file_size: int, count: int, path: str) -> None:
    """The end records as torch's own zip reader (miniz) checks them where Python's zipfile
    looks away: one disk, entry counts matching the directory, the zip64 locator pointing at
    the zip64 end record. A file failing these does not load with torch.load (nor in DeepSpeed)."""
    tail = min(file_size, _END.size + 0xFFFF)  # the record, and a comment of up to 64 KiB
    handle.seek(file_size - tail)
    data = handle.read(tail)
    at = data.rfind(b"PK\x05\x06")
    if at < 0 or at + _END.size > len(data):
        return  # zipfile has refused such a file already
    _, disk, cd_disk, entries_disk, entries, _, _, _ = _END.unpack_from(data, at)
    damaged = (
        disk not in (0, 0xFFFF)
        or cd_disk not in (0, 0xFFFF)
        or entries_disk != entries
        or entries not in (count, 0xFFFF)
    )
    end = file_size - tail + at
    if end >= _LOCATOR.size:
        handle.seek(end - _LOCATOR.size)
        locator = handle.read(_LOCATOR.size)
        if locator[:4] == b"PK\x06\x07":
            _, end64_disk, offset, disks = _LOCATOR.unpack(locator)
            handle.seek(offset)
            record = handle.read(_END64.size)
            if end64_disk != 0 or disks != 1 or len(record) != _END64.size or record[:4] != b"PK\x06\x06":
                damaged = True
            else:
                _, _, _, _, disk64, cd_disk64, entries_disk64, entries64, _, _ = _END64.unpack(record)
                damaged = damaged or (disk64, cd_disk64, entries_disk64, entries64) != (0, 0, count, count)
    if damaged:
        raise CorruptFileError(
            path,
            "damaged zip end records (disk numbers, entry counts or the zip64 locator); torch.load would refuse it too",
        )


def load(path: str | os.PathLike[str]) -> Any:
    """Unpickle a torch.save zip archive (or legacy file) into plain Python objects and
    :class:`TensorRef` s.

    Raises a :class:`~zckpt.core.errors.ZckptError` naming `path` for anything that is not a sound,
    safe torch archive: missing, truncated, garbled, compressed, or referencing a global that is
    not allowlisted.
    """
    return load_archive(path)[0]


def load_archive(path: str | os.PathLike[str]) -> tuple[Any, str]:
    """:func:`load`'s content and the archive's name: the folder its records sit in, which
    torch.save takes from the name of the file it saved to (``basename`` in PyTorch's
    ``caffe2/serialize/inline_container.cc``: the base name up to its last dot), or "archive"
    when it saved to a stream. A rank file renamed after the save still carries its old name.
    A legacy (non-zip) file records no name: "archive" too, which claims nothing."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(path, "file not found")
    if is_legacy_torch_file(path):
        return load_legacy(path), "archive"
    file_size = os.path.getsize(path)
    try:
        with open(path, "rb") as handle, uninterrupted(zipfile.ZipFile, handle) as archive:
            infos = archive.infolist()
            starts = [_check_record(handle, info, path) for info in infos]  # every record, read here or
            # not: torch's reader takes none of these damaged
            _check_end_records(handle, file_size, len(infos), path)
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
            handle.seek(0)
            if handle.read(4) == _LOCAL_MAGIC:  # what the CRC checks will look up (checksums.archive_records)
                stored = [
                    (info.filename, start, info.file_size, info.CRC)
                    for info, start in zip(infos, starts)
                    if info.compress_type == zipfile.ZIP_STORED and info.file_size
                ]
                remember_records(path, os.fstat(handle.fileno()), stored)
    except zipfile.BadZipFile as exc:
        raise CorruptFileError(path, f"truncated or not a torch checkpoint ({exc})") from None
    except CorruptFileError:
        raise
    except OSError as exc:
        raise CorruptFileError(path, f"cannot read: {exc.strerror or exc}") from None
    except Exception as exc:  # zipfile trips over garbled headers in many ways (bad names, versions)
        raise CorruptFileError(path, f"damaged zip structure ({type(exc).__name__}: {exc})") from None
    return unpickle(data, path, storages), prefix[:-1]
