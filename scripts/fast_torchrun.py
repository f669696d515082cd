#!/usr/bin/env python3
"""torchrun for the test suite's many short DeepSpeed runs, forked from a process that has
imported torch and DeepSpeed once.

Why: the interop tier launches DeepSpeed under torchrun a few hundred times, and on a 2-core
machine each launch spends ~8-12 s before DeepSpeed does any work, while the work itself (load a
small checkpoint, a step or two) is often under a second. Measured here for one 2-rank load:
torchrun's own interpreter and torch import ~3 s before a rank starts, each rank's ``import
deepspeed`` ~2 s, the ``torch._dynamo`` import DeepSpeed's engine pulls in (its Muon module's
``torch.compile`` and torch's ``_disable_dynamo`` optimizer hooks) ~2.5-3 s, and for CPU-optimizer
runs py-cpuinfo's three subprocess probes per rank (~3.7 s).

``serve SOCKET``: the zygote. Imports torch and DeepSpeed once, caches py-cpuinfo's answer (the
same machine answers the same), then for each request forks one process per rank that runs the
script as ``python SCRIPT ARGS`` would (``runpy`` as ``__main__``, ``sys.path[0]`` the script's
folder, the client's cwd, environment and stdin/stdout/stderr, which come over the socket), with
the variables torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT,
TORCHELASTIC_*; rank 0 hosts the store, as without torchrun's agent). As torchrun does, when a rank
fails the others get SIGTERM (SIGKILL 10 s later) and the job's status is 1; when the client dies
(a test's timeout kills it) every rank is killed.

``run [TORCHRUN OPTIONS] SCRIPT [ARGS]``: the client, standard library only (starts in ~30 ms).
Sends the request to the zygote named by ``$ZCKPT_FAST_TORCHRUN`` and exits with the job's status.
Without that variable, or for what the zygote cannot honour exactly (several nodes, a module
instead of a script, options it does not know, another interpreter, another ``PYTHONHASHSEED`` or
``DS_ACCELERATOR``), it execs ``python -m torch.distributed.run`` with the same arguments: a run is
the same either way, only faster here.

Test infrastructure only: zckpt never uses it. ``tests/interop_helpers.py`` starts one zygote per
interop test session (``fast_torchrun_session``) and ``launcher(python)`` gives the command prefix.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from pathlib import Path

ENV_VAR = "ZCKPT_FAST_TORCHRUN"
# variables whose value is fixed when the zygote's interpreter starts or imports DeepSpeed
FIXED_AT_START = ("PYTHONHASHSEED", "DS_ACCELERATOR")
TERM_GRACE_S = 10.0


def launcher(python: str) -> list[str]:
    """The command prefix that replaces ``[python, "-m", "torch.distributed.run"]``: this client
    when a zygote is serving (``$ZCKPT_FAST_TORCHRUN``), torchrun itself otherwise."""
    if os.environ.get(ENV_VAR):
        return [python, os.path.abspath(__file__), "run"]
    return [python, "-m", "torch.distributed.run"]


# --------------------------------------------------------------------------------------
# wire format: a 4-byte length, then JSON (the request carries the client's fds 0, 1, 2)
# --------------------------------------------------------------------------------------
def _send(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    payload = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], fds)
    else:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return buf


def _recv(sock: socket.socket, with_fds: int = 0) -> tuple[dict, list[int]]:
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, 4, with_fds)
        if not head:
            raise ConnectionError("peer closed")
        head = head + _recv_exact(sock, 4 - len(head))
    else:
        head = _recv_exact(sock, 4)
    (n,) = struct.unpack("!I", head)
    return json.loads(_recv_exact(sock, n)), fds


# --------------------------------------------------------------------------------------
# the client
# --------------------------------------------------------------------------------------
def parse_torchrun(argv: list[str]) -> dict | None:
    """torchrun's options this launcher honours, or None for anything else."""
    nproc, port, i = 1, None, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return {"nproc": nproc, "port": port, "script": argv[i], "args": argv[i + 1 :]}
        name, eq, value = arg.partition("=")
        key = name.lstrip("-").replace("_", "-")
        if key == "standalone":
            i += 1
            continue
        if key not in ("nproc-per-node", "master-port", "nnodes", "max-restarts"):
            return None
        if not eq:
            if i + 1 >= len(argv):
                return None
            value, i = argv[i + 1], i + 2
        else:
            i += 1
        if key == "nproc-per-node":
            if not value.isdigit() or int(value) < 1:
                return None
            nproc = int(value)
        elif key == "master-port":
            port = int(value)
        elif key == "nnodes" and value not in ("1", "1:1"):
            return None
        elif key == "max-restarts" and value != "0":
            return None
    return None


def _fallback(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])


def client(argv: list[str]) -> int:
    path = os.environ.get(ENV_VAR)
    plan = parse_torchrun(argv)
    if not path or plan is None or not os.path.isfile(plan["script"]):
        _fallback(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        _fallback(argv)
    request = {
        **plan,
        "script": os.path.abspath(plan["script"]),
        "python": os.path.realpath(sys.executable),
        "cwd": os.getcwd(),
        "env": dict(os.environ),
    }
    _send(sock, request, fds=[0, 1, 2])
    answer, _ = _recv(sock)
    if not answer.get("accepted"):
        sock.close()
        _fallback(argv)
    done, _ = _recv(sock)
    return int(done["rc"])


# --------------------------------------------------------------------------------------
# the zygote
# --------------------------------------------------------------------------------------
def _preimport() -> None:
    """What every DeepSpeed rank imports; py-cpuinfo answered once."""
    import copy

    import cpuinfo
    import deepspeed  # noqa: F401
    import deepspeed.ops.adam  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (its torch.compile: torch._dynamo)
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401

    info = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: copy.deepcopy(info)
    torch.distributed.is_available()


def _refusal(request: dict, base_env: dict[str, str]) -> str | None:
    if request["python"] != os.path.realpath(sys.executable):
        return "another interpreter"
    for key in FIXED_AT_START:
        mine, theirs = base_env.get(key), request["env"].get(key)
        if theirs is not None and theirs != mine:
            return f"{key}={theirs}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun_env(rank: int, world: int, port: int, run_id: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(world),
        "WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def _run_rank(request: dict, rank: int, port: int, fds: list[int], base_path: list[str], keep: set[int]) -> None:
    """In the forked rank: become ``python SCRIPT ARGS`` under torchrun, run, leave."""
    import atexit
    import io
    import runpy
    import signal
    import threading
    import traceback

    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in keep:
        try:
            os.close(fd)
        except OSError:
            pass
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    env = dict(request["env"])
    world = int(request["nproc"])
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it
    env.update(_torchrun_env(rank, world, port, request["run_id"]))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])

    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    out = io.FileIO(1, "w", closefd=False)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(out), line_buffering=out.isatty(), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        line_buffering=True,
        write_through=unbuffered,
        errors="backslashreplace",
    )
    script = request["script"]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *[os.path.abspath(p) for p in extra], *base_path]
    sys.argv = [script, *request["args"]]

    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))

    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code & 0xFF)


def _kill_groups(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _handle(conn: socket.socket, listener: socket.socket, base_env: dict[str, str], base_path: list[str]) -> None:
    """In a forked handler: the job's agent (fork the ranks, watch them and the client)."""
    import select
    import signal
    import time
    import uuid

    request, fds = _recv(conn, with_fds=3)
    why = _refusal(request, base_env)
    if why is not None or len(fds) != 3:
        _send(conn, {"accepted": False, "why": why or "no stdio"})
        os._exit(0)
    _send(conn, {"accepted": True})
    request["run_id"] = uuid.uuid4().hex
    port = int(request["port"] or _free_port())
    keep = {conn.fileno(), listener.fileno(), *fds}
    ranks: dict[int, int] = {}
    for rank in range(int(request["nproc"])):
        pid = os.fork()
        if pid == 0:
            try:
                _run_rank(request, rank, port, fds, base_path, keep)
            finally:
                os._exit(70)
        ranks[pid] = rank
    for fd in fds:
        os.close(fd)

    live, rc, term_at = set(ranks), 0, None
    while live:
        readable, _, _ = select.select([conn], [], [], 0.1)
        if readable and not conn.recv(1, socket.MSG_PEEK):
            _kill_groups(live, signal.SIGKILL)  # the client is gone: so is the job
            for pid in list(live):
                os.waitpid(pid, 0)
            os._exit(0)
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid not in live:
                continue
            live.discard(pid)
            failed = os.waitstatus_to_exitcode(status) != 0
            if failed and rc == 0:
                rc = 1
                _kill_groups(live, signal.SIGTERM)
                term_at = time.monotonic()
        if term_at is not None and live and time.monotonic() - term_at > TERM_GRACE_S:
            _kill_groups(live, signal.SIGKILL)
            term_at = None
    try:
        _send(conn, {"rc": rc})
    except OSError:
        pass
    os._exit(0)


def serve(path: str) -> None:
    """Preimport, then answer requests until killed; writes ``PATH.ready`` once listening."""
    import signal

    _preimport()
    base_env = dict(os.environ)
    own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    own.add(os.path.dirname(os.path.abspath(__file__)))
    base_path = [p for p in sys.path[1:] if os.path.abspath(p or ".") not in own]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path)
    listener.listen(16)
    Path(path + ".ready").write_text(str(os.getpid()))
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        conn, _ = listener.accept()
        pid = os.fork()
        if pid == 0:
            try:
                os.setpgid(0, 0)
                _handle(conn, listener, base_env, base_path)
            finally:
                os._exit(0)
        conn.close()
        while True:  # reap finished handlers
            try:
                done, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if done == 0:
                break


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 2:
        serve(argv[1])
        return 0
    if argv[:1] == ["run"]:
        return client(argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
