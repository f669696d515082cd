"""One writer per output folder (issue #17, item 5): `zckpt.io.output.OutputLock`, and writers
started together into one folder as a retried job or a job array starts them.

Each round starts several real `python -m zckpt` processes at once into one fresh folder
(reshard at world sizes 2 and 3, to-universal, consolidate in fp32 and bf16) and judges only
outcomes: exactly one exits 0 (or, with --wait, each in turn); the folder then holds exactly that
run's files, byte for byte those of a reference run of the same command alone, and `verify`
passes; every other run printed one line, naming the writer it found (pid and host), or saying
that the output exists (it came after); nothing of any run is left behind.

Rounds of three kinds:
- gated: the writers meet at a gate right before their first try of the lock, and the one that
  takes it holds it until every other has found it held (a `sitecustomize` in the children wraps
  `fcntl.flock` and `os.link`; no hook in zckpt). So every round is a real contest whatever the
  machine's load, and the outcome is exact: one winner, all others refused naming it.
- natural: no gate, the processes race as they start (world sizes 2 and 3 into one folder, the
  issue's case); the first to take the lock wins, the others are refused or find the output.
- wait: gated, every writer with --wait: with --overwrite each writes in turn (all exit 0, the
  folder holds one whole output); without, one writes and the others, once it is done, find
  the output there.
Two-process torchrun jobs (ranks started as torchrun starts them) contend in the same way: the
holder's ranks are never refused, the other job's all fail, its rank 0 naming the holder.

`ZCKPT_WRITERS_ROUNDS=N` runs N rounds of each kind (default: 8 gated, 6 natural, 4 wait).
"""

from __future__ import annotations

import collections
import errno
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from helpers import ROOT, sample
from zckpt.core.errors import OutputError
from zckpt.io.output import LOCK_FILE, OutputLock, find_leftovers, owner_tag
from zckpt.ops.verify import verify

SOURCE = sample("z3_bf16_ws3_subgroups_groups").checkpoint
HOST = owner_tag().rpartition("-")[0]
VARIANTS = {
    "reshard-w2": ("reshard", "--world-size", "2"),
    "reshard-w3": ("reshard", "--world-size", "3"),
    "universal": ("to-universal",),
    "consolidate": ("consolidate",),
    "consolidate-bf16": ("consolidate", "--dtype", "bf16"),
}
ROUNDS = os.environ.get("ZCKPT_WRITERS_ROUNDS")
COUNTS = (
    {"gated": 8, "natural": 6, "wait": 4}
    if ROUNDS is None
    else dict.fromkeys(("gated", "natural", "wait"), int(ROUNDS))
)
SEEN: collections.Counter = collections.Counter()  # outcomes by round kind, printed by test_zz_outcomes
TIMEOUT = 300  # seconds a writer may take (a loaded machine); a gate gives up after 120 s
REFUSED = re.compile(
    r"^zckpt: error: (?P<out>.+): another zckpt run is writing it: process (?P<pid>\d+) on (?P<host>\S+); pass --wait"
)

GATE = r"""
import fcntl, os, time

_gate = os.environ.get("ZCKPT_TEST_GATE")
if _gate:
    _folder, _count = _gate.rsplit(":", 1)
    _count, _me = int(_count), str(os.getpid())
    _real_flock, _real_link = fcntl.flock, os.link
    _started = []

    def _mark(kind):
        open(os.path.join(_folder, f"{kind}-{_me}"), "w").close()

    def _wait_for(kind, count):
        deadline = time.monotonic() + 120
        while sum(n.startswith(kind + "-") for n in os.listdir(_folder)) < count and time.monotonic() < deadline:
            time.sleep(0.01)

    def flock(fd, operation):
        if not operation & fcntl.LOCK_EX:
            return _real_flock(fd, operation)
        if not _started:  # the first try of the lock: all start it together
            _started.append(True)
            _mark("arrived")
            _wait_for("arrived", _count)
        try:
            return _real_flock(fd, operation)
        except BlockingIOError:  # it found the lock held (its owner read already)
            _mark("tried")
            raise

    def link(src, dst, *args, **kwargs):
        done = _real_link(src, dst, *args, **kwargs)
        if os.fspath(dst).endswith("/.zckpt-lock"):  # the lock is ours: held until every other writer found it held
            _wait_for("tried", _count - 1)
        return done

    fcntl.flock, os.link = flock, link
"""


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if ".zckpt-" in p.name]


@pytest.fixture(scope="module")
def gate_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gate")
    (folder / "sitecustomize.py").write_text(GATE)
    return folder


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """Each variant's output, written alone."""
    base = tmp_path_factory.mktemp("references")
    refs = {}
    for name, (verb, *options) in VARIANTS.items():
        done = subprocess.run(
            [sys.executable, "-m", "zckpt", verb, str(SOURCE), str(base / name), *options, "--quiet"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, done.stderr
        refs[name] = snapshot(base / name)
    return refs


def start(variant: str, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    verb, *options = VARIANTS[variant]
    return subprocess.Popen(
        [sys.executable, "-m", "zckpt", verb, str(SOURCE), str(out), *options, "--quiet", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish(processes: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """(exit code, stderr) of each process, by start order."""
    results = []
    for process in processes:
        try:
            _, err = process.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail(f"{process.args} still ran after {TIMEOUT} s")
        results.append((process.returncode, err))
    return results


def gated_env(gate_path: Path, gate: Path, count: int, **extra: str) -> dict[str, str]:
    gate.mkdir()
    path = os.pathsep.join([str(gate_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "ZCKPT_TEST_GATE": f"{gate}:{count}", "OMP_NUM_THREADS": "1", **extra}


def refusal(err: str, out: Path) -> int:
    """The pid a refused run named (one line, the output folder, this host)."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    match = REFUSED.match(lines[0])
    assert match and match["out"] == str(out) and match["host"] == HOST, lines[0]
    return int(match["pid"])


def judge(out: Path, winners: list[str], references: dict[str, dict[str, bytes]]) -> None:
    """The folder holds exactly one whole output, byte for byte a winner's reference; verify
    passes; no run left anything."""
    found = snapshot(out)
    assert any(found == references[w] for w in winners), (winners, sorted(found))
    assert verify(str(out)).ok
    assert not leftovers(out.parent), leftovers(out.parent)


def rounds(kind: str) -> list[int]:
    return list(range(COUNTS[kind]))


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("round_", rounds("gated"))
def test_writers_started_together_one_wins_the_others_name_it(
    references, gate_path: Path, tmp_path: Path, round_: int
) -> None:
    rng = random.Random(f"gated-{round_}")
    variants = ["reshard-w2", "reshard-w3", *rng.sample(sorted(VARIANTS), 2)]  # both world sizes in every round
    rng.shuffle(variants)
    out = tmp_path / "out"
    env = gated_env(gate_path, tmp_path / "gate", len(variants))
    processes = [start(v, out, env=env) for v in variants]
    results = finish(processes)
    winners = [i for i, (code, _) in enumerate(results) if code == 0]
    assert len(winners) == 1, results
    winner = winners[0]
    for i, (code, err) in enumerate(results):
        if i != winner:
            assert code == 1 and refusal(err, out) == processes[winner].pid, (code, err)
            SEEN["gated", "refused, winner named"] += 1
        else:
            assert err == "", err
    judge(out, [variants[winner]], references)
    SEEN["gated", f"won by {variants[winner]}"] += 1


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("round_", rounds("natural"))
def test_world_sizes_2_and_3_racing_into_one_folder(references, tmp_path: Path, round_: int) -> None:
    variants = ["reshard-w2", "reshard-w3", "reshard-w2", "reshard-w3"]
    out = tmp_path / "rs"
    processes = [start(v, out) for v in variants]
    results = finish(processes)
    winners = [i for i, (code, _) in enumerate(results) if code == 0]
    assert len(winners) == 1, results
    pids = {p.pid for p in processes}
    for i, (code, err) in enumerate(results):
        if i in winners:
            continue
        assert code == 1, (code, err)
        if "already exists" in err:  # it took the lock after the winner was done
            assert err == f"zckpt: error: {out / 'global_step3'}: already exists; pass --overwrite to replace it\n", err
            SEEN["natural", "found the output (came after)"] += 1
        else:
            assert refusal(err, out) in pids - {processes[i].pid}
            SEEN["natural", "refused, a writer named"] += 1
    judge(out, [variants[winners[0]]], references)
    SEEN["natural", "rounds with one winner"] += 1


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("round_", rounds("wait"))
def test_writers_with_wait_write_in_turn(references, gate_path: Path, tmp_path: Path, round_: int) -> None:
    overwrite = round_ % 2 == 0
    variants = ["reshard-w2", "reshard-w3", "reshard-w3", "reshard-w2"][: 3 + round_ % 2]
    out = tmp_path / "out"
    env = gated_env(gate_path, tmp_path / "gate", len(variants))
    results = finish([start(v, out, "--wait", *(["--overwrite"] if overwrite else []), env=env) for v in variants])
    if overwrite:
        assert all(r == (0, "") for r in results), results
        judge(out, variants, references)
        SEEN["wait", "--overwrite: each wrote in turn"] += len(results)
        return
    winners = [i for i, (code, _) in enumerate(results) if code == 0]
    assert len(winners) == 1, results
    for i, (code, err) in enumerate(results):
        if i not in winners:  # it waited for the winner, then found its output
            assert (code, err) == (
                1,
                f"zckpt: error: {out / 'global_step3'}: already exists; pass --overwrite to replace it\n",
            )
            SEEN["wait", "waited, then found the output"] += 1
    judge(out, [variants[winners[0]]], references)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_env(env: dict[str, str], rank: int, port: int) -> dict[str, str]:
    """One process of a 2-process torchrun job, as torchrun starts it."""
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@pytest.mark.heavy
@pytest.mark.slow
def test_two_torchrun_jobs_one_holds_the_folder_for_all_its_ranks(references, gate_path: Path, tmp_path: Path) -> None:
    """Two 2-process jobs (world sizes 2 and 3) into one folder, gated: process 0 of each tries
    the lock, its ranks write together. The holder's ranks all succeed; the other job's all fail
    at once (rank 0 naming the holder, rank 1 saying its job failed), none left waiting."""
    out = tmp_path / "out"
    env = gated_env(gate_path, tmp_path / "gate", 2)
    jobs = {}
    for variant in ("reshard-w2", "reshard-w3"):
        port = _free_port()
        jobs[variant] = [start(variant, out, env=rank_env(env, r, port)) for r in range(2)]
    results = {variant: finish(processes) for variant, processes in jobs.items()}
    [holder] = [v for v, ranks in results.items() if all(code == 0 for code, _ in ranks)]
    assert all(err == "" for _, err in results[holder]), results
    [(code0, err0), (code1, err1)] = next(ranks for v, ranks in results.items() if v != holder)
    assert code0 == 1 and refusal(err0, out) == jobs[holder][0].pid, err0
    assert (code1, err1) == (
        1,
        f"zckpt: error: {out}: another process of this job failed (its own error says why); the previous output is kept\n",
    )
    judge(out, [holder], references)
    SEEN["torchrun", "job refused, holder named"] += 1


@pytest.mark.heavy
@pytest.mark.slow
def test_a_torchrun_job_waits_with_all_its_ranks(references, gate_path: Path, tmp_path: Path) -> None:
    """A 2-process job with --wait behind another writer: process 0 tries the lock again and
    again while rank 1 waits with it (short collectives); once the writer is done the job writes."""
    out = tmp_path / "out"
    holder = hold(out)
    try:
        env = gated_env(gate_path, tmp_path / "gate", 1)
        port = _free_port()
        ranks = [start("reshard-w3", out, "--wait", "--overwrite", env=rank_env(env, r, port)) for r in range(2)]
        while not list((tmp_path / "gate").glob("tried-*")):  # process 0 found the lock held: it waits
            assert all(r.poll() is None for r in ranks), [r.communicate() for r in ranks]
            time.sleep(0.05)
    finally:
        holder.stdin.close()
        holder.wait()
    assert finish(ranks) == [(0, ""), (0, "")]
    judge(out, ["reshard-w3"], references)
    SEEN["torchrun", "job waited, then wrote"] += 1


# ---------------------------------------------------------------------------------------------
# The lock itself


HOLDER = r"""
import sys, time
from zckpt.io.output import OutputLock
lock = OutputLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.readline()  # until told (or killed)
lock.release()
"""


def hold(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s lock until its stdin closes."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "held\n"
    return process


def test_a_second_writer_is_refused_in_one_line_naming_the_first(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = OutputLock(str(out))
    first.acquire()
    assert (out / LOCK_FILE).read_text() == owner_tag() + "\n"
    with pytest.raises(OutputError) as refused:
        OutputLock(str(out)).acquire()  # another open file, even in this process
    assert (
        str(refused.value)
        == f"{out}: another zckpt run is writing it: process {os.getpid()} on {HOST}; pass --wait to wait for it to end; nothing was written"
    )
    assert [(left.pid, left.alive) for left in find_leftovers(str(out))] == [
        (os.getpid(), True)
    ]  # the live writer, as inspect shows it
    first.release()
    assert not out.exists()  # the folder the lock made, removed empty
    second = OutputLock(str(out))
    second.acquire()
    second.release()


def once_after(monkeypatch: pytest.MonkeyPatch, name: str, then: Callable[[], None]) -> None:
    """`os.path.<name>` answers its first call truthfully, then `then()` runs: what another
    run does in that instant."""
    real = getattr(os.path, name)
    calls = []

    def patched(path):
        answer = real(path)
        if not calls:
            calls.append(path)
            then()
        return answer

    monkeypatch.setattr(os.path, name, patched)


def test_a_folder_another_run_makes_between_our_look_and_our_try_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers started together all find no folder, and all make it: the ones whose makedirs
    comes second take the folder the first made (CI once refused one "exists and is not a
    folder")."""
    out = tmp_path / "out"
    once_after(monkeypatch, "isdir", out.mkdir)
    lock = OutputLock(str(out))
    lock.acquire()
    monkeypatch.undo()
    assert (out / LOCK_FILE).read_text() == owner_tag() + "\n"
    lock.release()
    assert out.is_dir()  # made by the other run: left alone


def test_a_folder_removed_between_our_look_and_our_try_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that made the folder and leaves without writing removes it, maybe just after
    another run found it there."""
    out = tmp_path / "out"
    out.mkdir()
    once_after(monkeypatch, "isdir", out.rmdir)
    lock = OutputLock(str(out))
    lock.acquire()
    monkeypatch.undo()
    assert (out / LOCK_FILE).read_text() == owner_tag() + "\n"
    lock.release()
    assert not out.exists()  # made by this lock: removed empty


def test_a_file_in_the_folders_place_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("x")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        OutputLock(str(out)).acquire()
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        OutputLock(str(tmp_path / "link")).acquire()


@pytest.mark.slow
def test_a_killed_writers_lock_blocks_nobody(tmp_path: Path) -> None:
    """SIGKILL: the kernel drops its lock; the lock file left is listed as a dead run's, taken
    over by the next writer, and gone when that one ends."""
    out = tmp_path / "out"
    holder = hold(out)
    holder.kill()
    holder.wait()
    [left] = find_leftovers(str(out))
    assert (left.path, left.pid, left.alive) == (str(out / LOCK_FILE), holder.pid, False)
    assert "no longer runs" in left.describe()
    done = subprocess.run(
        [sys.executable, "-m", "zckpt", "consolidate", str(SOURCE), str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == ["model.safetensors"]


@pytest.mark.slow
def test_waiting_ends_when_the_writer_does_and_stays_interruptible(gate_path: Path, tmp_path: Path) -> None:
    """--wait behind a live writer: SIGTERM ends the wait (exit 143, one line, nothing of its own
    left, the writer's lock untouched); a second waiter writes once the writer is done."""
    out = tmp_path / "out"
    holder = hold(out)
    try:
        env = gated_env(
            gate_path, tmp_path / "gate", 1
        )  # the gate only notes that it found the lock held ("tried-<pid>")
        waiter = start("reshard-w2", out, "--wait", env=env)
        while not list((tmp_path / "gate").glob("tried-*")):
            assert waiter.poll() is None, waiter.communicate()
            time.sleep(0.05)
        waiter.send_signal(signal.SIGTERM)
        _, err = waiter.communicate(timeout=60)
        assert (
            waiter.returncode == 143 and err.startswith("zckpt: error: interrupted by SIGTERM") and err.count("\n") == 1
        ), err
        assert os.listdir(out) == [LOCK_FILE] and find_leftovers(str(out))[0].alive
        second = start("reshard-w3", out, "--wait")
    finally:
        holder.stdin.close()
        holder.wait()
    _, err = second.communicate(timeout=TIMEOUT)
    assert second.returncode == 0, err
    assert sorted(os.listdir(out)) == ["global_step3", "latest"]


@pytest.mark.slow
def test_consolidate_dot_dot_inside_a_trainer_folder_takes_that_folders_lock(tmp_path: Path) -> None:
    """`consolidate . .` in a checkpoint-N folder: refused while another run writes there, then
    adds the weights and leaves no lock file."""
    import shutil

    folder = tmp_path / "checkpoint-3"
    shutil.copytree(sample("hf_trainer").folder / "checkpoint-3", folder)
    before = sorted(os.listdir(folder))
    holder = hold(folder)
    try:
        refused = subprocess.run(
            [sys.executable, "-m", "zckpt", "consolidate", ".", ".", "--quiet"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert refused.returncode == 1 and refusal(refused.stderr, Path(".")) == holder.pid
    finally:
        holder.stdin.close()
        holder.wait()
    done = subprocess.run(
        [sys.executable, "-m", "zckpt", "consolidate", ".", ".", "--quiet"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(folder)) == sorted(before + ["model.safetensors"])


def test_without_file_locks_the_link_still_lets_one_writer_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses flock (ENOSYS, as Lustre without -o flock): a second writer is
    still refused; a lock file whose owner is a dead process of this host is taken over; another
    host's is reported with what to do, never taken over."""
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "out"
    first = OutputLock(str(out))
    first.acquire()
    with pytest.raises(OutputError, match=f"process {os.getpid()} on {HOST};"):
        OutputLock(str(out)).acquire()
    first.release()
    out.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    (out / LOCK_FILE).write_text(f"{HOST}-{dead}\n")
    taker = OutputLock(str(out))
    taker.acquire()
    assert (out / LOCK_FILE).read_text() == owner_tag() + "\n"
    taker.release()
    (out / LOCK_FILE).write_text("elsewhere-42\n")
    with pytest.raises(
        OutputError,
        match=re.escape(
            f"process 42 on elsewhere (this filesystem has no locks: if that run is gone, remove {out / LOCK_FILE})"
        ),
    ):
        OutputLock(str(out)).acquire()
    assert (out / LOCK_FILE).read_text() == "elsewhere-42\n"


def test_two_runs_taking_over_one_dead_lock_let_one_in(tmp_path: Path) -> None:
    """Threads (each its own open file, as processes) race for a dead writer's lock: one wins."""
    out = tmp_path / "out"
    holder = hold(out)
    holder.kill()
    holder.wait()
    outcomes: list[object] = []
    barrier = threading.Barrier(4)

    def take() -> None:
        lock = OutputLock(str(out))
        barrier.wait()
        try:
            lock.acquire()
            outcomes.append(lock)
        except OutputError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = [o for o in outcomes if isinstance(o, OutputLock)]
    assert len(held) == 1 and all(
        f"process {os.getpid()} on" in str(o) for o in outcomes if not isinstance(o, OutputLock)
    )
    held[0].release()
    assert os.listdir(out) == []


def test_zz_outcomes() -> None:
    """How the rounds ended (printed with `pytest -s`); runs last in this file."""
    for key, count in sorted(SEEN.items()):
        print(" ".join(key), count)
