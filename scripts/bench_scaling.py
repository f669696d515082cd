#!/usr/bin/env python3
"""The cost curve (issue 21): time and peak memory of zckpt's commands against checkpoint size,
beside the I/O floor and DeepSpeed's own tools, as a table and two plots.

For every size, ZeRO stage and world size asked, a synthetic bf16 checkpoint of ``zckpt train``'s
GPT (``scripts/synthetic_ckpt.py``: zckpt's writer streaming a synthetic training state, in
DeepSpeed 0.19.8's layout, checked against a checkpoint DeepSpeed wrote by
``tests/test_interop/test_interop_synthetic.py``) is written, then these run in alternation,
``--repeats`` rounds, each measured by ``bench_common.run_measured`` (wall time, then the
``sync`` it leaves, timed apart; peak RSS of the whole process tree sampled from /proc):

* floors: ``cp -r`` of the checkpoint (then sync; where the copy does not fit, of its largest
  files that fit), and once per size a cold read of it and ``dd`` of as many bytes (direct I/O);
* zckpt: ``consolidate`` (fp32, bf16), ``reshard`` to world size + 1, ``to-universal``,
  ``to-dcp``, ``verify``; ``reshard``, ``to-universal`` and ``to-dcp`` under
  ``torchrun --nproc-per-node N`` too (``--processes``, 1 and 2 by default);
* DeepSpeed (``--ds-python``, a venv with DeepSpeed 0.19.8): ``zero_to_fp32`` and
  ``ds_to_universal``, where its measured memory per param says the machine holds it.

Before each run the checkpoint is dropped from the page cache (``--warm`` keeps it), so that
every size is read from the disk, as a checkpoint larger than memory is. Each run's bytes read
from the disk and written (``ru_inblock``, ``ru_oublock`` of the process tree) give its I/O
floor: the seconds this disk, at its cold-read and ``dd`` speeds, needs for those bytes.

Free disk is checked before each checkpoint and each command's output (2 GB of margin): what
does not fit is left out, and the table says so. Run it on a quiet machine::

    python scripts/bench_scaling.py --workdir /data/bench --sizes 0.4e9 1.2e9 3e9 --stages 3 2 \\
        --world-sizes 2 4 --repeats 2 --json BENCH_scaling.json
    python scripts/bench_scaling.py --plot BENCH_scaling.json --figures docs/   # needs matplotlib

The table (markdown) is printed; ``--plot RUN.json`` writes ``RUN_time_per_gb.png`` and
``RUN_peak_rss.png``: a panel per ZeRO stage and world size, one line per command and tool, the
floors dashed, DeepSpeed's tools dotted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common  # noqa: E402
import bench_consolidate as bc  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MARGIN = 2 * 10**9
FLOOR_SAMPLE_BYTES = 8 * 10**9  # the read and dd floors measure a speed on at most this many bytes
# DeepSpeed's tools hold the model: bytes of peak RSS per param, measured (BENCHMARKS.md: zero_to_fp32
# 3.35 GB at 400M params, ds_to_universal at 400M); a size is run where this fits in 80% of RAM
DS_BYTES_PER_PARAM = {"zero_to_fp32": 8.5, "ds_to_universal": 12.0}


def zckpt(python: str, *args: str, processes: int = 0) -> list[str]:
    """A zckpt command line, alone or under torchrun with `processes` processes."""
    if processes:
        launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
        return [python, *launcher, "--master-port", str(bc.free_port()), "-m", "zckpt", *args]
    return [python, "-m", "zckpt", *args]


def variants(
    python: str,
    ds_python: str | None,
    ckpt: Path,
    out: Path,
    world: int,
    stage: int,
    params: int,
    processes: list[int],
    left_out: dict[str, str],
    full: bool = True,
) -> dict[str, list[str]]:
    """name -> command line, for one checkpoint (every output goes to `out`); DeepSpeed's tools
    where the machine's memory would not hold them go into `left_out`, with why. Without `full`,
    zckpt's commands alone, run once each (no torchrun variants, no DeepSpeed)."""
    tag = ckpt / "global_step1000"
    commands = {
        "consolidate fp32": zckpt(python, "consolidate", str(ckpt), str(out), "-q"),
        "consolidate bf16": zckpt(python, "consolidate", str(ckpt), str(out), "--dtype", "bf16", "-q"),
        "reshard": zckpt(python, "reshard", str(ckpt), str(out), "-w", str(world + 1), "-q"),
        "to-universal": zckpt(python, "to-universal", str(ckpt), str(out), "-q"),
        "to-dcp": zckpt(python, "to-dcp", str(ckpt), str(out), "-q"),
        "verify": zckpt(python, "verify", str(ckpt)),
    }
    if not full:
        return commands
    for n in processes:  # torchrun's own cost shows in reshard x1; x2 and up share the work
        commands[f"reshard x{n}"] = zckpt(
            python, "reshard", str(ckpt), str(out), "-w", str(world + 1), "-q", processes=n
        )
    for n in processes:
        if n > 1:
            commands[f"to-universal x{n}"] = zckpt(python, "to-universal", str(ckpt), str(out), "-q", processes=n)
            commands[f"to-dcp x{n}"] = zckpt(python, "to-dcp", str(ckpt), str(out), "-q", processes=n)
    if ds_python:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        for tool, need in DS_BYTES_PER_PARAM.items():
            if need * params >= 0.8 * ram:
                left_out[f"DeepSpeed {tool}"] = (
                    f"it would need about {need * params / 1e9:.0f} GB of memory, {ram / 2**30:.1f} GiB here"
                )
        if DS_BYTES_PER_PARAM["zero_to_fp32"] * params < 0.8 * ram:
            commands["DeepSpeed zero_to_fp32"] = [ds_python, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(out)]
        if DS_BYTES_PER_PARAM["ds_to_universal"] * params < 0.8 * ram:
            commands["DeepSpeed ds_to_universal"] = [
                ds_python,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(tag),
                "--output_folder",
                str(out / "universal"),
                # ZeRO-1/2 runs that saved no universal_checkpoint_info need it (FORMAT_NOTES)
                *(["--inject_missing_state"] if stage < 3 else []),
            ]
    return commands


def dd_floor(workdir: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` of zeros with direct I/O, then sync (the disk's write speed)."""
    target = workdir / "dd.bin"
    block = 64 * 2**20
    started = time.perf_counter()
    os.system(f"dd if=/dev/zero of={target} bs={block} count={max(1, nbytes // block)} oflag=direct status=none")
    os.sync()
    seconds = time.perf_counter() - started
    target.unlink(missing_ok=True)
    return seconds


def evict(folder: Path) -> None:
    """Drop `folder`'s files from the page cache (written back first), so that each run reads the
    checkpoint from the disk, as it reads one larger than memory, at every size alike."""
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_floor(folder: Path, most: int = FLOOR_SAMPLE_BYTES) -> tuple[float, int]:
    """Seconds to read the files of `folder` from the disk (evicted first) into one buffer, and
    the bytes read: all of them, or the first `most` (enough to measure a speed)."""
    evict(folder)
    buffer = bytearray(16 * 2**20)
    done = 0
    started = time.perf_counter()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb", buffering=0) as fh:
                while done < most and (got := fh.readinto(buffer)):
                    done += got
    return time.perf_counter() - started, done


def copy_floor(ckpt: Path, out: Path, free: int) -> tuple[list[str], int]:
    """The floor command, `cp -r` of the checkpoint (then sync, timed by the runner), and the
    bytes it copies. Where the copy would not fit beside the checkpoint, the largest files that do
    fit are copied instead (the time per GB is still the disk's)."""
    total = bc.dir_size(ckpt)
    if total + MARGIN < free:
        return ["cp", "-r", str(ckpt), str(out)], total
    files, copied = [], 0
    for path in sorted((p for p in ckpt.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size):
        if copied + path.stat().st_size + MARGIN < free:
            files.append(str(path))
            copied += path.stat().st_size
    return ["sh", "-c", 'mkdir -p "$0" && cp "$@" "$0"', str(out), *files], copied


def bench_one(args: argparse.Namespace, size: float, stage: int, world: int) -> dict[str, Any]:
    import synthetic_ckpt

    config = synthetic_ckpt.gpt_config(size, 0, 0, 0, 0)
    workdir = args.workdir
    ckpt, out = workdir / "ckpt", workdir / "out"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    params = 12 * config.layers * config.dim**2 + (config.vocab + config.seq_len) * config.dim
    estimate = params * (2 + 12) * (1.02 if stage == 3 else 1.0)  # bf16 weights, fp32 master and moments
    case = {"size": size, "params": params, "stage": stage, "world_size": world, "model": asdict(config)}
    free = shutil.disk_usage(workdir).free
    if estimate + MARGIN > free:
        return {
            **case,
            "skipped": f"the checkpoint needs about {estimate / 1e9:.0f} GB of disk, {free / 1e9:.0f} GB free",
        }
    made = synthetic_ckpt.write_synthetic(ckpt, config, world, stage, "bf16", workdir / "noise")
    ckpt_bytes = bc.dir_size(ckpt)
    left_out: dict[str, str] = {}
    full = world == args.world_sizes[0]
    commands = variants(args.python, args.ds_python, ckpt, out, world, stage, params, args.processes, left_out, full)
    free = shutil.disk_usage(workdir).free
    for name in list(commands):  # each output must fit beside the checkpoint
        if output_bytes(name, params, ckpt_bytes) + MARGIN > free:
            left_out[name] = (
                f"its output needs about {output_bytes(name, params, ckpt_bytes) / 1e9:.0f} GB, {free / 1e9:.0f} GB free"
            )
            del commands[name]
    if args.commands:  # only these (and the floors)
        commands = {name: cmd for name, cmd in commands.items() if name in args.commands}
        left_out = {name: why for name, why in left_out.items() if name in args.commands}
    copy_cmd, copy_bytes = copy_floor(ckpt, out, free)
    commands = {"floor: cp -r": copy_cmd, **commands}
    runs = []
    for rnd in range(args.repeats):
        for name, cmd in commands.items():
            if name.startswith("DeepSpeed") and rnd >= args.competitor_repeats:
                continue
            common.wait_for_quiet(args.quiet_wait)
            if not args.warm:
                evict(ckpt)
            run = common.run_measured(name, cmd, out, workdir / "run.log", rnd, sample_s=0.05)
            runs.append(asdict(run))
            status = "" if run.returncode == 0 else f" FAILED ({run.returncode}): {run.log_tail[-300:]}"
            print(
                f"  {size:.1e} z{stage} w{world} {name}: {run.wall_s + run.sync_s:.1f} s, {run.tree_rss_mib:.0f} MiB{status}"
            )
    read_s, read_bytes = read_floor(ckpt)
    dd_bytes = min(ckpt_bytes, FLOOR_SAMPLE_BYTES, shutil.disk_usage(workdir).free - MARGIN)
    dd_s = dd_floor(workdir, dd_bytes)
    shutil.rmtree(ckpt, ignore_errors=True)
    return {
        **case,
        "checkpoint_bytes": ckpt_bytes,
        "write": made,
        "cold": not args.warm,
        "copy_bytes": copy_bytes,
        "read_s": read_s,
        "read_floor_bytes": read_bytes,
        "dd_write_s": dd_s,
        "dd_bytes": dd_bytes,
        "runs": runs,
        "left_out": left_out,
    }


def output_bytes(name: str, params: int, ckpt_bytes: int) -> float:
    """About how much a command writes: weights files by their dtype, the rest about the checkpoint."""
    if name == "verify":
        return 0
    if "fp32" in name:  # consolidate fp32, zero_to_fp32
        return 4 * params
    if "bf16" in name:
        return 2 * params
    return 1.05 * ckpt_bytes


def summary(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """variant -> median seconds (wall + sync), seconds per GB of checkpoint (of the bytes copied,
    for the copy floor), peak tree RSS (MiB), GB read from the disk and written, and the I/O floor:
    the seconds this disk needs to read and write those bytes (its cold-read and `dd` speeds)."""
    gb = result["checkpoint_bytes"] / 1e9
    read_bytes = result.get("read_floor_bytes", result["checkpoint_bytes"])
    read_speed = read_bytes / result["read_s"] if result.get("read_s") else 0.0
    dd_bytes = result.get("dd_bytes", result["checkpoint_bytes"])
    write_speed = dd_bytes / result["dd_write_s"]
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["variant"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["variant"] == name and r["returncode"] == 0]
        if not runs:  # every run failed: the table says so, the plots leave it out
            failed = [r for r in result["runs"] if r["variant"] == name]
            out[name] = {"failed": float(failed[0]["returncode"])}
            continue
        seconds = statistics.median(r["wall_s"] + r["sync_s"] for r in runs)
        per = result.get("copy_bytes", result["checkpoint_bytes"]) / 1e9 if name == "floor: cp -r" else gb
        row = {
            "s": seconds,
            "s_per_gb": seconds / per,
            "rss_mib": max(r["tree_rss_mib"] for r in runs),
            "disturbed": float(sum(bool(r.get("disturbed")) for r in runs)),
        }
        if read_speed:
            read = statistics.median(r.get("read_bytes", 0) for r in runs)
            written = statistics.median(r.get("written_bytes", 0) for r in runs)
            row.update(
                read_gb=read / 1e9, written_gb=written / 1e9, io_floor_s=read / read_speed + written / write_speed
            )
        out[name] = row
    if read_speed:
        out["floor: cold read"] = {
            "s": result["read_s"],
            "s_per_gb": result["read_s"] / (read_bytes / 1e9),
            "rss_mib": 0.0,
        }
    out["floor: dd write"] = {
        "s": result["dd_write_s"],
        "s_per_gb": result["dd_write_s"] / (dd_bytes / 1e9),
        "rss_mib": 0.0,
    }
    return out


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table: one row per command and checkpoint."""
    lines = [
        "| checkpoint | command | s | s/GB | x cp floor | GB read | GB written | x I/O floor | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        label = f"{result['params'] / 1e9:.2f}B z{result['stage']} w{result['world_size']}"
        if "skipped" in result:
            lines.append(f"| {label} | skipped: {result['skipped']} | | | | | | | |")
            continue
        label += f" ({result['checkpoint_bytes'] / 1e9:.1f} GB)"
        rows = summary(result)
        floor = rows.get("floor: cp -r", {}).get("s_per_gb")
        for name, why in result.get("left_out", {}).items():
            lines.append(f"| {label} | {name}: left out, {why} | | | | | | | |")
        for name, row in rows.items():
            if "failed" in row:
                lines.append(f"| {label} | {name}: every run failed (exit {row['failed']:.0f}) | | | | | | | |")
                continue
            shown = name
            if (
                name == "floor: cp -r"
                and result.get("copy_bytes", result["checkpoint_bytes"]) < result["checkpoint_bytes"]
            ):
                shown = f"floor: cp of {result['copy_bytes'] / 1e9:.1f} GB (the rest would not fit)"
            measured = {"floor: cold read": "read_floor_bytes", "floor: dd write": "dd_bytes"}.get(name)
            if measured and result.get(measured, result["checkpoint_bytes"]) < result["checkpoint_bytes"]:
                shown = f"{name} of {result[measured] / 1e9:.1f} GB"
            if row.get("disturbed"):  # another process took over a quarter of the CPUs during the run
                shown += " (disturbed)"
            ratio = f"{row['s_per_gb'] / floor:.2f}" if floor else ""
            io = ""
            if row.get("io_floor_s"):
                io = f"{row['s'] / row['io_floor_s']:.2f}"
            read = f"{row['read_gb']:.1f}" if "read_gb" in row else ""
            written = f"{row['written_gb']:.1f}" if "written_gb" in row else ""
            lines.append(
                f"| {label} | {shown} | {row['s']:.1f} | {row['s_per_gb']:.2f} | {ratio} | {read} | {written} | {io} "
                f"| {row['rss_mib']:.0f} |"
            )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], figures: Path, stem: str = "scaling") -> list[Path]:
    """Time per GB and peak RSS against params: one panel per ZeRO stage and world size, one
    line per command (the same colour in every panel), floors dashed, DeepSpeed's tools dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    figures.mkdir(parents=True, exist_ok=True)
    done = [r for r in results if "runs" in r]
    stages = sorted({r["stage"] for r in done}, reverse=True)
    worlds = sorted({r["world_size"] for r in done})
    names = list(dict.fromkeys(v for r in done for v in summary(r)))
    colors = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(names)}
    written = []
    for key, ylabel, file_name, log in (
        ("s_per_gb", "seconds per GB of checkpoint (wall + sync)", f"{stem}_time_per_gb.png", True),
        ("rss_mib", "peak RSS of the process tree (MiB)", f"{stem}_peak_rss.png", True),
    ):
        fig, axes = plt.subplots(
            len(stages), len(worlds), figsize=(6 * len(worlds) + 3, 4.2 * len(stages)), sharey=True, squeeze=False
        )
        for row, stage in enumerate(stages):
            for col, world in enumerate(worlds):
                ax = axes[row][col]
                lines: dict[str, list[tuple[float, float]]] = {}
                for result in done:
                    if (result["stage"], result["world_size"]) != (stage, world):
                        continue
                    for variant, values in summary(result).items():
                        if (key == "rss_mib" and variant.startswith("floor")) or "failed" in values:
                            continue
                        lines.setdefault(variant, []).append((result["params"] / 1e9, values[key]))
                for variant, points in lines.items():
                    points.sort()
                    style = "--" if variant.startswith("floor") else ":" if variant.startswith("DeepSpeed") else "-"
                    xs, ys = [p[0] for p in points], [p[1] for p in points]
                    ax.plot(xs, ys, style, marker="o", color=colors[variant], label=variant)
                ax.set_title(f"ZeRO-{stage}, bf16, {world} ranks")
                ax.set_xlabel("params (billions)")
                if log:  # ratios read as distances; labels at 1, 2, 5 of each decade
                    ax.set_yscale("log")
                    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
                    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
                    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
                ax.grid(True, alpha=0.3)
            axes[row][0].set_ylabel(ylabel)
        handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
        order = [n for n in names if n in handles]
        fig.legend([handles[n] for n in order], order, fontsize=8, loc="center right")
        fig.tight_layout(rect=(0, 0, 1 - 2.6 / (6 * len(worlds) + 3), 1))
        path = figures / file_name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_scaling"))
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.4e9, 1.2e9, 3e9])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 2])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument(
        "--processes",
        type=int,
        nargs="*",
        default=[1, 2],
        help="torchrun process counts for reshard, to-universal, to-dcp",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--competitor-repeats", type=int, default=1, help="rounds (of --repeats) that run DeepSpeed's tools"
    )
    ap.add_argument("--commands", nargs="+", help="run only these commands (names as in the table), and the floors")
    ap.add_argument("--warm", action="store_true", help="leave the checkpoint in the page cache between runs")
    ap.add_argument("--quiet-wait", type=float, default=60, help="seconds to wait for a quiet machine before each run")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs zckpt")
    ap.add_argument("--ds-python", default=str(REPO / ".venv-interop" / "bin" / "python"))
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--plot", type=Path, help="plot the results of this JSON file (no runs)")
    ap.add_argument("--figures", type=Path, default=REPO / "docs")
    args = ap.parse_args(argv)
    if args.plot:
        results = json.loads(args.plot.read_text())["results"]
        print(table(results))
        for path in plot(results, args.figures, args.plot.stem):
            print(f"wrote {path}")
        return 0
    if args.ds_python and not Path(args.ds_python).exists():
        args.ds_python = None
    args.workdir.mkdir(parents=True, exist_ok=True)
    snapshot = common.snapshot_zckpt(args.python, args.workdir / "snapshot", args.workdir)
    results = []
    started = time.time()
    for size in args.sizes:
        for stage in args.stages:
            for world in args.world_sizes:
                results.append(bench_one(args, size, stage, world))
                if args.json:
                    args.json.write_text(json.dumps({"snapshot": snapshot, "results": results}, indent=1))
    print(table(results))
    print(f"total {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
