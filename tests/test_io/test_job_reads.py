"""Under torchrun each process reads only its share of the input (issue 36, item 2).

The fact checked is the kernel's: each process's ``rchar`` (``/proc/PID/io``: every byte it
read, page cache or disk), recorded by ``scripts/io_counted.py`` around the zckpt process, minus
what an interpreter that only imports zckpt and torch.distributed reads, and minus what the same
job reads on a 72 KB sample (a process of a torchrun job reads ~2.6 MB before any work: the
rendezvous, gloo). Each process may read its share of the input's tensor bytes, 1.1 x (tensor
bytes / processes), plus the input's metadata (every file's pickle and zip directory: each
process plans the whole job), never a record whole because it copied a part of it (the CRC-32 of a record split between processes is
joined across the job). Before this held, each process of a 2-process ``reshard`` read the
whole checkpoint.

The input is a synthetic ZeRO-3 checkpoint of 4 ranks (``scripts/synthetic_ckpt.py``, ~100 MB)
so that the tensor bytes outweigh the import noise; outputs have enough files to balance
(the split is by output file; a safetensors file's bytes are split in pieces).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = [pytest.mark.heavy, pytest.mark.slow]

TINY = ROOT / "sample_ckpts" / "z1_fp32_ws2_frozen_tied" / "checkpoint"  # 72 KB: a job that reads ~nothing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reads") / "ckpt"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "synthetic_ckpt.py"), str(out), "--layers", "4", "--dim", "256",
         "--vocab", "8192", "--stage", "3", "--world-size", "4", "--dtype", "bf16"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out


def _tensor_and_metadata_bytes(checkpoint: Path) -> tuple[int, int]:
    """(bytes inside the tensor data records, every other byte) of the input's tag folder."""
    tensors = total = 0
    for path in (checkpoint / "global_step1000").iterdir():
        total += path.stat().st_size
        with zipfile.ZipFile(path) as archive:
            tensors += sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)
    return tensors, total - tensors


def _reads(checkpoint: Path, out: Path, io_dir: Path, args: list[str], nodes: int, per_node: int) -> list[int]:
    """Run `zckpt <args> <checkpoint> <out>` on `nodes` x `per_node` processes (two simulated
    nodes: two torchrun agents meeting at one rendezvous; `nodes` 0: one process, no torchrun);
    each process's bytes read."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [args[0], str(checkpoint), *([str(out)] if args[0] != "verify" else []), *args[1:], "-q"]
    if nodes == 0:
        counted = [sys.executable, str(ROOT / "scripts" / "io_counted.py"), str(io_dir), "--"]
        subprocess.run([*counted, sys.executable, "-m", "zckpt", *command], env=env, check=True, timeout=600)
        return [_counted(path) for path in sorted(io_dir.glob("io_*.json"))]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(per_node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"reads-{port}",
                str(ROOT / "scripts" / "io_counted.py"),
                str(io_dir),
                "--",
                sys.executable,
                "-m",
                "zckpt",
                *command,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in range(nodes)
    ]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(o[-3000:] for o in outputs)
    paths = sorted(io_dir.glob("io_*.json"))
    assert len(paths) == nodes * per_node
    return [_counted(path) for path in paths]


def _counted(path: Path) -> int:
    record = json.loads(path.read_text())
    assert record["exit_code"] == 0, record
    return record["io"]["rchar"] - record["baseline"]["rchar"]


_FIXED: dict[tuple[str, int, int], int] = {}
_ALONE: dict[str, int] = {}


def _fixed(tmp_path: Path, args: list[str], nodes: int, per_node: int) -> int:
    """What a process of this command and job layout reads before any work: the same command
    on a 72 KB sample (its imports, the rendezvous, gloo)."""
    key = (args[0], nodes, per_node)
    if key not in _FIXED:
        where = f"{args[0]}_{nodes}x{per_node}"
        _FIXED[key] = max(_reads(TINY, tmp_path / f"tiny_{where}", tmp_path / f"io_{where}", args, nodes, per_node))
    return _FIXED[key]


def _alone(checkpoint: Path, tmp_path: Path, args: list[str]) -> int:
    """What the command reads in one process (minus the same on the tiny sample)."""
    if args[0] not in _ALONE:
        fixed = _fixed(tmp_path, args, 0, 1)
        _ALONE[args[0]] = _reads(checkpoint, tmp_path / "alone", tmp_path / "io_alone", args, 0, 1)[0] - fixed
    return _ALONE[args[0]]


@pytest.mark.parametrize(
    ("args", "nodes", "per_node"),
    [
        (["reshard", "-w", "8"], 1, 2),
        (["reshard", "-w", "8"], 1, 4),
        (["reshard", "-w", "8"], 2, 1),  # two simulated nodes
        (["to-universal"], 1, 4),
        (["to-dcp"], 1, 2),
        (["consolidate"], 1, 4),  # one safetensors file: shared in pieces
        (["verify"], 1, 2),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, list) else str(v),
)
def test_each_process_reads_its_share(
    checkpoint: Path, tmp_path: Path, args: list[str], nodes: int, per_node: int
) -> None:
    processes = nodes * per_node
    tensors, metadata = _tensor_and_metadata_bytes(checkpoint)
    alone = _alone(checkpoint, tmp_path, args)
    if args[0] not in ("to-dcp", "consolidate"):  # one process reads every tensor byte once
        assert alone <= 1.02 * tensors + metadata, (alone, tensors, metadata)
    # (to-dcp writes the tied head twice; consolidate reads the masters only, the tied one twice)
    fixed = _fixed(tmp_path, args, nodes, per_node)
    reads = [n - fixed for n in _reads(checkpoint, tmp_path / "out", tmp_path / "io", args, nodes, per_node)]
    limit = 1.1 * alone / processes + metadata
    assert max(reads) <= limit, (reads, limit, alone, metadata, fixed)
    # and the job as a whole reads what one process reads, not that once per process
    assert sum(reads) <= 1.05 * alone + processes * metadata, (reads, alone, fixed)
