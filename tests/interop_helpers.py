"""Helpers for tests that run real DeepSpeed: find its interpreter, run ``scripts/ds_probe.py`` at
M ranks, and remove the ``/dev/shm`` buffers DeepSpeed's CPU runs leak.

``run_probe(case, checkpoint, M, out)`` loads ``checkpoint`` with a plain
``engine.load_checkpoint`` at world size M and returns what the engine then holds::

    live, optim, state = run_probe("z2_fp16_ws4_tied", ckpt_dir, 4, tmp_path / "probe")
    live["fc1.weight"]            # fp32 master (frozen params: their value; buffers as held)
    optim["fc1.weight.exp_avg"]   # every per-element optimizer state, fp32, full shape
    state["global_steps"], state["cur_scale"], state["param_groups"][0]["step"], ...

It needs nothing from DeepSpeed in this process: the probe runs under ``ds_python()`` (this
interpreter when it imports deepspeed, else ``$ZCKPT_DS_PYTHON``, else the test is skipped).

Loaded as a pytest plugin (``-p interop_helpers``, with ``tests/`` on ``PYTHONPATH``) or imported
into a test module, ``shm_leak_safety_net`` removes at the end of the session every DeepSpeed
shared-memory buffer that appeared during it and that no live process holds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "scripts" / "ds_probe.py"


def _load_script(name: str) -> Any:
    """A module of scripts/ (stdlib-only helpers shared with the scripts), loaded once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


# the /dev/shm leak helpers live in scripts/shm_leaks.py, for the scripts that launch DeepSpeed too
_shm = _load_script("shm_leaks")
SHM_DIR, SHM_PREFIX = _shm.SHM_DIR, _shm.SHM_PREFIX
shm_listing, held_shm_paths, cleanup_shm_leaks = _shm.shm_listing, _shm.held_shm_paths, _shm.cleanup_shm_leaks
# torchrun for DeepSpeed launches, forked from a pre-imported zygote while one serves (scripts/fast_torchrun.py)
_fast_torchrun = _load_script("fast_torchrun")
launcher = _fast_torchrun.launcher


class ProbeError(RuntimeError):
    """The probe failed: ``returncode``, ``log_tail``, ``errors`` (rank -> traceback text)."""

    def __init__(self, message: str, returncode: int | None, log_tail: str, errors: dict[int, str]):
        super().__init__(message)
        self.returncode = returncode
        self.log_tail = log_tail
        self.errors = errors

    @property
    def error_text(self) -> str:
        """All ranks' tracebacks (where the probe wrote one) followed by the log tail."""
        return "\n".join(self.errors.values()) + "\n" + self.log_tail


# --------------------------------------------------------------------------------------
# /dev/shm leaks
# --------------------------------------------------------------------------------------
def extensions_for(pythons: dict[str, str]) -> dict[str, str]:
    """For make_sample_ckpts.generate: each release's interpreter builds DeepSpeed's ops where the
    tests' own runs of it do (:func:`torch_extensions_dir`: CI built async_io there)."""
    return {release: str(torch_extensions_dir(python)) for release, python in pythons.items()}


def sample_generator() -> Any:
    """scripts/make_sample_ckpts.py as a module (its Case and generate), loaded once."""
    return _load_script("make_sample_ckpts")


@pytest.fixture(scope="session", autouse=True)
def shm_leak_safety_net() -> Iterator[None]:
    """Session-wide: remove the DeepSpeed shm buffers that runs during the session leaked."""
    before = shm_listing()
    yield
    cleanup_shm_leaks(before)


@pytest.fixture(scope="session", autouse=True)
def fast_torchrun_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Session-wide: one zygote (scripts/fast_torchrun.py) that has imported torch and DeepSpeed,
    from which every DeepSpeed launch of the session forks its ranks (``launcher(python)``): 8-12 s
    less per launch on 2 cores. ``ZCKPT_FAST_TORCHRUN=0`` runs plain torchrun instead; without
    DeepSpeed, or when the zygote does not start within 3 minutes, launches run plain torchrun."""
    var = _fast_torchrun.ENV_VAR
    python = _deepspeed_python()
    if os.environ.get(var) == "0" or python is None:
        os.environ.pop(var, None)
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="zft-"))  # short: a socket path holds at most 107 bytes
    sock = folder / "s"
    log = tmp_path_factory.getbasetemp() / "fast_torchrun.log"
    env = ds_env(1, python)
    env.pop("LOCAL_SIZE")
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [python, str(ROOT / "scripts" / "fast_torchrun.py"), "serve", str(sock)],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    ready = Path(str(sock) + ".ready")
    deadline = time.monotonic() + 180
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if ready.exists():
        os.environ[var] = str(sock)
    try:
        yield
    finally:
        os.environ.pop(var, None)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------------------
# DeepSpeed interpreter
# --------------------------------------------------------------------------------------
def ds_python() -> str:
    """An interpreter with DeepSpeed: this one if it imports deepspeed, else ``$ZCKPT_DS_PYTHON``;
    skips the calling test when there is none."""
    python = _deepspeed_python()
    if python is None:
        pytest.skip("DeepSpeed is not installed here and ZCKPT_DS_PYTHON is not set")
    return python


def _deepspeed_python() -> str | None:
    """:func:`ds_python`'s answer, None where there is none."""
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable
    env = os.environ.get("ZCKPT_DS_PYTHON")
    return env if env and Path(env).exists() else None


@functools.lru_cache(maxsize=None)
def ds_release(python: str) -> str:
    """``ds<major><minor>`` of the DeepSpeed that ``python`` imports (``ds19`` for 0.19.x)."""
    if python == sys.executable:
        from importlib.metadata import version

        ver = version("deepspeed")
    else:
        ver = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    major, minor = ver.split(".")[:2]
    return f"ds{major if major != '0' else ''}{minor}"


def torch_extensions_dir(python: str) -> Path:
    """Where DeepSpeed JIT-builds its ops (``deepspeed_shm_comm``) for runs of ``python``.

    Per DeepSpeed release, as make_sample_ckpts does (two releases on one torch would otherwise load
    each other's builds), and also per virtualenv: the build commands name the venv's absolute
    paths, so two venvs sharing one folder rebuild the op (30-60 s on 2 cores) whenever the other
    one ran last, and a run can load the .so while the other venv's build rewrites it."""
    venv = Path(sys.prefix if python == sys.executable else Path(python).absolute().parent.parent)
    key = hashlib.sha1(str(venv).encode()).hexdigest()[:8]
    return Path.home() / ".cache" / f"torch_extensions_{ds_release(python)}_{key}"


# DeepSpeed's CPU Adagrad and Lion are C++ ops built on first use: 3-5 minutes each on 2 cores,
# more than the cases that need them take. .ci/run builds them (with every other op the tier
# loads) into torch_extensions_dir before the interop tier; elsewhere, where they are not built,
# those cases are skipped, saying so (build one with `python -c "from deepspeed.accelerator import
# get_accelerator as g; g().create_op_builder('CPULionBuilder').load()"` and TORCH_EXTENSIONS_DIR
# set to torch_extensions_dir).
CPU_OPTIMIZER_OPS = {"z2_fp32_ws2_cpuadagrad": "cpu_adagrad", "z2_bf16_ws2_cpulion": "cpu_lion"}


def needs_built_op(name: str) -> list[Any]:
    """pytest marks for a case on sample `name`: a skip when it needs a DeepSpeed CPU optimizer
    op that is not built for the interop venv."""
    op = CPU_OPTIMIZER_OPS.get(name)
    if op is None:
        return []
    built = any((torch_extensions_dir(ds_python()) / op).glob("*.so"))
    import pytest

    return [pytest.mark.skipif(not built, reason=f"DeepSpeed's {op} op is not built (a 3-5 minute C++ build)")]


def ds_env(world_size: int, python: str) -> dict[str, str]:
    """Environment for a CPU DeepSpeed run of ``world_size`` ranks (as make_sample_ckpts sets it)."""
    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
        "LOCAL_SIZE": str(world_size),
        "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir(python)),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------
def case_arg(case_or_name: Any) -> str:
    """``--case-json`` for a bundled case name, a make_sample_ckpts ``Case`` or its asdict."""
    if isinstance(case_or_name, str):
        return case_or_name
    if dataclasses.is_dataclass(case_or_name):
        return json.dumps(dataclasses.asdict(case_or_name))
    if isinstance(case_or_name, dict):
        return json.dumps(case_or_name)
    raise TypeError(f"case: expected a name, a Case or a dict, got {type(case_or_name).__name__}")


def run_probe(
    case_or_name: Any,
    checkpoint_dir: str | Path,
    world_size: int,
    out_dir: str | Path,
    stage: int | None = None,
    load_universal: bool = False,
    train_steps: int = 0,
    timeout: float = 600,
    config_override: dict | None = None,
    tag: str | None = None,
    data: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Load ``checkpoint_dir`` with real DeepSpeed at ``world_size`` ranks (``scripts/ds_probe.py``
    under torchrun) and return ``(live_tensors, live_optimizer_tensors, state)``.

    ``stage`` runs another ZeRO stage than the case's; ``config_override`` is deep-merged into the
    DeepSpeed config (a None value deletes a key); ``train_steps`` trains that many more steps after
    the load (``data="global"``: on one data stream shared by the ranks, see ds_probe's ``--data``;
    ``state["train"]`` has the losses; ``out_dir`` then also holds
    ``live_after_train.safetensors`` / ``live_optimizer_after_train.safetensors``). ``out_dir`` is
    emptied first; it also receives ``live_module.safetensors`` (the module's own 16-bit values),
    ``state.json`` and the run's log ``probe.log``. Raises ``ProbeError`` (log tail and each rank's traceback) when the run
    fails or times out. DeepSpeed's leaked /dev/shm buffers are removed in every case.
    """
    from safetensors.torch import load_file

    python = ds_python()
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    log = out / "probe.log"
    cmd = [
        *launcher(python),
        "--nproc-per-node",
        str(world_size),
        "--master-port",
        str(free_port()),
        str(PROBE),
        "--case-json",
        case_arg(case_or_name),
        "--checkpoint",
        str(Path(checkpoint_dir).resolve()),
        "--out",
        str(out.resolve()),
    ]
    if stage is not None:
        cmd += ["--stage", str(stage)]
    if load_universal:
        cmd.append("--load-universal")
    if train_steps:
        cmd += ["--train-steps", str(train_steps)]
    if config_override:
        cmd += ["--config-override", json.dumps(config_override)]
    if tag is not None:
        cmd += ["--tag", tag]
    if data is not None:
        cmd += ["--data", data]

    returncode = run_logged(cmd, ds_env(world_size, python), log, timeout)
    state_file = out / "state.json"
    if returncode != 0 or not state_file.exists():
        lines = log.read_text(errors="replace").splitlines()
        tail = "\n".join(lines[-60:])
        errors = {int(p.stem.removeprefix("error_rank")): p.read_text() for p in sorted(out.glob("error_rank*.txt"))}
        what = f"timed out after {timeout:.0f}s" if returncode is None else f"exit status {returncode}"
        first = next(iter(errors.values()), "").strip().splitlines()
        raise ProbeError(
            f"ds_probe {what} (world size {world_size}, {checkpoint_dir}): {first[-1] if first else ''}\n{tail}",
            returncode,
            tail,
            errors,
        )
    state = json.loads(state_file.read_text())
    return load_file(out / "live.safetensors"), load_file(out / "live_optimizer.safetensors"), state


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int | None:
    """Run a DeepSpeed launch (torchrun and its ranks, in their own session) with its output in
    `log`; its exit status, or None when it was stopped at `timeout`. The /dev/shm buffers it
    leaked are removed whatever happens."""
    before = shm_listing()
    try:
        with log.open("w") as fh:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return None
    finally:
        cleanup_shm_leaks(before)


def run_hf_job(
    what: str,
    cmd: list[str],
    out: Path,
    processes: int,
    python: str,
    *,
    log_name: str = "run.log",
    outputs: tuple[str, ...] = (),
    timeout: float = 300,
) -> dict:
    """Run a Hugging Face job script of scripts/ (offline, `processes` DeepSpeed ranks) with its
    output in ``out/<log_name>``; fail the test with the ranks' error files and the log's tail
    unless it exits 0 leaving ``run.json`` and `outputs` in `out`. Returns ``run.json``."""
    log = out / log_name
    env = {**ds_env(processes, python), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    returncode = run_logged(cmd, env, log, timeout)
    if returncode != 0 or not all((out / name).is_file() for name in ("run.json", *outputs)):
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error_*.txt")))
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        status = f"timed out after {timeout:.0f}s" if returncode is None else f"exit status {returncode}"
        pytest.fail(f"{what}: {status}\n{errors}\n{tail}")
    return json.loads((out / "run.json").read_text())


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop torchrun and its ranks (their own session, started by us)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
