"""Faults (issue #9, item 5): every command that writes, killed at random points by SIGKILL,
SIGTERM and SIGINT, with and without --overwrite over a previous complete output; a full disk; a
read-only output folder.

What each killed run must leave:
(a) nothing that looks complete is corrupt: every final-named file is, byte for byte, the one an
    uninterrupted run writes or the one the previous output had, and the folder as a whole is
    the old state or the complete new one (a tag folder absent or whole, `latest` naming only a
    whole tag folder). A state between the two is allowed only where the killed run's
    leftovers say so: `zckpt inspect` and `zckpt verify` list them as problems (exit 3);
(b) after SIGTERM/SIGINT no temporary file or staging folder anywhere; after SIGKILL its
    leftovers listed by `inspect` and `verify` on the output folder (exit 3), and removed by the
    next run into that folder;
(c) a rerun succeeds and writes exactly the uninterrupted output.

The commands run as real `zckpt` processes, forked from a warm interpreter that has imported
zckpt and torch already (a fork costs milliseconds where a fresh interpreter costs 0.3-2 s), so
that a few hundred kills fit in the heavy tier (`pytest -m heavy`, where this whole file runs). Two kinds of kill points:
- at a random time between 0 and the uninterrupted run's measured duration (seeded);
- right before and right after each operation that makes, moves or removes a name in the output
  folder (mkdir, rename, replace, remove, rmdir: the commit steps, which a timed kill almost
  never hits), by the forked process signalling itself there: a wrapper around `os` set up in
  the test's child process, not a hook in zckpt.
The follow-up of a killed run (inspect, verify, the rerun) depends only on the state it left:
it runs once per distinct state (file names, owners aside, and which version each file is).
`ZCKPT_FAULTS_FULL=1` runs more seeds, every op (also those inside staging folders) and SIGINT at
each op too. `test_zz_counts` prints how many cases ran.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import ROOT, default_signals, sample

BIG = sample("z3_bf16_ws2_nvmeoffload_frozen_tied_groups").checkpoint  # 537k params, the largest sample
OTHER = sample("z3_bf16_ws3_subgroups_groups").checkpoint  # same tag (global_step3), other model
TAG = "global_step3"
USER_FILE = "notes.txt"  # a file of the user's in the output folder: never touched
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
CAUGHT_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}
FULL = bool(os.environ.get("ZCKPT_FAULTS_FULL"))
TIMED_SEEDS = 10 if FULL else 2
OP_SIGNALS = (
    SIGNALS if FULL else {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
)  # SIGINT: the same handler as SIGTERM
COUNTS: collections.Counter = collections.Counter()
SIGNALLED_DEADLINE = 30  # seconds a signalled process may take to leave (generous: the machine may be loaded)
TIMES: collections.Counter = collections.Counter()  # seconds in zckpt processes, by (verb, kind)


# ---------------------------------------------------------------------------------------------
# A warm interpreter that forks one `zckpt` process per request

ZYGOTE = r'''
import faulthandler, json, os, signal, sys, time, traceback
import torch  # noqa: F401  (the torch writer and the CRC checks use it: forks start warm)
import zckpt.cli.app as cli
import zckpt.io.output as output
import zckpt.ops.consolidate, zckpt.ops.reshard, zckpt.ops.universal, zckpt.ops.verify, zckpt.ops.inspect  # noqa: F401

OPS = ("mkdir", "rename", "replace", "remove", "unlink", "rmdir")


def hook_ops(at, signum, log, scope):
    """Send `signum` to this process before (2k) or after (2k+1) the k-th op; count the ops.
    With `scope` (the output folder) only ops on it, on names directly in it, and on staging
    folders' owner files count."""
    count = [0]

    def counted(path):
        if scope is None:
            return True
        path = os.path.abspath(os.fsdecode(path))
        return path == scope or os.path.dirname(path) == scope or os.path.basename(path) == ".zckpt-owner"

    def signal_here():
        handler = signal.getsignal(signum) if signum != signal.SIGKILL else None
        if callable(handler):  # as if it landed in the zckpt frame that makes the op (this wrapper is not zckpt code,
            handler(signum, sys._getframe(2))  # where zckpt would hold the exception until it is back in its own)
        else:
            os.kill(os.getpid(), signum)

    def wrap(real):
        def op(path, *args, **kwargs):
            if kwargs.get("dir_fd") is not None or not counted(path):  # shutil.rmtree's inner steps
                return real(path, *args, **kwargs)
            k = count[0]
            count[0] += 1
            if at == 2 * k:
                signal_here()
            result = real(path, *args, **kwargs)
            if at == 2 * k + 1:
                signal_here()
            return result
        return op

    for name in OPS:
        setattr(os, name, wrap(getattr(os, name)))
    return lambda: open(log, "w").write(str(count[0]))


def fill_after_check(mount, keep):
    """Let the up-front free-space check pass, then fill the disk but `keep` bytes (another
    process took the space meanwhile): the writes then meet a real ENOSPC."""
    real = output.check_free_space

    def check(path, needed):
        real(path, needed)
        st = os.statvfs(mount)
        free = st.f_bavail * st.f_frsize
        with open(os.path.join(mount, "filler"), "ab") as handle:
            handle.write(bytes(max(0, free - keep)))

    output.check_free_space = check


def child(req):
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    os.chdir(req["cwd"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks a hung child for its stacks
    done = lambda: None
    if req.get("ops_log"):
        done = hook_ops(req.get("at"), req.get("signal") or 0, req["ops_log"], req.get("scope"))
    if req.get("fill"):
        fill_after_check(*req["fill"])
    sys.argv = ["zckpt", *req["argv"]]
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    done()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


for line in sys.stdin:
    req = json.loads(line)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            code = child(req)
        except BaseException:
            traceback.print_exc()
            os._exit(99)
        # out through interpreter exit, as `zckpt` leaves: helper threads are joined and atexit
        # runs there, so a thread that never ends shows as a hang (the parent's deadline)
        sys.exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    landed, status = None, None
    if req.get("kill_after") is not None:
        time.sleep(req["kill_after"])
        done, status = os.waitpid(pid, os.WNOHANG)
        landed = done == 0
        if landed:
            os.kill(pid, req["signal"])
    if status is None or landed:
        _, status = os.waitpid(pid, 0)
    elapsed = time.monotonic() - start
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    print(json.dumps({"pid": pid, "code": code, "elapsed": elapsed, "landed": landed}), flush=True)
'''


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    elapsed: float
    landed: bool | None  # a timed signal: whether the process still ran when it was sent
    ops: int | None = None


class Zygote:
    """A warm interpreter (zckpt and torch imported) forking one `zckpt` process per run."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        env = {k: v for k, v in os.environ.items() if k != "ZCKPT_DEBUG"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            cwd=workdir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=default_signals,
        )
        self.count = 0

    def _reply(self, timeout: float, pid: int | None = None) -> dict | None:
        """The zygote's next message: the fork's pid, or (`pid` given) that run's end. A late end
        of an earlier run that was killed for hanging is skipped, so one hang cannot shift every
        later run's replies."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            if not ready:
                return None
            message = json.loads(self.process.stdout.readline())
            if ("code" in message) == (pid is not None) and (pid is None or message["pid"] == pid):
                return message
        return None

    def run(
        self,
        *argv: str | Path,
        cwd: Path | None = None,
        kill_after: float | None = None,
        signum: int | None = None,
        at: int | None = None,
        count_ops: bool = False,
        scope: Path | None = None,
        fill: tuple[str, int] | None = None,
        timeout: float = 60,
    ) -> Run:
        """Run `zckpt *argv`; `kill_after` seconds: send `signum`; `at`: the process sends
        `signum` to itself at that op point (see hook_ops); `fill`: (mount, bytes kept free)."""
        self.count += 1
        stem = self.workdir / f"run{self.count}"
        request = {
            "argv": [str(a) for a in argv],
            "cwd": str(cwd or self.workdir),
            "stdout": f"{stem}.out",
            "stderr": f"{stem}.err",
            "kill_after": kill_after,
            "signal": int(signum) if signum is not None else None,
            "at": at,
            "ops_log": f"{stem}.ops" if (count_ops or at is not None) else None,
            "scope": str(scope) if scope else None,
            "fill": list(fill) if fill else None,
        }
        assert self.process.poll() is None, "the zygote died"
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        pid = self._reply(30)["pid"]
        if kill_after is not None:
            timeout = kill_after + SIGNALLED_DEADLINE
        reply = self._reply(timeout, pid)
        if reply is None:  # a hang: its Python stacks (faulthandler, on SIGUSR1), then kill it and fail
            os.kill(pid, signal.SIGUSR1)
            time.sleep(1)
            os.kill(pid, signal.SIGKILL)
            self._reply(60, pid)
            stacks = Path(f"{stem}.err").read_text() if Path(f"{stem}.err").exists() else ""
            pytest.fail(
                f"zckpt {' '.join(request['argv'])} still ran {timeout:.0f} s after it started"
                f"{f' ({SIGNALLED_DEADLINE} s after the signal)' if kill_after is not None else ''}; its stderr and stacks:\n{stacks}"
            )
        ops_log = Path(f"{stem}.ops")
        ops = int(ops_log.read_text()) if ops_log.exists() and ops_log.read_text() else None
        text = {
            n: Path(f"{stem}.{n}").read_text() if Path(f"{stem}.{n}").exists() else "" for n in ("out", "err")
        }  # none: killed at once
        for n in ("out", "err", "ops"):
            Path(f"{stem}.{n}").unlink(missing_ok=True)
        kind = "timed kill" if kill_after is not None else "kill at op" if at is not None else "run"
        TIMES[argv[0], kind] += reply["elapsed"]
        TIMES[argv[0], kind + " (count)"] += 1
        return Run(reply["code"], text["out"], text["err"], reply["elapsed"], reply["landed"], ops)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


# ---------------------------------------------------------------------------------------------
# The writing commands: each with a previous output of other content under the same final names


@dataclass(frozen=True)
class Input:
    """A checkpoint the commands read, one writing other content under the same names (for the
    previous outputs of checkpoint commands), and a shard size that gives several shards."""

    name: str
    checkpoint: Path
    other: Path
    shard: str


# timed kills: the largest sample (537k params), so that a random moment falls inside the write;
# kills at each op: small ones, where only the ops matter
INPUTS = {
    "big": Input("big", BIG, OTHER, "300KB"),
    "small": Input("small", OTHER, sample("z3_fp16_ws4_subgroups_frozen").checkpoint, "8KB"),
}


@dataclass(frozen=True)
class Command:
    name: str
    kind: str  # "weights" (files in OUT) or "checkpoint" (OUT/<tag folder>/ and OUT/<latest>)
    args: tuple[str, ...]  # the verb, then options after CHECKPOINT OUTPUT_DIR
    previous: tuple[str, ...]  # a command line ({in}, {other}, {out}) writing other content under the same names
    folder: str = TAG  # the tag folder a checkpoint command writes
    latest: str = "latest"

    def argv(self, source: Input, out: Path, cfg: Path, overwrite: bool) -> list[str]:
        verb, *rest = self.args
        options = [a.replace("{cfg}", str(cfg)).replace("{shard}", source.shard) for a in rest]
        return [verb, str(source.checkpoint), str(out), *options, "--quiet", *(["--overwrite"] if overwrite else [])]

    def previous_argv(self, source: Input, out: Path) -> list[str]:
        fill = {
            "{in}": str(source.checkpoint),
            "{other}": str(source.other),
            "{out}": str(out),
            "{shard}": source.shard,
        }
        return [fill.get(a, a) for a in self.previous] + ["--quiet"]


COMMANDS = [
    Command(
        "consolidate-safetensors", "weights", ("consolidate",), ("consolidate", "{in}", "{out}", "--dtype", "bf16")
    ),
    Command(
        "consolidate-safetensors-sharded",
        "weights",
        ("consolidate", "--max-shard-size", "{shard}"),
        ("consolidate", "{in}", "{out}", "--dtype", "bf16", "--max-shard-size", "{shard}"),
    ),
    Command(
        "consolidate-torch",
        "weights",
        ("consolidate", "--format", "torch"),
        ("consolidate", "{in}", "{out}", "--format", "torch", "--dtype", "bf16"),
    ),
    Command(
        "consolidate-torch-sharded",
        "weights",
        ("consolidate", "--format", "torch", "--max-shard-size", "{shard}"),
        ("consolidate", "{in}", "{out}", "--format", "torch", "--dtype", "bf16", "--max-shard-size", "{shard}"),
    ),
    # the largest sample offloads to NVMe; the target run's config asks for CPU offload instead
    Command(
        "reshard",
        "checkpoint",
        ("reshard", "--world-size", "3", "--config", "{cfg}"),
        ("reshard", "{other}", "{out}", "--world-size", "2"),
    ),
    Command(
        "to-universal",
        "checkpoint",
        ("to-universal",),
        ("to-universal", "{other}", "{out}"),
        folder=f"{TAG}_universal",
        latest="latest_universal",
    ),
]
BY_NAME = {c.name: c for c in COMMANDS}
MODES = {"fresh": False, "overwrite": True}


def is_leftover(name: str) -> bool:
    return ".zckpt-" in name


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every final-named file under `folder` (relative path: bytes); zckpt's temporary names
    and staging folders, and the user's own file, left out."""
    files: dict[str, bytes] = {}
    if not folder.is_dir():
        return files
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not is_leftover(d)]
        for name in names:
            if not is_leftover(name) and not (Path(root) == folder and name == USER_FILE):
                path = Path(root) / name
                files[str(path.relative_to(folder))] = path.read_bytes()
    return files


def leftovers_under(folder: Path) -> list[str]:
    found = []
    for root, dirs, names in os.walk(folder):
        found += [os.path.join(root, n) for n in dirs + names if is_leftover(n)]
    return sorted(found)


@dataclass
class Reference:
    new: dict[str, bytes]
    old: dict[str, bytes]
    old_folder: Path  # the previous output (and the user's file), copied into each --overwrite case
    duration: dict[bool, float]  # an uninterrupted run's time, by overwrite
    ops: dict[bool, int]  # the op points of an uninterrupted run (see hook_ops), by overwrite


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "ds_config.json"
    path.write_text(
        json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"}}})
    )
    return path


@pytest.fixture(scope="module")
def references(zygote: Zygote, cfg: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Reference]:
    """By (command, input): the uninterrupted output, the previous one, durations and op counts."""
    refs = {}
    for source in INPUTS.values():
        for command in COMMANDS:
            if source.name == "small" and command.name not in AT_OP:
                continue  # the small input serves the kills at each op only
            base = tmp_path_factory.mktemp(f"{command.name}-{source.name}")
            old = base / "old"
            old.mkdir()
            (old / USER_FILE).write_text("mine")
            run = zygote.run(*command.previous_argv(source, old))
            assert run.code == 0, run.stderr
            durations, ops = {}, {}
            for overwrite, out in ((False, base / "new"), (True, base / "again")):
                if overwrite:
                    shutil.copytree(old, out)
                done = zygote.run(
                    *command.argv(source, out, cfg, overwrite), count_ops=True, scope=None if FULL else out
                )
                assert done.code == 0 and not done.stderr, done.stderr
                durations[overwrite], ops[overwrite] = done.elapsed, done.ops
                if source.name == "big":  # the time of a warm run (the first one reads the input from disk)
                    again = zygote.run(*command.argv(source, out, cfg, True))
                    assert again.code == 0, again.stderr
                    durations[overwrite] = min(done.elapsed, again.elapsed)
            new = snapshot(base / "new")
            assert snapshot(base / "again") == new, "an overwrite writes what a fresh run writes"
            assert (base / "again" / USER_FILE).read_text() == "mine"
            same = {n for n, d in snapshot(old).items() if d == new.get(n)}
            assert new and same <= {command.latest}, (command.name, same)  # old and new tell apart
            if "sharded" in command.name:
                assert len(new) > 2 and len(snapshot(old)) > 2, "several shards"
            refs[command.name, source.name] = Reference(new, snapshot(old), old, durations, ops)
    return refs


# ---------------------------------------------------------------------------------------------
# The checks


def check_state(command: Command, out: Path, ref: Reference, overwrite: bool) -> str:
    """(a): what the output folder holds: "new", "old" (the previous output), "none" (nothing
    yet), "new tag folder, no latest yet", or "between" (allowed only where leftovers flag it);
    fails at once on anything that looks complete and is not."""
    old = ref.old if overwrite else {}
    final = snapshot(out)
    for name, data in final.items():
        assert data in (ref.new.get(name), old.get(name)), f"{name}: neither the new nor the previous file"
    if overwrite:
        assert (out / USER_FILE).read_text() == "mine", "the user's own file was touched"
    if final == ref.new:
        return "new"
    if final == old:
        return "old" if overwrite else "none"
    if command.kind == "checkpoint":
        inside = command.folder + os.sep
        tag_now = {k: v for k, v in final.items() if k.startswith(inside)}
        rest_now = {k: v for k, v in final.items() if not k.startswith(inside)}
        tag_new = {k: v for k, v in ref.new.items() if k.startswith(inside)}
        tag_old = {k: v for k, v in old.items() if k.startswith(inside)}
        assert tag_now in ({}, tag_new, tag_old), "a tag folder neither absent nor whole"
        if command.latest not in rest_now and tag_now == tag_new:
            return "new tag folder, no latest yet"  # complete, not named yet
    return "between"


def describe(out: Path, ref: Reference, overwrite: bool) -> str:
    """Each file in `out`: new, old (the previous output's) or other; and the new files missing."""
    final, old = snapshot(out), (ref.old if overwrite else {})
    marks = {n: "new" if d == ref.new.get(n) else "old" if d == old.get(n) else "other" for n, d in final.items()}
    return f"{marks}; missing new: {sorted(set(ref.new) - set(final))}"


def signature(tmp: Path, ref: Reference, overwrite: bool) -> tuple:
    """The state a killed run left, owners aside: the leftovers' names (not what is inside them)
    and which version each final file is; the follow-up (inspect, verify, the rerun) depends on
    nothing else."""
    old = ref.old if overwrite else {}
    entries = []
    for root, dirs, names in os.walk(tmp):
        for name in [d for d in dirs if is_leftover(d)] + names:
            path = Path(root) / name
            rel = str(path.relative_to(tmp))
            if is_leftover(name):
                entries.append((re.sub(r"zckpt-tmp-.*$", "zckpt-tmp-OWNER", rel), "leftover"))
            elif path.is_relative_to(tmp / "out"):
                key, data = str(path.relative_to(tmp / "out")), path.read_bytes()
                entries.append((rel, "new" if data == ref.new.get(key) else "old" if data == old.get(key) else "other"))
        dirs[:] = [d for d in dirs if not is_leftover(d)]
    return tuple(sorted(entries)) + (("out exists", (tmp / "out").is_dir()),)


def assert_one_line_error(run: Run, code: int, *expected: str) -> str:
    assert run.code == code, (run.code, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zckpt: error: "), run.stderr
    assert "Traceback" not in run.stderr and "internal error" not in lines[0], run.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def assert_listed(zygote: Zygote, out: Path, leftovers: list[str]) -> None:
    """`inspect` and `verify` on the output folder list each dead leftover in it as a problem, exit 3."""
    for verb in ("inspect", "verify"):
        shown = zygote.run(verb, out, "--json")
        assert shown.code == 3, (verb, shown.code, shown.stdout, shown.stderr)
        problems = " ".join(json.loads(shown.stdout)["problems"])
        for path in leftovers:
            if os.path.dirname(path) == str(out):
                assert path in problems, (verb, path, problems)
        COUNTS[("listed by", verb)] += 1


# The follow-ups already run, by (command, mode, state signature)
FOLLOWED: dict[tuple, str] = {}


def after_kill(
    zygote: Zygote,
    command: Command,
    source: Input,
    ref: Reference,
    cfg: Path,
    tmp: Path,
    overwrite: bool,
    run: Run,
    signum: int,
) -> str:
    """(a), (b) and (c) for one killed run; the state it left."""
    out = tmp / "out"
    if signum == signal.SIGKILL:
        assert run.code in (0, -signal.SIGKILL), (run.code, run.stderr)
    else:  # -signum: it came before zckpt set its handlers (the interpreter starting): default action
        assert run.code in (0, CAUGHT_EXIT[signum], -signum), (run.code, run.stderr)
        if run.code > 0:
            assert_one_line_error(run, CAUGHT_EXIT[signum], signal.Signals(signum).name)
    if run.code == 0:
        assert not run.stderr.strip(), run.stderr
    state = check_state(command, out, ref, overwrite)
    left = leftovers_under(tmp)
    if signum != signal.SIGKILL or run.code == 0:
        assert not left, (state, left)  # (b): a caught signal leaves nothing of its own
    if not left:
        assert state != "between", (
            f"a state between the old and the new output that nothing flags: {describe(out, ref, overwrite)}"
        )
    key = (command.name, source.name, overwrite, signature(tmp, ref, overwrite))
    if key in FOLLOWED:
        return state
    if left:
        assert_listed(zygote, out, left)
    # (c): a rerun into the same folder succeeds, removes the leftovers and writes the new output
    again = zygote.run(*command.argv(source, out, cfg, overwrite or bool(snapshot(out))))
    assert again.code == 0, (again.code, again.stderr)
    assert not leftovers_under(tmp), leftovers_under(tmp)
    assert snapshot(out) == ref.new
    if overwrite:
        assert (out / USER_FILE).read_text() == "mine"
    FOLLOWED[key] = state
    COUNTS[("followed up", "distinct states")] += 1
    return state


def prepare(tmp: Path, ref: Reference, overwrite: bool) -> Path:
    tmp.mkdir()
    out = tmp / "out"
    if overwrite:
        shutil.copytree(ref.old_folder, out)
    return out


# ---------------------------------------------------------------------------------------------
# Kills at random times

CASES = [(c.name, mode, signame) for c in COMMANDS for mode in MODES for signame in SIGNALS]


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("name, mode, signame", CASES, ids=["-".join(c) for c in CASES])
def test_killed_at_random_times(
    zygote: Zygote, references: dict[str, Reference], cfg: Path, tmp_path: Path, name: str, mode: str, signame: str
) -> None:
    command, ref, signum, overwrite = BY_NAME[name], references[name, "big"], SIGNALS[signame], MODES[mode]
    rng = random.Random(f"{name}-{mode}-{signame}")
    for seed in range(TIMED_SEEDS):
        tmp = tmp_path / f"seed{seed}"
        out = prepare(tmp, ref, overwrite)
        delay = rng.uniform(0, ref.duration[overwrite])
        run = zygote.run(*command.argv(INPUTS["big"], out, cfg, overwrite), kill_after=delay, signum=signum)
        state = after_kill(zygote, command, INPUTS["big"], ref, cfg, tmp, overwrite, run, signum)
        COUNTS[("timed", name, signame)] += 1
        COUNTS[("state", state)] += 1
        COUNTS[("timed kill landed" if run.landed else "timed kill after the end", signame)] += 1
        shutil.rmtree(tmp)


# ---------------------------------------------------------------------------------------------
# Kills right before and right after each op on the output folder's names (the commit steps)

# The torch writer commits through the same StagedOutput steps as safetensors' (the same ops in the
# same order): its kills at each op add nothing but time, except in the full run.
# SIGTERM into a fresh reshard or to-universal takes the steps of an overwriting one, less two.
OP_CASES = [
    c
    for c in CASES
    if c[2] in OP_SIGNALS
    and (FULL or ("torch" not in c[0] and (c[1] == "overwrite" or c[2] == "SIGKILL" or "consolidate" in c[0])))
]
AT_OP = {c[0] for c in OP_CASES}


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("name, mode, signame", OP_CASES, ids=["-".join(c) for c in OP_CASES])
def test_killed_at_each_commit_step(
    zygote: Zygote, references: dict[str, Reference], cfg: Path, tmp_path: Path, name: str, mode: str, signame: str
) -> None:
    command, ref, signum, overwrite = BY_NAME[name], references[name, "small"], SIGNALS[signame], MODES[mode]
    points = 2 * ref.ops[overwrite]
    assert points > 0
    for at in range(points):
        tmp = tmp_path / f"at{at}"
        out = prepare(tmp, ref, overwrite)
        run = zygote.run(
            *command.argv(INPUTS["small"], out, cfg, overwrite), at=at, signum=signum, scope=None if FULL else out
        )
        state = after_kill(zygote, command, INPUTS["small"], ref, cfg, tmp, overwrite, run, signum)
        COUNTS[("at op", name, signame)] += 1
        COUNTS[("state", state)] += 1
        shutil.rmtree(tmp)


# ---------------------------------------------------------------------------------------------
# A full disk and a read-only output folder: one line naming the path, exit 1, nothing left


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(exist_ok=True)
    try:
        return (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
            ).returncode
            == 0
        )
    except OSError:  # no mount command
        return False


@pytest.fixture
def disk(tmp_path: Path):
    """A 16 MiB tmpfs (as tests/test_cli/test_bad_input.py's tiny_disk: needs mount rights, else skipped)."""
    mountpoint = tmp_path / "disk"
    if not _mount_tmpfs(mountpoint, "16m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True)


DISK_CASES = [(c.name, mode, keep) for c in COMMANDS for mode in MODES for keep in ("nothing", "half")]


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("name, mode, keep", DISK_CASES, ids=["-".join(c) for c in DISK_CASES])
def test_full_disk(
    zygote: Zygote, references: dict[tuple[str, str], Reference], cfg: Path, disk: Path, name: str, mode: str, keep: str
) -> None:
    """The up-front free-space check passes, then the disk fills up (another process took the
    space): with nothing left, or half the output's size, the writes meet a real ENOSPC."""
    command, source, overwrite = BY_NAME[name], INPUTS["big"], MODES[mode]
    ref = references[name, "big"]
    out = disk / "out"
    if overwrite:
        shutil.copytree(ref.old_folder, out)
    left_free = 0 if keep == "nothing" else sum(map(len, ref.new.values())) // 2 // 4096 * 4096
    run = zygote.run(*command.argv(source, out, cfg, overwrite), fill=(str(disk), left_free))
    assert_one_line_error(run, 1, "no space left on device", str(out))
    assert sorted(p.name for p in disk.iterdir()) == (["filler", "out"] if overwrite else ["filler"])
    assert not leftovers_under(disk)
    if overwrite:
        assert snapshot(out) == ref.old and (out / USER_FILE).read_text() == "mine"
    COUNTS[("full disk", name, mode)] += 1


@pytest.fixture
def read_only(tmp_path: Path):
    """make(fill) -> a read-only folder holding what fill(folder) put there: chmod 0o555 where
    that stops this user (not root), else a tmpfs remounted read-only; skipped if neither works."""
    mounts = []

    def make(fill) -> Path:
        folder = tmp_path / f"ro{len(mounts)}"
        folder.mkdir()
        fill(folder)
        folder.chmod(0o555)
        try:
            (folder / ".probe").touch()
        except PermissionError:
            return folder
        (folder / ".probe").unlink()
        folder.chmod(0o755)
        shutil.rmtree(folder)
        if not _mount_tmpfs(folder, "16m"):
            pytest.skip("the folder stays writable (root) and no tmpfs can be mounted read-only here")
        mounts.append(folder)
        fill(folder)
        if subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True).returncode:
            pytest.skip("cannot remount a tmpfs read-only here")
        return folder

    yield make
    for folder in mounts:
        subprocess.run(["umount", str(folder)], capture_output=True)
    for path in tmp_path.glob("ro*"):
        path.chmod(0o755)


RO_CASES = [(c.name, layout) for c in COMMANDS for layout in ("missing", "empty", "previous")]


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("name, layout", RO_CASES, ids=["-".join(c) for c in RO_CASES])
def test_read_only_output_folder(
    zygote: Zygote, references: dict[tuple[str, str], Reference], cfg: Path, read_only, name: str, layout: str
) -> None:
    """OUTPUT_DIR in a read-only folder ("missing"), read-only and empty, or read-only holding
    a previous output (--overwrite): one line naming the path, exit 1, nothing changed."""
    command, source = BY_NAME[name], INPUTS["big"]
    ref = references[name, "big"]
    if layout == "missing":
        out = read_only(lambda folder: None) / "out"
    elif layout == "empty":
        out = read_only(lambda folder: None)
    else:
        out = read_only(lambda folder: shutil.copytree(ref.old_folder, folder, dirs_exist_ok=True))
    before = snapshot(out)
    run = zygote.run(*command.argv(source, out, cfg, layout == "previous"))
    line = assert_one_line_error(run, 1, str(out))
    assert "read-only file system" in line.lower() or "permission denied" in line.lower(), line
    assert snapshot(out) == before and not leftovers_under(out.parent)
    assert out.exists() == (layout != "missing")
    COUNTS[("read-only", name, layout)] += 1


@pytest.mark.heavy
@pytest.mark.slow
def test_zz_counts(references: dict[tuple[str, str], Reference]) -> None:
    """How many cases ran (printed with `pytest -s`); runs last in this file."""
    for (name, source), ref in sorted(references.items()):
        print(
            f"{name:34} {source:6} run {ref.duration[False]:.2f} s ({ref.duration[True]:.2f} s overwriting), op points {2 * ref.ops[False]} ({2 * ref.ops[True]})"
        )
    for key, count in sorted(COUNTS.items()):
        print(" ".join(key), count)
    for key, seconds in sorted(TIMES.items()):
        print(" ".join(key), round(seconds, 1))
    kills = sum(n for k, n in COUNTS.items() if k[0] in ("timed", "at op"))
    print("killed runs:", kills)
