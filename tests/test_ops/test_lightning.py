"""PyTorch Lightning checkpoints (``DeepSpeedStrategy``'s ``epoch=E-step=S.ckpt/`` folders) against
facts Lightning and DeepSpeed wrote (scripts/make_lightning_ckpts.py): the file Lightning's own
converter ``convert_zero_checkpoint_to_fp32_state_dict`` wrote (``reference/lightning_model.pt``,
read with torch.load), and the live engine's gathered values at the save (fp32 masters, frozen
params and buffers, Adam moments, global step, the scheduler's lr). Resuming with Lightning is in
tests/test_interop/test_interop_lightning.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import LIGHTNING_SAMPLES, Sample, assert_same_objects, one_line, run_cli, same_bits, sample
from zckpt import consolidate
from zckpt.core.errors import UsageError
from zckpt.deepspeed.locate import locate
from zckpt.ops.classify import Kind, classify
from zckpt.ops.lightning import LIGHTNING_FILE

BY_NAME = {s.name: s for s in LIGHTNING_SAMPLES}


def converter_output(case: Sample) -> dict:
    return torch.load(case.folder / "reference" / LIGHTNING_FILE, weights_only=True)


def test_the_four_samples_are_there() -> None:
    assert sorted(BY_NAME) == [
        "lightning_z2_bf16_ws2",
        "lightning_z2_fp32_ws2_legacy_prefix",
        "lightning_z3_bf16_ws2",
        "lightning_z3_fp32_ws2",
    ]


@pytest.mark.parametrize("case", LIGHTNING_SAMPLES, ids=lambda s: s.name)
def test_format_lightning_is_what_lightnings_converter_writes(case: Sample, tmp_path: Path) -> None:
    result = consolidate(case.folder / "checkpoints", tmp_path, format="lightning")
    assert result.files == (LIGHTNING_FILE,)
    ours_file = tmp_path / LIGHTNING_FILE
    ours = torch.load(ours_file, weights_only=True)
    theirs = converter_output(case)
    assert_same_objects(ours, theirs)
    # the tied head is one storage with the embedding, as in the model
    assert ours["state_dict"]["head.weight"] is ours["state_dict"]["embed.weight"]
    assert ours["global_step"] == case.meta["global_step"] == 4
    if case.meta["zero_stage"] == 3:  # the very bytes (ZeRO-1/2: see the test below)
        assert ours_file.read_bytes() == (case.folder / "reference" / LIGHTNING_FILE).read_bytes()


def test_zero2_masters_are_views_of_one_flat_group_in_lightnings_file_and_own_storages_in_ours(tmp_path: Path) -> None:
    """The one difference from the converter, on ZeRO-1/2: its masters are views into one fp32
    vector per param group (zero_to_fp32 cuts them out of the merged partitions, padding and all);
    zckpt writes each its own storage. Values, dtypes and names are the same (above)."""
    case = BY_NAME["lightning_z2_bf16_ws2"]
    consolidate(case.checkpoint, tmp_path, format="lightning")
    theirs = converter_output(case)["state_dict"]
    ours = torch.load(tmp_path / LIGHTNING_FILE, weights_only=True)["state_dict"]
    assert theirs["up.weight"].untyped_storage().data_ptr() == theirs["embed.weight"].untyped_storage().data_ptr()
    assert ours["up.weight"].untyped_storage().data_ptr() != ours["embed.weight"].untyped_storage().data_ptr()
    assert ours["up.weight"].untyped_storage().nbytes() == ours["up.weight"].nbytes


@pytest.mark.parametrize("case", LIGHTNING_SAMPLES, ids=lambda s: s.name)
def test_state_dict_holds_the_live_engines_values(case: Sample, tmp_path: Path) -> None:
    consolidate(case.checkpoint, tmp_path, format="lightning")
    state_dict = torch.load(tmp_path / LIGHTNING_FILE, weights_only=True)["state_dict"]
    live = load_file(case.folder / "reference" / "live.safetensors")
    assert list(state_dict) != [] and sorted(state_dict) == sorted(live)
    for name, value in live.items():
        trainable = name not in case.meta["frozen"] and name not in case.meta["buffers"]
        assert state_dict[name].dtype == (torch.float32 if trainable else value.dtype), name
        assert same_bits(state_dict[name], value), name


@pytest.mark.parametrize("case", LIGHTNING_SAMPLES, ids=lambda s: s.name)
def test_optimizer_states_are_the_live_moments_step_and_groups(case: Sample, tmp_path: Path) -> None:
    """``--optimizer-states``: torch.optim's state dict of the run's AdamW, params numbered in
    group order as configure_optimizers gave them (weights, then biases)."""
    consolidate(case.checkpoint, tmp_path, format="lightning", optimizer_states=True)
    saved = torch.load(tmp_path / LIGHTNING_FILE, weights_only=True)
    (optimizer,) = saved["optimizer_states"]
    trainable = ["embed.weight", "up.weight", "down.weight", "up.bias", "down.bias"]
    assert [g["params"] for g in optimizer["param_groups"]] == [[0, 1, 2], [3, 4]]
    assert [g["weight_decay"] for g in optimizer["param_groups"]] == [0.1, 0.0]
    assert [g["lr"] for g in optimizer["param_groups"]] == case.meta["last_lr"]
    live = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    for number, name in enumerate(trainable):
        state = optimizer["state"][number]
        assert list(state) == ["step", "exp_avg", "exp_avg_sq"]
        assert state["step"].dtype == torch.float32 and state["step"].shape == () and float(state["step"]) == 4.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32 and same_bits(state[key], live[f"{name}.{key}"]), (name, key)
    # everything else as the converter writes it
    del saved["optimizer_states"]
    assert_same_objects(saved, converter_output(case))


def test_legacy_names_lose_lightnings_old_prefix_in_every_format(tmp_path: Path) -> None:
    """Lightning < 2.1 saved every name under ``_forward_module.``; consolidate writes the
    LightningModule's own names, as Lightning's converter does, and says so."""
    case = BY_NAME["lightning_z2_fp32_ws2_legacy_prefix"]
    result = run_cli("consolidate", case.folder / "checkpoints", tmp_path / "st")
    assert result.returncode == 0, result.stderr
    assert "names less the '_forward_module.'" in result.stderr
    weights = load_file(tmp_path / "st" / "model.safetensors")
    assert sorted(weights) == sorted(converter_output(case)["state_dict"])
    assert all(same_bits(weights[n], t) for n, t in load_file(case.folder / "reference" / "live.safetensors").items())


def test_a_modelcheckpoint_folder_reads_its_newest_checkpoint(tmp_path: Path) -> None:
    """The dirpath of ``ModelCheckpoint``: the largest step= (natural order, not text order); a
    ``last*.ckpt`` wins when there is one (Lightning's own ``ckpt_path="last"`` rule: newest)."""
    case = BY_NAME["lightning_z3_bf16_ws2"]
    folder = tmp_path / "checkpoints"
    shutil.copytree(case.folder / "checkpoints", folder)
    assert classify(str(folder)).kind is Kind.LIGHTNING_FOLDER
    found = locate(folder)
    assert Path(found.checkpoint_dir).name == "epoch=0-step=4.ckpt" and found.tag == "checkpoint"
    assert found.note == "Lightning checkpoint folder: read epoch=0-step=4.ckpt, the largest step= of 2 .ckpt folder(s)"
    shutil.copytree(folder / "epoch=0-step=2.ckpt", folder / "epoch=0-step=10.ckpt")
    assert Path(locate(folder).checkpoint_dir).name == "epoch=0-step=10.ckpt"
    shutil.copytree(folder / "epoch=0-step=2.ckpt", folder / "last.ckpt")
    shutil.copytree(folder / "epoch=0-step=4.ckpt", folder / "last-v1.ckpt")
    os.utime(folder / "last.ckpt" / "latest", (1_000_000_000, 1_000_000_000))
    found = locate(folder)
    assert Path(found.checkpoint_dir).name == "last-v1.ckpt"
    assert "the newest last*.ckpt of 5 .ckpt folder(s)" in found.note
    # what was read is the step-4 save: the inspect line says which folder
    result = run_cli("inspect", folder)
    assert result.returncode == 0, result.stderr
    assert "read last-v1.ckpt, the newest last*.ckpt" in result.stdout


def test_a_link_named_ckpt_is_not_followed(tmp_path: Path) -> None:
    case = BY_NAME["lightning_z3_bf16_ws2"]
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    shutil.copytree(case.checkpoint, folder / "epoch=0-step=4.ckpt")
    os.symlink(case.folder / "checkpoints" / "epoch=0-step=2.ckpt", folder / "epoch=9-step=99.ckpt")
    assert Path(locate(folder).checkpoint_dir).name == "epoch=0-step=4.ckpt"


def test_lightning_output_leaves_weights_files_beside_it(tmp_path: Path) -> None:
    case = BY_NAME["lightning_z2_bf16_ws2"]
    consolidate(case.checkpoint, tmp_path)
    consolidate(case.checkpoint, tmp_path, format="lightning")
    assert sorted(p.name for p in tmp_path.iterdir()) == [LIGHTNING_FILE, "model.safetensors"]
    consolidate(case.checkpoint, tmp_path, format="lightning", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LIGHTNING_FILE, "model.safetensors"]


def test_lightning_usage_errors(tmp_path: Path) -> None:
    case = sample("lightning_z3_fp32_ws2")
    with pytest.raises(UsageError, match="--optimizer-states goes with --format lightning"):
        consolidate(case.checkpoint, tmp_path, optimizer_states=True)
    result = run_cli("consolidate", case.checkpoint, tmp_path / "lightning_model.ckpt", "--format", "lightning")
    assert result.returncode != 0
    assert one_line(result).endswith(f"give the folder: '{tmp_path}' gets lightning_model.pt")
    assert not (tmp_path / "lightning_model.ckpt").exists()
    result = run_cli("consolidate", case.checkpoint, tmp_path / "out", "-f", "lightning", "--safe_serialization")
    assert result.returncode != 0 and "--format lightning was given" in result.stderr
    result = run_cli("consolidate", case.checkpoint, tmp_path / "out", "--format", "lightning", "--optimizer-states")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("wrote 9 tensors") and result.stdout.rstrip().endswith(LIGHTNING_FILE)
