"""DeepSpeed's CPU runs leak ``/dev/shm/deepspeed_allreduce_buffer_*`` (~66 MB of RAM per rank
per run; see ../shared/FORMAT_NOTES.md): whatever launches DeepSpeed removes what its finished
runs left. Stdlib only, so every script and the tests (``tests/interop_helpers.py``) share it.

    with removing_shm_leaks():
        subprocess.run([python, "-m", "torch.distributed.run", ...])
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer_"


def shm_listing() -> set[str]:
    """Names of DeepSpeed's shm allreduce buffers now in /dev/shm."""
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def held_shm_paths() -> set[str]:
    """Paths under /dev/shm that some live process has open (``/proc/*/fd``) or mapped (``/proc/*/maps``)."""
    held: set[str] = set()
    prefix = str(SHM_DIR) + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith(prefix):
                    held.add(target.removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            with open(proc / "maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    i = line.find(prefix)
                    if i >= 0:
                        held.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            pass
    return held


def cleanup_shm_leaks(before: set[str]) -> list[str]:
    """Remove DeepSpeed shm buffers that appeared since ``before`` (a ``shm_listing()``) and that no
    live process holds open or mapped. Returns the names removed."""
    new = shm_listing() - set(before)
    if not new:
        return []
    held = held_shm_paths()
    removed = []
    for name in sorted(new):
        path = SHM_DIR / name
        if str(path) in held:
            continue
        try:
            path.unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError:
            continue
    return removed


@contextlib.contextmanager
def removing_shm_leaks() -> Iterator[None]:
    """Around a DeepSpeed launch: remove the buffers its finished runs left, whatever happens."""
    before = shm_listing()
    try:
        yield
    finally:
        cleanup_shm_leaks(before)
