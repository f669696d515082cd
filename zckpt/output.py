"""Writing an output folder all-or-nothing.

Files are written under temporary names in the output folder itself (same filesystem, so the
final rename is atomic), fsynced, and renamed into place only when every one of them is
complete; the index file goes last, so a reader never sees an index naming missing shards.
On any error the temporary files are removed and a folder we created is removed again.

A process killed outright (SIGKILL, a node lost) cannot clean up, so every temporary name
carries its owner, ``<host>-<pid>`` (staging folders: an owner file inside): the next run into
the folder removes the leftovers of owners that no longer run, and ``zckpt inspect`` lists them.
While files are renamed into place, SIGINT/SIGTERM/SIGHUP are held back, so an interrupted run
leaves the old output or the whole new one, never a mix.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
from dataclasses import dataclass
from types import TracebackType
from typing import Callable

from .errors import OutputError, UsageError
from .interrupts import signals_deferred
from .shards import format_size
from .untrusted import within

# Weights files a previous run may have left; replaced only with overwrite=True.
_WEIGHTS_FILE_RE = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json)$"
)


# Leftovers of zckpt runs: `.<name>.zckpt-tmp-<host>-<pid>` files (`-<pid>` alone from older
# releases), `.<name>.zckpt-staging` folders (owner in OWNER_FILE) and `.<name>.zckpt-old` folders
# (the previous version of <name>, moved aside while the new one is renamed into place).
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.zckpt-tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)$")
_FOLDER_RE = re.compile(r"^\.(?P<name>.+)\.zckpt-(?P<kind>staging|old)$")
OWNER_FILE = ".zckpt-owner"


def _host() -> str:
    """This machine's name as it appears in temporary names (no path separators or spaces)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def owner_tag() -> str:
    """`<host>-<pid>`: who writes a temporary file, so a later run can tell whether it still runs."""
    return f"{_host()}-{os.getpid()}"


def temp_name(name: str) -> str:
    """The hidden name `name` is written under until it is complete."""
    return f".{name}.zckpt-tmp-{owner_tag()}"


@dataclass(frozen=True)
class Leftover:
    """A temporary file or folder of a zckpt run found in an output folder.

    `alive`: whether its owner still runs (True: a write in progress; False: interrupted);
    None when that cannot be told (another host's, or no owner recorded).
    """

    path: str
    host: str | None
    pid: int | None
    alive: bool | None
    previous_of: str | None = None  # a `.zckpt-old` folder whose <name> is missing: the only copy left

    def describe(self) -> str:
        if self.previous_of is not None:
            return f"{self.path}: the previous {self.previous_of}, moved aside by a zckpt run killed while replacing it; rename it back to {os.path.basename(self.previous_of)}"
        owner = f"zckpt process {self.pid} on {self.host or 'this host'}" if self.pid is not None else "a zckpt run"
        if self.alive:
            return f"{self.path}: being written by {owner}, still running"
        if self.alive is None:
            return f"{self.path}: left by {owner}; cannot tell whether it still runs"
        return f"{self.path}: left by {owner}, which no longer runs (interrupted); the next zckpt run into this folder removes it"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _owner_alive(host: str | None, pid: int | None) -> bool | None:
    if pid is None or (host is not None and host != _host()):
        return None
    return _pid_alive(pid)


def _read_owner(folder: str) -> tuple[str | None, int | None]:
    """The (host, pid) recorded in a staging folder's owner file, or (None, None)."""
    try:
        with open(os.path.join(folder, OWNER_FILE), encoding="utf-8") as handle:
            host, _, pid = handle.read(512).strip().rpartition("-")
        return (host or None), int(pid)
    except (OSError, ValueError, UnicodeDecodeError):
        return None, None


def find_leftovers(folder: str) -> list[Leftover]:
    """Every zckpt temporary file and staging/old folder directly in `folder`, with its owner."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(folder, name)
        if match := _TEMP_RE.match(name):
            host, pid = match["host"], int(match["pid"])
            found.append(Leftover(path, host, pid, _owner_alive(host, pid)))
        elif (match := _FOLDER_RE.match(name)) and os.path.isdir(path):
            if match["kind"] == "old":
                final = os.path.join(folder, match["name"])
                # beside its replacement: the rest of a commit; alone: the only copy of <name>
                found.append(Leftover(path, None, None, False, None if os.path.exists(final) else final))
            else:
                host, pid = _read_owner(path)
                # no owner file: a commit cut between removing it and the rename (a staging
                # folder is only ever made with its owner file inside): its run is gone
                orphan = not os.path.exists(os.path.join(path, OWNER_FILE))
                found.append(Leftover(path, host, pid, False if orphan else _owner_alive(host, pid)))
    return found


def remove_dead_leftovers(folder: str) -> list[str]:
    """Remove the leftovers in `folder` whose owner no longer runs on this host; the paths removed.
    A moved-aside previous version with nothing in its place is kept (it is the only copy)."""
    removed = []
    for leftover in find_leftovers(folder):
        if leftover.alive is not False or leftover.previous_of is not None:
            continue
        try:
            if os.path.isdir(leftover.path) and not os.path.islink(leftover.path):
                shutil.rmtree(leftover.path)
            else:
                os.remove(leftover.path)
        except OSError:
            continue  # not ours to fight over: inspect still lists it
        removed.append(leftover.path)
    return removed


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
        else:
            remove_dead_leftovers(self.output_dir)  # a killed run's temp files
        return self

    def temp_path(self, name: str) -> str:
        """Where to write `name` until commit; it and its temporary name are checked to stay
        inside the output folder."""
        path_inside(self.output_dir, name)
        path = path_inside(self.output_dir, temp_name(name))
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
        with signals_deferred():
            # stale files first: a run killed (SIGKILL) anywhere in here leaves temporary files
            # that say so, never new weights beside an old output's shards and nothing to tell
            for name in self._stale:
                os.remove(os.path.join(self.output_dir, name))
            for name, temp in ordered:
                os.replace(temp, os.path.join(self.output_dir, name))
            self._temps.clear()
        _fsync_dir(self.output_dir)

    def abort(self) -> None:
        for temp in self._temps.values():
            try:
                os.remove(temp)
            except OSError:  # not there (a read-only folder says EROFS then): the error being handled is what counts
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
        """Make an empty staging folder, owned by this process (a leftover of an interrupted run
        is removed first, as are other dead runs' leftovers beside it).

        It is made under this process's temporary name with the owner file inside, then renamed:
        killed at any point, no staging folder is left without an owner (which no later run
        could tell from a live one's)."""
        fresh = os.path.join(self.parent, temp_name(os.path.basename(self.final_dir)))
        try:
            self._created_parent = not os.path.isdir(self.parent)
            os.makedirs(self.parent, exist_ok=True)
            remove_dead_leftovers(self.parent)
            shutil.rmtree(self.staging, ignore_errors=True)
            os.makedirs(fresh)
            with open(os.path.join(fresh, OWNER_FILE), "w", encoding="utf-8") as handle:
                handle.write(owner_tag() + "\n")
            os.rename(fresh, self.staging)
        except BaseException as exc:  # an error, or a signal turned into an exception: nothing left
            shutil.rmtree(fresh, ignore_errors=True)
            self.abort()
            if isinstance(exc, OSError):
                raise output_error(self.staging, exc) from None
            raise

    def path(self, name: str) -> str:
        """Where `name` (a path relative to the folder) is written, checked to stay inside it."""
        return path_inside(self.staging, name)

    def commit(self) -> None:
        """Rename the (fully written and synced) staging folder into place."""
        for folder, _, _ in os.walk(self.staging, topdown=False):  # subfolders' entries, then its own
            _fsync_dir(folder)
        replaced = os.path.exists(self.final_dir)
        if replaced:
            shutil.rmtree(self._old, ignore_errors=True)
        with signals_deferred():
            try:
                os.remove(os.path.join(self.staging, OWNER_FILE))
            except FileNotFoundError:
                pass
            if replaced:
                os.replace(self.final_dir, self._old)
            os.replace(self.staging, self.final_dir)
        _fsync_dir(self.parent)
        # the previous version moved aside, by this run or by one killed while replacing it
        shutil.rmtree(self._old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        if os.path.isdir(self.final_dir):  # interrupted once committed: the previous version moved aside goes too
            shutil.rmtree(self._old, ignore_errors=True)
        if getattr(self, "_created_parent", False):
            try:
                os.rmdir(self.parent)  # only if still empty
            except OSError:
                pass


def is_inside(path: str, folder: str) -> bool:
    """`path` is `folder` or below it (symlinks resolved)."""
    return within(os.path.realpath(path), os.path.realpath(folder))


def refuse_output_inside_input(output_dir: str, input_dirs: tuple[str, ...], *, may_be: str | None = None) -> None:
    """Refuse (usage, exit 2) an output folder inside an input folder: writing there would mix
    the output into the checkpoint it is made from, or replace it. `may_be` is the one input
    folder the output may be itself: a Trainer ``checkpoint-N`` folder consolidated in place
    (weights beside its config), or the checkpoint folder a universal folder goes beside the tag
    folders in (DeepSpeed's own habit)."""
    for folder in input_dirs:
        same = os.path.realpath(output_dir) == os.path.realpath(folder)
        if is_inside(output_dir, folder) and not (may_be is not None and os.path.realpath(output_dir) == os.path.realpath(may_be)):
            raise UsageError(output_dir, f"{'is the input folder' if same else f'is inside the input {folder}'}; choose a folder outside it")


def path_inside(folder: str, relative: str) -> str:
    """``folder/relative``, refused unless it lies strictly inside `folder`, the folders on the
    way resolved (symlinks followed).

    The writers' second fence: names from an input are checked where they become paths
    (:func:`zckpt.untrusted.path_component`); this check stands behind that rule, so a name that
    reached a writer unchecked (``../x``, ``/tmp/x``, ``.``, ``a_link/x``) still cannot place a
    file elsewhere. The last component is not resolved: a final name that exists already (the
    output being replaced) is replaced by a rename, and staged or temporary files are new names."""
    path = os.path.join(folder, relative)
    root, target = os.path.abspath(folder), os.path.abspath(path)
    resolved = os.path.join(os.path.realpath(os.path.dirname(target)), os.path.basename(target))
    if target == root or not within(target, root) or not within(resolved, os.path.realpath(folder)):
        raise OutputError(path, f"would be written at {resolved}, outside the output folder {folder}; refused, nothing is written there")
    return path


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: str, write: Callable[[str], object]) -> None:
    """Write a file under a temporary name beside `path` (via `write(temp_path)`), fsync it and
    rename it over `path`, so readers see the old file or the whole new one."""
    temp = os.path.join(os.path.dirname(path) or ".", temp_name(os.path.basename(path)))
    try:
        write(temp)
        fsync_file(temp)
        os.replace(temp, path)
    except OSError as exc:
        _remove_quietly(temp)
        raise output_error(path, exc) from None
    except BaseException:  # interrupted (a signal turned into an exception): no temp file left
        _remove_quietly(temp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def write_text_atomic(path: str, text: str) -> None:
    replace_atomically(path, lambda temp: _write_text(temp, text))


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
