"""What each process of a torchrun job reads (issue 36, item 2): bytes, not seconds.

For each command and job layout (1 process; 2 and 4 processes on one node; 2 simulated nodes of
1 process each, two torchrun agents meeting at one rendezvous), every process runs under
``scripts/io_counted.py``, which records the kernel's count of the bytes it read (``rchar``:
page cache or disk alike). A process's figure is that count minus what the same layout reads on
a 72 KB sample (imports, the rendezvous, gloo: ~2.6 MB under torchrun). The table gives the
largest process's reads against the ideal share (the one-process figure / processes) and the
job's total against the one-process figure.

Usage::

    python scripts/bench_job_reads.py OUT_JSON [--checkpoint DIR] [--commands reshard,to-universal,...]

Without ``--checkpoint`` a synthetic ZeRO-3 bf16 checkpoint of 4 ranks is written first
(``scripts/synthetic_ckpt.py --layers 8 --dim 512 --vocab 16384``, ~0.4 GB). Prints a Markdown
table and writes every figure to OUT_JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "sample_ckpts" / "z1_fp32_ws2_frozen_tied" / "checkpoint"
COMMANDS = {
    "reshard": ["reshard", "-w", "8"],
    "to-universal": ["to-universal"],
    "to-dcp": ["to-dcp"],
    "consolidate": ["consolidate", "--max-shard-size", "8MB"],
    "verify": ["verify"],
}
LAYOUTS = [(0, 1), (1, 2), (1, 4), (2, 1)]  # (nodes, processes per node); 0 nodes: no torchrun


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_reads(checkpoint: Path, args: list[str], nodes: int, per_node: int, work: Path) -> list[int]:
    """Run `zckpt <args>` on `checkpoint` (into ``work/out``) on `nodes` x `per_node` processes
    (`nodes` 0: one process, no torchrun); each process's bytes read (rchar minus the baseline
    interpreter's). RuntimeError with the processes' output when the job fails."""
    out, io_dir = work / "out", work / "io"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(io_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [args[0], str(checkpoint)] + ([str(out)] if args[0] != "verify" else []) + [*args[1:], "-q"]
    counted = [str(ROOT / "scripts" / "io_counted.py"), str(io_dir), "--", sys.executable, "-m", "zckpt", *command]
    if nodes == 0:
        launches = [[sys.executable, *counted]]
    else:
        port = _free_port()
        launches = [
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
             "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"reads-{port}", *counted]
            for node in range(nodes)
        ]  # fmt: skip
    agents = [
        subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for launch in launches
    ]
    outputs = [agent.communicate(timeout=3600)[0] for agent in agents]
    records = [json.loads(path.read_text()) for path in sorted(io_dir.glob("io_*.json"))]
    if any(agent.returncode for agent in agents) or len(records) != max(nodes, 1) * per_node:
        raise RuntimeError(
            f"{' '.join(command)} on {nodes}x{per_node} failed:\n" + "\n".join(o[-3000:] for o in outputs)
        )
    return [record["io"]["rchar"] - record["baseline"]["rchar"] for record in records]


def tensor_and_metadata_bytes(checkpoint: Path) -> tuple[int, int]:
    tag = (checkpoint / "latest").read_text().strip()
    tensors = total = 0
    for path in (checkpoint / tag).iterdir():
        total += path.stat().st_size
        with zipfile.ZipFile(path) as archive:
            tensors += sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)
    return tensors, total - tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_json")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--commands", default=",".join(COMMANDS))
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zckpt-reads-") as temp:
        work = Path(temp)
        checkpoint = options.checkpoint
        if checkpoint is None:
            checkpoint = work / "ckpt"
            subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "synthetic_ckpt.py"), str(checkpoint), "--layers", "8",
                 "--dim", "512", "--vocab", "16384", "--stage", "3", "--world-size", "4", "--dtype", "bf16"],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        tensors, metadata = tensor_and_metadata_bytes(checkpoint)
        rows = []
        print(f"input: {tensors / 1e6:.1f} MB of tensors, {metadata / 1e6:.2f} MB of metadata\n")
        print("| command | processes | largest process reads | its share of one process's | job total / one process |")
        print("|---|---|---|---|---|")
        for name in options.commands.split(","):
            args = COMMANDS[name]
            alone = None
            for nodes, per_node in LAYOUTS:
                fixed = max(
                    job_reads(TINY, ["verify"] if name == "verify" else ["reshard", "-w", "2"], nodes, per_node, work)
                )
                reads = [n - fixed for n in job_reads(checkpoint, args, nodes, per_node, work)]
                processes = max(nodes, 1) * per_node
                if alone is None:
                    alone = reads[0]
                share = alone / processes
                row = {
                    "command": name,
                    "nodes": nodes,
                    "processes": processes,
                    "reads": reads,
                    "alone": alone,
                    "largest_over_share": max(reads) / share,
                    "total_over_alone": sum(reads) / alone,
                }
                rows.append(row)
                layout = "1" if nodes == 0 else (f"{processes}" if nodes == 1 else f"{nodes} nodes x {per_node}")
                print(
                    f"| {name} | {layout} | {max(reads) / 1e6:.1f} MB | {row['largest_over_share']:.3f}x "
                    f"| {row['total_over_alone']:.3f}x |",
                    flush=True,
                )
        Path(options.out_json).write_text(
            json.dumps({"tensor_bytes": tensors, "metadata_bytes": metadata, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
