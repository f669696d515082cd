"""scripts/fast_torchrun.py, the interop tier's torchrun: each rank sees what torchrun gives it,
a failed rank fails the job and stops the others, and a killed client takes its ranks with it.

Each case runs the same script under ``python -m torch.distributed.run`` and under the launcher,
and compares what the ranks saw (torchrun is the reference, not the launcher's own code).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

from interop_helpers import ROOT, free_port, launcher  # noqa: E402


@pytest.fixture(autouse=True)
def zygote_serving() -> None:
    """The session's zygote (interop_helpers.fast_torchrun_session, under ``-p interop_helpers``)."""
    if os.environ.get("ZCKPT_FAST_TORCHRUN", "0") == "0":
        pytest.skip("no fast_torchrun zygote in this session (-p interop_helpers starts one)")


RANK_SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "MY_VAR"]
seen = {k: os.environ.get(k) for k in keys}
seen["argv"] = sys.argv[1:]
seen["cwd"] = os.getcwd()
seen["path0"] = sys.path[0]
seen["name"] = __name__
seen["world"] = dist.get_world_size()
seen["threads"] = __import__("torch").get_num_threads()
print(f"rank {rank} says hello", flush=True)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
    json.dump(seen, fh)
dist.barrier()
if sys.argv[2] == "fail" and rank == 1:
    sys.exit(3)
if sys.argv[2] == "fail":
    import time
    time.sleep(120)  # the launcher must stop this rank once rank 1 has failed
if sys.argv[2] == "hang":
    import time
    open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
    time.sleep(300)
dist.destroy_process_group()
"""


def _run(prefix: list[str], tmp: Path, mode: str, world: int = 2) -> tuple[subprocess.CompletedProcess, dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp / "out"
    out.mkdir()
    env = {**os.environ, "MY_VAR": "x y"}
    cmd = [*prefix, "--nproc-per-node", str(world), "--master-port", str(free_port()), str(script), str(out), mode]
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    seen = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    return done, seen


def test_ranks_see_what_torchrun_gives_them(tmp_path: Path) -> None:
    theirs, seen_theirs = _run([sys.executable, "-m", "torch.distributed.run"], tmp_path / "a", "ok")
    ours, seen_ours = _run(launcher(sys.executable), tmp_path / "b", "ok")
    assert launcher(sys.executable)[1].endswith("fast_torchrun.py")
    assert theirs.returncode == ours.returncode == 0, ours.stderr
    assert sorted(seen_ours) == sorted(seen_theirs) == [0, 1]
    for rank in (0, 1):
        a = json.loads(json.dumps(seen_theirs[rank]).replace(str(tmp_path / "a"), "RUN"))
        b = json.loads(json.dumps(seen_ours[rank]).replace(str(tmp_path / "b"), "RUN"))
        # torchrun's ranks reach the store its agent hosts; without an agent, rank 0 hosts it
        assert (a.pop("TORCHELASTIC_USE_AGENT_STORE"), b.pop("TORCHELASTIC_USE_AGENT_STORE")) == ("True", "False")
        assert a == b, rank
    for rank in (0, 1):
        assert f"rank {rank} says hello" in ours.stdout


def test_a_failed_rank_fails_the_job_and_stops_the_others(tmp_path: Path) -> None:
    start = time.monotonic()
    ours, _ = _run(launcher(sys.executable), tmp_path, "fail")
    assert ours.returncode == 1, ours.stderr
    assert time.monotonic() - start < 60  # not rank 0's 120 s sleep


def test_a_killed_client_takes_its_ranks_with_it(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        *launcher(sys.executable),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(script),
        str(out),
        "hang",
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while len(list(out.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in out.glob("pid*")]
    assert len(pids) == 2
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return status != "Z"


def test_without_a_zygote_it_is_torchrun(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ZCKPT_FAST_TORCHRUN"}
    code = "import sys; sys.path.insert(0, 'scripts'); import fast_torchrun as f; print(f.launcher('py'))"
    shown = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "['py', '-m', 'torch.distributed.run']"
