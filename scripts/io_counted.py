"""Run a command and record what it read and wrote, from the kernel's per-process I/O counters.

Usage::

    python scripts/io_counted.py OUT_DIR -- COMMAND [ARGS...]
    torchrun --nproc-per-node 4 scripts/io_counted.py OUT_DIR -- python -m zckpt reshard IN OUT -w 8

Writes ``OUT_DIR/io_<RANK>.json`` (``RANK`` from torchrun's environment, else 0): the command's
``/proc/PID/io`` counters once it has exited (``rchar``: bytes it read through read/pread and
copy_file_range, from the page cache or the disk alike; ``read_bytes``: those the disk
served), its exit code, and the same counters of an interpreter that only imports zckpt and
torch.distributed (``baseline``: what any zckpt process reads before it does any work).

Why a wrapper and not a counter inside zckpt: the kernel's count is an independent fact, and
it includes every byte, not only those zckpt means to read. The command's counters are read
while it is a zombie (``waitid`` with ``WNOWAIT``), after its last read and before the kernel
forgets it; its exit code is passed on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

BASELINE = "import zckpt.cli.app, torch.distributed"


def io_counters(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/io") as handle:
        return {key: int(value) for key, value in (line.split(": ") for line in handle if ": " in line)}


def run_counted(argv: list[str]) -> tuple[int, dict[str, int]]:
    """Run `argv`; (exit code as the shell reports it, its I/O counters)."""
    child = subprocess.Popen(argv)
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for signum in forwarded:  # torchrun stops its workers with SIGTERM: the command hears it
        signal.signal(signum, lambda s, _f: child.send_signal(s))
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    counters = io_counters(child.pid)
    code = child.wait()
    return (128 - code if code < 0 else code), counters


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, command = sys.argv[1], sys.argv[3:]
    rank = os.environ.get("RANK", "0")
    baseline = io_counters_of_baseline()
    code, counters = run_counted(command)
    os.makedirs(out_dir, exist_ok=True)
    record = {"rank": int(rank), "command": command, "exit_code": code, "io": counters, "baseline": baseline}
    with open(os.path.join(out_dir, f"io_{rank}.json"), "w") as handle:
        json.dump(record, handle, indent=2)
    return code


def io_counters_of_baseline() -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    _, counters = _run_env([sys.executable, "-c", BASELINE], env)
    return counters


def _run_env(argv: list[str], env: dict[str, str]) -> tuple[int, dict[str, int]]:
    child = subprocess.Popen(argv, env=env)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    counters = io_counters(child.pid)
    return child.wait(), counters


if __name__ == "__main__":
    sys.exit(main())
