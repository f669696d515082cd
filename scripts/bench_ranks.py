#!/usr/bin/env python3
"""The rank-axis benchmark (issue 36, item 1): every command at 64 to 4,096 ranks, time and peak RSS.

The byte-axis benchmark (``bench_scaling.py``) grows the params at 2 ranks; this one holds the
model and grows the ranks, where the per-file costs show: each ZeRO-3 rank file holds the whole
model's ``param_shapes`` and a placeholder per param, and every param is cut across every rank.

For each model, ZeRO stage and rank count, a synthetic checkpoint is made once with
``scripts/synthetic_ckpt.py`` (kept in ``--work``), then each command runs as a child process,
one at a time: ``inspect``, ``verify``, ``consolidate``, ``reshard -w W/2`` (at W >= 2),
``to-universal``, and DeepSpeed's ``zero_to_fp32`` with ``--ds-python`` (skipped where it fails;
its error is recorded). Measured per run: wall time, ``ru_maxrss`` of the child (``os.wait4``:
its largest process) and the sampled peak of the summed RSS of its process tree
(``bench_common.TreeSampler``), which is the figure reported.

Models (``--models``):

- ``small``: ``zckpt train``'s GPT at 48 layers x dim 64 (580 params), the issue's own;
- ``deep80``: the same block at 80 layers x dim 64 (962 params), standing in for a 70B-class
  param list (Llama-2-70B's 80 layers of q/k/v/o, gate/up/down and two norms: 723 params); tiny
  widths keep the bytes small, so the cost is the ranks' and the params' count, not the bytes';
- ``llama80``: Llama's own param list at 80 layers x dim 64 (723 params, Hugging Face's names,
  grouped k/v, no biases, untied head: ``synthetic_ckpt.py --block llama``).

Usage::

    python scripts/bench_ranks.py --ranks 64 256 1024 --stages 3 2 --models small --plot
    python scripts/bench_ranks.py --ranks 256 --commands verify consolidate --tree before=/tmp/before --tree zckpt=.

``--tree LABEL=PATH`` (repeatable) runs that tree's zckpt (``PYTHONPATH``; a ``git archive``
export) on the same inputs: each command runs once per tree, back to back, so a before/after
pair sees the same machine load (CPU seconds, user + system, are recorded beside the wall time:
on a shared machine they move less). ``--json`` (default docs/ranks.json) collects every run,
appended to what the file already holds; ``--plot`` draws docs/ranks_time.png and
docs/ranks_rss.png (matplotlib: the ``bench`` extra) from that JSON, ``--plot-labels`` naming the
labels drawn (docs/ranks.json keeps earlier trees' runs as ``before`` and ``previous``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_common import TreeSampler  # noqa: E402

MODELS = {
    "small": ["--layers", "48", "--dim", "64", "--vocab", "256"],
    "deep80": ["--layers", "80", "--dim", "64", "--vocab", "256"],
    "llama80": ["--block", "llama", "--layers", "80", "--dim", "64", "--vocab", "256"],
}
COMMANDS = ("inspect", "verify", "consolidate", "reshard", "to-universal", "zero_to_fp32")


def checkpoint(work: Path, model: str, stage: int, ranks: int) -> Path:
    """The synthetic checkpoint of (model, stage, ranks) in `work`, made once."""
    folder = work / f"{model}_s{stage}_w{ranks}"
    if not (folder / "synthetic.json").exists():
        if folder.exists():
            shutil.rmtree(folder)
        cmd = [sys.executable, str(HERE / "synthetic_ckpt.py"), str(folder), *MODELS[model]]
        cmd += ["--stage", str(stage), "--world-size", str(ranks)]
        print(f"making {folder.name} ...", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return folder


def command_line(command: str, ckpt: Path, out: Path, ranks: int, ds_python: str | None) -> list[str] | None:
    zckpt = [sys.executable, "-m", "zckpt"]
    if command == "inspect":
        return [*zckpt, "inspect", str(ckpt)]
    if command == "verify":
        return [*zckpt, "verify", str(ckpt)]
    if command == "consolidate":
        return [*zckpt, "consolidate", str(ckpt), str(out), "-q"]
    if command == "reshard":
        return None if ranks < 2 else [*zckpt, "reshard", str(ckpt), str(out), "-w", str(ranks // 2), "-q"]
    if command == "to-universal":
        return [*zckpt, "to-universal", str(ckpt), str(out), "-q"]
    if command == "zero_to_fp32" and ds_python:
        return [ds_python, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(out)]
    return None


def measure(cmd: list[str], env: dict[str, str], log: Path, sample_s: float) -> dict[str, Any]:
    """Wall time, the child's ru_maxrss and the sampled peak RSS of its process tree."""
    with log.open("w") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd="/", stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        sampler = TreeSampler(proc.pid, sample_s)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        sampler.stop()
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "maxrss_mib": round(usage.ru_maxrss / 1024, 1),
        "tree_rss_mib": round(max(sampler.peak_bytes, usage.ru_maxrss * 1024) / 2**20, 1),
        "returncode": os.waitstatus_to_exitcode(status),
        "log_tail": log.read_text(errors="replace")[-400:],
    }


def plot(results: list[dict[str, Any]], docs: Path, labels: list[str] | None = None) -> None:
    """Draw the two plots from `results`, the runs of `labels` only (default: every label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["returncode"] == 0 and (labels is None or r["label"] in labels)]
    series: dict[tuple, list[tuple[int, float, float]]] = {}
    for r in ok:
        key = (r["label"], r["model"], r["stage"], r["command"])
        series.setdefault(key, []).append((r["ranks"], r["cpu_s"], r["tree_rss_mib"]))
    for metric, index, ylabel, name in (  # CPU seconds: on a shared machine wall time measures the others
        ("CPU time", 1, "CPU time, user + system (s)", "ranks_time.png"),
        ("peak RSS", 2, "peak RSS of the process tree (MiB)", "ranks_rss.png"),
    ):
        fig, ax = plt.subplots(figsize=(9, 6))
        for (label, model, stage, command), points in sorted(series.items()):
            points = sorted(points)
            if len(points) < 2:
                continue
            ax.plot(
                [p[0] for p in points],
                [p[index] for p in points],
                marker="o",
                linestyle="-" if label == "zckpt" else "--",
                label=f"{command} ({model}, ZeRO-{stage}{'' if label == 'zckpt' else ', ' + label})",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("data-parallel ranks (ZeRO-3: 2 files a rank)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"zckpt on synthetic checkpoints: {metric} against ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(docs / name, dpi=110)
        plt.close(fig)
        print(f"wrote {docs / name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 2], choices=[1, 2, 3])
    ap.add_argument("--models", nargs="+", default=["small", "deep80"], choices=sorted(MODELS))
    ap.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=COMMANDS)
    ap.add_argument("--work", type=Path, default=Path("/tmp/zckpt-bench-ranks"), help="checkpoints and outputs")
    ap.add_argument("--ds-python", help="a Python with DeepSpeed, for zero_to_fp32")
    ap.add_argument(
        "--tree",
        action="append",
        metavar="LABEL=PATH",
        help="a zckpt tree to run (PYTHONPATH), by label; repeatable (default: zckpt=the repository)",
    )
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "ranks.json")
    ap.add_argument("--plot", action="store_true", help="draw docs/ranks_time.png and docs/ranks_rss.png")
    ap.add_argument("--plot-only", action="store_true", help="only draw the plots from --json")
    ap.add_argument(
        "--plot-labels", nargs="+", metavar="LABEL", help="plot these labels' runs only (default: every label)"
    )
    ap.add_argument("--sample-s", type=float, default=0.05)
    args = ap.parse_args(argv)

    results: list[dict[str, Any]] = json.loads(args.json.read_text()) if args.json.exists() else []
    if not args.plot_only:
        args.work.mkdir(parents=True, exist_ok=True)
        trees = [t.split("=", 1) for t in args.tree or [f"zckpt={ROOT}"]]
        envs = {label: dict(os.environ, PYTHONPATH=str(Path(path).resolve())) for label, path in trees}
        for model in args.models:
            for stage in args.stages:
                for ranks in args.ranks:
                    ckpt = checkpoint(args.work, model, stage, ranks)
                    info = json.loads((ckpt / "synthetic.json").read_text())
                    for command in args.commands:
                        out = args.work / "out"
                        cmd = command_line(command, ckpt, out, ranks, args.ds_python)
                        if cmd is None:
                            continue
                        runs = [("deepspeed", envs[trees[0][0]])] if command == "zero_to_fp32" else envs.items()
                        for label, env in runs:
                            shutil.rmtree(out, ignore_errors=True)
                            run = measure(cmd, env, args.work / "log.txt", args.sample_s)
                            shutil.rmtree(out, ignore_errors=True)
                            row = {
                                "label": label,
                                "model": model,
                                "stage": stage,
                                "ranks": ranks,
                                "files": info["files"],
                                "bytes": info["bytes"],
                                "command": command,
                                **run,
                            }
                            results.append(row)
                            print(
                                f"{label:>9} {model:>6} ZeRO-{stage} {ranks:>5} ranks {command:>13}: "
                                f"{run['wall_s']:8.2f} s ({run['cpu_s']:7.2f} s CPU) {run['tree_rss_mib']:8.1f} MiB "
                                f"rc {run['returncode']}",
                                flush=True,
                            )
                            args.json.parent.mkdir(parents=True, exist_ok=True)
                            args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.plot or args.plot_only:
        plot(results, args.json.parent, args.plot_labels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
