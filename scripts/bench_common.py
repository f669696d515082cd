"""Measuring machinery shared by the benchmarks that compare ``zckpt`` commands with other tools.

``bench_reshard.py`` and ``bench_universal.py`` import this; ``bench_consolidate.py`` (the
checkpoint maker and the first benchmark) keeps its own simpler single-process measurement.

- :func:`run_measured` runs one command as a child: wall time (``perf_counter``), user/sys CPU
  and ``ru_maxrss`` from ``os.wait4`` (the largest single process of the child's tree), the peak
  of the summed RSS of the whole process tree sampled from ``/proc`` (and optionally the summed
  PSS, which counts pages shared between forked workers once), CPU time other processes used
  meanwhile (``/proc/stat`` minus the child's), then ``os.sync()`` timed outside the wall time.
- :func:`snapshot_zckpt` copies the ``zckpt`` package to a private folder that every child
  imports, so commits made to the repository while a benchmark runs do not mix code versions.
- :func:`wait_for_quiet` waits for other sessions' CPU use to drop before a run.

Only the standard library: the drivers stay small, since a child's ``ru_maxrss`` can include
the parent's resident size at the time of the fork.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_consolidate as bc  # noqa: E402  (tool_env, dir_size, busy_processes)

# "pythonpath": the folder holding the zckpt copy every child imports; "cwd": where children run
_SNAPSHOT: dict[str, Path] = {}


def child_env() -> dict[str, str]:
    """bench_consolidate's environment, plus PYTHONPATH to the zckpt snapshot (when taken)."""
    env = bc.tool_env()
    if "pythonpath" in _SNAPSHOT:
        env["PYTHONPATH"] = str(_SNAPSHOT["pythonpath"])
    return env


def child_cwd() -> str | None:
    """Children run outside the repository: ``python -m`` puts the working folder first on sys.path."""
    return str(_SNAPSHOT["cwd"]) if "cwd" in _SNAPSHOT else None


# --------------------------------------------------------------------------------------
# Measuring one run
# --------------------------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICK = os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """Non-idle CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:9]]
    return (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / _TICK


def _pss_bytes(pid: int) -> int:
    """Proportional set size of `pid` (``/proc/PID/smaps_rollup``), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            for line in fh:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(root: int, pss: bool = False) -> tuple[int, int, int]:
    """(summed RSS in bytes, summed PSS in bytes or 0, process count) of `root` and all its
    descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    total, total_pss, count, todo = 0, 0, 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/statm", "rb") as fh:
                total += int(fh.read().split()[1]) * _PAGE
            count += 1
        except OSError:
            pass
        if pss:
            total_pss += _pss_bytes(pid)
        todo.extend(children.get(pid, ()))
    return total, total_pss, count


class TreeSampler(threading.Thread):
    """Samples the summed RSS of a process tree every `interval_s` until stopped, and its summed
    PSS at most every `pss_interval_s` (None: never; reading ``smaps_rollup`` walks the page
    tables, ~5x the CPU of ``statm``); keeps the peaks."""

    def __init__(self, root: int, interval_s: float, pss_interval_s: float | None = None) -> None:
        super().__init__(daemon=True)
        self.root, self.interval_s, self.pss_interval_s = root, interval_s, pss_interval_s
        self.peak_bytes, self.peak_pss_bytes, self.peak_procs, self.samples = 0, 0, 0, 0
        self._halt = threading.Event()

    def run(self) -> None:
        last_pss = float("-inf")
        while not self._halt.is_set():
            now = time.perf_counter()
            want_pss = self.pss_interval_s is not None and now - last_pss >= self.pss_interval_s
            if want_pss:
                last_pss = now
            rss, pss, procs = tree_rss(self.root, want_pss)
            self.samples += 1
            self.peak_bytes = max(self.peak_bytes, rss)
            self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
            self.peak_procs = max(self.peak_procs, procs)
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


@dataclass
class Run:
    """One measured run of one variant."""

    variant: str
    round: int
    wall_s: float
    sync_s: float
    cpu_user_s: float  # child and its waited-for children (worker processes)
    cpu_sys_s: float
    max_proc_rss_mib: float  # ru_maxrss from wait4: the largest single process
    tree_rss_mib: float  # sampled peak of the summed RSS of the whole process tree
    tree_procs: int
    rss_samples: int
    other_cpu_s: float  # CPU time used by other processes during the run (/proc/stat minus the child's)
    returncode: int
    output_bytes: int
    output_files: list[str] = field(default_factory=list)
    log_tail: str = ""
    disturbed: bool = False  # a fixture-generation job was seen just before or after the run
    read_bytes: int = 0  # read from the disk (not the page cache) by the tree: ru_inblock
    written_bytes: int = 0  # written (dirtied for writeback) by the tree: ru_oublock


def run_measured(
    variant: str,
    cmd: list[str],
    out_dir: Path,
    log: Path,
    rnd: int,
    sample_s: float,
    keep: bool = False,
    pss_s: float | None = None,
    cls: type = Run,
) -> Any:
    """Run `cmd`; wall time around it, RSS from wait4 and /proc sampling, then time os.sync().

    `out_dir` is removed before the run and, unless `keep`, after it. With `pss_s` the tree's
    summed PSS is sampled too, every `pss_s` seconds, and passed to `cls` (a subclass of
    :class:`Run` with a ``tree_pss_mib`` field) as ``tree_pss_mib``.
    """
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.sync()
    busy = bool(bc.busy_processes())
    with log.open("w") as fh:
        cpu0 = busy_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=child_env(), cwd=child_cwd(), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        sampler = TreeSampler(proc.pid, sample_s, pss_s)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        machine_cpu = busy_cpu_s() - cpu0
        sampler.stop()
    proc.returncode = os.waitstatus_to_exitcode(status)  # tell Popen it has been reaped
    t1 = time.perf_counter()
    os.sync()
    sync_s = time.perf_counter() - t1
    files = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file()) if out_dir.exists() else []
    out_bytes = bc.dir_size(out_dir) if out_dir.exists() else 0
    tail = ""
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    if not keep and out_dir.exists():
        shutil.rmtree(out_dir)
        os.sync()
    other = max(0.0, machine_cpu - usage.ru_utime - usage.ru_stime)
    # another process took more than a quarter of the machine's CPUs on average
    busy = busy or bool(bc.busy_processes()) or other > 0.25 * wall * (os.cpu_count() or 1)
    extra = {"tree_pss_mib": sampler.peak_pss_bytes / 2**20} if pss_s is not None else {}
    return cls(
        variant,
        rnd,
        wall,
        sync_s,
        usage.ru_utime,
        usage.ru_stime,
        usage.ru_maxrss / 1024.0,
        sampler.peak_bytes / 2**20,
        sampler.peak_procs,
        sampler.samples,
        other,
        proc.returncode,
        out_bytes,
        files,
        tail,
        busy,
        read_bytes=usage.ru_inblock * 512,
        written_bytes=usage.ru_oublock * 512,
        **extra,
    )


def wait_for_quiet(max_wait_s: float, max_busy_cpus: float = 0.3, window_s: float = 2.0) -> float:
    """Wait (at most `max_wait_s`) until the machine used under `max_busy_cpus` CPUs over the
    last `window_s`; return seconds waited. Other sessions share this machine."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        c0 = busy_cpu_s()
        time.sleep(window_s)
        if (busy_cpu_s() - c0) / window_s < max_busy_cpus:
            break
    return time.perf_counter() - t0


def snapshot_zckpt(python: str, dest: Path, cwd: Path) -> dict[str, Any]:
    """Copy the zckpt package `python` imports to ``dest/zckpt`` and make every child import that
    copy: others may edit or commit the repository while this runs, and all runs must measure
    the same code. Returns where it came from (git commit, uncommitted changes)."""
    proc = subprocess.run(
        [python, "-c", "import zckpt, os; print(os.path.dirname(zckpt.__file__))"],
        capture_output=True,
        text=True,
        cwd=cwd,
    )
    if proc.returncode != 0:
        sys.exit(f"{python} cannot import zckpt: {proc.stderr.strip()[-300:]}")
    package = Path(proc.stdout.strip())
    root = package.parent
    out: dict[str, Any] = {"zckpt_package": str(package)}

    def git(*a: str) -> str:
        p = subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else ""

    out["commit"] = git("rev-parse", "--short", "HEAD")
    out["commit_subject"] = git("log", "-1", "--format=%s")[:100]
    out["dirty_files"] = git("status", "--short", "--", package.name).splitlines()
    diff = subprocess.run(["git", "-C", str(root), "diff", "HEAD", "--", package.name], capture_output=True)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(package, dest / "zckpt", ignore=shutil.ignore_patterns("__pycache__"))
    if diff.stdout:
        (dest / "zckpt.diff").write_bytes(diff.stdout)
        out["diff_sha256"] = hashlib.sha256(diff.stdout).hexdigest()[:16]
    out["snapshot"] = str(dest / "zckpt")
    out["taken_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _SNAPSHOT.update(pythonpath=dest, cwd=cwd)
    check = subprocess.run(
        [python, "-c", "import zckpt; print(zckpt.__file__)"],
        env=child_env(),
        cwd=child_cwd(),
        capture_output=True,
        text=True,
    )
    imported = check.stdout.strip()
    if not imported.startswith(str(dest)):
        sys.exit(f"children would import {imported or check.stderr.strip()[-300:]}, not the snapshot in {dest}")
    return out


def describe_snapshot(src: dict[str, Any]) -> str:
    """One line: which zckpt code the children ran."""
    return (
        f"snapshot of {src['zckpt_package']} taken {src['taken_at']} at {src['commit']} "
        f"({src['commit_subject'][:60]})"
        + (
            f" + uncommitted changes in {', '.join(d.split()[-1] for d in src['dirty_files'])} (diff sha256 "
            f"{src.get('diff_sha256')})"
            if src.get("dirty_files")
            else ", no uncommitted changes"
        )
    )


def filesystem_of(path: Path) -> str:
    """Device and file system type of `path` (``df``)."""
    fs = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True)
    return " ".join(fs.stdout.split()[2:]) if fs.returncode == 0 else "?"


def damon_reclaim() -> str | None:
    """A line describing any active DAMON scheme that pages memory out (``/sys/kernel/mm/damon``),
    or None. Such a scheme evicts page-cache pages left unused for a while, so a checkpoint read
    once is not "warm" a minute later: re-read the input right before each run."""
    root = Path("/sys/kernel/mm/damon/admin/kdamonds")
    found = []
    for kd in sorted(root.glob("[0-9]*")):
        try:
            if (kd / "state").read_text().strip() != "on":
                continue
            for ctx in sorted((kd / "contexts").glob("[0-9]*")):
                aggr_us = int((ctx / "monitoring_attrs/intervals/aggr_us").read_text())
                for sch in sorted((ctx / "schemes").glob("[0-9]*")):
                    action = (sch / "action").read_text().strip()
                    if action not in ("pageout", "lru_deprio", "cold"):
                        continue
                    age = int((sch / "access_pattern/age/min").read_text())
                    found.append(
                        f"kdamond {kd.name}: {action} of memory idle >= {age * aggr_us / 1e6:.0f} s "
                        f"({(ctx / 'operations').read_text().strip()})"
                    )
        except (OSError, ValueError):
            continue
    return "; ".join(found) or None


def stats(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def print_run_header(result: dict[str, Any]) -> None:
    """The lines every benchmark report starts with: command, machine, versions, zckpt measured."""
    f, v = result["machine"], result["machine"]["versions"]
    print()
    print("=" * 100)
    print(f"command: {' '.join(result['argv'])}")
    print(
        f"machine: {f['nproc']} CPUs ({f['nproc_affinity']} usable), {f['mem_total_gib']} GiB RAM, "
        f"{f['cpu_model']}, Linux {f['kernel']}; disk {result['filesystem']}"
    )
    print(
        f"versions: python {v.get('python')}, torch {v.get('torch')}, deepspeed {v.get('deepspeed')}, "
        f"zckpt {v.get('zckpt')}, numpy {v.get('numpy')}"
    )
    if result.get("zckpt_source"):
        print(f"zckpt measured: {describe_snapshot(result['zckpt_source'])}")


def variant_stats(runs: list[Run], variant: str) -> dict[str, Any] | None:
    """Medians/min/max of one variant's successful runs (None if none succeeded)."""
    rs = [r for r in runs if r.variant == variant and r.returncode == 0]
    if not rs:
        return None
    pss = [getattr(r, "tree_pss_mib", None) for r in rs]
    return {
        "ok_runs": len(rs),
        "failed_runs": sum(1 for r in runs if r.variant == variant and r.returncode != 0),
        "wall_s": stats([r.wall_s for r in rs]),
        "sync_s": stats([r.sync_s for r in rs]),
        "wall_plus_sync_s": stats([r.wall_s + r.sync_s for r in rs]),
        "cpu_s": stats([r.cpu_user_s + r.cpu_sys_s for r in rs]),
        "cpu_user_s": stats([r.cpu_user_s for r in rs]),
        "cpu_sys_s": stats([r.cpu_sys_s for r in rs]),
        "max_proc_rss_mib": stats([r.max_proc_rss_mib for r in rs]),
        "tree_rss_mib": stats([r.tree_rss_mib for r in rs]),
        **({"tree_pss_mib": stats(pss)} if None not in pss else {}),
        "tree_procs": max(r.tree_procs for r in rs),
        "output_bytes": rs[0].output_bytes,
    }


def time_ratios(runs: list[Run], summary: dict[str, Any], num: str, den: str) -> dict[str, Any] | None:
    """Wall, wall+sync and CPU of variant `num` over `den`: ratios of the medians, and the ratios
    of runs of the same round (the machine's load drifts between rounds)."""
    a, b = summary.get(num), summary.get(den)
    if not a or not b:
        return None
    pairs = [
        (r, c)
        for r in runs
        if r.variant == num and r.returncode == 0
        for c in runs
        if c.variant == den and c.round == r.round and c.returncode == 0
    ]
    per_wall = [r.wall_s / c.wall_s for r, c in pairs]
    per_sync = [(r.wall_s + r.sync_s) / (c.wall_s + c.sync_s) for r, c in pairs]
    return {
        "wall": a["wall_s"]["median"] / b["wall_s"]["median"],
        "wall_plus_sync": a["wall_plus_sync_s"]["median"] / b["wall_plus_sync_s"]["median"],
        "cpu": a["cpu_s"]["median"] / b["cpu_s"]["median"],
        "wall_per_round": per_wall,
        "wall_per_round_median": statistics.median(per_wall) if per_wall else None,
        "wall_plus_sync_per_round": per_sync,
        "wall_plus_sync_per_round_median": statistics.median(per_sync) if per_sync else None,
    }
