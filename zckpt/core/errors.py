"""One exception family for bad input.

Every error a user can cause (a missing file, a truncated archive, an unsafe pickle, an
inconsistent checkpoint, a full disk) is a :class:`ZckptError` whose message is one line naming
the file and the problem; the CLI prints that line and exits 1. Each subclass also derives from
the matching builtin so callers can catch ``FileNotFoundError`` or ``ValueError`` as usual.
"""

from __future__ import annotations

import os
import signal


class ZckptError(Exception):
    """Base class of every error caused by bad input or a bad environment."""

    def __init__(self, path: str | os.PathLike[str] | None, problem: str) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)


class CheckpointNotFoundError(ZckptError, FileNotFoundError):
    """A path, tag or rank file that should exist does not."""


class CorruptFileError(ZckptError, ValueError):
    """A file is truncated, garbled, or not the kind of file it should be."""


class UnsafePickleError(ZckptError, ValueError):
    """A pickle references a global that is not on the allowlist (it could run code)."""


class UnsafePathError(ZckptError, ValueError):
    """A name or a symlink in the input would make zckpt read or write outside the folders it was
    given: a name that is not one plain path component, or a link that leads out of the input."""


class LayoutError(ZckptError, ValueError):
    """Files that are individually fine do not form one consistent checkpoint."""


class OutputError(ZckptError, OSError):
    """The output cannot be written (exists already, disk full, permission denied)."""


class UsageError(ZckptError, ValueError):
    """An option value or combination of options is invalid."""


class Interrupted(KeyboardInterrupt):
    """A termination signal (SIGTERM from kill, timeout or Slurm; SIGINT; SIGHUP) raised as an
    exception, so the cleanup that runs for Ctrl-C (temporary files, staging folders) runs for
    it too. A KeyboardInterrupt, so ``except Exception`` does not swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}; no partial output was left")
