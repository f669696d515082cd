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
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from helpers import Sample, same_bits
from zckpt.deepspeed.reader import open_training_state
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader

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
def sample_generator() -> Any:
    """scripts/make_sample_ckpts.py as a module (its Case and generate), loaded once."""
    return _load_script("make_sample_ckpts")


@pytest.fixture(scope="session", autouse=True)
def shm_leak_safety_net() -> Iterator[None]:
    """Session-wide: remove the DeepSpeed shm buffers that runs during the session leaked."""
    before = shm_listing()
    yield
    cleanup_shm_leaks(before)


# --------------------------------------------------------------------------------------
# DeepSpeed interpreter
# --------------------------------------------------------------------------------------
def ds_python() -> str:
    """An interpreter with DeepSpeed: this one if it imports deepspeed, else ``$ZCKPT_DS_PYTHON``;
    skips the calling test when there is none."""
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable
    env = os.environ.get("ZCKPT_DS_PYTHON")
    if env and Path(env).exists():
        return env
    pytest.skip("DeepSpeed is not installed here and ZCKPT_DS_PYTHON is not set")


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
        python,
        "-m",
        "torch.distributed.run",
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


def _check_loaded(case: Sample, live: dict, optim: dict, state: dict, world_size: int, stage: int) -> None:
    """What DeepSpeed holds after load_checkpoint equals what the original engine held."""
    from safetensors.torch import load_file

    assert (state["world_size"], state["zero_stage"]) == (world_size, stage)
    meta = case.meta
    for name, expected in case.live().items():
        if name in meta["buffers"] and meta["deepspeed_version"].startswith("0.14"):
            expected, got = (
                expected.float() if expected.is_floating_point() else expected,
                live[name].float() if live[name].is_floating_point() else live[name],
            )
            assert same_bits(got, expected), name
        else:
            assert same_bits(live[name], expected), name
    optim_file = case.folder / "reference" / "live_optimizer.safetensors"
    if optim_file.exists():
        for name, expected in load_file(optim_file).items():
            assert same_bits(optim[name], expected), name
    original = open_training_state(case.checkpoint)
    assert (state["global_steps"], state["skipped_steps"], state["global_samples"]) == (
        original.global_steps,
        original.skipped_steps,
        original.global_samples,
    )
    with FileReader() as reader:
        steps = [read_tensor(reader, g.scalars["step"].tensor).item() for g in original.groups]
    assert [set(g["step"]) for g in state["param_groups"]] == [{s} for s in steps]
    for group, saved in zip(state["param_groups"], original.groups):
        assert group["hyperparameters"]["lr"] == saved.hyperparams["lr"]
        assert group["hyperparameters"]["weight_decay"] == saved.hyperparams["weight_decay"]
    if meta["dtype"] == "fp16":
        scaler = state["loss_scaler"]
        for key, value in vars(original.loss_scaler).items():
            if isinstance(value, (int, float, bool)):
                assert scaler[key] == value, key
    assert state["lr_scheduler"] == original.lr_scheduler


GEN = sample_generator()


def _plain(value: Any) -> Any:
    """A JSON-like rendering (tuples as lists, 0-dim tensors as numbers), as ds_probe dumps state."""
    if torch.is_tensor(value) and value.numel() == 1 and value.dim() == 0:
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _saved(checkpoint: Path, tag: str | None = None) -> dict[str, Any]:
    """Rank 0's model_states and optim_states of a DeepSpeed checkpoint (any stage, BF16_Optimizer
    included): counters, lr scheduler, loss scaler, per-group hyperparameters, Adam steps."""
    tag = tag or (checkpoint / "latest").read_text().strip()
    folder = checkpoint / tag
    model_file = next(
        f
        for f in (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt", folder / "mp_rank_00_model_states.pt")
        if f.exists()
    )
    optim_file = next(
        f
        for f in (
            folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        )
        if f.exists()
    )
    model = torch.load(model_file, map_location="cpu", weights_only=False)
    optim = torch.load(optim_file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    base = optim["base_optimizer_state"] if "base_optimizer_state" in optim else optim["optimizer_state_dict"]
    return {
        "global_steps": model["global_steps"],
        "skipped_steps": model["skipped_steps"],
        "global_samples": model["global_samples"],
        "lr_scheduler": _plain(model["lr_scheduler"]),
        "loss_scaler": optim.get("loss_scaler"),
        "dynamic_loss_scale": optim.get("dynamic_loss_scale"),
        "steps": {_plain(s["step"]) for s in base["state"].values()},
        "hyperparameters": [_plain({k: v for k, v in g.items() if k != "params"}) for g in base["param_groups"]],
    }


def _fresh_buffers(case: Any) -> dict[str, torch.Tensor]:
    """The buffers of the model as the probe builds it before any load (make_sample_ckpts' seed)."""
    return {n: b.detach().clone() for n, b in GEN.build_model(case).named_buffers()}


def _check_resumed(
    case: Sample,
    spec: Any,
    live: dict,
    optim: dict,
    state: dict,
    *,
    world_size: int,
    stage: int,
    universal: bool,
    expected_optim: dict | None = None,
) -> None:
    """What DeepSpeed holds after the load equals what the original engine held when it saved.

    ``universal``: the load went through ``load_universal`` (module state dict not loaded: frozen
    params and buffers are the fresh model's; ZeRO-3's loader spreads group 0's hyperparameters).
    ``expected_optim``: the Adam states to expect, where the sample has no live_optimizer file."""
    from safetensors.torch import load_file

    meta = case.meta
    assert (state["world_size"], state["zero_stage"], state["dtype"]) == (world_size, stage, meta["dtype"])
    if universal:
        assert state["ds_config"]["checkpoint"]["load_universal"] is True
        assert Path(state["load_path"]).parent.name.endswith("_universal"), state["load_path"]
    saved_live = case.live()
    buffers = set(meta["buffers"])
    fresh = _fresh_buffers(spec) if universal else {}
    for name, expected in saved_live.items():
        if name in buffers:
            if universal:  # not restored by DeepSpeed's universal loader: the fresh model's values
                assert same_bits(live[name], fresh[name].to(live[name].dtype)), name
            elif meta["deepspeed_version"].startswith("0.14"):
                got = live[name].float() if live[name].is_floating_point() else live[name]
                assert same_bits(got, expected.float() if expected.is_floating_point() else expected), name
            else:
                assert same_bits(live[name], expected), name
        else:  # trainable: the fp32 master; frozen: its value (never trained, so also the fresh one)
            assert same_bits(live[name], expected), name
    assert set(live) == set(saved_live)
    if expected_optim is None:
        expected_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    assert set(optim) == set(expected_optim)
    for name, expected in expected_optim.items():
        assert same_bits(optim[name], expected), name

    saved = _saved(case.checkpoint, meta["tag"])
    assert (state["global_steps"], state["skipped_steps"], state["global_samples"]) == (
        saved["global_steps"],
        saved["skipped_steps"],
        saved["global_samples"],
    )
    assert saved["global_steps"] == meta["steps"]
    assert len(saved["steps"]) == 1  # every group stepped as often (no group skipped a step)
    assert all(s in saved["steps"] for g in state["param_groups"] for s in g["step"]), [
        g["step"] for g in state["param_groups"]
    ]
    assert len(state["param_groups"]) == len(saved["hyperparameters"])
    for i, group in enumerate(state["param_groups"]):
        expected_hyper = saved["hyperparameters"][0 if (universal and stage == 3) else i]
        for key, value in expected_hyper.items():
            assert group["hyperparameters"][key] == value, (i, key)
    assert state["lr_scheduler"] == saved["lr_scheduler"]
    if meta["dtype"] == "fp16":
        assert state["cur_scale"] == meta["final_loss_scale"]
        scaler = state["loss_scaler"]
        assert scaler["type"].endswith(type(saved["loss_scaler"]).__name__)
        for key, value in vars(saved["loss_scaler"]).items():
            if isinstance(value, (int, float, bool)):
                assert scaler[key] == value, key
        assert state["dynamic_loss_scale"] == saved["dynamic_loss_scale"]


FRESH = GEN.Case(
    "fresh_uc_z3_bf16_ws3_subgroups_groups_tied_frozen_sched",
    "ds19",
    3,
    "bf16",
    3,
    tied=True,
    frozen=True,
    groups=True,
    sub_group_size=300,
    scheduler=True,
    vocab=31,
    dim=41,
    hidden=13,
    seed=11,
)


DS_TO_UNIVERSAL = r"""
import contextlib, io, json, sys, traceback
from argparse import Namespace
from deepspeed.checkpoint import ds_to_universal as D
jobs = json.loads(sys.argv[1])
results = {}
for name, (input_folder, output_folder) in jobs.items():
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            D.main(Namespace(input_folder=input_folder, output_folder=output_folder, num_extract_workers=1,
                             num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
        results[name] = None
    except BaseException as exc:
        results[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
print("RESULTS " + json.dumps(results))
"""
