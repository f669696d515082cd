"""Safe, lazy reader of torch.save's legacy (non-zip) format.

Why: ``torch.save(..., _use_new_zipfile_serialization=False)`` still writes it, and DeepSpeed
does so for every rank file of a run configured with ``"checkpoint": {"checkpoint_serialization":
false}`` (``TorchCheckpointEngine.save``, deepspeed/runtime/checkpoint_engine/
torch_checkpoint_engine.py). The layout (``_legacy_save`` and ``_legacy_load`` in
torch/serialization.py), as measured on DeepSpeed 0.19.8's files:

1. five pickles, back to back: the magic number ``0x1950A86A20F9469CFC6C``, the protocol
   version ``1001``, ``sys_info`` (``little_endian``, C type sizes), the main pickle (the
   object; each storage a persistent id ``("storage", storage type, key, location, numel,
   view_metadata)``, view_metadata always None), and the storage keys, sorted as strings;
2. then for each key in that order: its element count as 8 bytes little-endian (elements of
   the storage's dtype, not bytes: ``THPStorage_writeFileRaw``), then its bytes, little-endian.

Nothing here executes a pickle: each one's extent is found by walking its opcodes
(``pickletools.genops``, which stops at STOP); only the pickles are read, by the same restricted
unpickler as the zip format's data.pkl (:mod:`zckpt.torchfile.unpickler`); each storage's place is
found by reading its 8-byte header and seeking past its data, checked against the file size. The
format carries no checksum and no file name.
"""

from __future__ import annotations

import os
import pickletools
from typing import Any, BinaryIO

from ..core.errors import CorruptFileError
from .unpickler import storage_sizes, unpickle

__all__ = ["LEGACY_MAGIC", "is_legacy_torch_file", "load_legacy"]


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_PROTOCOL_VERSION = 1001
# the magic number opens the stream: as LONG1 (pickle protocol >= 2) or as text (0 and 1)
_MARKS = (b"\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little"), b"L%dL\n" % LEGACY_MAGIC)
_WHAT = "a legacy (non-zip) torch.save file"
_PICKLES = ("magic number", "protocol version", "sys_info", "main", "storage keys")


def is_legacy_torch_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a legacy torch.save file. Only the first bytes are read: the magic
    number comes first in the stream."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(32)
    except OSError:
        return False
    return any(mark in head for mark in _MARKS)


def load_legacy(path: str) -> Any:
    """The object a legacy torch.save file at `path` holds, tensors as TensorRefs into it.

    Raises CorruptFileError naming `path` for a truncated or garbled file, and for one in a
    variant zckpt does not read (big-endian, another protocol version, storage views)."""
    file_size = os.path.getsize(path)
    try:
        with open(path, "rb") as handle:
            magic = unpickle(_next_pickle(handle, path, 0, file_size), path)
            if magic != LEGACY_MAGIC:
                raise CorruptFileError(path, "not a torch.save file (no torch magic number)")
            version = unpickle(_next_pickle(handle, path, 1, file_size), path)
            if version != _PROTOCOL_VERSION:
                raise CorruptFileError(
                    path, f"{_WHAT} of protocol version {version!r:.20}: zckpt reads version {_PROTOCOL_VERSION} only"
                )
            _check_sys_info(unpickle(_next_pickle(handle, path, 2, file_size), path), path)
            main = _next_pickle(handle, path, 3, file_size)
            keys = unpickle(_next_pickle(handle, path, 4, file_size), path)
            sizes = storage_sizes(main, path)
            storages = _storage_layout(handle, path, keys, sizes, handle.tell(), file_size)
    except OSError as exc:
        raise CorruptFileError(path, f"cannot read: {exc.strerror or exc}") from None
    return unpickle(main, path, storages, legacy=True)


def _next_pickle(handle: BinaryIO, path: str, index: int, file_size: int) -> bytes:
    """The bytes of the pickle starting at the handle's position, found by walking its opcodes
    (nothing executed); the handle is left after its STOP."""
    start = handle.tell()
    try:
        for _ in pickletools.genops(handle):
            pass
    except Exception as exc:  # genops' answer to a stream cut short or garbled
        if handle.tell() >= file_size:
            raise CorruptFileError(path, f"truncated: the file ends inside its {_PICKLES[index]} pickle") from None
        raise CorruptFileError(
            path, f"{_WHAT} with a damaged {_PICKLES[index]} pickle ({type(exc).__name__}: {exc})"
        ) from None
    end = handle.tell()
    handle.seek(start)
    data = handle.read(end - start)
    if len(data) != end - start:
        raise CorruptFileError(path, f"truncated: the file ends inside its {_PICKLES[index]} pickle")
    return data


def _check_sys_info(sys_info: Any, path: str) -> None:
    """The writer's byte order: zckpt reads little-endian data only."""
    if not isinstance(sys_info, dict) or "little_endian" not in sys_info:
        raise CorruptFileError(path, f"{_WHAT} with a damaged sys_info pickle ({sys_info!r:.60})")
    if sys_info["little_endian"] is not True:
        raise CorruptFileError(
            path,
            f"{_WHAT} written on a big-endian machine (sys_info little_endian {sys_info['little_endian']!r:.10}): "
            "zckpt reads little-endian files only",
        )


def _storage_layout(
    handle: BinaryIO, path: str, keys: Any, sizes: dict[str, tuple[int, int]], start: int, file_size: int
) -> dict[str, tuple[int, int]]:
    """Each storage's (byte offset, byte length): the storages follow the pickles in the order
    of `keys`, each as an 8-byte element count and its data; the counts are read, the data
    skipped. `sizes` (key -> elements, element size) is what the main pickle records."""
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise CorruptFileError(path, f"{_WHAT} with a damaged storage keys pickle")
    missing = sorted(set(sizes) - set(keys))
    if missing:
        raise CorruptFileError(path, f"{_WHAT} whose pickle uses storage {missing[0]}, which its storage list lacks")
    layout: dict[str, tuple[int, int]] = {}
    position = start
    for key in keys:
        if key not in sizes:
            raise CorruptFileError(path, f"{_WHAT} listing storage {key}, which its pickle does not use")
        numel, itemsize = sizes[key]
        nbytes = numel * itemsize
        if position + 8 > file_size:
            raise CorruptFileError(path, f"truncated: the file ends at byte {file_size}, before storage {key}")
        handle.seek(position)
        count = int.from_bytes(handle.read(8), "little", signed=True)
        if count != numel:  # torch.load refuses it too ("storage has wrong byte size")
            raise CorruptFileError(
                path, f"storage {key} at byte {position} holds {count} elements, the pickle records {numel}"
            )
        end = position + 8 + nbytes
        if end > file_size:
            raise CorruptFileError(
                path, f"truncated: storage {key} ends at byte {end}, past the end of the file ({file_size} bytes)"
            )
        layout[key] = (position + 8, nbytes)
        position = end
    return layout
