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

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = [pytest.mark.heavy, pytest.mark.slow]
_SPEC = importlib.util.spec_from_file_location("bench_job_reads", ROOT / "scripts" / "bench_job_reads.py")
BENCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(BENCH)

TINY = ROOT / "sample_ckpts" / "z1_fp32_ws2_frozen_tied" / "checkpoint"  # 72 KB: a job that reads ~nothing


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reads") / "ckpt"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "synthetic_ckpt.py"), str(out), "--layers", "4", "--dim", "256",
         "--vocab", "8192", "--stage", "3", "--world-size", "4", "--dtype", "bf16"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out


def _reads(checkpoint: Path, work: Path, args: list[str], nodes: int, per_node: int) -> list[int]:
    """Each process's bytes read by `zckpt <args>` on `checkpoint` on `nodes` x `per_node`
    processes (the benchmark's own runner: scripts/bench_job_reads.py)."""
    return BENCH.job_reads(checkpoint, args, nodes, per_node, work)


_FIXED: dict[tuple[str, int, int], int] = {}
_ALONE: dict[str, int] = {}


def _fixed(tmp_path: Path, args: list[str], nodes: int, per_node: int) -> int:
    """What a process of this command and job layout reads before any work: the same command
    on a 72 KB sample (its imports, the rendezvous, gloo)."""
    key = (args[0], nodes, per_node)
    if key not in _FIXED:
        where = f"{args[0]}_{nodes}x{per_node}"
        _FIXED[key] = max(_reads(TINY, tmp_path / f"tiny_{where}", args, nodes, per_node))
    return _FIXED[key]


def _alone(checkpoint: Path, tmp_path: Path, args: list[str]) -> int:
    """What the command reads in one process (minus the same on the tiny sample)."""
    if args[0] not in _ALONE:
        fixed = _fixed(tmp_path, args, 0, 1)
        _ALONE[args[0]] = _reads(checkpoint, tmp_path / "alone", args, 0, 1)[0] - fixed
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
    tensors, metadata = BENCH.tensor_and_metadata_bytes(checkpoint)
    alone = _alone(checkpoint, tmp_path, args)
    if args[0] not in ("to-dcp", "consolidate"):  # one process reads every tensor byte once
        assert alone <= 1.02 * tensors + metadata, (alone, tensors, metadata)
    # (to-dcp writes the tied head twice; consolidate reads the masters only, the tied one twice)
    fixed = _fixed(tmp_path, args, nodes, per_node)
    reads = [n - fixed for n in _reads(checkpoint, tmp_path / "job", args, nodes, per_node)]
    limit = 1.1 * alone / processes + metadata
    assert max(reads) <= limit, (reads, limit, alone, metadata, fixed)
    # and the job as a whole reads what one process reads, not that once per process
    assert sum(reads) <= 1.05 * alone + processes * metadata, (reads, alone, fixed)
