"""Many nodes, one shared folder (issue 36, item 3): a writing command's torchrun job spread over two
nodes keeps what holds on one: the output is byte for byte a one-node run's; a process killed outright
(SIGKILL: no handler, no word to the others) ends the whole job within seconds, on both nodes; the
folder then holds the previous output or the whole new one, never half, and no lock that stops the
next run; a rerun writes the uninterrupted output.

Two nodes are simulated on this machine: two torchrun agents meeting through a c10d rendezvous,
each starting its own processes, as `torchrun --nnodes 2` starts them on two hosts sharing a
filesystem. The processes run a small script instead of `-m zckpt`: it records its pid and node,
then runs zckpt's command line in-process; in the process chosen to die it first wraps `os` so that
it SIGKILLs itself at a chosen point (the k-th file it creates in the staging folder: midway through
its share; or right before or after the k-th rename into the output folder: the commit steps), as
tests/test_cli/test_faults.py does on one node. Nothing in zckpt knows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import ROOT, default_signals, listing, run_zckpt_torchrun, sample
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal

pytestmark = [pytest.mark.heavy, pytest.mark.slow]

CHECKPOINT = sample("z3_bf16_ws3_subgroups_groups").checkpoint
OTHER = sample("z3_fp16_ws4_subgroups_frozen").checkpoint  # same tag (global_step3), another model
TAG = "global_step3"
ENDS_WITHIN = 60  # seconds from the kill to the last agent's exit (measured: well under 2 s on one machine)
JOB_TIMEOUT = 300  # a whole two-node job, on a loaded machine

# Run by each process torchrun starts, instead of `-m zckpt`.
PROCESS = r"""
import json, os, signal, sys, time

rank = int(os.environ["RANK"])
record = os.environ["ZCKPT_TEST_RECORD"]
with open(os.path.join(record, f"rank{rank}"), "w") as handle:
    handle.write(json.dumps({"pid": os.getpid(), "node": int(os.environ["GROUP_RANK"]), "agent": os.getppid()}))
kill = json.loads(os.environ["ZCKPT_TEST_KILL"])

if kill is not None and kill["rank"] == rank:
    count = [0]

    def die():
        with open(os.path.join(record, "killed"), "w") as handle:
            handle.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process here
        os.kill(os.getpid(), signal.SIGKILL)

    if kill["at"] == "created":  # the n-th file this process creates in the staging folder
        real_open = os.open

        def created(path, flags, *args, **kwargs):
            if flags & os.O_CREAT and ".zckpt-staging" in os.fsdecode(path):
                count[0] += 1
                if count[0] == kill["n"]:
                    die()
            return real_open(path, flags, *args, **kwargs)

        os.open = created
    else:  # "renamed": before (2k) or after (2k + 1) the k-th rename of a name into the output folder
        def wrap(real):
            def renamed(src, dst, *args, **kwargs):
                if os.path.dirname(os.path.abspath(os.fsdecode(dst))) != kill["scope"]:
                    return real(src, dst, *args, **kwargs)
                k = count[0]
                count[0] += 1
                if kill["n"] == 2 * k:
                    die()
                result = real(src, dst, *args, **kwargs)
                if kill["n"] == 2 * k + 1:
                    die()
                return result
            return renamed

        os.rename, os.replace = wrap(os.rename), wrap(os.replace)

sys.argv = ["zckpt", *sys.argv[1:]]
from zckpt.__main__ import main

main()
"""


@dataclass
class Job:
    codes: list[int]  # each agent's exit code, by the node its processes are (rendezvous order)
    stderr: list[str]
    ranks: dict[int, dict]  # rank: {"pid", "node"}
    killed_at: float | None  # time.monotonic() when the chosen process killed itself
    ended_at: float  # when the last agent exited

    @property
    def after_kill(self) -> float:
        assert self.killed_at is not None, "the chosen process never reached its kill point"
        return self.ended_at - self.killed_at


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_nodes(tmp: Path, *argv: str | Path, per_node: int = 1, kill: dict | None = None) -> Job:
    """`zckpt ARGV` as one torchrun job over two simulated nodes of `per_node` processes each;
    `kill`: {"rank", "at": "created" | "renamed", "n", "scope"} (see PROCESS)."""
    port = free_port()
    record = tmp / f"job-{port}"
    record.mkdir(parents=True)
    script = record / "process.py"
    script.write_text(PROCESS)
    env = {
        **{k: v for k, v in os.environ.items() if k != "ZCKPT_DEBUG"},
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "ZCKPT_TEST_RECORD": str(record),
        "ZCKPT_TEST_KILL": json.dumps(kill),
    }
    agents, logs = [], []
    for node in range(2):
        logs.append(record / f"agent{node}.err")
        with open(record / f"agent{node}.out", "w") as out, open(logs[-1], "w") as err:
            agents.append(
                subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)]
                    + ["--nproc-per-node", str(per_node), "--max-restarts", "0", "--rdzv-backend", "c10d"]
                    + ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"zckpt-nodes-{port}"]
                    + [str(script), *map(str, argv)],
                    env=env,
                    stdout=out,
                    stderr=err,
                    preexec_fn=default_signals,
                    start_new_session=True,  # a hung job is stopped whole: the agent and its processes
                )
            )
    deadline = time.monotonic() + JOB_TIMEOUT
    while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = time.monotonic()
    if any(a.poll() is None for a in agents):
        # the agents, then their processes (each in a session of its own, as torchrun starts them)
        stuck = [json.loads(p.read_text())["pid"] for p in record.glob("rank*")]
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for pid in stuck:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"the job still ran {JOB_TIMEOUT} s after it started: {[p.read_text()[-2000:] for p in logs]}")
    ranks = {int(p.name[4:]): json.loads(p.read_text()) for p in record.glob("rank*")}
    assert len(ranks) == 2 * per_node, sorted(ranks)
    killed = record / "killed"
    # the agents in node order: the rendezvous numbers the nodes (not --node-rank), node 0 holds rank 0
    pids = [a.pid for a in agents]
    order = [pids.index(next(r["agent"] for r in ranks.values() if r["node"] == node)) for node in (0, 1)]
    assert ranks[0]["node"] == 0 and {r["node"] for r in ranks.values()} == {0, 1}, ranks
    return Job(
        [agents[i].returncode for i in order],
        [logs[i].read_text() for i in order],
        ranks,
        float(killed.read_text()) if killed.exists() else None,
        ended,
    )


# ---------------------------------------------------------------------------------------------
# Outputs and what a folder holds

ONE_PROCESS = {
    "reshard": lambda out, overwrite=False: reshard(CHECKPOINT, out, world_size=3, overwrite=overwrite),
    "to-universal": lambda out, overwrite=False: to_universal(CHECKPOINT, out, overwrite=overwrite),
}


def argv(command: str, out: Path, overwrite: bool = False) -> list[str]:
    options = ["-w", "3"] if command == "reshard" else []
    return [command, str(CHECKPOINT), str(out), *options, *(["--overwrite"] if overwrite else [])]


def is_leftover(name: str) -> bool:
    return ".zckpt-" in name


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every final-named file under `folder` (relative path: bytes); zckpt's leftovers left out."""
    files: dict[str, bytes] = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not is_leftover(d)]
        for name in names:
            if not is_leftover(name):
                path = Path(root) / name
                files[str(path.relative_to(folder))] = path.read_bytes()
    return files


def leftovers(folder: Path) -> list[str]:
    """zckpt's temporary files, staging and moved-aside folders, and lock files under `folder`."""
    return sorted(
        os.path.join(root, n) for root, dirs, names in os.walk(folder) for n in dirs + names if is_leftover(n)
    )


def write_previous(out: Path) -> dict[str, bytes]:
    """A complete previous output in `out` (another model, the same tag): what an overwriting run replaces."""
    reshard(OTHER, out, world_size=2)
    return snapshot(out)


DCP_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.json"]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, bytes]]]:
    """Each command's output and where it was written: one process's (reshard and to-universal
    write the same files whatever the number of processes); to-dcp's by two processes on one node
    (each process writes its own data file)."""
    found = {}
    for command, write in ONE_PROCESS.items():
        out = tmp_path_factory.mktemp(command) / "out"
        write(out)
        found[command] = out, snapshot(out)
    out = tmp_path_factory.mktemp("to-dcp") / "out"
    run_zckpt_torchrun("to-dcp", str(CHECKPOINT), str(out), processes=2)
    found["to-dcp"] = out, snapshot(out)
    assert sorted(found["to-dcp"][1]) == DCP_FILES
    return found


def assert_written(out: Path, command: str, references) -> None:
    """`out` holds the command's uninterrupted output. to-dcp's `.metadata` records the output's
    path and a random id of the save (a UUID, torch's `save_id`): the id is masked, and the file
    compared only where the reference was written into the same path."""
    where, reference = references[command]
    ours = snapshot(out)
    if command == "to-dcp":
        ours, reference = ({k: masked(k, v) for k, v in d.items()} for d in (ours, reference))
        if where != out:
            assert ".metadata" in ours
            ours, reference = ({k: v for k, v in d.items() if k != ".metadata"} for d in (ours, reference))
    assert ours == reference


UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def masked(name: str, data: bytes) -> bytes:
    """`.metadata` with its save id (one UUID) blanked; other files as they are."""
    if name != ".metadata":
        return data
    blanked, count = UUID.subn(b"-" * 36, data)
    assert count == 1, count
    return blanked


def zckpt_lines(job: Job, node: int) -> list[str]:
    """The lines zckpt's processes wrote on node `node`'s stderr (the agents' own lines aside)."""
    return [line for line in job.stderr[node].splitlines() if line.startswith("zckpt: error: ")]


ENDED: dict[str, float] = {}  # seconds from the kill to the job's end, by case (printed by test_zz_times)


def assert_ended(job: Job, case: str) -> None:
    """Both agents exited non-zero soon after the kill; zckpt's processes said why in one line each."""
    assert job.codes[0] != 0 and job.codes[1] != 0, (job.codes, job.stderr)
    ENDED[case] = job.after_kill
    assert job.after_kill < ENDS_WITHIN, f"the job ended {job.after_kill:.1f} s after the kill"
    lines = zckpt_lines(job, 0) + zckpt_lines(job, 1)
    assert lines and not any("internal error" in line for line in lines), job.stderr


# ---------------------------------------------------------------------------------------------
# 1. Two nodes write what one writes


@pytest.mark.parametrize("command", ["reshard", "to-universal", "to-dcp"])
def test_two_nodes_write_what_one_node_writes(references, command: str, tmp_path: Path) -> None:
    """Two nodes of one process each write the output byte for byte as one process does (to-dcp:
    as two processes on one node, since each process writes its own data file; into the same
    path, which `.metadata` records)."""
    out = tmp_path / "out"
    if command == "to-dcp":  # into the reference's own path: its `.metadata` too is compared
        out = references[command][0]
        shutil.rmtree(out)
    job = two_nodes(tmp_path, *argv(command, out))
    assert job.codes == [0, 0], job.stderr
    assert_written(out, command, references)
    assert not leftovers(out.parent)


# ---------------------------------------------------------------------------------------------
# 2. A process that does not commit, killed on the other node

# (command, processes per node, over a previous output, n): the process killed is node 1's first,
# at the n-th file it creates in the staging folder (its first already written when n is 2)
WORKER_CASES = [("reshard", 1, False, 2), ("reshard", 2, True, 1), ("to-dcp", 1, False, 1)]


@pytest.mark.parametrize(
    "command, per_node, overwrite, n",
    WORKER_CASES,
    ids=[f"{c}-{p}x2-{'overwrite' if o else 'fresh'}" for c, p, o, _ in WORKER_CASES],
)
def test_a_worker_killed_on_the_other_node_ends_the_job(
    references, command: str, per_node: int, overwrite: bool, n: int, tmp_path: Path
) -> None:
    """SIGKILL to a process of node 1 midway: both agents exit non-zero within seconds, process 0
    removes the staging folder and lets the lock go (the folder holds the previous output, or is
    not there), and a rerun writes the uninterrupted output."""
    out = tmp_path / "out"
    old = write_previous(out) if overwrite else None
    before = listing(tmp_path)
    victim = per_node  # node 1's first process
    job = two_nodes(
        tmp_path, *argv(command, out, overwrite), per_node=per_node, kill={"rank": victim, "at": "created", "n": n}
    )
    assert job.ranks[victim]["node"] == 1
    assert_ended(job, f"{command} {per_node}x2 {'overwrite' if overwrite else 'fresh'}")
    assert any("another process of this job stopped answering" in line for line in zckpt_lines(job, 0)), job.stderr[0]
    if old is None:
        assert not out.exists(), os.listdir(out)  # the folder the lock made went with it
    else:
        assert snapshot(out) == old
    assert not leftovers(tmp_path), leftovers(tmp_path)  # staging folder and lock file gone
    assert {k: v for k, v in listing(tmp_path).items() if "job-" not in k} == before
    if command in ONE_PROCESS and per_node == 1:  # the rerun: one process (the same steps as process 0's)
        ONE_PROCESS[command](out, overwrite)
    else:  # on both nodes again
        again = two_nodes(tmp_path, *argv(command, out, overwrite), per_node=per_node)
        assert again.codes == [0, 0], again.stderr
    assert_written(out, command, references)
    assert not leftovers(tmp_path)


# ---------------------------------------------------------------------------------------------
# 3. The committing process (rank 0, node 0) killed: midway, and right before or after its renames

# Process 0's renames into the output folder, over a previous output: (0) the staging folder made,
# (1) the previous tag folder moved aside, (2) the new one in its place, (3) `latest`. Kill points:
# before (2k) or after (2k + 1) rename k; the ones where the folder's state differs.
# (kill point, the state it leaves: see assert_old_or_new)
COMMIT_POINTS = {
    "before the previous tag folder is moved aside": (2, "previous"),
    "after the previous tag folder is moved aside": (3, "previous tag folder moved aside"),
    "after the new tag folder is in place": (5, "new"),
    "before latest is replaced": (6, "new"),
    "after latest is replaced": (7, "new"),
}
COMMITTER_CASES = [("midway", {"at": "created", "n": 2}, "previous")] + [
    (name, {"at": "renamed", "n": n}, state) for name, (n, state) in COMMIT_POINTS.items()
]


def assert_old_or_new(out: Path, old: dict[str, bytes], new: dict[str, bytes]) -> str:
    """The folder holds the previous output or the whole new one; or, killed between the two
    renames, no tag folder and the previous one moved aside whole (which verify names). Which."""
    now = snapshot(out)
    for name, data in now.items():
        assert data in (old.get(name), new.get(name)), f"{name}: neither the previous nor the new file"
    inside = TAG + os.sep
    tag_now, tag_old, tag_new = ({k: v for k, v in d.items() if k.startswith(inside)} for d in (now, old, new))
    assert tag_now in (tag_old, tag_new, {}), "a tag folder neither the previous one nor the whole new one"
    if tag_now == {}:  # the previous one moved aside: whole, and the only copy
        assert snapshot(out / f".{TAG}.zckpt-old") == {k[len(inside) :]: v for k, v in tag_old.items()}
        return "previous tag folder moved aside"
    assert now.get("latest") == TAG.encode() or now.get("latest") is None
    return "new" if tag_now == tag_new else "previous"


def verify_problems(out: Path) -> tuple[int, list[str]]:
    """`zckpt verify OUT --json`: its exit code and problems."""
    done = subprocess.run(
        [sys.executable, "-m", "zckpt", "verify", str(out), "--json"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 3), done.stderr
    return done.returncode, json.loads(done.stdout)["problems"]


@pytest.mark.parametrize("point, kill, state", COMMITTER_CASES, ids=[c[0].replace(" ", "-") for c in COMMITTER_CASES])
def test_the_committing_process_killed(references, point: str, kill: dict, state: str, tmp_path: Path) -> None:
    """SIGKILL to process 0 (node 0, the lock holder, the one that commits), over a previous
    output: both agents exit non-zero within seconds; the folder holds the previous output or the
    whole new one, never half (verify passes, or names the killed run's leftovers, exit 3); the
    lock it held stops no one: a rerun writes the uninterrupted output and removes the leftovers."""
    out = tmp_path / "out"
    old = write_previous(out)
    new = references["reshard"][1]
    job = two_nodes(tmp_path, *argv("reshard", out, True), kill={"rank": 0, "scope": str(out), **kill})
    assert_ended(job, point)
    assert any("another process of this job stopped answering" in line for line in zckpt_lines(job, 1)), job.stderr[1]
    assert assert_old_or_new(out, old, new) == state
    left = leftovers(out)
    assert os.path.join(out, ".zckpt-lock") in left  # its lock file, no longer locked
    code, problems = verify_problems(out)
    assert code == 3, problems
    for path in left:
        if os.path.dirname(path) == str(out):
            assert any(path in problem for problem in problems), (path, problems)
    if state != "previous tag folder moved aside":  # else the missing tag folder is a problem too
        assert all(".zckpt-" in problem for problem in problems), problems
    reshard(CHECKPOINT, out, world_size=3, overwrite=True)  # the rerun (one process: the same steps)
    assert snapshot(out) == new
    assert not leftovers(tmp_path)


def test_zz_times() -> None:
    """The measured times from each kill to the job's end (`pytest -s` shows them)."""
    for case, seconds in ENDED.items():
        print(f"job ended {seconds:.2f} s after the kill: {case}")
