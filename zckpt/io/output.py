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

One writer per output folder (:class:`OutputLock`): every writer holds the folder's lock file
from its first check of what the folder holds to its last rename, so two runs into one folder
(a retried job, a job array) never mix their files or remove each other's.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Callable

from ..core.errors import OutputError, UsageError
from ..core.sizes import format_size
from ..core.untrusted import within
from .interrupts import signals_deferred

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
# In an output folder while a zckpt run writes it (see OutputLock): the writer's <host>-<pid>.
LOCK_FILE = ".zckpt-lock"


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
        if self.alive and os.path.basename(self.path) == LOCK_FILE:
            return f"{self.path}: {owner} is writing this folder"
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


def _read_owner(path: str | int) -> tuple[str | None, int | None]:
    """The (host, pid) recorded in an owner file (a staging folder's, the lock file), or (None, None)."""
    try:
        if isinstance(path, int):  # an open descriptor
            text = os.pread(path, 512, 0).decode("utf-8")
        else:
            with open(path, encoding="utf-8") as handle:
                text = handle.read(512)
        host, _, pid = text.strip().rpartition("-")
        return (host or None), int(pid)
    except (OSError, ValueError, UnicodeDecodeError):
        return None, None


def _lock_alive(path: str, host: str | None, pid: int | None) -> bool | None:
    """Whether a writer holds the lock file `path`: told by trying a shared lock on it (the kernel
    drops a killed process's locks), or where the filesystem has no locks by its recorded owner."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return _owner_alive(host, pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return _owner_alive(host, pid)
    finally:
        os.close(fd)  # drops the probe's shared lock


def find_leftovers(folder: str) -> list[Leftover]:
    """Every zckpt temporary file and staging/old folder directly in `folder`, with its owner."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(folder, name)
        if name == LOCK_FILE:
            host, pid = _read_owner(path)
            found.append(Leftover(path, host, pid, _lock_alive(path, host, pid)))
        elif match := _TEMP_RE.match(name):
            host, pid = match["host"], int(match["pid"])
            found.append(Leftover(path, host, pid, _owner_alive(host, pid)))
        elif (match := _FOLDER_RE.match(name)) and os.path.isdir(path):
            if match["kind"] == "old":
                final = os.path.join(folder, match["name"])
                # beside its replacement: the rest of a commit; alone: the only copy of <name>
                found.append(Leftover(path, None, None, False, None if os.path.exists(final) else final))
            else:
                host, pid = _read_owner(os.path.join(path, OWNER_FILE))
                # no owner file: a commit cut between removing it and the rename (a staging
                # folder is only ever made with its owner file inside): its run is gone
                orphan = not os.path.exists(os.path.join(path, OWNER_FILE))
                found.append(Leftover(path, host, pid, False if orphan else _owner_alive(host, pid)))
    return found


def remove_dead_leftovers(folder: str) -> list[str]:
    """Remove the leftovers in `folder` whose owner no longer runs on this host; the paths removed.
    A moved-aside previous version with nothing in its place is kept (it is the only copy); a dead
    writer's lock file is left to :class:`OutputLock`, which takes it over."""
    removed = []
    for leftover in find_leftovers(folder):
        if (
            leftover.alive is not False
            or leftover.previous_of is not None
            or os.path.basename(leftover.path) == LOCK_FILE
        ):
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
        raise OutputError(
            path, f"needs {format_size(needed_bytes)} but only {format_size(free)} is free; nothing was written"
        )


def output_error(path: str, exc: OSError) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError(path, "no space left on device; nothing was written")
    return OutputError(path, f"cannot write: {exc.strerror or exc}; nothing was written")


POLL_SECONDS = 0.2  # between tries of a lock held by another run (--wait)
SETTLE_SECONDS = 5.0  # a lock held under a dead writer's name is a takeover under way for this long
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


def _try_lock(fd: int) -> bool | None:
    """An exclusive lock on `fd`, not waiting: True taken, False held by another open file, None
    when the filesystem has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return None
        raise


def _still_at(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd` (not removed or replaced meanwhile)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


@dataclass(frozen=True)
class _Holder:
    """Who holds an output folder's lock, as its lock file says. `alive`: False while the lock is
    held under a dead process's name (another run taking it over); None where the filesystem has
    no locks and the owner runs on another host. `retry`: the lock file changed while it was read."""

    host: str | None
    pid: int | None
    alive: bool | None
    retry: bool = False

    def refusal(self, lock_path: str) -> str:
        who = (
            f"process {self.pid} on {self.host or 'this host'}"
            if self.pid is not None
            else f"its owner is not readable in {lock_path}"
        )
        unsure = (
            f" (this filesystem has no locks: if that run is gone, remove {lock_path})" if self.alive is None else ""
        )
        return f"another zckpt run is writing it: {who}{unsure}; pass --wait to wait for it to end; nothing was written"


class OutputLock:
    """One writer per output folder, held from a writer's first look at what the folder holds to
    its last rename, so that concurrent runs into one folder neither mix their files nor remove
    each other's: the second is refused, naming the first (pid, host), or waits (`wait`).

    The lock is ``<folder>/.zckpt-lock``, a file holding its writer's ``<host>-<pid>`` and locked
    (``flock``, exclusive) for as long as the writer runs. The kernel drops the locks of a process
    that dies, SIGKILL included, so a lock that can be taken is a dead writer's: a killed writer
    never blocks the next run. Taking it:

    1. write the owner into a file under this process's temporary name and lock it;
    2. hard-link it to ``.zckpt-lock``: the link fails when the name exists, so the lock file
       appears whole, already locked, its owner written;
    3. the name exists: locked by another process, that run is named (or waited for); lockable,
       its writer is dead: holding its lock, ours is renamed over it (of two runs taking over one
       dead lock, the second finds the name no longer names the file it locked, and tries again).

    Released: the lock file is removed, then unlocked; a folder the lock made goes if empty.
    Across hosts on a shared filesystem this relies on ``flock`` being seen by every client (NFSv3
    with lockd, NFSv4, Lustre mounted with ``flock``, GPFS, CephFS, BeeGFS with global locks) and
    on atomic ``link`` and ``rename``. Where ``flock`` is refused (ENOLCK, EOPNOTSUPP, ENOSYS) the
    link still lets one writer in; a lock file whose owner is a dead process of this host is then
    taken over, another host's is reported and left alone.

    Under torchrun process 0 holds it for the whole job (see ``deepspeed.save``).
    """

    def __init__(self, folder: str, *, wait: bool = False, while_waiting: Callable[[], None] | None = None) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LOCK_FILE)
        self.wait = wait
        self.while_waiting = while_waiting  # called between tries (the other processes of a torchrun job wait with it)
        self._fd: int | None = None
        self._made_folder = False

    def acquire(self) -> None:
        """Take the lock, making the folder if missing. Held by another run: an OutputError naming
        it, or with `wait` a new try every POLL_SECONDS until it is free. A try runs whole with
        signals held back (it is a few system calls), so a signal leaves the lock held or no
        trace of the try; the wait between tries stays interruptible."""
        unsettled_since = None
        while True:
            try:
                with signals_deferred():
                    holder = self._try()
            except OutputError:
                raise
            except OSError as exc:
                raise output_error(self.folder, exc) from None
            if holder is None:
                return
            if holder.retry:
                continue
            if holder.alive is False:
                unsettled_since = unsettled_since or time.monotonic()
            settled = holder.alive is not False or time.monotonic() - unsettled_since > SETTLE_SECONDS
            if settled and not self.wait:
                raise OutputError(self.folder, holder.refusal(self.path))
            if settled and self.while_waiting is not None:
                self.while_waiting()
            time.sleep(POLL_SECONDS)

    def _try(self) -> _Holder | None:
        """One try: None when the lock is now ours, else who holds it."""
        self._make_folder()
        temp = os.path.join(
            self.folder, temp_name(f"{LOCK_FILE[1:]}-{id(self):x}")
        )  # one per lock: threads of a process too
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # the folder went meanwhile (a run that made it left it empty)
            if os.path.lexists(self.folder):
                raise
            return _Holder(None, None, None, retry=True)
        taken = False
        try:
            os.write(fd, f"{owner_tag()}\n".encode())
            mine = _try_lock(fd)  # a new file of ours: taken at once, where there are locks
            if mine is False:  # a dead namesake's file (pid reused) that someone has open: removed, made anew
                return _Holder(None, None, None, retry=True)
            locks = mine is not None
            try:
                os.link(temp, self.path)
            except FileExistsError:
                holder = self._existing(temp, locks)
                taken = holder is None
                return holder
            taken = True
            os.remove(temp)
            return None
        finally:
            if taken:
                self._fd = fd
            else:
                _remove_quietly(temp)
                os.close(fd)

    def _existing(self, temp: str, locks: bool) -> _Holder | None:
        """The lock file exists: who holds it; or, its writer dead, `temp` renamed over it (None)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)  # for writing: NFS emulates flock by a write lock
        except FileNotFoundError:
            return _Holder(None, None, None, retry=True)  # released meanwhile
        try:
            host, pid = _read_owner(fd)
            free = _try_lock(fd) if locks else None
            if free is None:  # no locks on this filesystem: its recorded owner tells
                alive = _owner_alive(host, pid)
                if alive is not False:
                    return _Holder(host, pid, alive)
            elif not free:
                return _Holder(host, pid, _owner_alive(host, pid) is not False)
            if not _still_at(fd, self.path):
                return _Holder(None, None, None, retry=True)  # taken over by another run already
            os.rename(temp, self.path)  # its writer is dead: ours replaces it
            return None
        finally:
            os.close(fd)

    def _make_folder(self) -> None:
        """Make the folder unless it is there. Other runs start into the same folder at the same
        moment: one makes it between our look and our try, or (a run that made it and wrote
        nothing, leaving) removes it; only a name that stays a non-folder is refused."""
        while not os.path.isdir(self.folder):
            try:
                os.makedirs(self.folder)
                self._made_folder = True
                return
            except FileExistsError:
                if os.path.isdir(self.folder):
                    return
                if os.path.lexists(self.folder):
                    raise OutputError(self.folder, "exists and is not a folder") from None
                # removed meanwhile: make it again

    def release(self) -> None:
        """Remove the lock file, then unlock it; remove the folder if this lock made it and it is empty."""
        with signals_deferred():
            if self._fd is not None:
                try:
                    if _still_at(self._fd, self.path):
                        os.remove(self.path)
                except OSError:
                    pass
                os.close(self._fd)
                self._fd = None
            if self._made_folder:
                self._made_folder = False
                try:
                    if not os.listdir(self.folder):
                        os.rmdir(self.folder)
                except OSError:
                    pass


class StagedOutput:
    """An output folder whose files appear together, or not at all; one writer at a time
    (its :class:`OutputLock` is held from the check of existing files to the end)."""

    def __init__(
        self,
        output_dir: str,
        final_names: list[str],
        overwrite: bool = False,
        needed_bytes: int = 0,
        wait: bool = False,
        weights_folder: bool = True,
        while_waiting: Callable[[], None] | None = None,
    ) -> None:
        self.output_dir = output_dir
        self.final_names = list(final_names)
        # a weights folder's other weights files are its stale shards; a single-file output
        # (Lightning's checkpoint) leaves them alone
        self._weights_re = _WEIGHTS_FILE_RE if weights_folder else None
        self.overwrite = overwrite
        self.needed_bytes = needed_bytes
        self._lock = OutputLock(output_dir, wait=wait, while_waiting=while_waiting)  # see OutputLock
        self._temps: dict[str, str] = {}
        self._stale: list[str] = []

    def _check(self) -> None:
        existing = [n for n in sorted(os.listdir(self.output_dir)) if self._stale_or_ours(n)]
        if existing and not self.overwrite:
            raise OutputError(
                os.path.join(self.output_dir, existing[0]),
                "already exists; pass --overwrite to replace the weights in this folder",
            )
        self._stale = [n for n in existing if n not in self.final_names]
        check_free_space(self.output_dir, self.needed_bytes)

    def _stale_or_ours(self, name: str) -> bool:
        return name in self.final_names or (self._weights_re is not None and bool(self._weights_re.match(name)))

    def __enter__(self) -> "StagedOutput":
        try:
            self._lock.acquire()  # makes the folder if missing
            self._check()
            remove_dead_leftovers(self.output_dir)  # a killed run's temp files
        except BaseException:
            self._lock.release()
            raise
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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is not None:
                self.abort()
        finally:
            self._lock.release()  # and the folder, if the lock made it and nothing was written


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
    ranks) can fill it together; `create` and `commit` are called by one of them, the holder of
    the parent folder's :class:`OutputLock`, which keeps every other run out of it.
    """

    def __init__(self, final_dir: str) -> None:
        self.final_dir = os.path.normpath(final_dir)
        parent, base = os.path.split(self.final_dir)
        self.parent = parent or "."
        self.staging = os.path.join(self.parent, f".{base}.zckpt-staging")
        self._old = os.path.join(self.parent, f".{base}.zckpt-old")

    def create(self, *, overwrite: bool = False, needed_bytes: int = 0) -> None:
        """Check the folder may be written (it exists only with `overwrite`; the space is free),
        then make an empty staging folder owned by this process (a leftover of an interrupted run
        is removed first, as are other dead runs' leftovers beside it). Call with the parent's
        lock held.

        It is made under this process's temporary name with the owner file inside, then renamed:
        killed at any point, no staging folder is left without an owner (which no later run
        could tell from a live one's)."""
        if os.path.exists(self.final_dir) and not overwrite:
            raise OutputError(self.final_dir, "already exists; pass --overwrite to replace it")
        check_free_space(self.final_dir, needed_bytes)
        fresh = os.path.join(self.parent, temp_name(os.path.basename(self.final_dir)))
        try:
            remove_dead_leftovers(self.parent)
            shutil.rmtree(self.staging, ignore_errors=True)  # no live run's: the lock is ours
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
        """Remove the staging folder (this job's: call it only as a process of the lock holder's job)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        if os.path.isdir(self.final_dir):  # interrupted once committed: the previous version moved aside goes too
            shutil.rmtree(self._old, ignore_errors=True)


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
        if is_inside(output_dir, folder) and not (
            may_be is not None and os.path.realpath(output_dir) == os.path.realpath(may_be)
        ):
            raise UsageError(
                output_dir,
                f"{'is the input folder' if same else f'is inside the input {folder}'}; choose a folder outside it",
            )


def path_inside(folder: str, relative: str) -> str:
    """``folder/relative``, refused unless it lies strictly inside `folder`, the folders on the
    way resolved (symlinks followed).

    The writers' second fence: names from an input are checked where they become paths
    (:func:`zckpt.core.untrusted.path_component`); this check stands behind that rule, so a name that
    reached a writer unchecked (``../x``, ``/tmp/x``, ``.``, ``a_link/x``) still cannot place a
    file elsewhere. The last component is not resolved: a final name that exists already (the
    output being replaced) is replaced by a rename, and staged or temporary files are new names."""
    path = os.path.join(folder, relative)
    root, target = os.path.abspath(folder), os.path.abspath(path)
    resolved = os.path.join(os.path.realpath(os.path.dirname(target)), os.path.basename(target))
    if target == root or not within(target, root) or not within(resolved, os.path.realpath(folder)):
        raise OutputError(
            path,
            f"would be written at {resolved}, outside the output folder {folder}; refused, nothing is written there",
        )
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
