"""Interop with real DeepSpeed for ``zckpt nvme-plan``: the issue's Qwen3-0.6B report scaled down.

A model whose token embedding (8M elements) is 8x any other layer (six 1M-element layers, at 2
ranks and bf16 exactly DeepSpeed's 1 MiB swap threshold) runs under ZeRO-3 with ``offload_param``
and ``offload_optimizer`` on NVMe, 2 ranks (``scripts/nvme_plan_run.py``):

* a buffer_size that fits the layers but not the embedding fails at ``zero.Init`` with DeepSpeed's
  "More elements ... than buffer size ..." (the report's first failure), and nvme-plan names the
  setting with that very message;
* DeepSpeed's documented ``buffer_count: 5`` fails when every param is gathered at once, as
  transformers and PEFT do at init under ZeRO-3 ("Not enough buffers 5 for swapping 7", the
  report's second failure), and nvme-plan names it;
* with nvme-plan's settings the same run gathers, trains and saves; the swap folder DeepSpeed
  wrote has the size nvme-plan said.

Run: ``DS_ACCELERATOR=cpu PYTHONPATH=tests python -m pytest -m deepspeed -p interop_helpers
tests/test_interop/test_interop_nvme_plan.py`` (about a minute on 2 cores: three 2-rank runs).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_helpers import (  # noqa: E402,F401 (autouse fixture)
    ROOT,
    _load_script,
    ds_env,
    ds_python,
    run_logged,
    shm_leak_safety_net,
)

RUNNER = _load_script("nvme_plan_run")
WORLD_SIZE = 2
TOO_SMALL_BUFFER = 1_048_576  # fits the 1M-element layers' partitions (524288), not the embedding's (4194304)


def base_config(buffer_size: int, buffer_count: int) -> dict[str, Any]:
    """The run's DeepSpeed config, both offloads on NVMe (the swap folder is filled in per run)."""
    nvme = RUNNER.NVME_PATH
    return {
        "train_micro_batch_size_per_gpu": RUNNER.MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "buffer_size": buffer_size,
                "buffer_count": buffer_count,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
    }


def nvme_plan_cli(model: Path, config: Path) -> tuple[int, dict[str, Any]]:
    """``zckpt nvme-plan MODEL --world-size 2 --config CONFIG --json``: exit status and report."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zckpt",
            "nvme-plan",
            str(model),
            "--world-size",
            str(WORLD_SIZE),
            "--config",
            str(config),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode in (0, 3), result.stderr
    return result.returncode, json.loads(result.stdout)


def run_deepspeed(config: dict[str, Any], out: Path, gather: bool) -> tuple[int | None, dict[str, Any]]:
    """One 2-rank run of scripts/nvme_plan_run.py; its exit status and rank 0's report."""
    out.mkdir(parents=True)
    (out / "nvme").mkdir()
    config_file = out / "ds_config.json"
    config_file.write_text(json.dumps(config))
    python = ds_python()
    cmd = RUNNER.launch_command(python, config_file, out, out / "nvme", WORLD_SIZE, gather)
    returncode = run_logged(cmd, ds_env(WORLD_SIZE, python), out / "run.log", timeout=300)
    report = out / "rank0.json"
    assert report.exists(), (out / "run.log").read_text()[-3000:]
    return returncode, json.loads(report.read_text())


@pytest.fixture(scope="module", autouse=True)
def async_io_op() -> None:
    """DeepSpeed's async_io op (NVMe swapping), built once into the folder the launches use; .ci/run
    builds it before the tier, so this is quick there."""
    python = ds_python()
    env = ds_env(1, python)
    code = "from deepspeed.ops.op_builder import AsyncIOBuilder as B; b = B(); assert b.is_compatible(False), 'libaio'; b.load(verbose=False)"
    result = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        pytest.fail(
            "DeepSpeed's async_io op cannot be built or loaded (NVMe offload needs it; `apt-get install -y libaio-dev`): "
            + (result.stderr.strip().splitlines() or ["?"])[-1]
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's weights as safetensors: the MODEL nvme-plan plans from."""
    folder = tmp_path_factory.mktemp("nvme_model")
    RUNNER.write_weights(folder / "model.safetensors")
    return folder


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config))
    return path


def test_too_small_buffer_size_fails_as_planned(model_dir: Path, tmp_path: Path) -> None:
    config = base_config(TOO_SMALL_BUFFER, 200)  # the report's buffer_count 200: enough buffers, each too small
    code, plan = nvme_plan_cli(model_dir, write_config(tmp_path / "cfg.json", config))
    returncode, ran = run_deepspeed(config, tmp_path / "run", gather=False)

    assert returncode != 0 and not ran["ok"] and ran["stage"] == "init"
    assert ran["error"] == "AssertionError: More elements 4194304 than buffer size 1048576"
    assert code == 3
    flagged = {p["setting"]: p for p in plan["config_problems"]}
    problem = flagged["zero_optimization.offload_param.buffer_size"]
    assert ran["error"].removeprefix("AssertionError: ") == problem["error"]
    assert set(flagged) == {"zero_optimization.offload_param.buffer_size"}  # 200 buffers are enough


def test_documented_buffer_count_fails_a_whole_model_gather_as_planned(model_dir: Path, tmp_path: Path) -> None:
    config = base_config(4_194_304, 5)  # buffers large enough, DeepSpeed's default count
    code, plan = nvme_plan_cli(model_dir, write_config(tmp_path / "cfg.json", config))
    returncode, ran = run_deepspeed(config, tmp_path / "run", gather=True)

    assert returncode != 0 and not ran["ok"] and ran["stage"] == "gather"
    swapped = sorted(n for n, p in ran["params"].items() if p["swapped"])
    assert ran["error"] == f"AssertionError: Not enough buffers 5 for swapping {len(swapped)}"
    assert code == 3
    flagged = {p["setting"]: p for p in plan["config_problems"]}
    assert set(flagged) == {"zero_optimization.offload_param.buffer_count"}
    assert flagged["zero_optimization.offload_param.buffer_count"]["error"] == ran["error"].removeprefix(
        "AssertionError: "
    )
    assert sorted(p["name"] for p in plan["swapped"]["params"]) == swapped


def test_planned_settings_gather_train_and_save(model_dir: Path, tmp_path: Path) -> None:
    failing = base_config(TOO_SMALL_BUFFER, 5)  # fails both ways
    _, plan = nvme_plan_cli(model_dir, write_config(tmp_path / "failing.json", failing))
    config = copy.deepcopy(failing)
    for section, settings in plan["config_snippet"]["zero_optimization"].items():
        if isinstance(settings, dict):
            config["zero_optimization"][section].update(settings)
        else:
            config["zero_optimization"][section] = settings
    code, replanned = nvme_plan_cli(model_dir, write_config(tmp_path / "planned.json", config))
    assert code == 0 and replanned["config_problems"] == []

    returncode, ran = run_deepspeed(config, tmp_path / "run", gather=True)

    assert returncode == 0 and ran["ok"], ran.get("traceback")
    assert len(ran["losses"]) == RUNNER.STEPS and all(math.isfinite(x) for x in ran["losses"])
    checkpoint = tmp_path / "run" / "checkpoint"
    tag = (checkpoint / "latest").read_text().strip()
    assert sorted(p.name for p in (checkpoint / tag).glob("*_optim_states.pt")) == [
        f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(WORLD_SIZE)
    ]
    # DeepSpeed's own buffers and swap folder, against the plan
    swapper = ran["param_swapper"]
    assert (
        swapper["buffer_count"] * swapper["aligned_elements_per_buffer"] * swapper["element_size"]
        == plan["pinned_bytes_per_rank"]["param_swap_buffers"]
    )
    opt = ran["optimizer_swapper"]
    assert opt["buffer_count"] * opt["buffer_numel"] * 4 == plan["pinned_bytes_per_rank"]["optimizer_swap_buffers"]
    rank0 = {k: v for k, v in ran["swap_folder"].items() if "/rank0/" in k}
    params_bytes = sum(v for k, v in rank0.items() if k.startswith("bfloat16params/"))
    optimizer_bytes = sum(v for k, v in rank0.items() if k.startswith("optimizer/"))
    assert params_bytes == plan["disk_bytes"]["params_per_rank"]
    assert optimizer_bytes <= plan["disk_bytes"]["optimizer_per_rank"]
    assert sum(ran["swap_folder"].values()) <= plan["disk_bytes"]["all_ranks"]
