"""CRC-32 checks of the zip records whose bytes a job uses.

Why: torch stores a CRC-32 for every record of a ``torch.save`` archive, and a flipped bit in a
tensor's data is invisible to every other check (sizes, offsets and the pickle stay intact).
A job that reads tensor bytes hands them to a :class:`RecordChecker` as it reads them; before
the job commits its output, :meth:`RecordChecker.finish` reads whatever part of each touched
record was not seen (bytes moved by the kernel, padding the job skipped) and compares. Bytes
are read once in the usual case: pieces are checksummed where they were read, in any order
and on any thread, and joined with :func:`crc32_combine`.

Raw swap files and safetensors files carry no checksum: nothing is checked for them.
"""

from __future__ import annotations

import array
import bisect
import os
import struct
import threading
import zipfile
import zlib
from dataclasses import dataclass, field

from ..core.errors import CorruptFileError
from .interrupts import uninterrupted
from .jobs import JobSync, share_of
from .workers import WorkerPool

_READ_BYTES = 1 << 20  # checksum reads go through a cache-sized buffer
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_ZIP_MAGIC = b"PK\x03\x04"
_POLY = 0xEDB88320  # the reflected CRC-32 polynomial (zlib's)
_GAP_SPLIT_BYTES = 64 << 20  # unread bytes a job shares out are cut this fine (balance)


# --- combining CRCs ---------------------------------------------------------------------------


def _times(matrix: list[int], vector: int) -> int:
    """A 32x32 GF(2) matrix (as 32 column words) times a 32-bit vector."""
    total, index = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[index]
        vector >>= 1
        index += 1
    return total


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


def _shift_operators() -> list[list[int]]:
    """operator[k] appends 2**k zero bytes to a CRC's message (zlib's crc32_combine matrices)."""
    one_bit = [_POLY] + [1 << n for n in range(31)]
    operator = _square(_square(_square(one_bit)))  # 8 zero bits: one zero byte
    table = [operator]
    for _ in range(63):
        operator = _square(operator)
        table.append(operator)
    return table


_SHIFTS: list[list[int]] | None = None


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of A + B from crc(A), crc(B) and len(B), as zlib's crc32_combine.

    >>> crc32_combine(zlib.crc32(b"zero"), zlib.crc32(b" checkpoint"), 11) == zlib.crc32(b"zero checkpoint")
    True
    """
    global _SHIFTS
    if length2 <= 0:
        return crc1
    if _SHIFTS is None:
        _SHIFTS = _shift_operators()
    bit = 0
    while length2:
        if length2 & 1:
            crc1 = _times(_SHIFTS[bit], crc1)
        length2 >>= 1
        bit += 1
    return crc1 ^ crc2


# --- the records of one archive ---------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One stored zip record: its data lies at [start, start + size) and must hash to crc."""

    name: str
    start: int
    size: int
    crc: int

    @property
    def end(self) -> int:
        return self.start + self.size


# The records of archives the torch file reader parsed already (its zip directory read and every
# header checked): path -> (the file's identity then, its records). A ZeRO-3 model-states file
# holds a record per param (hundreds), so parsing a directory again costs as much as reading the
# pickle: the survey's copy check, a job's CRC checks and verify's would each do it once more.
_REMEMBERED: dict[str, tuple[tuple[int, ...], tuple[Record, ...]]] = {}
_REMEMBER_AT_MOST = 1 << 17


def _identity(stat: os.stat_result) -> tuple[int, ...]:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def remember_records(path: str, stat: os.stat_result, records: list[tuple[str, int, int, int]]) -> None:
    """What :func:`archive_records` would find in the zip archive at `path` (whose ``fstat``
    is `stat`), from a reader that parsed its directory and checked every header: (name, data
    offset, size, CRC-32) of each stored, nonempty record. Used while the file is unchanged."""
    if len(_REMEMBERED) >= _REMEMBER_AT_MOST:
        _REMEMBERED.clear()
    found = tuple(sorted((Record(*r) for r in records), key=lambda r: r.start))
    _REMEMBERED[path] = (_identity(stat), found)


def forget_records() -> None:
    """Drop what :func:`remember_records` kept (each operation starts afresh)."""
    _REMEMBERED.clear()


def archive_records(path: str) -> tuple[Record, ...]:
    """The stored records of a zip archive, by data offset; () for a file that is not a zip
    (raw swap files, safetensors: they carry no checksum). Structure problems are the
    parser's to report (torchfile.load): records that cannot be located are left out."""
    known = _REMEMBERED.get(path)
    if known is not None:
        try:
            if _identity(os.stat(path)) == known[0]:
                return known[1]
        except OSError:
            pass
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != _ZIP_MAGIC:
                return ()
            with uninterrupted(zipfile.ZipFile, handle) as archive:
                records = []
                for info in archive.infolist():
                    if info.compress_type != zipfile.ZIP_STORED or info.file_size == 0:
                        continue
                    handle.seek(info.header_offset)
                    header = handle.read(_LOCAL_HEADER.size)
                    if len(header) != _LOCAL_HEADER.size or header[:4] != _ZIP_MAGIC:
                        continue
                    fields = _LOCAL_HEADER.unpack(header)
                    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
                    records.append(Record(info.filename, start, info.file_size, info.CRC))
    # NotImplementedError: zipfile's answer to a damaged "version needed to extract" field
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
        return ()
    return tuple(sorted(records, key=lambda r: r.start))


@dataclass(frozen=True)
class RepeatedRank:
    """A rank file whose records repeat an earlier rank's file byte for byte (sizes and CRC-32s).

    `telling` is True where honest ranks cannot hold those bytes twice: one file was copied over
    the other. It is False where they can: the file holds no partition of its own (only state
    every rank keeps alike, such as buffers), or each repeated partition record is one value
    repeated (constant params, zero moments), which honest ranks' slices of it share."""

    rank: int
    path: str
    other: int
    other_path: str
    partitioned: bool  # the comparison was of the file's own partitions, not of all its tensors
    telling: bool


def repeated_ranks(files: dict[int, tuple[str, list[tuple[int, int]]]]) -> list[RepeatedRank]:
    """The rank files (rank -> path and the (byte offset, element size) of each tensor that is
    that rank's own partition) whose partition records repeat an earlier rank's, from the zip
    directories. Every partition record counts, however small: a size cut would leave only the
    replicated records, the same on every honest rank. A file holding no partition record is
    compared by all its tensor records and never tells. Data is read only for a repeat, to see
    whether its records are constant runs (see RepeatedRank)."""
    seen: dict[tuple, tuple[int, str]] = {}
    repeats = []
    for rank, (path, parts) in sorted(files.items()):
        records = [r for r in archive_records(path) if "/data/" in r.name]
        own = _holding(records, parts)
        key = (bool(own), tuple((r.size, r.crc) for r, _ in own) if own else tuple((r.size, r.crc) for r in records))
        if not key[1]:
            continue
        other, other_path = seen.setdefault(key, (rank, path))
        if other != rank:
            telling = bool(own) and not all(_constant_run(path, record, size) for record, size in own)
            repeats.append(RepeatedRank(rank, path, other, other_path, bool(own), telling))
    return repeats


def _holding(records: list[Record], parts: list[tuple[int, int]]) -> list[tuple[Record, int]]:
    """The records (by data offset, each once) that hold the tensors at `parts`, with the
    element size of the first tensor found in each."""
    starts = [r.start for r in records]
    held: dict[int, tuple[Record, int]] = {}
    for offset, size in parts:
        i = bisect.bisect_right(starts, offset) - 1
        if i >= 0 and offset < records[i].end:
            held.setdefault(i, (records[i], size))
    return [held[i] for i in sorted(held)]


def _constant_run(path: str, record: Record, size: int) -> bool:
    """Whether the record holds one `size`-byte element repeated (read until it differs)."""
    if size < 1 or record.size % size:
        return False
    try:
        with open(path, "rb") as handle:
            handle.seek(record.start)
            first = handle.read(size)
            if len(first) != size:
                return False
            handle.seek(record.start)
            pattern = first * (_READ_BYTES // size)
            left = record.size
            while left:
                chunk = handle.read(min(left, len(pattern)))
                if not chunk or chunk != pattern[: len(chunk)]:
                    return False
                left -= len(chunk)
    except OSError:
        return False
    return True


# --- the checker --------------------------------------------------------------------------------


@dataclass
class _Seen:
    """Pieces of one record already checksummed: (offset in record, length, crc). A piece that
    meets another end to start is joined with it as it comes (:func:`crc32_combine`): a record
    read in thousands of slices (a ZeRO-3 rank's partition, a slice per param and output file)
    keeps a few runs until the job's end, not a tuple per slice.

    The runs are three sorted int64 columns (24 bytes a run): a run stays apart where no output
    reads the bytes after it (a ZeRO-3 rank's padding slot of each param smaller than the world
    size, thousands of slots a record at 4,096 ranks), so a record may keep hundreds of runs
    until :meth:`RecordChecker.finish` reads the gaps; as dict entries they cost ~250 bytes each
    and were most of `to-universal`'s memory there."""

    record: Record
    _starts: array.array = field(default_factory=lambda: array.array("q"))
    _lengths: array.array = field(default_factory=lambda: array.array("q"))
    _crcs: array.array = field(default_factory=lambda: array.array("q"))
    _others: list[tuple[int, int, int]] = field(default_factory=list)  # overlapping pieces, as read

    def add(self, start: int, length: int, crc: int) -> None:
        end = start + length
        starts, lengths, crcs = self._starts, self._lengths, self._crcs
        at = bisect.bisect_right(starts, start)  # runs [at:] start after `start`
        joins_before = at > 0 and starts[at - 1] + lengths[at - 1] == start
        if (
            length <= 0
            or (at > 0 and starts[at - 1] + lengths[at - 1] > start)  # overlaps the run before
            or (at < len(starts) and starts[at] < end)  # overlaps the run after
        ):
            self._others.append((start, length, crc))  # read twice: kept apart
            return
        if at < len(starts) and starts[at] == end:  # joins the run after
            crc = crc32_combine(crc, crcs[at], lengths[at])
            length += lengths[at]
            del starts[at], lengths[at], crcs[at]
        if joins_before:
            crcs[at - 1] = crc32_combine(crcs[at - 1], crc, length)
            lengths[at - 1] += length
        else:
            starts.insert(at, start)
            lengths.insert(at, length)
            crcs.insert(at, crc)

    @property
    def pieces(self) -> list[tuple[int, int, int]]:
        return list(zip(self._starts, self._lengths, self._crcs)) + self._others


def checksum_range(fd: int, path: str, position: int, count: int) -> int:
    """CRC-32 of `count` bytes of `fd` (the file at `path`) at `position`, through a buffer
    small enough to stay in the CPU cache (page-cache pages cost less read than mapped)."""
    buffer = bytearray(min(count, _READ_BYTES))
    view = memoryview(buffer)
    crc, end = 0, position + count
    while position < end:
        got = os.preadv(fd, [view[: min(len(buffer), end - position)]], position)
        if got <= 0:
            raise CorruptFileError(path, f"truncated: file ends at offset {position}, inside a record")
        crc = zlib.crc32(view[:got], crc)
        position += got
    return crc


class RecordChecker:
    """Collects checksums of the bytes a job read, per zip record, and checks each touched
    record whole at :meth:`finish`. Thread-safe: one checker serves every reader of a job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[str, tuple[tuple[Record, ...], list[int]]] = {}
        self._seen: dict[tuple[str, int], _Seen] = {}
        self._verified: set[tuple[str, int]] = set()  # records checked already: not again
        self.records_checked = 0
        self.bytes_checked = 0

    def _table(self, path: str) -> tuple[tuple[Record, ...], list[int]]:
        table = self._tables.get(path)
        if table is None:
            records = archive_records(path)
            table = (records, [r.start for r in records])
            with self._lock:
                self._tables.setdefault(path, table)
        return table

    def _overlaps(self, path: str, offset: int, length: int) -> list[Record]:
        records, starts = self._table(path)
        found = []
        index = max(0, bisect.bisect_right(starts, offset) - 1)
        while index < len(records) and records[index].start < offset + length:
            if records[index].end > offset:
                found.append(records[index])
            index += 1
        return found

    def _add(self, path: str, record: Record, start: int, length: int, crc: int | None) -> None:
        key = (path, record.start)
        with self._lock:
            if key in self._verified:
                return
            seen = self._seen.get(key)
            if seen is None:
                seen = self._seen[key] = _Seen(record)
            if crc is not None:
                seen.add(start, length, crc)

    def feed(self, path: str, offset: int, data: memoryview | bytes) -> None:
        """Bytes of `path` read at `offset`: checksum the parts that lie inside records."""
        for record in self._overlaps(path, offset, len(data)):
            if (path, record.start) in self._verified:
                continue
            low, high = max(offset, record.start), min(offset + len(data), record.end)
            piece = memoryview(data)[low - offset : high - offset]
            self._add(path, record, low - record.start, high - low, zlib.crc32(piece))

    def feed_crc(self, path: str, offset: int, length: int, crc: int) -> None:
        """The CRC of bytes [offset, offset + length) of `path`, computed by the caller while
        it used them; a range that is not inside one record is checked at finish instead."""
        records = self._overlaps(path, offset, length)
        if len(records) == 1 and records[0].start <= offset and offset + length <= records[0].end:
            self._add(path, records[0], offset - records[0].start, length, crc)
        else:
            self.touch(path, offset, length)

    def touch(self, path: str, offset: int, length: int) -> None:
        """Bytes used without being read here (a kernel-side copy): checked at finish."""
        for record in self._overlaps(path, offset, length):
            self._add(path, record, 0, 0, None)

    def finish(self, workers: int = 2, job: JobSync | None = None) -> None:
        """Check every touched record whole; CorruptFileError naming the first bad one.

        With a `job` of several processes (torchrun), every process calls this at the same
        point: the records any of them touched are checked together, each byte read by one
        process (see :meth:`_finish_in_job`), and every process raises the same error."""
        if job is not None and not job.alone:
            self._finish_in_job(job)
            return
        with self._lock:
            pending = list(self._seen.items())
            self._seen.clear()
        if not pending:
            return
        if workers > 1 and len(pending) > 1:
            with WorkerPool(workers, "zckpt-crc") as pool:
                results = list(pool.map(lambda item: self._check(item[0][0], item[1]), pending))
        else:
            results = [self._check(key[0], seen) for key, seen in pending]
        for problem in results:
            if problem is not None:
                raise problem
        with self._lock:
            self._verified.update(key for key, _ in pending)
            self.records_checked += len(pending)
            self.bytes_checked += sum(seen.record.size for _, seen in pending)

    def _finish_in_job(self, job: JobSync) -> None:
        """The job-wide check. Why: a record split between processes (a ZeRO-3 flat partition
        that several output files copy parts of) would otherwise be read whole by each of them
        to be checked. Instead each process shares the CRCs of the pieces it read; the bytes no
        process read (padding, overlaps) are shared out by size and read by one process each;
        every process then joins each record's pieces (crc32_combine) and compares. Three
        collectives: a barrier (a failed process ends it, before any gather), and two gathers
        between which nothing raises."""
        job()
        with self._lock:
            pending = list(self._seen.items())
            self._seen.clear()
        mine = {key: (seen.record, _joined(seen.pieces)) for key, seen in pending}
        records: dict[tuple[str, int], Record] = {}
        pieces: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        for found in job.gather(mine):
            for key, (record, joined) in found.items():
                records.setdefault(key, record)
                pieces.setdefault(key, []).extend(joined)
        keys = sorted(records)
        covers = {key: _cover(records[key].size, pieces[key]) for key in keys}
        gaps = [(key, start, length) for key in keys for start, length in covers[key][1]]
        owner = share_of([length for _, _, length in gaps], job.part, job.parts)
        read, problems = {}, []
        for index in owner:
            key, start, length = gaps[index]
            found = piece_crc(key[0], records[key], start, length)
            if isinstance(found, CorruptFileError):
                problems.append((index, found.path, found.problem))
            else:
                read[index] = found
        found_crcs: dict[int, int] = {}
        found_problems = []
        for crcs, bad in job.gather((read, problems)):
            found_crcs.update(crcs)
            found_problems.extend(bad)
        if found_problems:
            _, path, problem = min(found_problems)
            raise CorruptFileError(path, problem)
        gap_crcs = {(gaps[i][0], gaps[i][1]): crc for i, crc in found_crcs.items()}
        for key in keys:
            record = records[key]
            parts = covers[key][0] + [(s, n, gap_crcs[key, s]) for s, n in covers[key][1]]
            crc = 0
            for _, length, part_crc in sorted(parts):
                crc = crc32_combine(crc, part_crc, length)
            if crc != record.crc:
                raise crc_mismatch(key[0], record, crc)
        with self._lock:
            self._verified.update(keys)
            self.records_checked += len(keys)
            self.bytes_checked += sum(records[key].size for key in keys)

    @staticmethod
    def _check(path: str, seen: _Seen) -> CorruptFileError | None:
        record, crc, position = seen.record, 0, 0
        fd = None
        try:
            for start, length, piece_crc in sorted(seen.pieces):
                end = start + length
                if end <= position:
                    continue  # bytes read twice: counted once
                if start > position:  # a gap: bytes the job did not read here
                    fd = fd if fd is not None else os.open(path, os.O_RDONLY)
                    crc = crc32_combine(
                        crc, checksum_range(fd, path, record.start + position, start - position), start - position
                    )
                    position = start
                if start < position:  # overlaps the last piece: read its new part again
                    fd = fd if fd is not None else os.open(path, os.O_RDONLY)
                    piece_crc = checksum_range(fd, path, record.start + position, end - position)
                crc = crc32_combine(crc, piece_crc, end - position)
                position = end
            if position < record.size:
                fd = fd if fd is not None else os.open(path, os.O_RDONLY)
                crc = crc32_combine(
                    crc,
                    checksum_range(fd, path, record.start + position, record.size - position),
                    record.size - position,
                )
        except CorruptFileError as exc:
            return exc
        except OSError as exc:
            return CorruptFileError(path, f"cannot read record {record.name}: {exc.strerror or exc}")
        finally:
            if fd is not None:
                os.close(fd)
        if crc != record.crc:
            return crc_mismatch(path, record, crc)
        return None


def crc_mismatch(path: str, record: Record, crc: int) -> CorruptFileError:
    """The error of a record whose data hashes to `crc`, not to its stored CRC-32."""
    return CorruptFileError(
        path,
        f"record {record.name} fails its CRC-32 check (stored {record.crc:08x}, data {crc:08x}): the data is corrupted",
    )


def piece_crc(path: str, record: Record, offset: int, length: int) -> int | CorruptFileError:
    """The CRC-32 of bytes [offset, offset + length) of `record` in `path`, or the problem
    reading them (returned, not raised: a job's processes gather it before anyone raises)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return checksum_range(fd, path, record.start + offset, length)
        finally:
            os.close(fd)
    except CorruptFileError as exc:
        return exc
    except OSError as exc:
        return CorruptFileError(path, f"cannot read record {record.name}: {exc.strerror or exc}")


def _joined(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """A process's pieces of one record, those that follow each other joined into one (fewer
    to send); a piece overlapping the one before is dropped (its bytes count as unread)."""
    joined: list[tuple[int, int, int]] = []
    for start, length, crc in sorted(pieces):
        if joined and joined[-1][0] + joined[-1][1] == start:
            first, first_length, first_crc = joined[-1]
            joined[-1] = (first, first_length + length, crc32_combine(first_crc, crc, length))
        elif not joined or joined[-1][0] + joined[-1][1] < start:
            joined.append((start, length, crc))
    return joined


def _cover(size: int, pieces: list[tuple[int, int, int]]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Pieces that tile a record of `size` bytes without overlapping, and the gaps they leave
    ((start, length), cut to at most _GAP_SPLIT_BYTES each)."""
    used, gaps, position = [], [], 0
    for start, length, crc in sorted(pieces, key=lambda p: (p[0], -p[1])):
        if start < position or length <= 0:
            continue
        if start > position:
            gaps.append((position, start - position))
        used.append((start, length, crc))
        position = start + length
    if position < size:
        gaps.append((position, size - position))
    cut = [(s + o, min(_GAP_SPLIT_BYTES, n - o)) for s, n in gaps for o in range(0, n, _GAP_SPLIT_BYTES)]
    return used, cut


def check_archive(path: str, workers: int = 1) -> tuple[int, int, str | None]:
    """Check every record of one file: (records, bytes checked, the problem or None). A file that
    is not a zip archive has no records and no problem (it carries no checksum)."""
    records = archive_records(path)
    if not records:
        return 0, 0, None
    checker = RecordChecker()
    for record in records:
        checker.touch(path, record.start, record.size)
    try:
        checker.finish(workers=workers)
    except CorruptFileError as exc:
        return len(records), 0, str(exc)
    return len(records), checker.bytes_checked, None
