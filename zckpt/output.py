"""Writing an output folder all-or-nothing.

Files are written under temporary names in the output folder itself (same filesystem, so the
final rename is atomic), fsynced, and renamed into place only when every one of them is
complete; the index file goes last, so a reader never sees an index naming missing shards.
On any error the temporary files are removed and a folder we created is removed again.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from types import TracebackType
from typing import Callable

from .errors import OutputError
from .shards import format_size

# Weights files a previous run may have left; replaced only with overwrite=True.
_WEIGHTS_FILE_RE = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json)$"
)


def check_free_space(path: str, needed_bytes: int) -> None:
    """Refuse up front when the filesystem that will hold `path` has less free space than needed."""
    probe = path
    while not os.path.isdir(probe):
        probe = os.path.dirname(os.path.abspath(probe))
    free = shutil.disk_usage(probe).free
    if needed_bytes > free:
        raise OutputError(path, f"needs {format_size(needed_bytes)} but only {format_size(free)} is free; nothing was written")


def output_error(path: str, exc: OSError) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError(path, "no space left on device; nothing was written")
    return OutputError(path, f"cannot write: {exc.strerror or exc}; nothing was written")


class StagedOutput:
    """An output folder whose files appear together, or not at all."""

    def __init__(self, output_dir: str, final_names: list[str], overwrite: bool = False, needed_bytes: int = 0) -> None:
        self.output_dir = output_dir
        self.final_names = list(final_names)
        self.overwrite = overwrite
        self._created_dir = False
        self._temps: dict[str, str] = {}
        self._stale: list[str] = []
        self._check(needed_bytes)

    def _check(self, needed_bytes: int) -> None:
        if os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise OutputError(self.output_dir, "exists and is not a folder")
        if os.path.isdir(self.output_dir):
            existing = [n for n in sorted(os.listdir(self.output_dir)) if _WEIGHTS_FILE_RE.match(n) or n in self.final_names]
            if existing and not self.overwrite:
                raise OutputError(os.path.join(self.output_dir, existing[0]), "already exists; pass --overwrite to replace the weights in this folder")
            self._stale = [n for n in existing if n not in self.final_names and _WEIGHTS_FILE_RE.match(n)]
        check_free_space(self.output_dir, needed_bytes)

    def __enter__(self) -> "StagedOutput":
        if not os.path.isdir(self.output_dir):
            try:
                os.makedirs(self.output_dir)
            except OSError as exc:
                raise output_error(self.output_dir, exc) from None
            self._created_dir = True
        return self

    def temp_path(self, name: str) -> str:
        """Where to write `name` until commit."""
        path = os.path.join(self.output_dir, f".{name}.zckpt-tmp-{os.getpid()}")
        self._temps[name] = path
        return path

    def commit(self) -> None:
        """fsync every temp file, then rename them into place (index files last)."""
        for name, temp in self._temps.items():
            try:
                fd = os.open(temp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise output_error(os.path.join(self.output_dir, name), exc) from None
        ordered = sorted(self._temps.items(), key=lambda kv: kv[0].endswith(".index.json"))
        for name, temp in ordered:
            os.replace(temp, os.path.join(self.output_dir, name))
        self._temps.clear()
        for name in self._stale:
            os.remove(os.path.join(self.output_dir, name))
        _fsync_dir(self.output_dir)

    def abort(self) -> None:
        for temp in self._temps.values():
            try:
                os.remove(temp)
            except FileNotFoundError:
                pass
        self._temps.clear()
        if self._created_dir:
            try:
                os.rmdir(self.output_dir)
            except OSError:
                pass

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class StagedFolder:
    """A folder that appears whole or not at all: its files are written into a hidden staging
    folder beside it (same filesystem), which is renamed into place once every file is synced.

    The staging name is fixed (not per process), so several processes of one job (torchrun
    ranks) can fill it together; `commit` is then called by one of them.
    """

    def __init__(self, final_dir: str, *, overwrite: bool = False, needed_bytes: int = 0) -> None:
        self.final_dir = os.path.normpath(final_dir)
        parent, base = os.path.split(self.final_dir)
        self.parent = parent or "."
        self.staging = os.path.join(self.parent, f".{base}.zckpt-staging")
        self._old = os.path.join(self.parent, f".{base}.zckpt-old")
        self.overwrite = overwrite
        if os.path.exists(self.final_dir) and not overwrite:
            raise OutputError(self.final_dir, "already exists; pass --overwrite to replace it")
        check_free_space(self.final_dir, needed_bytes)

    def create(self) -> None:
        """Make an empty staging folder (a leftover of an interrupted run is removed first)."""
        try:
            self._created_parent = not os.path.isdir(self.parent)
            os.makedirs(self.parent, exist_ok=True)
            shutil.rmtree(self.staging, ignore_errors=True)
            os.makedirs(self.staging)
        except OSError as exc:
            raise output_error(self.staging, exc) from None

    def path(self, name: str) -> str:
        return os.path.join(self.staging, name)

    def commit(self) -> None:
        """Rename the (fully written and synced) staging folder into place."""
        for folder, _, _ in os.walk(self.staging, topdown=False):  # subfolders' entries, then its own
            _fsync_dir(folder)
        replaced = os.path.exists(self.final_dir)
        if replaced:
            shutil.rmtree(self._old, ignore_errors=True)
            os.replace(self.final_dir, self._old)
        os.replace(self.staging, self.final_dir)
        _fsync_dir(self.parent)
        if replaced:
            shutil.rmtree(self._old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        if getattr(self, "_created_parent", False):
            try:
                os.rmdir(self.parent)  # only if still empty
            except OSError:
                pass


def is_inside(path: str, folder: str) -> bool:
    """`path` is `folder` or below it (symlinks resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: str, write: Callable[[str], object]) -> None:
    """Write a file under a temporary name beside `path` (via `write(temp_path)`), fsync it and
    rename it over `path`, so readers see the old file or the whole new one."""
    temp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.zckpt-tmp-{os.getpid()}")
    try:
        write(temp)
        fsync_file(temp)
        os.replace(temp, path)
    except OSError as exc:
        try:
            os.remove(temp)
        except OSError:
            pass
        raise output_error(path, exc) from None
    _fsync_dir(os.path.dirname(path) or ".")


def write_text_atomic(path: str, text: str) -> None:
    replace_atomically(path, lambda temp: _write_text(temp, text))


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
