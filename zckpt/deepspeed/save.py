"""Write a planned DeepSpeed checkpoint: the tag folder appears whole, then ``latest`` names it.

Files are independent, so they are written by threads (and, under torchrun, split between the
job's processes); every byte streams from the source files through torchsave.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

from ..core.errors import OutputError
from ..io.checksums import RecordChecker
from ..io.interrupts import signals_deferred
from ..io.jobs import JobFailed, JobSync, share_of
from ..io.output import OutputLock, StagedFolder, fsync_file, output_error, path_inside, write_text_atomic
from ..io.reading import FileReader
from ..io.workers import WorkerPool
from ..torchfile.save import ArchivePlan, RawPlan, archive_name_for, plan_archive, plan_raw, write_archive, write_raw
from .writer import AnyPlannedFile, CheckpointPlan, LazyFile, RawFile

PARALLEL_MIN_BYTES = 64 << 20  # below this, one thread does it


@dataclass(frozen=True)
class SaveResult:
    output_dir: str
    tag: str
    files: tuple[str, ...]
    bytes_written: int


def planned_archive(planned: AnyPlannedFile) -> ArchivePlan | RawPlan:
    """A file's archive plan (pickled object tree, record layout, exact size), or for a raw swap
    file its byte plan; reads nothing. A lazy file's tree is built for it, and dropped with it."""
    obj = planned.obj
    return plan_raw(obj.tensor) if isinstance(obj, RawFile) else plan_archive(obj, archive_name_for(planned.name))


def archives(plan: CheckpointPlan) -> list[tuple[str, ArchivePlan | RawPlan]]:
    """Each file's archive plan (:func:`planned_archive`), all held at once."""
    return [(f.name, planned_archive(f)) for f in plan.files]


def archive_sizes(plan: CheckpointPlan) -> Iterator[int]:
    """Each file's exact size, as :func:`archives` plans it, one file at a time: what a size
    needs, without holding every file's pickle at once (thousands of rank files' worth)."""
    known: dict[tuple[object, int], int] = {}
    for f in plan.files:
        yield _size(f, known)


def _size(planned: AnyPlannedFile, known: dict[tuple[object, int], int]) -> int:
    """A file's exact size. Lazy files that pickle alike (:attr:`~.writer.LazyFile.alike`) are
    planned once per length of name (`known`: the sizes found), as their archives differ in
    their names only."""
    if not isinstance(planned, LazyFile) or planned.alike is None:
        return planned_archive(planned).total_size
    key = (planned.alike, len(archive_name_for(planned.name)))
    if key not in known:
        known[key] = planned_archive(planned).total_size
    return known[key]


def _write_one(
    path: str, planned: AnyPlannedFile | ArchivePlan | RawPlan, size: int, checker: RecordChecker | None
) -> int:
    """Write one file; a planned file's archive is planned here (again: only its size was kept)."""
    archive = planned if isinstance(planned, (ArchivePlan, RawPlan)) else planned_archive(planned)
    if archive.total_size != size:  # a plan is a pure function: built twice, it is the same
        raise RuntimeError(f"{path}: planned at {size} bytes, then at {archive.total_size}")
    with FileReader(verify=False, checker=checker) as reader:
        if isinstance(archive, RawPlan):
            write_raw(path, archive, reader)
        else:
            write_archive(path, archive, reader)
    return archive.total_size


def write_checkpoint(
    plan: CheckpointPlan,
    output_dir: str,
    *,
    overwrite: bool = False,
    workers: int | None = None,
    part: int = 0,
    parts: int = 1,
    barrier: JobSync | None = None,
    progress: Callable[[int, int], None] | None = None,
    before_latest: Callable[[], None] | None = None,
    verify: bool = True,
    by_rank: bool = False,
    wait: bool = False,
) -> SaveResult:
    """Write every file of `plan` into ``output_dir/<tag>/`` and point ``output_dir/latest`` (the
    plan's `latest_file`) at it.

    One writer per output folder: process 0 holds ``output_dir``'s :class:`~zckpt.io.output.OutputLock`
    from its checks to ``latest``; another run holding it refuses this one, or with `wait` is
    waited for. With `parts` > 1 (processes of one job sharing a filesystem), process `part`
    writes its share and process 0 checks, commits and holds the lock for the job; `barrier`
    synchronises them and carries a failure (or process 0's wait) to the others, so every process
    of the job returns or raises together. `before_latest` runs (on process 0) once the tag folder
    is in place, before ``latest`` names it. With `verify`, every input record whose bytes were
    copied passes its CRC-32 check before anything is committed. With `by_rank`, process `part`
    writes the files of data-parallel rank `part` (and process 0 the shared ones) instead of a
    size-balanced share.
    """
    # sizes first (the disk check, the shares of a job's processes), one file at a time; a lazy
    # file's tree is built again when it is written, so that the trees of thousands of rank files
    # (a piece per param and rank) are never held together. An eager file's archive is kept.
    names = [f.name for f in plan.files]
    kept: dict[int, ArchivePlan | RawPlan] = {}
    sizes = []
    known: dict[tuple[object, int], int] = {}
    for i, f in enumerate(plan.files):
        if isinstance(f, LazyFile):
            sizes.append(_size(f, known))
        else:
            kept[i] = planned_archive(f)
            sizes.append(kept[i].total_size)
    total = sum(sizes)
    # the tag comes from the input (`latest`): the folder it names must be one inside output_dir
    folder = StagedFolder(path_inside(output_dir, plan.tag))
    sync = barrier or JobSync(None, output_dir)
    lock = OutputLock(output_dir, wait=wait, while_waiting=sync.waiting) if part == 0 else None
    if by_rank:  # each process holds only its own rank's data (the trainer): it writes that rank's files
        mine = [i for i, f in enumerate(plan.files) if (f.rank or 0) % parts == part]
    else:
        mine = share_of(sizes, part, parts)
    done = 0
    checker = RecordChecker() if verify else None
    staged = False  # this process may remove the staging folder: it is this job's, being written
    try:
        if lock is not None:
            lock.acquire()
            folder.create(overwrite=overwrite, needed_bytes=total)
            staged = True
        sync()
        staged = True  # process 0 made it for this job
        jobs = [(folder.path(names[i]), kept.get(i, plan.files[i]), sizes[i], checker) for i in mine]
        for folder_name in sorted(({os.path.dirname(name) for name in names} | set(plan.folders)) - {""}):
            os.makedirs(folder.path(folder_name), exist_ok=True)
        # Threads, not processes: checksums, kernel copies, reads, writes and dtype conversion all
        # release the GIL, and a thread per file keeps every core busy however the sizes fall.
        # Two files per CPU: one converting dtypes (CPU-bound) overlaps others that only copy.
        count = (
            min(workers or 2 * (os.cpu_count() or 1), len(jobs))
            if sum(size for _, _, size, _ in jobs) >= PARALLEL_MIN_BYTES
            else 1
        )
        if count > 1:
            pool = WorkerPool(count, "zckpt-save")
            try:
                for size in pool.map(_write_one, *zip(*jobs)):
                    done += size
                    if progress:
                        progress(done, total)
            finally:  # on an error or a signal, files not started yet are not started
                pool.shutdown(wait=True, cancel_futures=True)
        else:
            for path, planned, size, _ in jobs:
                done += _write_one(path, planned, size, checker)
                if progress:
                    progress(done, total)
        # Synced once all are written, not one by one: the first fsync's journal commit takes the
        # data of every file along (ext4, xfs), so the rest cost little; per-file syncs in between
        # each forced a commit (735 files of a universal checkpoint: 8.6 s of 10 s).
        if checker is not None:  # input records partly read: the job reads the rest once
            checker.finish(job=sync)
        for path, _, _, _ in jobs:
            fsync_file(path)
        sync()
        staged = part == 0  # every file is in: committing, or cleaning up, is process 0's
        if part == 0:
            # past the point of no return (the tag folder in place): a signal waits until `latest`
            # names it, so an interrupted run leaves the previous state or the whole new one
            with signals_deferred():
                folder.commit()
                if before_latest:
                    before_latest()
                write_text_atomic(path_inside(output_dir, plan.latest_file), plan.tag)
        sync()  # nobody returns before `latest` names the new tag folder (or knows that it could not)
    except BaseException as exc:
        # process 0 cleans up under its lock; another process only while it writes, and not when
        # told of a failure (process 0 may have let the lock go: the staging folder may be another run's)
        if staged and (part == 0 or not isinstance(exc, JobFailed)):
            folder.abort()
        sync.fail()
        if isinstance(exc, OSError) and not isinstance(exc, OutputError):
            raise output_error(output_dir, exc) from None
        raise
    finally:
        if lock is not None:
            lock.release()
    return SaveResult(output_dir, plan.tag, tuple(names), total)
