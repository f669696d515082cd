"""``zckpt verify``: judge a checkpoint, universal folder or weights output before anyone runs on it.

`inspect` describes; this reads every byte and says yes or no. Checks, in order: every file the
layout needs is present and parses (the reader's survey: world size, tag, version and sizes
agree across ranks, ZeRO-1/2 rank files hold the partition their name says), every zip record
matches its CRC-32, optimizer moments are zero in each rank's padding (a file holding data
there belongs to another rank), no two rank files are copies of each other, every param has
the optimizer states of its group, no leftovers of an interrupted zckpt run, and with `scan`
no NaN or Inf anywhere. It also says what each zckpt operation on the input would need.

What no check can tell is said, not hidden: raw NVMe swap files carry no checksum, and the fp32
padding is uninitialised memory (DeepSpeed never clears it), so ZeRO-3 rank files of a model
whose every param divides by the world size cannot be told apart.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np

from ..core.dtypes import BF16, FP16, FP32, DType
from ..core.errors import CheckpointNotFoundError, CorruptFileError, UsageError, ZckptError
from ..core.index import CheckpointIndex, Entry, Segment, TensorSource
from ..core.sizes import format_size
from ..core.state import TrainingState
from ..deepspeed import swap_folder as swap
from ..deepspeed.reader import survey
from ..deepspeed.survey import Survey
from ..deepspeed.zenflow import overlapped as zenflow_overlapped
from ..deepspeed.zenflow import topk_ratio, unsaved_moments_note, zenflow_settings
from ..io.checksums import Record, RecordChecker, archive_records, crc32_combine, crc_mismatch, piece_crc
from ..io.jobs import JobSync, job_share, share_of
from ..io.materialize import CHUNK_BYTES
from ..io.output import find_leftovers
from ..io.reading import FileReader, read_range
from ..io.workers import WorkerPool
from ..torchfile.legacy import is_legacy_torch_file
from .classify import Kind, classify
from .replicas import (
    replica_problems,
    rounded_copy_problems,
    rounding_difference,
    state_copy_problems,
    zenflow_difference,
)
from .tensor_sources import open_tensors

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Check:
    """One verdict: `ok` False when it found a problem, None when it could not be run."""

    name: str
    ok: bool | None
    detail: str


@dataclass(frozen=True)
class Need:
    """What one zckpt operation on this input needs: disk for its output, memory at peak."""

    operation: str
    disk_bytes: int
    memory_bytes: int


@dataclass(frozen=True)
class VerifyReport:
    path: str
    kind: str  # "deepspeed_checkpoint", "universal_checkpoint" or "weights"
    checks: tuple[Check, ...]
    problems: tuple[str, ...]  # each names a file and what is wrong with it
    notes: tuple[str, ...] = ()
    needs: tuple[Need, ...] = ()
    files: int = 0
    bytes: int = 0
    scanned: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


@dataclass
class _Findings:
    checks: list[Check] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, problems: list[str], passed: str, *, skipped: str | None = None) -> None:
        if skipped is not None:
            self.checks.append(Check(name, None, skipped))
            return
        self.problems.extend(problems)
        self.checks.append(
            Check(name, not problems, passed if not problems else f"{len(problems)} problem{'s' * (len(problems) > 1)}")
        )


def verify(
    path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    scan: bool = False,
    workers: int = 2,
    checkpoint: str | os.PathLike[str] | None = None,
    swap_folder: str | os.PathLike[str] | None = None,
    tp_rules: str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Check `path` (a ZeRO checkpoint folder or tag folder, a universal folder, consolidated
    weights: a folder, a .safetensors, a .index.json or a torch .bin, or a live ZeRO-Infinity
    swap folder) and report every problem. A swap folder is checked against the layout of
    `checkpoint`; ``verify(CHECKPOINT, swap_folder=NVME_PATH)`` is the same check. `tp_rules`: a
    ``--tp-rules`` file, for a tensor-parallel run that records no merge rules.

    Under torchrun (``WORLD_SIZE`` > 1) the processes share the reading, sizes balanced: the
    module weights compared with their masters, with `scan` the tensors, and the rest of every
    record for its CRC-32 check, so each byte is read by one process. The checks that read
    metadata only (the files' pickles, the copies of replicated params) run on every process.
    Every process returns the report one process alone would give."""
    path = os.fspath(path)
    _, _, job = job_share(path)
    try:
        report = _verify(path, tag, scan, workers, checkpoint, swap_folder, tp_rules, job)
        job()  # every process has its report (or hears that one failed)
    except BaseException:
        job.fail()
        raise
    return report


def _verify(
    path: str,
    tag: str | None,
    scan: bool,
    workers: int,
    checkpoint: str | os.PathLike[str] | None,
    swap_folder: str | os.PathLike[str] | None,
    tp_rules: str | os.PathLike[str] | None,
    job: JobSync,
) -> VerifyReport:
    found = classify(path)
    if found.kind is Kind.MISSING:
        raise CheckpointNotFoundError(path, "no such file or directory")
    if swap_folder is not None:
        if checkpoint is not None:
            raise UsageError(
                path,
                "give the checkpoint either as PATH with --swap-folder, or with --checkpoint and the swap folder as PATH",
            )
        return _verify_swap_folder(os.fspath(swap_folder), path, tag, scan, workers, job)
    if found.kind is Kind.SWAP_FOLDER:
        return _verify_swap_folder(path, checkpoint, tag, scan, workers, job)
    if checkpoint is not None:
        raise UsageError(path, "--checkpoint goes with a swap folder as PATH (<nvme_path> or its zero_stage_3/)")
    if not found.is_checkpoint:
        return _verify_weights(path, scan, workers, job)
    return _verify_checkpoint(path, tag, scan, workers, job, tp_rules)


# --- ZeRO checkpoints and universal folders ---------------------------------------------------


def _verify_checkpoint(
    path: str, tag: str | None, scan: bool, workers: int, job: JobSync, tp_rules: str | os.PathLike[str] | None = None
) -> VerifyReport:
    found = survey(path, tag, tp_rules=tp_rules)
    findings = _Findings()
    kind = "universal_checkpoint" if found.universal else "deepspeed_checkpoint"
    files = _tag_files(found)
    findings.add(
        "layout",
        [str(p) for p in found.problems],
        f"ZeRO-{found.zero_stage}, world size {found.world_size}, {len(found.files)} rank files consistent"
        if not found.universal
        else "every param has its folder and states, shapes match the model states",
    )
    folder = found.location.checkpoint_dir if found.location is not None else path if os.path.isdir(path) else None
    if folder is not None:  # no location: `latest` names a missing tag (a run killed while replacing it?)
        findings.add(
            "leftovers",
            [left.describe() for left in find_leftovers(folder) if left.alive is False],
            "no leftovers of an interrupted zckpt run",
        )
    # the checks that read tensors go first, their reads fed to the CRC-32 checks (each byte read once)
    checker = RecordChecker()
    state = found.state
    judged = state is not None and not found.universal  # the checks of rank files' copies
    copies = state.index.rounded_copies if state is not None and judged else ()
    zenflow = zenflow_settings(state.ds_config) if state is not None else None
    # ZenFlow with overlap_step: the 16-bit weights are a step behind the masters (zenflow.overlapped)
    overlapped = zenflow_overlapped(zenflow)
    if copies and zenflow is None:
        differences = _rounding_differences(copies, workers, job, checker)
    elif copies and not overlapped:
        differences = _zenflow_differences(copies, zenflow, state.index.topology.dp, workers, job, checker)
    else:
        differences = []
    replicas = _replica_problems(state.index, workers, job, checker) if state is not None and judged else []
    held = _state_copy_problems(state, workers, job, checker) if state is not None and judged else []
    sources = _checkpoint_sources(found) if scan else []
    values = _scan(sources, workers, job, checker) if scan else []
    _check_crcs(files, findings, workers, job, checker)
    if state is not None and judged:
        _check_identity(found, findings)
        _check_optimizer_state(found, findings)
        if state.index.replicas:
            count = len(state.index.replicas)
            findings.add(
                "replicas",
                replicas,
                f"{count} cop{'ies' if count != 1 else 'y'} of params that several ranks keep "
                "(tied across pipeline stages, replicated across tensor ranks) equal the one written",
            )
        if state.state_copies:
            count = len(state.state_copies)
            findings.add(
                "state copies",
                held,
                f"{count} further cop{'ies' if count != 1 else 'y'} of optimizer states that several ranks "
                "keep whole (DeepSpeed's Muon momentum of a param two partitions touch) equal the one read",
            )
        moments = unsaved_moments_note(state.ds_config)
        if moments and not state.state_names:  # a ZenFlow overlap_step run's moments are in no file
            findings.notes.append(moments)
        if copies and overlapped:
            findings.add(
                "module weights",
                [],
                "",
                skipped="not run: a ZenFlow run with overlap_step (zero_optimization.zenflow) steps its masters in "
                "another process while the 16-bit weights hold the step before, so they are not the masters rounded",
            )
        elif copies and zenflow is not None:
            flat = sum(1 for copy, _ in copies if len(copy.source.shape) != 2)
            findings.add(
                "module weights",
                rounded_copy_problems(state.index, differences=differences, zenflow=True),
                f"{len(copies) - flat} 2-D weights of the module are their masters rounded outside the few columns "
                f"(topk_ratio {topk_ratio(zenflow)}) that ZenFlow's selective optimizer updates; "
                f"{flat} of other shapes, which it updates whole, not judged",
            )
        elif copies:
            kinds = sorted({copy.source.dtype.name for copy, _ in copies})
            findings.add(
                "module weights",
                rounded_copy_problems(state.index, differences=differences),
                f"{len(copies)} {'/'.join(kinds)} weights of the module (model-states, layer and expert files) "
                "are their masters rounded (the optimizer's copy of the same step)",
            )
    elif state is None:
        # the weights read, the optimizer state not: why (a ZeRO-0 optimizer its files do not name)
        why = f"the optimizer state is not read: {found.state_problem.problem}" if found.state_problem else ""
        for name in ("rank identity", "optimizer state"):
            findings.add(name, [], "", skipped="not run: " + (why or "the layout has problems"))
    if scan:
        findings.add("values", values, f"no NaN or Inf in {len(sources)} tensors")
    needs = _needs(found) if found.complete else ()
    return VerifyReport(
        path,
        kind,
        tuple(findings.checks),
        tuple(dict.fromkeys(findings.problems)),
        tuple(findings.notes),
        tuple(needs),
        files=len(files),
        bytes=sum(_size(f) for f in files),
        scanned=scan,
    )


def _tag_files(found: Survey) -> list[str]:
    """Every file of the tag folder (rank files, offloaded_tensors/, universal zero/)."""
    if found.location is None:
        return []
    listed = []
    for root, dirs, names in os.walk(found.location.tag_dir):
        dirs.sort()
        listed.extend(os.path.join(root, n) for n in sorted(names) if not n.startswith("."))
    return listed


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _check_crcs(files: list[str], findings: _Findings, workers: int, job: JobSync, checker: RecordChecker) -> None:
    """Every record of every torch archive; files without a checksum are counted and named.

    `checker` holds the CRC-32s of what the other checks read already: the rest of each record
    is read once, by one process of a job (:meth:`RecordChecker.finish`). A record that fails
    makes every archive be read again in pieces, to name each damaged file's first bad record."""

    torch_files = [f for f in files if f.endswith((".pt", ".pth", ".bin"))]
    legacy = [f for f in torch_files if is_legacy_torch_file(f)]  # no CRC in that format
    archives = [f for f in torch_files if f not in legacy]
    unchecked = [f for f in files if f not in torch_files]
    tables = [archive_records(path) for path in archives]
    for path, records in zip(archives, tables):
        for record in records:
            checker.touch(path, record.start, record.size)
    try:
        checker.finish(max(1, workers), job=job)
        results: list[tuple[int, int, str | None]] = [(len(t), sum(r.size for r in t), None) for t in tables]
    except CorruptFileError:  # every process of a job hears it: they read again together
        results = _archive_crcs(archives, workers, job)
    problems = [problem for _, _, problem in results if problem]
    records = sum(r for r, _, _ in results)
    checked = sum(b for _, b, _ in results)
    if archives:
        findings.add(
            "checksums",
            problems,
            f"{records} records in {len(archives)} files match their CRC-32 ({format_size(checked)})",
        )
    elif legacy:
        findings.add("checksums", [], "", skipped="legacy torch.save files only: nothing carries a checksum")
    else:
        findings.add("checksums", [], "", skipped="no torch archives: nothing carries a checksum")
    if legacy:
        findings.notes.append(
            f"{len(legacy)} legacy torch.save files ({format_size(sum(map(_size, legacy)))}) carry no checksum "
            "(the non-zip format, as DeepSpeed writes with checkpoint_serialization false): their pickles and "
            "storage sizes were checked, their bytes cannot be"
        )
    swaps = [f for f in unchecked if f.endswith(".swp")]
    if swaps:
        findings.notes.append(
            f"{len(swaps)} NVMe swap files ({format_size(sum(map(_size, swaps)))}) carry no checksum: their sizes were checked, their bytes cannot be"
        )


_PIECE_BYTES = 32 << 20  # records are checked in pieces this big at most (threads and processes share them)


def _archive_crcs(archives: list[str], workers: int, job: JobSync) -> list[tuple[int, int, str | None]]:
    """:func:`~zckpt.io.checksums.check_archive` of each file: (records, bytes checked, the first
    bad record's problem or None). The records are cut into pieces shared between the threads
    and the job's processes (each byte read once), whose CRC-32s are joined per record."""
    tables = [archive_records(path) for path in archives]
    pieces = [
        (path, record, offset, min(_PIECE_BYTES, record.size - offset))
        for path, records in zip(archives, tables)
        for record in records
        for offset in range(0, record.size, _PIECE_BYTES)
    ]
    crcs = iter(_shared(_piece_crc, pieces, [length for _, _, _, length in pieces], workers, job))
    results = []
    for path, records in zip(archives, tables):
        problem = None
        for record in records:
            crc, bad = 0, None
            for offset in range(0, record.size, _PIECE_BYTES):
                piece = next(crcs)
                if isinstance(piece, str):
                    bad = bad or piece
                else:
                    crc = crc32_combine(crc, piece, min(_PIECE_BYTES, record.size - offset)) if offset else piece
            if bad is None and crc != record.crc:
                bad = str(crc_mismatch(path, record, crc))
            problem = problem or bad
        results.append((len(records), 0 if problem else sum(r.size for r in records), problem))
    return results


def _piece_crc(piece: tuple[str, Record, int, int]) -> int | str:
    """The CRC-32 of one piece of a record, or the problem reading it (as the record check says it)."""
    found = piece_crc(*piece)
    return str(found) if isinstance(found, CorruptFileError) else found


def _shared(work: Callable[[T], R], items: list[T], sizes: list[int], workers: int, job: JobSync) -> list[R]:
    """`work` of every item, in order, on every process; each process of a torchrun job does its
    share (sizes balanced, the same split everywhere) on `workers` threads, and the results are
    gathered. `work` says a problem in its result rather than raising (a process that raises
    stops the job at the barrier before the gather)."""
    mine = share_of(sizes, job.part, job.parts)
    with WorkerPool(max(1, workers), "zckpt-verify") as pool:
        done = dict(zip(mine, pool.map(work, [items[i] for i in mine])))
    job()
    for found in job.gather(done):
        done.update(found)
    return [done[i] for i in range(len(items))]


def _rounding_differences(
    copies: Sequence[tuple[Entry, Entry]], workers: int, job: JobSync, checker: RecordChecker
) -> list[str | None]:
    """How each 16-bit module weight differs from its master rounded (None: not at all), the
    pairs shared between threads and the job's processes by size; the bytes read are fed to
    `checker` (the checksums check's)."""

    def difference(pair: tuple[Entry, Entry]) -> str | None:
        with FileReader(verify=False, checker=checker) as reader:
            return rounding_difference(reader, pair[1], pair[0])

    return _shared(difference, list(copies), [c.source.nbytes + m.source.nbytes for c, m in copies], workers, job)


def _zenflow_differences(
    copies: Sequence[tuple[Entry, Entry]],
    zenflow: dict,
    partitions: int,
    workers: int,
    job: JobSync,
    checker: RecordChecker,
) -> list[str | None]:
    """:func:`_rounding_differences` of a ZenFlow run: how each 16-bit weight differs from its
    master rounded beyond the columns ZenFlow updates (:func:`~.replicas.zenflow_difference`)."""
    ratio = topk_ratio(zenflow)

    def difference(pair: tuple[Entry, Entry]) -> str | None:
        with FileReader(verify=False, checker=checker) as reader:
            return zenflow_difference(reader, pair[1], pair[0], ratio, partitions)

    return _shared(difference, list(copies), [c.source.nbytes + m.source.nbytes for c, m in copies], workers, job)


def _replica_problems(index: CheckpointIndex, workers: int, job: JobSync, checker: RecordChecker) -> list[str]:
    """:func:`~.replicas.replica_problems`, each copy compared on one thread of one process
    (sizes balanced), the bytes read fed to `checker`."""

    def problems(replica: Entry) -> list[str]:
        with FileReader(verify=False, checker=checker) as reader:
            return replica_problems(replace(index, replicas=(replica,)), reader)

    found = _shared(problems, list(index.replicas), [2 * r.source.nbytes for r in index.replicas], workers, job)
    return [problem for each in found for problem in each]


def _state_copy_problems(state: TrainingState, workers: int, job: JobSync, checker: RecordChecker) -> list[str]:
    """:func:`~.replicas.state_copy_problems`, shared out as :func:`_replica_problems` is."""

    def problems(copy: tuple[str, str, TensorSource]) -> list[str]:
        with FileReader(verify=False, checker=checker) as reader:
            return state_copy_problems(replace(state, state_copies=(copy,)), reader)

    copies = list(state.state_copies)
    found = _shared(problems, copies, [2 * source.nbytes for _, _, source in copies], workers, job)
    return [problem for each in found for problem in each]


def _check_identity(found: Survey, findings: _Findings) -> None:
    """What told rank files apart (the survey refuses a file saved under another rank file's
    name, ZeRO-1/2 files whose param_slice_mappings name another rank, and ZeRO-3 files that
    repeat another rank's partitions), and where nothing can (files saved to a stream, the
    survey's untold copies)."""
    legacy = [p for p in found.unnamed_archives if is_legacy_torch_file(p)]  # the format records no name
    streamed = [p for p in found.unnamed_archives if p not in legacy]
    told = f"{found.named_archives} rank file{'s' * (found.named_archives != 1)} saved under their own names"
    if legacy:
        told += f", {len(legacy)} legacy torch.save file{'s' * (len(legacy) != 1)} (the format records no name)"
    if found.zero_stage in (1, 2):
        told += "; param_slice_mappings name each file's own rank"
    if streamed and found.zero_stage == 3 and (found.world_size or 1) > 1:
        findings.notes.append(
            f"{len(streamed)} ZeRO-3 rank files were saved to a stream (their archive is named "
            f"'archive', e.g. {streamed[0]}): nothing in them tells which rank wrote them"
        )
    if legacy and found.zero_stage == 3 and (found.world_size or 1) > 1:
        findings.notes.append(
            f"{len(legacy)} ZeRO-3 rank files are legacy torch.save files (e.g. {legacy[0]}), which record "
            "neither the name they were saved under nor checksums: nothing in them tells which rank wrote them, "
            "or whether one was copied over another"
        )
    findings.notes.extend(found.untold_copies)
    if not (legacy and found.zero_stage == 3):  # the copy check compares zip records' CRC-32s
        told += "; no optimizer file is a copy of another rank's"
    findings.add("rank identity", [], told)


def _check_optimizer_state(found: Survey, findings: _Findings) -> None:
    """Every trainable param has the states the rest of its param group has."""
    state = found.state
    assert state is not None
    problems = []
    by_group: dict[int, set[str]] = {}
    for param in state.params:
        by_group.setdefault(param.group, set()).update(param.states)
    for param in state.params:
        missing = sorted(by_group[param.group] - set(param.states))
        if missing:
            problems.append(
                f"{found.location.tag_dir if found.location else found.path}: param {param.name} lacks optimizer state {', '.join(missing)} that its group has"
            )
    names = ", ".join(state.state_names) or "none"
    groups = len(state.groups)
    findings.add(
        "optimizer state",
        problems,
        f"{len(state.params)} params, states: {names}; {groups} param group{'s' * (groups != 1)}",
    )


def _checkpoint_sources(found: Survey) -> list[tuple[str, TensorSource]]:
    sources: list[tuple[str, TensorSource]] = []
    if found.index is not None:
        sources += [(e.name, e.source) for e in found.index.entries if e.kind != "tied"]
    if found.state is not None:
        for param in found.state.params:
            sources += [(f"{param.name}.{key}", source) for key, source in param.states.items()]
    return sources


# --- live swap folders -------------------------------------------------------------------------


def _verify_swap_folder(
    path: str, checkpoint: str | os.PathLike[str] | None, tag: str | None, scan: bool, workers: int, job: JobSync
) -> VerifyReport:
    """What can be checked on raw swap files, which carry no checksum: every rank holds the same
    files with the same sizes; with a checkpoint of the run, every file its layout needs is
    there with the partition's size, none is foreign, and the 16-bit param swaps agree with the
    fp32 masters (a difference is reported, not failed: those copies can lag a step); with
    `scan`, no NaN or Inf."""
    folder = swap.scan(path)
    findings = _Findings()
    findings.add(
        "ranks",
        swap.rank_problems(folder),
        f"{len(folder.optimizer_ranks)} rank(s) hold the same files with the same sizes",
    )
    found = survey(checkpoint, tag, path) if checkpoint is not None else None
    if found is None:
        no_layout = "not run: pass --checkpoint, a checkpoint of the same run (any step), for the layout"
        findings.add("layout", [], "", skipped=no_layout)
        findings.add("16-bit params", [], "", skipped=no_layout)
    else:
        findings.add(
            "layout",
            [str(p) for p in found.problems],
            f"every swapped sub-group of {found.location.tag if found.location else checkpoint} has its files, sizes fit, no foreign sub-group files",
        )
        agreement = found.swap.agreement if found.swap is not None else None
        if agreement is None:
            findings.add(
                "16-bit params",
                [],
                "",
                skipped="not run: " + ("the layout has problems" if found.problems else "no 16-bit param swap files"),
            )
        else:
            findings.checks.append(Check("16-bit params", True, agreement.describe()))
        if found.swap is not None:
            findings.notes.extend(n for n in found.swap.notes() if n != (agreement.describe() if agreement else None))
    orphans = folder.of_kind("orphan")
    findings.checks.append(
        Check(
            "orphans",
            True,
            f"{len(orphans)} file(s) DeepSpeed does not name this way (ignored)"
            + (f": {', '.join(f.path for f in orphans[:4])}" if orphans else ""),
        )
    )
    findings.checks.append(Check("checksums", None, swap.NO_CRC_NOTE))
    if scan:
        sources = _swap_sources(folder, found)
        findings.add("values", _scan(sources, workers, job, None), f"no NaN or Inf in {len(sources)} tensors")
    return VerifyReport(
        path,
        "swap_folder",
        tuple(findings.checks),
        tuple(dict.fromkeys(findings.problems)),
        tuple(findings.notes),
        files=len(folder.files),
        bytes=folder.total_bytes,
        scanned=scan,
    )


def _swap_sources(folder: swap.SwapFolder, found: Survey | None) -> list[tuple[str, TensorSource]]:
    """What --scan reads: with a usable layout, the masters and states (padding left out);
    otherwise every sub-group file whole, as fp32 (padding included: DeepSpeed may leave any
    bits there). The 16-bit copies are not scanned: the masters are what is recovered."""
    sources: list[tuple[str, TensorSource]] = []
    if found is not None and found.state is not None:
        for param in found.state.params:
            sources.append((param.name, param.master))
            sources += [(f"{param.name}.{key}", source) for key, source in param.states.items()]
    else:
        sources += [
            (f.path, TensorSource(FP32, (f.size // 4,), (Segment(f.path, 0, f.size // 4),)))
            for f in folder.of_kind("sub_group")
        ]
    return sources


# --- values ---------------------------------------------------------------------------------------


def _non_finite(raw: np.ndarray, dtype: DType) -> int:
    """How many elements are NaN or Inf: all exponent bits set (raw bits for 16-bit floats)."""
    if dtype == BF16:
        return int(np.count_nonzero((raw & 0x7F80) == 0x7F80))
    if dtype == FP16:
        return int(np.count_nonzero((raw.view(np.uint16) & 0x7C00) == 0x7C00))
    return int(raw.size - np.count_nonzero(np.isfinite(raw)))


def _chunks(reader: FileReader, source: TensorSource) -> Iterator[np.ndarray]:
    """A tensor's elements in bounded chunks (raw numpy, one reused buffer)."""
    step = max(1, CHUNK_BYTES // source.dtype.itemsize)
    buffer = np.empty(min(step, source.numel), dtype=np.dtype(source.dtype.numpy_raw))
    for start in range(0, source.numel, step):
        chunk = buffer[: min(step, source.numel - start)]
        read_range(reader, source, start, chunk)
        yield chunk


def _scan(
    sources: list[tuple[str, TensorSource]], workers: int, job: JobSync, checker: RecordChecker | None
) -> list[str]:
    floating = [(n, s) for n, s in sources if s.dtype.is_floating and s.numel]

    def count(item: tuple[str, TensorSource]) -> str | None:
        name, source = item
        with FileReader(verify=False, checker=checker) as reader:
            bad = sum(_non_finite(chunk, source.dtype) for chunk in _chunks(reader, source))
        if not bad:
            return None
        where = (
            source.segments[0].path
            if len({s.path for s in source.segments}) == 1
            else f"{len({s.path for s in source.segments})} files"
        )
        return f"{where}: {name} holds {bad} NaN/Inf of {source.numel} elements"

    return [p for p in _shared(count, floating, [s.nbytes for _, s in floating], workers, job) if p]


# --- what operations would need --------------------------------------------------------------------


def _needs(found: Survey) -> list[Need]:
    """Disk each operation writes (planned exactly, nothing read) and its peak memory bound."""
    from ..deepspeed.save import archive_sizes
    from ..deepspeed.universal import plan_universal
    from ..deepspeed.writer import plan_checkpoint, plan_target
    from .weights_folder import plan_consolidation

    assert found.index is not None
    largest = max((e.source.nbytes for e in found.index.entries), default=0)
    # the interpreter and the parsed pickles, plus one buffer per writing thread, each no bigger
    # than the largest tensor and a conversion's temporaries (measured: BENCHMARKS.md)
    base = 64 << 20
    buffers = min(2 * CHUNK_BYTES, 2 * largest)
    needs = []
    for dtype in ("fp32", "bf16"):
        plan = plan_consolidation(found.index, dtype=dtype)
        needs.append(Need(f"consolidate --dtype {dtype}", plan.disk_bytes(), base + buffers))
    if found.state is not None:
        threads = 2 * (os.cpu_count() or 1)
        buffers = threads * min(CHUNK_BYTES, 2 * largest)
        try:
            stage = 1 if found.state.index.zero_stage == 0 else None  # ZeRO-0 is written as ZeRO-1
            target = plan_target(found.state, found.state.index.world_size, stage, None)
            size = sum(archive_sizes(plan_checkpoint(found.state, target)))
            needs.append(Need("reshard (about the same at any world size)", size, base + buffers))
            size = sum(archive_sizes(plan_universal(found.state)))
            needs.append(Need("to-universal", size, base + buffers))
        except ZckptError:
            pass
    return needs


# --- weights outputs --------------------------------------------------------------------------------


_WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _verify_weights(path: str, scan: bool, workers: int, job: JobSync) -> VerifyReport:
    """A consolidated output: headers, shards and index agree (tensor_sources checks that), torch
    files' CRCs, leftovers, and with `scan` the values."""
    findings = _Findings()
    try:
        found = open_tensors(path)
    except ZckptError as exc:
        leftovers = find_leftovers(path) if os.path.isdir(path) else []
        if os.path.isdir(path) and not leftovers and not any(n.endswith(_WEIGHTS_SUFFIXES) for n in os.listdir(path)):
            # nothing here to judge (not a damaged output): bad input, as for every command (exit 1)
            raise CheckpointNotFoundError(
                path,
                "no checkpoint and no weights here (no 'latest', tag folder, universal folder, "
                ".safetensors, .bin, .pt or .index.json)",
            ) from None
        findings.add("files", [str(exc)], "")
        if os.path.isdir(path):  # a folder holding only what a killed run left: list it too
            findings.add(
                "leftovers",
                [left.describe() for left in leftovers if left.alive is False],
                "no leftovers of an interrupted zckpt run",
            )
        return VerifyReport(path, "weights", tuple(findings.checks), tuple(findings.problems))
    files = list(found.files)
    sources = list(found.tensors.items())
    findings.add(
        "files",
        [],
        f"{len(files)} weights file{'s' * (len(files) != 1)}, {len(sources)} tensors, headers, index and sizes consistent",
    )
    checker = RecordChecker()
    values = _scan(sources, workers, job, checker) if scan else []  # its reads fed to the CRC-32 checks
    _check_crcs(files, findings, workers, job, checker)
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    findings.add(
        "leftovers",
        [left.describe() for left in find_leftovers(folder) if left.alive is False],
        "no leftovers of an interrupted zckpt run",
    )
    if scan:
        findings.add("values", values, f"no NaN or Inf in {len(sources)} tensors")
    if found.kind == "safetensors":
        findings.notes.append(
            "safetensors files carry no checksum: their headers and sizes were checked, their bytes cannot be"
        )
    return VerifyReport(
        path,
        "weights",
        tuple(findings.checks),
        tuple(dict.fromkeys(findings.problems)),
        tuple(findings.notes),
        files=len(files),
        bytes=sum(map(_size, files)),
        scanned=scan,
    )
