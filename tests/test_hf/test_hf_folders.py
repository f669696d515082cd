"""Hugging Face Trainer folders as users point zckpt at them: the config's dtype follows the
weights written, `consolidate . .` inside a checkpoint-N folder, and a Trainer's output folder
holding several checkpoint-N."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from helpers import run_cli, sample
from zckpt.ops.consolidate import consolidate
from zckpt.ops.inspect import inspect_path


@pytest.mark.parametrize("dtype,name", [("fp32", "float32"), ("bf16", "bfloat16"), ("float16", "float16")])
def test_config_states_the_dtype_written(dtype: str, name: str, tmp_path: Path) -> None:
    """The bf16 run's config says bfloat16; transformers 5 loads with dtype="auto" by default, so
    an fp32 consolidation copied with that config would come back in bf16."""
    source = sample("hf_trainer").checkpoint
    consolidate(source, tmp_path / "out", dtype=dtype)
    original = json.loads((source / "config.json").read_text())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert original["torch_dtype"] == "bfloat16" and written["torch_dtype"] == name
    assert {k: v for k, v in written.items() if k != "torch_dtype"} == {
        k: v for k, v in original.items() if k != "torch_dtype"
    }
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert str(f.get_tensor("embed.weight").dtype) == f"torch.{name}"


def test_config_without_a_dtype_gets_one(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(sample("hf_trainer").checkpoint, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    del config["torch_dtype"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    consolidate(checkpoint, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.slow
def test_consolidate_dot_dot_inside_checkpoint_n_adds_only_the_weights(tmp_path: Path) -> None:
    """zero_to_fp32's habit: run inside the checkpoint folder, output into it."""
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(sample("hf_trainer").checkpoint, checkpoint)
    before = {p.relative_to(checkpoint): p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
    result = run_cli("consolidate", ".", ".", cwd=checkpoint)
    assert result.returncode == 0, result.stderr
    after = {p.relative_to(checkpoint): p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
    assert set(after) - set(before) == {Path("model.safetensors")}
    assert all(after[p] == before[p] for p in before)  # nothing else touched, config.json included
    again = run_cli("consolidate", ".", ".", cwd=checkpoint)
    assert again.returncode == 1 and "already exists" in again.stderr


@pytest.mark.slow
def test_trainer_output_folder_reads_the_newest_checkpoint(tmp_path: Path) -> None:
    output = tmp_path / "output"
    for step in (3, 12):
        shutil.copytree(sample("hf_trainer").checkpoint, output / f"checkpoint-{step}")
    for damaged in (output / "checkpoint-3" / "global_step3").glob("*optim_states.pt"):
        damaged.unlink()  # only checkpoint-12 is whole: reading it proves which one was used
    (output / "checkpoint-20").mkdir()  # not a checkpoint (a save that did not happen)
    (output / "runs").mkdir()
    result = run_cli("consolidate", output, tmp_path / "weights", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "read checkpoint-12, the newest" in result.stderr
    report = inspect_path(output)
    assert report["complete"] and any("checkpoint-12" in n for n in report["notes"])
