"""Interop: zckpt reads a ds_config as DeepSpeed 0.19.8 does. For each config of a table,
DeepSpeed's own parsing (``DeepSpeedConfig``, in this process; the engine's dtype check; for
``aio`` values of a run that swaps, DeepSpeed's async I/O op writing and reading a swap file)
accepts or refuses it, and zckpt agrees and reads the accepted values the same way. The
Hugging Face Trainer and Accelerate fill a config's "auto" values exactly where zckpt says it
cannot know them. Where the layout depends on a value DeepSpeed reads in its own way, an engine
built from that config loads what ``zckpt reshard`` wrote (two runs).

Run: ``PYTHONPATH=tests DS_ACCELERATOR=cpu python -m pytest -m deepspeed -p interop_helpers tests/test_interop/test_interop_ds_config.py``
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from helpers import sample
from zckpt import reshard
from zckpt.core.errors import ZckptError
from zckpt.deepspeed.run_config import read_run_config

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_checks import _check_loaded  # noqa: E402
from interop_helpers import ds_env, ds_python, run_probe, shm_leak_safety_net  # noqa: E402,F401 (autouse fixture)

NVME = {"device": "nvme", "nvme_path": "/tmp/zckpt_nvme"}


def zero(**values: Any) -> dict:
    return {"zero_optimization": {"stage": 3, **values}}


# --- what each side reads ---------------------------------------------------------------------------
def deepspeed_reads(config: dict) -> dict | None:
    """The values zckpt uses, as DeepSpeed reads them; None where DeepSpeed refuses the config."""
    from deepspeed.runtime.config import DeepSpeedConfig, DtypeEnum

    try:
        ds = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **copy.deepcopy(config)})
        accum = (
            None if ds.grad_accum_dtype is None else DtypeEnum(ds.grad_accum_dtype).name
        )  # engine.get_data_types (engine.py:1809)
        clip = ds.gradient_clipping
        clip > 0.0  # what its ZeRO optimizers do with it at every step (stage_1_and_2.py:3199)
    except Exception:  # noqa: BLE001 (refused, whatever the kind: pydantic, assertion, TypeError)
        return None
    zero_config = ds.zero_config

    def offload(section: Any, keys: tuple[str, ...]) -> dict | None:
        if section is None:
            return None
        values = {k: getattr(section, k) for k in keys}
        return {
            **values,
            "device": str(getattr(section.device, "value", section.device)),
            "nvme_path": None if section.nvme_path is None else str(section.nvme_path),
        }

    return {
        "stage": int(zero_config.stage),
        "sub_group_size": zero_config.sub_group_size,
        "round_robin_gradients": zero_config.round_robin_gradients,
        "parameter_alignment": zero_config.parameter_alignment,
        "offload_optimizer": offload(
            zero_config.offload_optimizer, ("buffer_count", "pipeline_read", "pipeline_write", "fast_init")
        ),
        "offload_param": offload(zero_config.offload_param, ("buffer_size", "buffer_count", "max_in_cpu")),
        "dtype": "bf16" if ds.bfloat16_config.enabled else "fp16" if ds.float16_config.enabled else "fp32",
        "grad_accum_dtype": accum,
        "gradient_clipping": float(clip),
        "aio": (ds.aio_config["block_size"], ds.aio_config["intra_op_parallelism"]),
    }


def zckpt_reads(config: dict, saved: bool = False) -> dict | None:
    """The same values as zckpt reads them; None where it refuses the config."""
    try:
        run = read_run_config(copy.deepcopy(config), "cfg.json", saved=saved)
    except ZckptError:
        return None

    def offload(section: Any) -> dict | None:
        return None if section is None else {k: v for k, v in vars(section).items()}

    return {
        "stage": run.stage,
        "sub_group_size": run.sub_group_size,
        "round_robin_gradients": run.round_robin_gradients,
        "parameter_alignment": run.parameter_alignment,
        "offload_optimizer": offload(run.offload_optimizer),
        "offload_param": offload(run.offload_param),
        "dtype": run.dtype,
        "grad_accum_dtype": run.grad_accum_dtype,
        "gradient_clipping": 1.0 if run.gradient_clipping is None else run.gradient_clipping,  # 0.19's default
        "aio": (run.aio.block_size, run.aio.intra_op_parallelism) if run.aio is not None else None,
    }


# --- the table ------------------------------------------------------------------------------------------
TABLE = [
    # the examples
    zero(sub_group_size=0),
    zero(sub_group_size=-5),
    zero(sub_group_size=1e30),
    {"zero_optimization": {"stage": 2, "parameter_alignment": 0}},
    {"zero_optimization": "oops"},
    # integers as pydantic coerces them
    zero(sub_group_size=10**30),
    zero(sub_group_size="5"),
    zero(sub_group_size=" 1_000 "),
    zero(sub_group_size="7.00"),
    zero(sub_group_size=1e9),
    zero(sub_group_size=True),
    zero(sub_group_size="auto"),
    zero(sub_group_size=5.5),
    zero(sub_group_size="1e3"),
    zero(sub_group_size=None),
    zero(sub_group_size=9.3e18),
    zero(sub_group_size="1__0"),
    {"zero_optimization": {"stage": "3"}},
    {"zero_optimization": {"stage": 2.0}},
    {"zero_optimization": {"stage": 4}},
    {"zero_optimization": {"stage": -1}},
    {"zero_optimization": {"stage": True}},
    {"zero_optimization": {"stage": "auto"}},
    {"zero_optimization": {"stage": None}},
    # the deprecated and odd forms of the section
    {"zero_optimization": True},
    {"zero_optimization": False},
    {"zero_optimization": None},
    {"zero_optimization": []},
    {},
    # booleans as pydantic coerces them
    *(
        {"zero_optimization": {"stage": 2, "parameter_alignment": v, "round_robin_gradients": v}}
        for v in ("no", "off", "f", "0", "yes", "ON", 1.0, 2, " true", None, "auto", 0.5)
    ),
    # offload sections
    zero(offload_optimizer={"device": "NVMe"}),
    zero(offload_optimizer={"device": "auto"}),
    zero(offload_optimizer="auto"),
    zero(offload_optimizer="oops"),
    zero(offload_optimizer=None),
    zero(offload_optimizer={"device": None}),
    zero(
        offload_optimizer={
            **NVME,
            "buffer_count": "6",
            "pipeline_read": "yes",
            "pipeline_write": 0,
            "fast_init": "auto",
        }
    ),
    zero(offload_optimizer={**NVME, "buffer_count": -1}),
    zero(offload_optimizer={"device": "nvme", "nvme_path": ""}),
    zero(offload_param={**NVME, "buffer_size": 1e30}),
    zero(offload_param={**NVME, "max_in_cpu": "5", "buffer_size": 2.0}),
    zero(offload_param={"device": "nvme", "nvme_path": 5}),
    zero(offload_param={"device": "cpu", "buffer_count": "auto"}),
    # deprecated spellings of the offload sections
    {"zero_optimization": {"stage": 2, "cpu_offload": True}},
    {"zero_optimization": {"stage": 2, "cpu_offload": "no"}},
    {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
    {"zero_optimization": {"stage": 2, "cpu_offload": None, "offload_optimizer": {"device": "cpu"}}},
    zero(cpu_offload_param=True),
    zero(cpu_offload_param=True, offload_param={"device": "cpu"}),
    # precision
    {"bf16": {"enabled": True}},
    {"bf16": None, "bfloat16": {"enabled": True}},
    {"bf16": {"enabled": False}, "bfloat16": {"enabled": True}},
    {"fp16": None},
    {"bf16": "oops"},
    {"bf16": {"enabled": "auto"}},
    {"bf16": {"enabled": "yes"}},
    {"bf16": {"enabled": 2}},
    {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
    {"bfloat16": None},
    # data types, gradient clipping, aio without NVMe (DeepSpeed never reads it then)
    {"data_types": {"grad_accum_dtype": "fp32"}},
    {"data_types": {"grad_accum_dtype": "torch.float32"}},
    {"data_types": {"grad_accum_dtype": "FP32"}},
    {"data_types": {"grad_accum_dtype": "auto"}},
    {"data_types": None},
    {"gradient_clipping": 0.5},
    {"gradient_clipping": "1.0"},
    {"gradient_clipping": 0},
    {"aio": {"block_size": 0, "intra_op_parallelism": -1}},
    {"aio": "oops"},
    {"aio": None},
]


def but_aio(reading: dict | None) -> dict | None:
    """A reading without aio: DeepSpeed reads it only in a run that swaps (next test, against its op)."""
    return None if reading is None else {**reading, "aio": None}


@pytest.mark.parametrize("config", TABLE, ids=[json.dumps(c) for c in TABLE])
def test_zckpt_accepts_and_reads_what_deepspeeds_config_parsing_does(config: dict) -> None:
    got = but_aio(zckpt_reads(config))
    assert got == but_aio(deepspeed_reads(config))
    assert but_aio(zckpt_reads(config, saved=True)) == got  # a checkpoint's own config: the same rules


# --- aio, for a run that swaps: DeepSpeed's async I/O op decides -----------------------------------------
AIO_PROBE = r"""
import json, os, signal, sys, time
import torch
from deepspeed.ops.op_builder import AsyncIOBuilder

op = AsyncIOBuilder().load(verbose=False)
results = []
for i, (block, parallelism) in enumerate(json.loads(sys.argv[1])):
    pid = os.fork()
    if pid == 0:  # the op may crash or abort: a child per value
        try:
            handle = op.aio_handle(block_size=block, queue_depth=8, single_submit=False, overlap_events=True, intra_op_parallelism=parallelism)
            data = torch.arange(262144, dtype=torch.float32)  # 1 MiB: as large as the smallest swapped tensor
            path = os.path.join(sys.argv[2], f"{i}.swp")
            handle.sync_pwrite(data, path)
            back = torch.zeros_like(data)
            handle.sync_pread(back, path)
            os._exit(0 if torch.equal(back, data) else 4)
        except BaseException:
            os._exit(3)
    deadline, status = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status = code
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    results.append(status == 0)
print(json.dumps(results))
"""
AIO_TABLE = [
    {},
    {"block_size": 0},
    {"block_size": -5},
    {"block_size": 1000},
    {"block_size": 4096},
    {"block_size": 2**31},
    {"block_size": 1048576.0},
    {"block_size": "auto"},
    {"intra_op_parallelism": 0},
    {"intra_op_parallelism": -1},
    {"intra_op_parallelism": 2},
    {"intra_op_parallelism": "2"},
]


def test_aio_values_zckpt_refuses_are_those_deepspeeds_io_op_fails_on(tmp_path: Path) -> None:
    configs = [{**zero(offload_optimizer=NVME), "aio": aio} for aio in AIO_TABLE]
    parsed = [deepspeed_reads(c) for c in configs]
    assert all(parsed), "DeepSpeed's config parsing takes any aio values"
    python = ds_python()
    result = subprocess.run(
        [python, "-c", AIO_PROBE, json.dumps([p["aio"] for p in parsed]), str(tmp_path)],
        env=ds_env(1, python),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    works = json.loads(result.stdout.strip().splitlines()[-1])
    assert works[0] and not works[1], "the op works with the defaults and fails with block_size 0"
    for config, deepspeed, ok in zip(configs, parsed, works):
        got = zckpt_reads(config)
        assert (got is not None) == ok, config["aio"]
        if ok:
            assert got == deepspeed, config["aio"]


# --- "auto": what the Hugging Face Trainer and Accelerate fill in -------------------------------------
HF_CONFIG = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "data_types": {"grad_accum_dtype": "fp32"},
    "zero_optimization": {
        "stage": "auto",
        "sub_group_size": "auto",
        "round_robin_gradients": "auto",
        "parameter_alignment": "auto",
        "offload_optimizer": {"device": "auto", "nvme_path": "auto", "buffer_count": "auto", "pipeline_read": "auto"},
        "offload_param": {"device": "auto", "nvme_path": "auto", "buffer_size": "auto", "max_in_cpu": "auto"},
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}
USED = [
    "bf16.enabled",
    "fp16.enabled",
    "gradient_clipping",
    "data_types.grad_accum_dtype",
    "zero_optimization.stage",
    "zero_optimization.sub_group_size",
    "zero_optimization.round_robin_gradients",
    "zero_optimization.parameter_alignment",
    *(f"zero_optimization.offload_optimizer.{k}" for k in ("device", "nvme_path", "buffer_count", "pipeline_read")),
    *(f"zero_optimization.offload_param.{k}" for k in ("device", "nvme_path", "buffer_size", "max_in_cpu")),
]


def _at(config: dict, key: str) -> Any:
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def test_auto_values_zckpt_cannot_know_are_those_the_trainer_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    for name in (
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
        "ACCELERATE_GRADIENT_CLIPPING",
    ):
        monkeypatch.delenv(name, raising=False)
    hf = HfTrainerDeepSpeedConfig(
        copy.deepcopy(HF_CONFIG)
    )  # what Trainer(args=TrainingArguments(deepspeed=...)) builds
    hf.trainer_config_process(
        SimpleNamespace(
            world_size=1,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
            max_grad_norm=0.5,
            learning_rate=1e-4,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            weight_decay=0.0,
            save_on_each_node=False,
            fp16=False,
            fp16_full_eval=False,
            bf16=True,
            bf16_full_eval=False,
        )
    )
    filled = DeepSpeedPlugin(hf_ds_config=hf).deepspeed_config  # then the Trainer's Accelerator
    replaced = {key for key in USED if _at(HF_CONFIG, key) == "auto" and _at(filled, key) != "auto"}
    run = read_run_config(copy.deepcopy(HF_CONFIG), "ds_config.json")
    assert set(run.filled) == replaced
    # the engine then reads the filled config, the rest of its "auto" values as its defaults; so does zckpt
    # (what the engine saves is that filled config)
    assert but_aio(zckpt_reads(filled, saved=True)) == but_aio(deepspeed_reads(filled))
    # DeepSpeed alone (no Trainer) reads the "auto" values of its models as their defaults, and so does
    # zckpt meanwhile (it keeps the batch sizes and gradient_clipping as strings, and fails on them)
    alone = {
        k: v
        for k, v in HF_CONFIG.items()
        if k
        not in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "gradient_clipping",
        )
    }
    assert deepspeed_reads(alone) is not None and but_aio(zckpt_reads(alone)) == but_aio(deepspeed_reads(alone))


# --- the layout zckpt writes is the one DeepSpeed's engine builds ------------------------------------
ENGINE_CASES = [  # (sample, world size, stage, --config): values DeepSpeed reads in its own way, that zckpt used to read otherwise
    ("z3_bf16_ws3_subgroups_groups", 2, 3, zero(sub_group_size=0)),  # a sub-group per param, not "unset"
    (
        "z2_bf16_ws3_paramalign",
        2,
        2,
        {"zero_optimization": {"stage": 2, "parameter_alignment": "false", "round_robin_gradients": "off"}},
    ),
]


@pytest.mark.parametrize("name,world_size,stage,config", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_deepspeed_engine_with_the_config_loads_what_zckpt_wrote(
    name: str, world_size: int, stage: int, config: dict, tmp_path: Path
) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    reshard(sample(name).checkpoint, tmp_path / "out", world_size=world_size, config=path)
    live, optim, state = run_probe(
        name, tmp_path / "out", world_size, tmp_path / "probe", stage=stage, config_override=config
    )
    _check_loaded(sample(name), live, optim, state, world_size, stage)
