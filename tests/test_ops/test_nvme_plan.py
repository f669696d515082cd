"""``zckpt nvme-plan`` against facts from outside the planner.

* DeepSpeed's decisions and sizes: ``tests/data/nvme_plan_measured.json``, recorded from real
  DeepSpeed 0.19.8 runs by ``scripts/nvme_plan_run.py`` (the command is in the file's ``_source``):
  which params zero.Init swapped, their partitions, the param and optimizer swappers' buffers, the
  swap folder's files, and the errors DeepSpeed raised for too-small configs.
* Shapes from a Hugging Face config: ``tests/data/nvme_plan_hf_shapes.json``, what transformers
  built for small configs of each family (recorded by the script stored in that file), and the
  published parameter counts of real models.
* The issue's report (Qwen3-0.6B, one rank, bf16): "More elements 155582464 than buffer size
  4194304" and "Not enough buffers 5 for swapping 197".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from helpers import ROOT
from zckpt.cli.app import app
from zckpt.core.errors import UsageError
from zckpt.deepspeed import swap_rules as R
from zckpt.ops.nvme_plan import nvme_plan, plan_nvme
from zckpt.ops.nvme_shapes import ParamShape, load_params, shapes_from_hf_config

DATA = ROOT / "tests" / "data"
MEASURED = json.loads((DATA / "nvme_plan_measured.json").read_text())["runs"]
HF_SHAPES = json.loads((DATA / "nvme_plan_hf_shapes.json").read_text())["cases"]
QWEN3_06B = {  # Qwen/Qwen3-0.6B config.json, the fields that matter
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "attention_bias": False,
}


def measured_params(run: dict) -> list[ParamShape]:
    return [ParamShape(name, (p["numel"],)) for name, p in run["params"].items()]


def deepspeed_message(run: dict) -> str:
    return run["error"].removeprefix("AssertionError: ")


# --------------------------------------------------------------------------------------
# DeepSpeed's rules, against what DeepSpeed did
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_name", ["ws2_planned", "ws3_subgroups"])
def test_swapped_params_and_partitions_are_deepspeeds(run_name: str) -> None:
    run = MEASURED[run_name]
    plan = plan_nvme(measured_params(run), world_size=run["world_size"], config=run["config"])
    assert {s.name: s.partition_numel for s in plan.swapped} == {
        n: p["partition_numel"] for n, p in run["params"].items() if p["swapped"]
    }
    assert plan.swap_threshold_bytes == run["param_swapper"]["min_aio_bytes"]
    assert R.Aio().numel_alignment(2) == run["param_swapper"]["numel_alignment"]
    size = run["param_swapper"]["elements_per_buffer"]
    assert R.io_aligned_numel(size, 512) == run["param_swapper"]["aligned_elements_per_buffer"]


@pytest.mark.parametrize("run_name", ["ws2_planned", "ws3_subgroups"])
def test_optimizer_buffers_and_swap_folder_sizes_are_deepspeeds(run_name: str) -> None:
    run = MEASURED[run_name]
    plan = plan_nvme(measured_params(run), world_size=run["world_size"], config=run["config"])
    opt = run["optimizer_swapper"]
    assert plan.offload_optimizer[R.BUFFER_COUNT] == opt["buffer_count"]
    assert plan.pinned.optimizer_swap_buffers == opt["buffer_count"] * opt["buffer_numel"] * 4
    for rank in range(run["world_size"]):
        files = {k: v for k, v in run["swap_folder"].items() if f"/rank{rank}/" in k}
        params = sum(v for k, v in files.items() if k.startswith("bfloat16params/"))
        gradients = sum(v for k, v in files.items() if "_gradient_" in k)
        states = sum(v for k, v in files.items() if k.startswith("optimizer/") and "_gradient_" not in k)
        assert params == plan.disk.params
        # masters and Adam states exactly; gradients (their I/O-aligned parts) at most a sub-group's elements
        sub_group_bytes = 4 * sum(opt["sub_group_partition_numels"])
        assert states == plan.disk.optimizer - sub_group_bytes
        assert gradients <= sub_group_bytes


def test_planned_settings_are_the_ones_that_ran() -> None:
    """The run with nvme-plan's settings gathered every param, trained and saved (ws2_planned)."""
    run = MEASURED["ws2_planned"]
    assert run["ok"] and run["gather"]
    plan = plan_nvme(measured_params(run), world_size=2, config=run["config"])
    ran = run["config"]["zero_optimization"]["offload_param"]
    assert (plan.offload_param[R.BUFFER_SIZE], plan.offload_param[R.BUFFER_COUNT]) == (
        ran["buffer_size"],
        ran["buffer_count"],
    )
    assert plan.problems == ()
    assert plan.pinned.param_swap_buffers == run["param_swapper"]["pinned_elements"] * 2


@pytest.mark.parametrize("run_name", ["ws2_buffer_size_too_small", "ws2_buffer_count_5_gather"])
def test_too_small_config_is_flagged_with_deepspeeds_message(run_name: str) -> None:
    run = MEASURED[run_name]
    assert not run["ok"]
    params = measured_params(MEASURED["ws2_planned"])  # the same model
    plan = plan_nvme(params, world_size=2, config=run["config"])
    assert [p.error for p in plan.problems] == [deepspeed_message(run)]
    assert not plan.ok


def test_too_few_optimizer_buffers_is_flagged_at_deepspeeds_assert() -> None:
    """DeepSpeed fails with a bare AssertionError at the first step; the plan names the assert."""
    run = MEASURED["ws2_optimizer_buffer_count_3"]
    assert not run["ok"] and run["stage"] == "train" and run["error"] == "AssertionError: "
    plan = plan_nvme(measured_params(MEASURED["ws2_planned"]), world_size=2, config=run["config"])
    [problem] = plan.problems
    assert problem.setting == "zero_optimization.offload_optimizer.buffer_count" and (
        problem.value,
        problem.needed,
    ) == (3, 4)
    assert f"`{run['failed_assert']}`" in problem.error and "partitioned_optimizer_swapper.py" in run["failed_at"]


def test_missing_nvme_path_and_wrong_stage_are_flagged() -> None:
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}}
    plan = plan_nvme(measured_params(MEASURED["ws2_planned"]), world_size=2, config=config)
    assert {p.setting for p in plan.problems} >= {
        "zero_optimization.offload_param.nvme_path",
        "zero_optimization.stage",
    }


def test_optimizer_kept_off_nvme_by_the_config_is_not_planned() -> None:
    config = {
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
        },
    }
    plan = plan_nvme(measured_params(MEASURED["ws2_planned"]), world_size=2, config=config)
    assert "offload_optimizer" not in plan.snippet()["zero_optimization"]
    assert plan.pinned.optimizer_swap_buffers == 0 and plan.disk.optimizer == 0
    assert plan.disk.params == sum(
        v for k, v in MEASURED["ws2_planned"]["swap_folder"].items() if k.startswith("bfloat16params/rank0/")
    )


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------
def test_qwen3_report_both_failures() -> None:
    params = shapes_from_hf_config(QWEN3_06B)
    swap = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
    }
    report_200 = json.loads(json.dumps(swap))
    report_200["zero_optimization"]["offload_param"].update(buffer_size=4194304, buffer_count=200)
    documented_5 = json.loads(json.dumps(swap))
    documented_5["zero_optimization"]["offload_param"].update(buffer_size=155582464, buffer_count=5)

    assert [p.error for p in plan_nvme(params, config=report_200).problems] == [
        "More elements 155582464 than buffer size 4194304"
    ]
    assert [p.error for p in plan_nvme(params, config=documented_5).problems] == [
        "Not enough buffers 5 for swapping 197"
    ]
    plan = plan_nvme(params, config=documented_5)
    assert (plan.offload_param[R.BUFFER_SIZE], plan.offload_param[R.BUFFER_COUNT]) == (155582464, 197)
    # the pinned cost of DeepSpeed's equal-sized buffers, and an alternative with one buffer
    assert plan.pinned.param_swap_buffers == 155582464 * 197 * 2
    one_buffer = [a for a in plan.alternatives if a.settings.get("zero_optimization.offload_param.buffer_count") == 1]
    assert one_buffer and one_buffer[0].settings["aio.block_size"] == 8 * 2**20


def test_qwen3_parameter_count_is_the_published_one() -> None:
    params = shapes_from_hf_config(QWEN3_06B)
    assert sum(p.numel for p in params) == 596_049_920  # 0.6B, of which 0.44B non-embedding (model card)
    assert sum(p.numel for p in params) - 151936 * 1024 == 440_467_456


@pytest.mark.parametrize(
    "config, count",
    [
        (
            {
                "model_type": "llama",
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 22,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "vocab_size": 32000,
                "tie_word_embeddings": False,
            },
            1_100_048_384,
        ),  # TinyLlama-1.1B
        (
            {
                "model_type": "qwen2",
                "hidden_size": 896,
                "intermediate_size": 4864,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
            },
            494_032_768,
        ),  # Qwen2-0.5B
        (
            {
                "model_type": "mistral",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "vocab_size": 32000,
                "tie_word_embeddings": False,
            },
            7_241_732_096,
        ),  # Mistral-7B-v0.1
        (
            {
                "model_type": "gpt2",
                "n_embd": 768,
                "n_layer": 12,
                "n_head": 12,
                "vocab_size": 50257,
                "n_positions": 1024,
            },
            124_439_808,
        ),  # gpt2
    ],
)
def test_published_parameter_counts(config: dict, count: int) -> None:
    assert sum(p.numel for p in shapes_from_hf_config(config)) == count


@pytest.mark.parametrize("case", sorted(HF_SHAPES))
def test_hf_config_shapes_are_what_transformers_builds(case: str) -> None:
    recorded = HF_SHAPES[case]
    config = dict(recorded["config"])
    config.setdefault("tie_word_embeddings", recorded["tie_word_embeddings"])
    assert [[p.name, list(p.shape)] for p in shapes_from_hf_config(config)] == recorded["params"]


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 8}))
    with pytest.raises(
        UsageError, match="model_type 'mixtral' is not supported; supported: llama, mistral, qwen2, qwen3, gpt2"
    ):
        load_params(path)


# --------------------------------------------------------------------------------------
# MODEL kinds
# --------------------------------------------------------------------------------------
def test_weights_file_folder_and_shards_give_the_same_params(tmp_path: Path) -> None:
    tensors = {
        "embed.weight": torch.zeros(4096, 256, dtype=torch.bfloat16),
        "fc.weight": torch.zeros(64, 256, dtype=torch.bfloat16),
        "fc.bias": torch.zeros(64, dtype=torch.bfloat16),
    }
    (tmp_path / "one").mkdir()
    save_file(tensors, str(tmp_path / "one" / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"embed.weight": tensors["embed.weight"]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if k != "embed.weight"}, str(sharded / "model-00002-of-00002.safetensors")
    )
    weight_map = {
        "embed.weight": "model-00001-of-00002.safetensors",
        "fc.weight": "model-00002-of-00002.safetensors",
        "fc.bias": "model-00002-of-00002.safetensors",
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch.save(tensors, tmp_path / "pytorch_model.bin")

    expected = {(n, tuple(t.shape)) for n, t in tensors.items()}
    for model in (
        tmp_path / "one",
        tmp_path / "one" / "model.safetensors",
        sharded,
        sharded / "model.safetensors.index.json",
        tmp_path / "pytorch_model.bin",
    ):
        loaded = load_params(model)
        assert loaded.kind == "weights"
        assert {(p.name, p.shape) for p in loaded.params} == expected, model


def test_tied_weights_in_a_torch_file_count_once(tmp_path: Path) -> None:
    embed = torch.zeros(2048, 256)
    torch.save({"embed.weight": embed, "lm_head.weight": embed, "norm.weight": torch.ones(256)}, tmp_path / "model.bin")
    assert [p.name for p in load_params(tmp_path / "model.bin").params] == ["embed.weight", "norm.weight"]


def test_checkpoint_params_frozen_and_tied_as_deepspeed_recorded() -> None:
    sample = ROOT / "sample_ckpts" / "z3_bf16_ws2_nvmeoffload_frozen_tied_groups"
    meta = json.loads((sample / "meta.json").read_text())
    loaded = load_params(sample / meta.get("checkpoint", "checkpoint"))
    assert loaded.kind == "checkpoint" and loaded.world_size == meta["world_size"] and loaded.dtype == "bf16"
    assert {p.name for p in loaded.params if not p.trainable} == set(meta["frozen"])
    assert not set(meta["tied"]) & {p.name for p in loaded.params}
    assert not set(meta["buffers"]) & {p.name for p in loaded.params}
    plan = nvme_plan(sample / meta.get("checkpoint", "checkpoint"))
    assert plan.world_size == meta["world_size"] and plan.dtype == "bf16"


def test_hf_folder_with_only_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    plan = nvme_plan(tmp_path, world_size=4)
    # at 4 ranks k_proj/v_proj partitions (262144 elements, 512 KiB) fall below the 1 MiB threshold
    assert plan.model_kind == "hf_config" and len(plan.swapped) == 1 + 28 * 5
    assert max(s.partition_numel for s in plan.swapped) == 155582464 // 4


# --------------------------------------------------------------------------------------
# Options, budget, CLI
# --------------------------------------------------------------------------------------
def test_memory_budget_lowers_settings_that_keep_the_same_params_on_nvme() -> None:
    params = shapes_from_hf_config(QWEN3_06B)
    full = plan_nvme(params)
    fitted = plan_nvme(params, memory_budget=full.pinned.param_swap_buffers + 4 * 2**30)
    assert fitted.ok and fitted.pinned.total <= fitted.memory_budget
    assert [s.name for s in fitted.swapped] == [s.name for s in full.swapped]
    assert fitted.offload_param[R.BUFFER_COUNT] == 197
    assert fitted.sub_group_size < full.sub_group_size
    too_small = plan_nvme(params, memory_budget=2**30)
    assert too_small.fits_budget is False and not too_small.ok
    assert all(a.pinned_bytes_per_rank < too_small.pinned.total for a in too_small.alternatives)


def test_frozen_base_of_a_peft_run_gets_no_optimizer_or_cpu_copy(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    full = nvme_plan(tmp_path / "config.json")
    peft = nvme_plan(tmp_path / "config.json", frozen=True)
    assert peft.trainable_numel == 0 and peft.pinned.param_cpu_copy == 0 and peft.pinned.optimizer_swap_buffers == 0
    assert peft.disk.optimizer == 0 and peft.disk.params == full.disk.params
    assert (peft.offload_param[R.BUFFER_SIZE], peft.offload_param[R.BUFFER_COUNT]) == (155582464, 197)


def test_config_dtype_and_aio_are_used() -> None:
    params = shapes_from_hf_config(QWEN3_06B)
    config = {"fp16": {"enabled": True}, "aio": {"block_size": 4 * 2**20}, "zero_optimization": {"stage": 3}}
    # k_proj (1M elements, 2 MiB) is below a 4 MiB threshold; q_proj/o_proj (2M, 4 MiB) and the MLP are not
    plan = plan_nvme(params, dtype="fp16", config=config)
    assert plan.swap_threshold_bytes == 4 * 2**20
    assert len(plan.swapped) == 1 + 28 * 5


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN3_06B))
    good = tmp_path / "good.json"
    good.write_text(
        json.dumps(
            {
                "bf16": {"enabled": True},
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {
                        "device": "nvme",
                        "nvme_path": "/nvme",
                        "buffer_size": 155582464,
                        "buffer_count": 197,
                    },
                },
            }
        )
    )
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "bf16": {"enabled": True},
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {
                        "device": "nvme",
                        "nvme_path": "/nvme",
                        "buffer_size": 4194304,
                        "buffer_count": 200,
                    },
                },
            }
        )
    )
    runner = CliRunner()

    text = runner.invoke(app, ["nvme-plan", str(model)])
    assert text.exit_code == 0, text.output
    assert "buffer_count 197" in text.output
    snippet = json.loads(text.output.split("paste into the DeepSpeed config:\n", 1)[1])
    assert snippet["zero_optimization"]["offload_param"]["buffer_size"] == 155582464

    ok = runner.invoke(app, ["nvme-plan", str(model), "--config", str(good), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.output)["config_problems"] == []
    failing = runner.invoke(app, ["nvme-plan", str(model), "--config", str(bad)])
    assert failing.exit_code == 3
    assert (
        "zero_optimization.offload_param.buffer_size = 4194304 (needs 155582464): More elements 155582464 than buffer size 4194304"
        in failing.output
    )
    over = runner.invoke(app, ["nvme-plan", str(model), "--memory-budget", "512MiB", "--json"])
    assert over.exit_code == 3 and json.loads(over.output)["memory_budget"] == 512 * 2**20
    unreadable = runner.invoke(app, ["nvme-plan", str(model), "--memory-budget", "lots"])
    assert unreadable.exit_code != 0 and "cannot read size 'lots'" in unreadable.output
