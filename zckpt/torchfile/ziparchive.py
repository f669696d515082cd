"""The zip byte layout of a ``torch.save`` archive, computed without writing anything.

Why a layer of its own: torch's writer (miniz inside ``PyTorchStreamWriter``) has a precise
layout: every record stored, its data 64-byte aligned by a padding extra field ``FB`` in the
local header, sizes and CRC left zero in the local header and given in a data descriptor after
the data, zip64 fields exactly where a size or offset reaches 0xFFFFFFFF, and zip64 end records
always. Reproducing it byte for byte makes our files indistinguishable from torch's, and knowing
every offset up front lets a writer stream record data straight into place (the CRC only ever
goes after the data) and report the final file size before writing a byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

ALIGNMENT = 64  # torch's default storage alignment (torch.utils.serialization.config)
ZIP64_LIMIT = 0xFFFFFFFF  # miniz switches to zip64 fields at sizes/offsets >= this

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature ... name length, extra length (30 bytes)
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_END = struct.Struct("<IHHHHIIH")  # 22 bytes
_FLAG_DESCRIPTOR = 0x0008  # sizes and CRC follow the data
_FLAG_UTF8 = 0x0800


@dataclass(frozen=True)
class RecordLayout:
    """Where one stored record lies in the archive."""

    name: str  # full name in the zip, e.g. "model/data/0"
    size: int
    header_offset: int
    data_offset: int  # a multiple of ALIGNMENT
    end_offset: int  # after the data descriptor: where the next record's header starts

    @property
    def zip64(self) -> bool:
        """Whether miniz gives this record zip64 fields (and a 64-bit data descriptor)."""
        return self.size >= ZIP64_LIMIT or self.header_offset >= ZIP64_LIMIT


def _zip64_extra(size: int | None, compressed: int | None, offset: int | None) -> bytes:
    values = [v for v in (size, compressed, offset) if v is not None]
    return struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values) if values else b""


def _local_extra(name_len: int, size: int, header_offset: int) -> bytes:
    """zip64 fields (miniz) then torch's ``FB`` padding field that aligns the data."""
    big_size, big_offset = size >= ZIP64_LIMIT, header_offset >= ZIP64_LIMIT
    # Compressed size is written as 0 here: miniz fills the local field before compressing.
    zip64 = _zip64_extra(size if big_size else None, 0 if big_size else None, header_offset if big_offset else None)
    start = header_offset + _LOCAL.size + name_len + len(zip64) + 4
    padding = -start % ALIGNMENT
    return zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding


def _descriptor_size(size: int, zip64: bool) -> int:
    return 0 if size == 0 else (24 if zip64 else 16)


def layout(records: Sequence[tuple[str, int]], start: int = 0) -> list[RecordLayout]:
    """Lay out records (full name, size) one after another from offset `start`."""
    result = []
    offset = start
    for name, size in records:
        if size < 0:
            raise ValueError(f"record {name} has negative size {size}")
        encoded = name.encode("utf-8")
        data_offset = offset + _LOCAL.size + len(encoded) + len(_local_extra(len(encoded), size, offset))
        entry = RecordLayout(name, size, offset, data_offset, 0)
        end = data_offset + size + _descriptor_size(size, entry.zip64)
        result.append(RecordLayout(name, size, offset, data_offset, end))
        offset = end
    return result


def local_header(record: RecordLayout) -> bytes:
    """The local file header, name and extra fields: everything before the record's data."""
    name = record.name.encode("utf-8")
    flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if record.size else 0)
    extra = _local_extra(len(name), record.size, record.header_offset)
    header = _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra
    if record.header_offset + len(header) != record.data_offset:
        raise AssertionError(f"layout of {record.name} does not match its header")
    return header


def data_descriptor(record: RecordLayout, crc: int) -> bytes:
    """What follows the data: signature, CRC-32 and sizes (none for an empty record)."""
    if record.size == 0:
        return b""
    if record.zip64:
        return struct.pack("<IIQQ", 0x08074B50, crc, record.size, record.size)
    return struct.pack("<IIII", 0x08074B50, crc, record.size, record.size)


def _central_entry(record: RecordLayout, crc: int) -> bytes:
    name = record.name.encode("utf-8")
    big_size, big_offset = record.size >= ZIP64_LIMIT, record.header_offset >= ZIP64_LIMIT
    extra = _zip64_extra(
        record.size if big_size else None,
        record.size if big_size else None,
        record.header_offset if big_offset else None,
    )
    flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if record.size else 0)
    size32 = min(record.size, ZIP64_LIMIT)
    return (
        _CENTRAL.pack(
            0x02014B50,
            0,
            0,
            flags,
            0,
            0,
            0,
            crc if record.size else 0,
            size32,
            size32,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            min(record.header_offset, ZIP64_LIMIT),
        )
        + name
        + extra
    )


def directory(records: Sequence[RecordLayout], crcs: Sequence[int]) -> bytes:
    """Central directory, zip64 end record and locator, end record: the archive's tail.

    torch always writes the zip64 end records (miniz runs in zip64 mode from the start).
    """
    if len(records) != len(crcs):
        raise ValueError("one CRC per record is needed")
    start = records[-1].end_offset if records else 0
    central = b"".join(_central_entry(r, c) for r, c in zip(records, crcs))
    count = len(records)
    zip64_end = _ZIP64_END.pack(
        0x06064B50, _ZIP64_END.size - 12, 0x031E, 0x002D, 0, 0, count, count, len(central), start
    )
    locator = _ZIP64_LOCATOR.pack(0x07064B50, 0, start + len(central), 1)
    end = _END.pack(
        0x06054B50,
        0,
        0,
        min(count, 0xFFFF),
        min(count, 0xFFFF),
        min(len(central), ZIP64_LIMIT),
        min(start, ZIP64_LIMIT),
        0,
    )
    return central + zip64_end + locator + end


def directory_size(records: Sequence[RecordLayout]) -> int:
    """Length of :func:`directory` (it does not depend on the CRCs)."""
    return len(directory(records, [0] * len(records)))
