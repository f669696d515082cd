"""A ds_config read as DeepSpeed 0.19.8 reads it (``reshard --config``, the checkpoint's saved
config, ``nvme-plan --config``, the trainer's own), without DeepSpeed.

The expected readings and refusals are what DeepSpeed's own config models did with these values
(``DeepSpeedConfig``/``DeepSpeedZeroConfig`` under pydantic 2.14, and its async I/O op for the
``aio`` values); ``tests/test_interop/test_interop_ds_config.py`` checks each against DeepSpeed itself.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from helpers import runner, sample
from zckpt.cli.app import app
from zckpt.core.errors import CorruptFileError, UsageError
from zckpt.deepspeed.reader import open_training_state
from zckpt.deepspeed.run_config import read_run_config
from zckpt.deepspeed.save import write_checkpoint
from zckpt.deepspeed.writer import plan_checkpoint, plan_target
from zckpt.ops.nvme_plan import ParamShape, plan_nvme
from zckpt.ops.reshard import reshard
from zckpt.torchfile import reader as torchfile
from zckpt.trainer import TrainConfig
from zckpt.trainer.loop import Trainer

ZERO3 = "z3_bf16_ws3_subgroups_groups"
NVME = {"device": "nvme", "nvme_path": "/tmp/nvme"}


def zero(**values: object) -> dict:
    return {"zero_optimization": {"stage": 3, **values}}


# --- the issue's examples, as a new user meets them ---------------------------------------------
ISSUE_EXAMPLES = [  # (config, the key and value the one error line names)
    (zero(sub_group_size=0), None),  # accepted: DeepSpeed makes a sub-group of each param
    (zero(sub_group_size=-5), "zero_optimization.sub_group_size = -5: DeepSpeed requires at least 0"),
    (zero(sub_group_size=1e30), "zero_optimization.sub_group_size = 1e+30: a float beyond 2**63"),
    ({**zero(offload_optimizer=NVME), "aio": {"block_size": 0}}, "aio.block_size = 0: "),
    ({**zero(offload_optimizer=NVME), "aio": {"intra_op_parallelism": -1}}, "aio.intra_op_parallelism = -1: "),
    ({"zero_optimization": {"stage": 2, "parameter_alignment": 0}}, None),  # accepted: 0 is false
    ({"zero_optimization": "oops"}, 'zero_optimization = "oops": must be a JSON object'),
]


@pytest.mark.parametrize("config,error", ISSUE_EXAMPLES, ids=[json.dumps(c) for c, _ in ISSUE_EXAMPLES])
def test_reshard_config_is_refused_in_one_line_or_read_as_deepspeed_reads_it(
    config: dict, error: str | None, tmp_path: Path
) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(
        app, ["reshard", str(sample(ZERO3).checkpoint), str(tmp_path / "out"), "-w", "2", "--config", str(path)]
    )
    if error is None:
        assert result.exit_code == 0, result.output
        return
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"zckpt: error: {path}: {error}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "config,error", [e for e in ISSUE_EXAMPLES if e[1]], ids=[json.dumps(c) for c, e in ISSUE_EXAMPLES if e]
)
def test_nvme_plan_refuses_the_same_values(config: dict, error: str, tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["nvme-plan", str(sample(ZERO3).checkpoint), "--config", str(path)])
    assert result.exit_code == 2 and result.stderr.strip().startswith(f"zckpt: error: {path}: {error}"), result.stderr


def test_sub_group_size_0_is_a_sub_group_per_param(tmp_path: Path) -> None:
    """zckpt used to read 0 as "unset" (one sub-group); DeepSpeed closes a sub-group after every param."""
    reshard(sample(ZERO3).checkpoint, tmp_path / "out", world_size=2, config=zero(sub_group_size=0))
    state = open_training_state(tmp_path / "out")
    optim = torchfile.load(tmp_path / "out" / state.index.tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert len(optim["optimizer_state_dict"]["fp32_flat_groups"]) == len(state.params)
    assert state.ds_config["zero_optimization"]["sub_group_size"] == 0


@pytest.mark.parametrize(
    "flag,expected",
    [("no", False), ("off", False), ("0", False), ("f", False), ("yes", True), ("ON", True), (1.0, True)],
)
def test_boolean_spellings_are_pydantics(flag: object, expected: bool, tmp_path: Path) -> None:
    """bool("no") is True in Python; DeepSpeed's pydantic model reads it as false."""
    config = {"zero_optimization": {"stage": 2, "round_robin_gradients": flag, "parameter_alignment": flag}}
    target = plan_target(open_training_state(sample("z2_fp32_ws1").checkpoint), 2, config=config)
    assert (target.round_robin, target.parameter_alignment) == (expected, expected)


# --- how values are read -----------------------------------------------------------------------
READINGS = [  # (config, attribute, value DeepSpeed's models give)
    (zero(sub_group_size="5"), "sub_group_size", 5),
    (zero(sub_group_size=" 1_000 "), "sub_group_size", 1000),
    (zero(sub_group_size="7.00"), "sub_group_size", 7),
    (zero(sub_group_size=1e9), "sub_group_size", 10**9),
    (zero(sub_group_size=10**30), "sub_group_size", 10**30),  # an integer this large is accepted
    (zero(sub_group_size=True), "sub_group_size", 1),
    (zero(sub_group_size="auto"), "sub_group_size", 10**9),  # "auto" is dropped: the default
    ({"zero_optimization": {"stage": "3"}}, "stage", 3),
    ({"zero_optimization": {"stage": 2.0}}, "stage", 2),
    ({"zero_optimization": True}, "stage", 1),  # the deprecated boolean form
    ({"zero_optimization": False}, "stage", 0),
    ({"zero_optimization": {"stage": "auto"}}, "stage", 0),
    ({"bf16": None, "bfloat16": {"enabled": True}}, "dtype", "bf16"),  # null falls back to the old spelling
    ({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}}, "dtype", "fp32"),  # "bf16" wins
    ({"bf16": {"enabled": "auto"}}, "dtype", "fp32"),
    ({"fp16": {"enabled": "yes"}}, "dtype", "fp16"),
    ({"data_types": {"grad_accum_dtype": "torch.float32"}}, "grad_accum_dtype", "fp32"),
    ({"data_types": {"grad_accum_dtype": "half"}}, "grad_accum_dtype", "fp16"),
    ({"gradient_clipping": 0}, "gradient_clipping", 0.0),
]


@pytest.mark.parametrize("config,attribute,value", READINGS, ids=[f"{json.dumps(c)}-{a}" for c, a, _ in READINGS])
def test_values_are_read_as_deepspeed_reads_them(config: dict, attribute: str, value: object) -> None:
    assert getattr(read_run_config(config), attribute) == value


def test_offload_sections_and_deprecated_spellings() -> None:
    run = read_run_config(
        zero(
            offload_optimizer={"device": "nvme", "nvme_path": "", "buffer_count": "6", "pipeline_read": "yes"},
            offload_param={"device": "auto", "max_in_cpu": 5.0},
        )
    )
    assert (
        run.offload_optimizer.nvme_path,
        run.offload_optimizer.buffer_count,
        run.offload_optimizer.pipeline_read,
    ) == (".", 6, True)
    assert (run.offload_param.device, run.offload_param.max_in_cpu) == ("none", 5)  # DeepSpeed's reading of "auto"
    assert "zero_optimization.offload_param.device" in run.filled  # which Accelerate fills in
    assert run.swap_rule is not None and run.aio.block_size == 1 << 20  # swapping: aio read (defaults)
    legacy = read_run_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert legacy.device("offload_optimizer") == "cpu" and legacy.aio is None
    assert read_run_config(zero(offload_optimizer="auto")).offload_optimizer is None


REFUSED = [  # (config, the start of the problem: key = value)
    (zero(sub_group_size=5.5), "zero_optimization.sub_group_size = 5.5: not a whole number"),
    (zero(sub_group_size="1e3"), 'zero_optimization.sub_group_size = "1e3": not an integer'),
    (zero(sub_group_size=None), "zero_optimization.sub_group_size = null: not an integer"),
    (zero(sub_group_size=float("inf")), "zero_optimization.sub_group_size = Infinity: not a finite number"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage = 4: DeepSpeed accepts 0, 1, 2 or 3"),
    ({"zero_optimization": None}, "zero_optimization = null: must be a JSON object"),
    (
        {"zero_optimization": {"stage": 2, "parameter_alignment": 2}},
        "zero_optimization.parameter_alignment = 2: not a boolean",
    ),
    (
        {"zero_optimization": {"stage": 2, "round_robin_gradients": " true"}},
        'zero_optimization.round_robin_gradients = " true": not a boolean',
    ),
    (
        zero(offload_optimizer={"device": "NVMe"}),
        'zero_optimization.offload_optimizer.device = "NVMe": DeepSpeed accepts "none", "cpu" or "nvme"',
    ),
    (zero(offload_optimizer="oops"), 'zero_optimization.offload_optimizer = "oops": must be a JSON object or null'),
    (
        zero(offload_param={**NVME, "buffer_count": -1}),
        "zero_optimization.offload_param.buffer_count = -1: DeepSpeed requires at least 0",
    ),
    (
        zero(offload_param={"device": "nvme", "nvme_path": 5}),
        "zero_optimization.offload_param.nvme_path = 5: not a path",
    ),
    (
        {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.cpu_offload = true: DeepSpeed refuses the deprecated",
    ),
    (
        {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
        "fp16.enabled = true: DeepSpeed refuses bf16 and fp16 enabled together",
    ),
    ({"fp16": None}, "fp16 = null: must be a JSON object"),
    ({"bf16": {"enabled": 2}}, "bf16.enabled = 2: not a boolean"),
    ({"data_types": {"grad_accum_dtype": "FP32"}}, 'data_types.grad_accum_dtype = "FP32": the engine refuses it'),
    ({"data_types": None}, "data_types = null: must be a JSON object"),
    ({"gradient_clipping": "1.0"}, 'gradient_clipping = "1.0": not a number'),
    ({"aio": "oops"}, 'aio = "oops": must be a JSON object'),
    ({**zero(offload_param=NVME), "aio": {"block_size": 1000}}, "aio.block_size = 1000: not a multiple of 512"),
    (
        {**zero(offload_param=NVME), "aio": {"block_size": 2**31}},
        "aio.block_size = 2147483648: DeepSpeed's async I/O op takes a C int",
    ),
    ({**zero(offload_param=NVME), "aio": {"block_size": 1048576.0}}, "aio.block_size = 1048576.0: not an integer"),
    ({**zero(offload_param=NVME), "aio": {"block_size": "auto"}}, 'aio.block_size = "auto": not an integer'),
    ({**zero(offload_param=NVME), "aio": {"intra_op_parallelism": 0}}, "aio.intra_op_parallelism = 0: "),
]


@pytest.mark.parametrize("config,problem", REFUSED, ids=[json.dumps(c) for c, _ in REFUSED])
def test_values_deepspeed_refuses_are_refused(config: dict, problem: str) -> None:
    with pytest.raises(UsageError) as given:
        read_run_config(config, "cfg.json")
    assert str(given.value).startswith(f"cfg.json: {problem}")
    with pytest.raises(CorruptFileError) as saved:
        read_run_config(config, "model_states.pt", saved=True)
    assert str(saved.value).startswith(f"model_states.pt: saved ds_config: {problem}")


def test_aio_is_checked_only_where_deepspeed_uses_it() -> None:
    """Without NVMe swapping at ZeRO-3, DeepSpeed never reads aio: a run with block_size 0 works."""
    bad_aio = {"aio": {"block_size": 0, "intra_op_parallelism": -1}}
    assert read_run_config({"zero_optimization": {"stage": 2, "offload_optimizer": NVME}, **bad_aio}).aio is None
    with pytest.raises(UsageError):
        read_run_config({**bad_aio, **zero(offload_optimizer=NVME)})
    with pytest.raises(UsageError):  # nvme-plan plans a run that swaps
        read_run_config({"zero_optimization": {"stage": 2}, **bad_aio}, swaps=True)


# --- "auto": what the Hugging Face Trainer and Accelerate fill in --------------------------------
HF_CONFIG = {  # as the Trainer's documentation writes a ZeRO-3 config
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def test_hugging_face_config_says_what_zckpt_cannot_know(tmp_path: Path) -> None:
    run = read_run_config(HF_CONFIG, "ds_config.json")
    assert set(run.filled) == {"bf16.enabled", "fp16.enabled", "gradient_clipping"}
    assert (run.stage, run.sub_group_size, run.device("offload_optimizer")) == (3, 10**9, "cpu")
    # a saved config's "auto" was read by DeepSpeed itself: "enabled" false; its optimizer cannot clip by "auto"
    saved = read_run_config({k: v for k, v in HF_CONFIG.items() if k != "gradient_clipping"}, saved=True)
    assert (saved.filled, saved.dtype) == ({}, "fp32")
    with pytest.raises(CorruptFileError, match='gradient_clipping = "auto": not a number'):
        read_run_config(HF_CONFIG, saved=True)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_CONFIG))
    # ZeRO-3 -> ZeRO-3: the layout depends on nothing the Trainer fills in
    result = runner.invoke(
        app, ["reshard", str(sample(ZERO3).checkpoint), str(tmp_path / "z3"), "-w", "2", "--config", str(path)]
    )
    assert result.exit_code == 0, result.output
    # ZeRO-3 -> ZeRO-2: the files carry gradient_clipping, which the Trainer fills in
    result = runner.invoke(
        app,
        [
            "reshard",
            str(sample(ZERO3).checkpoint),
            str(tmp_path / "z2"),
            "-w",
            "2",
            "--stage",
            "2",
            "--config",
            str(path),
        ],
    )
    assert (
        result.exit_code == 2 and 'gradient_clipping = "auto": filled in by the Hugging Face Trainer' in result.stderr
    )
    for stage_auto in ({"stage": "auto"}, {"offload_optimizer": {"device": "auto"}}):
        config = {**HF_CONFIG, "zero_optimization": {**HF_CONFIG["zero_optimization"], **stage_auto}}
        path.write_text(json.dumps(config))
        result = runner.invoke(
            app, ["reshard", str(sample(ZERO3).checkpoint), str(tmp_path / "x"), "-w", "2", "--config", str(path)]
        )
        assert (
            result.exit_code == 2
            and "filled in by Accelerate" in result.stderr
            and len(result.stderr.strip().splitlines()) == 1
        )


def test_nvme_plan_says_when_the_trainer_picks_the_dtype() -> None:
    params = [ParamShape("w", (1024, 1024))]
    config = {**HF_CONFIG, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "auto"}}}
    plan = plan_nvme(params, dtype="fp16", config=config, config_path="ds_config.json")
    assert not [p for p in plan.problems if p.setting == "bf16/fp16"]  # the Trainer decides: no mismatch claimed
    assert any('offload_param.nvme_path is "auto", filled in by Accelerate' in n for n in plan.notes)
    plain = plan_nvme(params, dtype="fp16", config={**config, "bf16": {"enabled": True}, "fp16": {"enabled": False}})
    assert [p.value for p in plain.problems if p.setting == "bf16/fp16"] == ["bf16"]


# --- the checkpoint's own saved config ----------------------------------------------------------
def test_saved_config_deepspeed_refuses_is_exit_1_naming_the_file(tmp_path: Path) -> None:
    state = open_training_state(sample("z2_fp32_ws1").checkpoint)
    target = plan_target(state, 1)
    bad = {
        **state.ds_config,
        "zero_optimization": {**state.ds_config["zero_optimization"], "round_robin_gradients": "maybe"},
    }
    write_checkpoint(plan_checkpoint(state, dataclasses.replace(target, ds_config=bad)), str(tmp_path / "ckpt"))
    result = runner.invoke(app, ["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    model = tmp_path / "ckpt" / state.index.tag / "mp_rank_00_model_states.pt"
    assert result.exit_code == 1 and result.stderr.strip() == (
        f'zckpt: error: {model}: saved ds_config: zero_optimization.round_robin_gradients = "maybe": not a boolean '
        '(true/false, 1/0, "yes"/"no", ...); DeepSpeed refuses it (runtime/zero/config.py:309)'
    )


# --- the trainer's own ds_config ------------------------------------------------------------------
def test_trainer_reads_its_ds_config_with_the_same_rules(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="zero_optimization.sub_group_size = -1: DeepSpeed requires at least 0"):
        Trainer(TrainConfig(sub_group_size=-1, layers=1, dim=16, heads=2, vocab=16, seq_len=4))
    trainer = Trainer(
        TrainConfig(
            sub_group_size=0, layers=1, dim=16, heads=2, vocab=16, seq_len=4, out=str(tmp_path / "run"), steps=1
        )
    )
    try:  # 0: a sub-group of each trainable param, as DeepSpeed makes them
        assert len(trainer.plan.layout.flat_groups) == sum(p.trainable for p in trainer.plan.params)
        assert read_run_config(trainer.ds_config()).sub_group_size == 0
    finally:
        trainer.close()
