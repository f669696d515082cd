"""The signal matrix (issue 17): every writing command, signalled at random moments, under CPU load.

Each run starts a real ``zckpt`` process (the installed command, the way a user or Slurm runs
it), sends SIGINT, SIGTERM or SIGHUP after a random delay between 0 and the uninterrupted run's
duration (start-up included), and then checks:

- it exits within ``--deadline`` seconds of the signal (else: a hang; each thread's kernel
  state and gdb's native stacks, then its Python stacks (faulthandler: PYTHONFAULTHANDLER=1 and
  SIGABRT) are printed; a process that exited while another holds its stderr is named);
- its stderr is exactly one line ``zckpt: error: interrupted by SIG...`` and its exit code
  128 + the signal's number, or, when it finished before the signal landed, exit 0 and no error;
- nothing is left behind: no zckpt temporary name or staging folder anywhere under the work
  folder, and after an interrupted run the output path absent or whole (past its commit a run
  finishes, then takes the signal; ``zckpt verify`` passes on it; train's earlier saves stay);
- a run that exited 0 left a complete output (``zckpt verify`` passes on it).

``--busy K`` runs K processes that burn a CPU each beside it (default 2: the loaded machine of
the issue). Prints one line per problem and a summary table; exit 1 on any problem.

    python scripts/signal_matrix.py --runs 500
    python scripts/signal_matrix.py --runs 60 --commands consolidate-bf16,reshard --busy 0
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEFT = ROOT / "sample_ckpts" / "peft_lora" / "llama_z3_bf16_ws2"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Command:
    name: str
    argv: tuple[str, ...]  # {ck} the checkpoint, {out} the output path
    verify: bool = True  # `zckpt verify {out}` after a run that exited 0


COMMANDS = (
    Command("consolidate-fp32", ("consolidate", "{ck}", "{out}")),
    Command("consolidate-bf16", ("consolidate", "{ck}", "{out}", "--dtype", "bf16")),
    Command("consolidate-torch", ("consolidate", "{ck}", "{out}", "--format", "torch")),
    Command("consolidate-sharded", ("consolidate", "{ck}", "{out}", "--max-shard-size", "50MB")),
    Command("reshard", ("reshard", "{ck}", "{out}", "--world-size", "3")),
    Command("to-universal", ("to-universal", "{ck}", "{out}")),
    Command("peft-merge", ("consolidate", str(PEFT / "checkpoint-3"), "{out}", "--merge-into", str(PEFT / "base"))),
    Command(
        "train-save",
        (
            "train",
            "--out",
            "{out}",
            "--steps",
            "2",
            "--save-every",
            "1",
            "--layers",
            "2",
            "--dim",
            "128",
            "--vocab",
            "2048",
        ),
    ),
)


@dataclass
class Outcome:
    command: str
    signal: str
    delay: float
    landed: bool
    code: int
    exit_after_signal: float | None
    problems: list[str]
    elapsed: float = 0.0  # start to exit
    before_start: bool = False  # killed by the signal's default action before zckpt's first line ran


def zckpt() -> list[str]:
    found = shutil.which("zckpt", path=os.path.dirname(sys.executable)) or shutil.which("zckpt")
    return [found] if found else [sys.executable, "-m", "zckpt"]


def leftovers(folder: Path) -> list[str]:
    return sorted(
        str(Path(root, n).relative_to(folder))
        for root, dirs, files in os.walk(folder)
        for n in dirs + files
        if ".zckpt-" in n
    )


def make_checkpoint(work: Path, layers: int, dim: int) -> Path:
    """A 2-rank ZeRO-3 bf16 checkpoint written by `zckpt train` (a few hundred MB)."""
    out = work / "input"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(29500 + os.getpid() % 1000),
            "-m",
            "zckpt",
            "train",
            "--out",
            str(out),
            "--steps",
            "1",
            "--layers",
            str(layers),
            "--dim",
            str(dim),
            "--heads",
            "8",
            "--vocab",
            "8192",
            "--seq-len",
            "32",
            "--micro-batch",
            "1",
            "--dtype",
            "bf16",
            "-q",
        ],
        check=True,
        cwd=work,
    )
    return out


def native_state(process: subprocess.Popen) -> str:
    """Each thread's name, state and kernel wait channel, and gdb's native backtraces: a thread
    stuck in C (a lock in a destructor at exit, a syscall) shows no Python frame to faulthandler."""
    pid = process.pid
    if process.poll() is not None:
        pipe = os.readlink(f"/proc/self/fd/{process.stderr.fileno()}")  # pipe:[inode], the same for both ends
        holders = []
        for fd_dir in Path("/proc").glob("[0-9]*/fd"):
            if fd_dir.parent.name == str(os.getpid()):
                continue
            try:
                if any(os.readlink(fd) == pipe for fd in fd_dir.iterdir()):
                    holders.append(f"{fd_dir.parent.name} {(fd_dir.parent / 'cmdline').read_bytes()[:200]!r}")
            except OSError:
                continue
        return f"the process exited ({process.returncode}); its stderr pipe is still open in: {holders}"
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            comm = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip()
            lines.append(f"  thread {task.name} {comm!r} state {state} wchan {wchan}")
        except OSError:
            continue
    gdb = shutil.which("gdb")
    if gdb:
        try:
            lines.append(
                subprocess.run(
                    [gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                ).stdout[-20000:]
            )
        except subprocess.TimeoutExpired:
            lines.append("gdb took over 60 s")
    return "native state:\n" + "\n".join(lines)


def run_once(command: Command, ck: Path, work: Path, signum: int | None, delay: float, deadline: float) -> Outcome:
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    argv = [*zckpt(), *(a.replace("{ck}", str(ck)).replace("{out}", str(out)) for a in command.argv)]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    env.pop("ZCKPT_DEBUG", None)
    start = time.monotonic()
    process = subprocess.Popen(
        argv,
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in SIGNALS],
    )
    problems: list[str] = []
    landed, sent_at = False, None
    if signum is not None:
        try:
            process.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            process.send_signal(signum)
            landed, sent_at = True, time.monotonic()
    try:
        _, stderr = process.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        native = native_state(process)  # what the kernel and gdb see, before faulthandler's Python stacks
        process.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER=1: every thread's Python stack on stderr
        try:
            _, stderr = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        problems.append(
            f"HANG: still running {deadline:.0f} s after the signal; stderr and stacks:\n{stderr}\n{native}"
        )
        return Outcome(
            command.name,
            signal.Signals(signum).name if signum else "-",
            delay,
            landed,
            -9,
            None,
            problems,
            time.monotonic() - start,
        )
    ended = time.monotonic()
    code = process.returncode
    lines = [line for line in stderr.splitlines() if line.strip()]
    name = signal.Signals(signum).name if signum else "-"
    before_start = False
    if signum is not None and ((code == -signum and not lines) or "init_import_site" in stderr):
        # the interpreter had not run zckpt's first line (it installs its handlers there): the
        # signal's default action ended it (a shell reports 128 + N all the same), or SIGINT's
        # KeyboardInterrupt stopped Python's own start-up (importing site); nothing written
        before_start = True
    elif code == 128 + (signum or 0):
        if lines != [lines[0]] or not lines[0].startswith(f"zckpt: error: interrupted by {name}"):
            problems.append(f"stderr is not the one line: {stderr!r}")
        if (
            out.exists() and command.verify
        ):  # past its commit a run finishes before it takes the signal: whole, or nothing
            check = subprocess.run([*zckpt(), "verify", str(out)], capture_output=True, text=True, cwd=work)
            if check.returncode != 0:
                problems.append(
                    f"an interrupted run left {out} ({sorted(os.listdir(out)) if out.is_dir() else 'a file'}), "
                    f"which verify refuses: {check.stdout[-300:]}{check.stderr[-300:]}"
                )
    elif code == 0:
        if any(not line.startswith(("note:", "step ", "wrote ", "NVMe")) for line in lines):
            problems.append(f"exit 0 with stderr {stderr!r}")
        if command.verify:
            check = subprocess.run([*zckpt(), "verify", str(out)], capture_output=True, text=True, cwd=work)
            if check.returncode != 0:
                problems.append(
                    f"exit 0 but verify says {check.returncode}: {check.stdout[-400:]}{check.stderr[-400:]}"
                )
    else:
        problems.append(f"exit code {code} (expected 0 or {128 + (signum or 0)}); stderr {stderr!r}")
    left = leftovers(work)
    if left:
        problems.append(f"left behind: {left}")
    return Outcome(
        command.name,
        name,
        delay,
        landed,
        code,
        ended - sent_at if sent_at else None,
        problems,
        ended - start,
        before_start,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=500, help="signalled runs in all (spread over the commands)")
    parser.add_argument("--commands", default=",".join(c.name for c in COMMANDS))
    parser.add_argument("--checkpoint", type=Path, help="the input (default: one made by zckpt train)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--busy", type=int, default=2, help="CPU-burning processes beside the runs")
    parser.add_argument("--deadline", type=float, default=20.0, help="seconds a signalled run may take to exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args()
    chosen = [c for c in COMMANDS if c.name in args.commands.split(",")]
    work = Path(tempfile.mkdtemp(prefix="signal-matrix-", dir=args.work_dir))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    outcomes: list[Outcome] = []
    try:
        ck = args.checkpoint or make_checkpoint(work, args.layers, args.dim)
        durations = {}
        for command in chosen:  # the uninterrupted run: its duration bounds the random delays
            plain = run_once(command, ck, work, None, 0.0, 600)
            durations[command.name] = plain.elapsed
            if plain.problems or plain.code != 0:
                print(f"{command.name}: the uninterrupted run failed: {plain.problems}", flush=True)
                return 1
        print("uninterrupted: " + ", ".join(f"{n} {d:.1f} s" for n, d in durations.items()), flush=True)
        rng = random.Random(args.seed)
        for i in range(args.runs):
            command = chosen[i % len(chosen)]
            signum = SIGNALS[(i // len(chosen)) % len(SIGNALS)]
            outcome = run_once(command, ck, work, signum, rng.uniform(0, durations[command.name]), args.deadline)
            outcomes.append(outcome)
            for problem in outcome.problems:
                print(f"run {i} {outcome.command} {outcome.signal} after {outcome.delay:.2f} s: {problem}", flush=True)
    finally:
        for process in busy:
            process.kill()
        shutil.rmtree(work, ignore_errors=True)
    table: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        row = table[o.command, o.signal]
        row["runs"] += 1
        row["landed"] += o.landed
        row["hangs"] += any(p.startswith("HANG") for p in o.problems)
        row["problems"] += bool(o.problems)
        row["before start"] += o.before_start
    timed = sorted((o for o in outcomes if o.exit_after_signal is not None), key=lambda o: -o.exit_after_signal)
    slowest = timed[0].exit_after_signal if timed else 0.0
    if timed:
        print(
            "slowest exits after the signal: "
            + ", ".join(
                f"{o.command} {o.signal} {o.exit_after_signal:.2f} s (sent {o.delay:.2f} s after start)"
                for o in timed[:5]
            )
        )
        within = [o.exit_after_signal for o in timed]
        print(
            f"exit after the signal: median {within[len(within) // 2]:.2f} s, {sum(t <= 1 for t in within)} of {len(within)} within 1 s, "
            f"{sum(t <= 3 for t in within)} within 3 s"
        )
    print(f"\n{'command':22} {'signal':8} {'runs':>5} {'landed':>7} {'start-up':>9} {'hangs':>6} {'problems':>9}")
    for (name, sig), row in sorted(table.items()):
        print(
            f"{name:22} {sig:8} {row['runs']:5} {row['landed']:7} {row['before start']:9} {row['hangs']:6} {row['problems']:9}"
        )
    total = sum(r["runs"] for r in table.values())
    landed = sum(r["landed"] for r in table.values())
    hangs = sum(r["hangs"] for r in table.values())
    bad = sum(r["problems"] for r in table.values())
    early = sum(r["before start"] for r in table.values())
    print(
        f"{total} runs, {landed} signalled while running ({early} before zckpt's first line ran), {hangs} hangs, {bad} with problems (stray lines, leftovers, "
        f"bad outputs); slowest exit after a signal {slowest:.2f} s; busy processes: {args.busy}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
