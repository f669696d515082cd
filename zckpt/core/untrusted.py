"""Names and links that come from an input: the rules that keep them from steering a read or a write.

A checkpoint is data someone else made. zckpt takes names from it (the tag in ``latest``, param
and optimizer-state names, file names, shard names) and some become parts of paths; it copies
some of its files along byte for byte. Two rules keep every read inside the input and every
write inside the output:

* :func:`path_component`: a name from the input becomes part of a path only when it is one plain
  path component. Every place that turns such a name into a path calls it; anything else is
  refused in one line naming the file and the name, before a byte is written.
* :func:`regular_file_inside`: a file whose bytes are taken without a format to check them (a
  file copied along, a raw NVMe swap file) must resolve, symlinks followed, to a regular file
  inside its input folder; a link that leads elsewhere is refused, and its target never read.

The writers add a fence of their own (:func:`zckpt.io.output.path_inside`): every path they create
must resolve inside the folder they stage, so a caller that forgot the first rule cannot escape.
"""

from __future__ import annotations

import os
import re

from .errors import UnsafePathError

MAX_NAME_BYTES = 255  # NAME_MAX of Linux filesystems: a longer name is no file name anywhere
# a folder of the Hugging Face hub cache: <cache>/models--org--name/snapshots/<revision>/...,
# whose files are links to <cache>/models--org--name/blobs/<hash>
_HUB_REPO_RE = re.compile(r"^(?:models|datasets|spaces)--.+$")
_SHOWN_CHARS = 80  # a name longer than this is cut in messages (a crafted one may be huge)


def name_problem(name: object) -> str | None:
    """Why `name` cannot be one path component, or None when it can.

    >>> [name_problem(n) for n in ("global_step3", "exp_avg")]
    [None, None]
    >>> name_problem("../escape_tag"), name_problem("..")
    ("it holds '/'", "it is '..', a reference to a folder")
    """
    if not isinstance(name, str):
        return f"it is a {type(name).__name__}, not text"
    if not name:
        return "it is empty"
    if name in (".", ".."):
        return f"it is '{name}', a reference to a folder"
    for separator in {os.sep, os.altsep or os.sep}:
        if separator in name:
            return f"it holds '{separator}'"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name):
        return "it holds a NUL or control character"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid text (a lone surrogate)"
    if size > MAX_NAME_BYTES:
        return f"it is {size} bytes long; a file name holds at most {MAX_NAME_BYTES}"
    return None


def shown(name: object) -> str:
    """`name` as a message shows it: quoted, control characters escaped, cut when long."""
    text = repr(name)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def path_component(name: object, where: str | os.PathLike[str] | None, what: str) -> str:
    """`name` (taken from the input file `where`, a `what` such as "param name") when it is one
    plain path component: not empty, not ``.`` or ``..``, no ``/``, no NUL or control character,
    valid text of at most 255 bytes. Raises UnsafePathError otherwise: used as a path, it could
    lead a read or a write outside its folder (``../x``, ``/tmp/x``) or be no file name at all."""
    problem = name_problem(name)
    if problem is not None:
        raise UnsafePathError(
            where,
            f"{what} {shown(name)} cannot be a file name ({problem}); a name from a checkpoint must be one plain path component",
        )
    assert isinstance(name, str)
    return name


def within(path: str, root: str) -> bool:
    """`path` is `root` or below it; both already resolved (no symlink is followed here)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def input_roots(folder: str | os.PathLike[str]) -> tuple[str, ...]:
    """Where the files of input folder `folder` may resolve to: inside it, and for a folder of a
    Hugging Face hub cache snapshot (``<repo>/snapshots/<revision>/...``, every file a link to
    ``<repo>/blobs/<hash>``, as ``snapshot_download`` leaves it) inside that ``blobs/`` too.
    Resolved paths: a ``blobs`` that is itself a link elsewhere contains nothing here."""
    real = os.path.realpath(folder)
    parts = real.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):  # a revision folder follows "snapshots"
        if parts[i] == "snapshots" and _HUB_REPO_RE.match(parts[i - 1]):
            return real, os.sep.join(parts[:i] + ["blobs"])
    return (real,)


def regular_file_inside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether `path` is a regular file inside input folder `folder`, through links that stay
    inside it (or go to the hub cache's ``blobs/``, see :func:`input_roots`): True to read or
    copy it, False when there is none (absent, a folder, a FIFO or device).

    Raises UnsafePathError when `path` resolves outside: its bytes are taken unchecked (copied
    along verbatim, or raw swap data), so following the link would put whatever it points at
    (``/etc/passwd``, ``~/.ssh/id_rsa``) into the output."""
    real = os.path.realpath(path)
    if not any(within(real, root) for root in input_roots(folder)):
        raise UnsafePathError(
            path,
            f"leads to {real}, outside {os.fspath(folder)} (a symlink): zckpt takes files only from inside the input; copy the file in place of the link if you trust it",
        )
    return os.path.isfile(real)
