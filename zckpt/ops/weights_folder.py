"""A Hugging Face weights folder (safetensors or torch, sharded or not), planned, then written:
the back end of ``consolidate``'s full weights and of the PEFT adapter and merged outputs.

Two steps: :func:`plan_consolidation` decides, from the checkpoint index alone, which tensor
goes into which file in which dtype (pure, no I/O); :func:`write_consolidated` then streams
the bytes, one tensor at a time, into staged files that appear together when all are done.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from ..core.dtypes import FP32, DType, DTypeLike, output_dtype
from ..core.index import CheckpointIndex, TensorSource
from ..core.sizes import parse_size
from ..hf import names as hf
from ..hf.shards import ShardItem, plan_shards
from ..io.checksums import RecordChecker
from ..io.jobs import JobFailed, job_share, share_of
from ..io.output import StagedOutput, fsync_file, output_error
from ..io.reading import FileReader
from .file_pieces import create_files, piece_bytes_for, plan_pieces, write_pieces
from .formats import OutputFormat, WeightsFormat, weights_format

__all__ = ["OutputFormat"]  # re-exported: the formats' names, from .formats
Progress = Callable[[int, int], None]  # (bytes done so far, total bytes)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: DType  # output dtype
    shape: tuple[int, ...]
    source: TensorSource
    alias_of: str | None = None

    @property
    def nbytes(self) -> int:
        return self.source.numel * self.dtype.itemsize


@dataclass(frozen=True)
class PlannedFile:
    name: str
    tensors: tuple[PlannedTensor, ...]


@dataclass(frozen=True)
class ConsolidationPlan:
    format: OutputFormat
    files: tuple[PlannedFile, ...]
    index_file: str | None  # written when sharded
    weight_map: dict[str, str]
    total_size: int  # bytes of distinct tensors (the index's metadata.total_size)
    tied: dict[str, str]  # alias -> source
    extra_files: tuple[str, ...]  # Hugging Face config/tokenizer files to copy along
    dtype: DType = FP32  # of the floating tensors written (config.json is told)

    @property
    def bytes_to_write(self) -> int:
        """Tensor bytes the writer produces (tied copies counted for safetensors)."""
        return weights_format(self.format).tensor_bytes([t for f in self.files for t in f.tensors], self.total_size)

    def disk_bytes(self) -> int:
        """The size of every output file: exact for safetensors (headers, index and the files
        copied along included); torch pickles add a few KB of their own per file."""
        total = sum(os.path.getsize(p) for p in self.extra_files if os.path.isfile(p))
        total += len(index_text(self.total_size, self.weight_map).encode("utf-8")) if self.index_file else 0
        fmt = weights_format(self.format)
        return total + sum(fmt.file_overhead(f.tensors, self.tied) for f in self.files) + self.bytes_to_write


@dataclass(frozen=True)
class ConsolidationResult:
    output_dir: str
    files: tuple[str, ...]
    tensors: int
    bytes_written: int
    index: CheckpointIndex
    dtype: DType = FP32  # of the floating tensors written
    peft: Literal["adapter", "merged"] | None = None  # a PEFT adapter folder, or the adapter merged into a base


def plan_consolidation(
    index: CheckpointIndex,
    *,
    dtype: DTypeLike = "fp32",
    format: OutputFormat | WeightsFormat = "safetensors",
    max_shard_size: str | int = "5GB",
    exclude_frozen: bool = False,
) -> ConsolidationPlan:
    """Decide every output file and tensor; reads nothing."""
    target = output_dtype(dtype)
    fmt = weights_format(format)
    limit = parse_size(max_shard_size)
    kept = [e for e in index.entries if not (exclude_frozen and e.kind == "frozen")]
    names = {e.name for e in kept}
    kept = [e for e in kept if e.alias_of is None or e.alias_of in names]
    tensors = {
        e.name: PlannedTensor(
            e.name, target if e.source.dtype.is_floating else e.source.dtype, e.source.shape, e.source, e.alias_of
        )
        for e in kept
    }
    items = [ShardItem(t.name, t.nbytes, t.alias_of) for t in tensors.values()]
    shards = plan_shards(items, limit, fmt.pattern)
    files = [
        PlannedFile(filename, tuple(fmt.order([tensors[n] for n in members]))) for filename, members in shards.files
    ]
    extra = hf.files_to_copy(index.checkpoint_dir, hf.MODEL_FILES)
    return ConsolidationPlan(
        format=fmt.name,  # type: ignore[arg-type]
        files=tuple(files),
        index_file=fmt.index_file if shards.is_sharded else None,
        weight_map=shards.weight_map(),
        total_size=shards.total_size,
        tied={t.name: t.alias_of for t in tensors.values() if t.alias_of},
        extra_files=extra,
        dtype=target,
    )


def write_consolidated(
    index: CheckpointIndex,
    plan: ConsolidationPlan,
    output_dir: str,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    verify: bool = True,
    wait: bool = False,
) -> ConsolidationResult:
    """Execute a plan: stream every tensor into staged files, then move them into place (holding
    the output folder's lock: see :class:`~zckpt.io.output.OutputLock`).

    Under torchrun (``WORLD_SIZE`` > 1) the job's processes share the weights (sizes balanced,
    the same split on every process: :func:`~zckpt.io.jobs.share_of`), each reading only
    what its share holds: safetensors files in pieces of every file (256 KiB-16 MiB)
    (:mod:`~zckpt.ops.file_pieces`), torch files whole (a CRC-32 per record: one process writes
    each). Process 0 holds the lock, creates the shared files, writes the index and the files
    copied along, and moves every file into place once all are written. With `verify`, the input
    records the job read pass their CRC-32 checks first, each byte read by one process."""
    names = [f.name for f in plan.files] + ([plan.index_file] if plan.index_file else [])
    # writing beside the checkpoint's own config and tokenizer (`consolidate . .` inside a
    # checkpoint-N folder): the weights are added and nothing else is touched
    extra = [p for p in plan.extra_files if not _same_file(p, os.path.join(output_dir, os.path.basename(p)))]
    names += [os.path.basename(p) for p in extra]
    total = plan.bytes_to_write
    part, parts, sync = job_share(output_dir)
    fmt = weights_format(plan.format)
    # safetensors under torchrun: every file's bytes shared out in pieces (file_pieces); torch
    # files (a CRC-32 per record) and a process alone: whole files
    pieces = (
        plan_pieces([(f.name, f.tensors) for f in plan.files], plan.tied, piece_bytes_for(total, parts))
        if parts > 1 and fmt.name == "safetensors"
        else None
    )
    if pieces is not None:
        my_pieces = [pieces.pieces[i] for i in share_of([p.read_bytes for p in pieces.pieces], part, parts)]
        mine = []
        advance = byte_counter(progress, sum(p.source.numel * p.dtype.itemsize for p in my_pieces))
    else:
        mine = [plan.files[i] for i in share_of([_file_bytes(fmt, f) for f in plan.files], part, parts)]
        advance = byte_counter(progress, sum(_file_bytes(fmt, f) for f in mine))
    staged = StagedOutput(
        output_dir, names, overwrite=overwrite, needed_bytes=total, wait=wait, while_waiting=sync.waiting
    )
    checker = RecordChecker() if verify else None

    def named_error(name: str, exc: OSError) -> Exception:
        return output_error(os.path.join(output_dir, name), exc)

    written: list[str] = []  # this process's temporary files (removed on its own failure)
    entered = False  # process 0 holds the lock
    try:
        if part == 0:
            staged.__enter__()
            entered = True
        # every process writes under process 0's temporary names (the lock holder's): a file a
        # killed job leaves names a process the next run can tell is gone
        temps = {name: staged.temp_path(name) for name in names} if part == 0 else None
        if pieces is not None and part == 0:  # at their final size, headers in: the others write into them
            create_files(pieces, temps, named_error)
        sync()
        temps = sync.gather(temps)[0]
        with FileReader(verify=False, checker=checker) as reader:
            if pieces is not None:
                touched = write_pieces(my_pieces, temps, reader, advance, named_error)
                for path in touched:
                    fsync_file(path)
            for planned in mine:
                written.append(temps[planned.name])
                _write_file(
                    output_dir,
                    planned.name,
                    temps[planned.name],
                    lambda path, f=planned: fmt.write(path, f.tensors, plan.tied, reader, advance, name=f.name),
                )
                if part != 0:  # synced by its writer (process 0's commit syncs the rest)
                    fsync_file(temps[planned.name])
        if part == 0:
            if plan.index_file:
                write_staged(
                    staged,
                    output_dir,
                    plan.index_file,
                    lambda path: write_text(path, index_text(plan.total_size, plan.weight_map)),
                )
            write_extra_files(staged, output_dir, extra, plan.dtype)
        if checker is not None:  # before anything is moved into place; each byte read by one process
            checker.finish(job=sync)
        sync()  # every file is written
        if part == 0:
            staged.commit()
        sync()  # nobody returns before the files are in place (or knows they could not be)
    except BaseException as exc:
        # process 0 removes every temporary file, under its lock; another process its own,
        # unless told of a failure (process 0 may have let the lock go)
        if entered:
            staged.abort()
        elif part != 0 and not isinstance(exc, JobFailed):
            for path in written:
                _remove_quietly(path)
        sync.fail()
        raise
    finally:
        if entered:
            staged.__exit__(None, None, None)  # the lock let go
    return ConsolidationResult(output_dir, tuple(names), len(plan.weight_map), total, index, plan.dtype)


def _file_bytes(fmt: WeightsFormat, planned: PlannedFile) -> int:
    """Tensor bytes one output file holds (what shares the files between processes)."""
    return fmt.tensor_bytes(planned.tensors, sum(t.nbytes for t in planned.tensors if t.alias_of is None))


def _write_file(output_dir: str, name: str, path: str, write: Callable[[str], object]) -> None:
    """Write output file `name` at (temporary) `path`; an OS error names the final file."""
    try:
        write(path)
    except OSError as exc:
        raise output_error(os.path.join(output_dir, name), exc) from None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def byte_counter(progress: Progress | None, total: int) -> Callable[[int], None]:
    """`advance(count)`: count more bytes written, reported to `progress` as (done, total)."""
    done = 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        if progress:
            progress(done, total)

    return advance


def write_staged(staged: StagedOutput, output_dir: str, name: str, write: Callable[[str], object]) -> None:
    """Write one output file under its temporary name; an OS error names the final file."""
    _write_file(output_dir, name, staged.temp_path(name), write)


def write_extra_files(staged: StagedOutput, output_dir: str, sources: Sequence[str], dtype: DType) -> None:
    """The Hugging Face files copied along; config.json told the dtype written."""
    for source in sources:
        if os.path.basename(source) == hf.CONFIG_FILE:
            write_staged(
                staged,
                output_dir,
                hf.CONFIG_FILE,
                lambda path, source=source: write_text(path, hf.config_with_dtype(source, dtype.name)),
            )
        else:
            write_staged(
                staged, output_dir, os.path.basename(source), lambda path, source=source: shutil.copyfile(source, path)
            )


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def index_text(total_size: int, weight_map: dict[str, str]) -> str:
    """The shard index (model.safetensors.index.json), as transformers writes it."""
    content = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return json.dumps(content, indent=2, sort_keys=True) + "\n"
