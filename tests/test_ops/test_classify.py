"""The one input classifier (zckpt.ops.classify) on tiny trees: each kind, and the ambiguous paths
decided in the order the commands always used (swap before weights, a tag folder before a
checkpoint folder, the index before single files, model weights before an adapter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zckpt.cli.consolidate import Format
from zckpt.core.errors import UsageError
from zckpt.ops.classify import Kind, classify
from zckpt.ops.formats import FORMATS, SAFETENSORS, TORCH, weights_format
from zckpt.ops.lightning import LIGHTNING


def touch(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def tag(folder: Path, name: str = "global_step1") -> Path:
    touch(folder / name / "mp_rank_00_model_states.pt")
    return folder / name


def swap(folder: Path) -> Path:
    (folder / "zero_stage_3" / "optimizer" / "rank0").mkdir(parents=True)
    return folder


def kind(path: Path) -> Kind:
    return classify(path).kind


def test_missing(tmp_path: Path) -> None:
    assert kind(tmp_path / "nope") is Kind.MISSING


def test_checkpoint_folders(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    tag(ck)
    touch(ck / "latest", "global_step1")
    assert kind(ck) is Kind.CHECKPOINT_FOLDER
    assert kind(ck / "global_step1") is Kind.TAG_FOLDER
    assert classify(ck).is_checkpoint and classify(ck / "global_step1").is_checkpoint
    untagged = tmp_path / "tags_only"
    tag(untagged)
    assert kind(untagged) is Kind.CHECKPOINT_FOLDER  # tag folders without 'latest'
    only_latest = touch(tmp_path / "only_latest" / "latest").parent
    assert kind(only_latest) is Kind.CHECKPOINT_FOLDER  # 'latest' alone: locate() says what is missing


def test_trainer_checkpoint_and_output(tmp_path: Path) -> None:
    out = tmp_path / "run"
    tag(out / "checkpoint-3")
    touch(out / "checkpoint-3" / "latest", "global_step1")
    assert kind(out / "checkpoint-3") is Kind.TRAINER_CHECKPOINT
    assert kind(out) is Kind.TRAINER_OUTPUT
    assert not classify(out).is_checkpoint  # locate() picks the newest checkpoint-N


def test_universal_folder(tmp_path: Path) -> None:
    uc = tag(tmp_path / "uc", "global_step1_universal")
    (uc / "zero").mkdir()
    assert kind(uc) is Kind.UNIVERSAL_FOLDER
    touch(uc / "zero_pp_rank_0_mp_rank_00_optim_states.pt")  # optimizer files: a ZeRO tag folder
    assert kind(uc) is Kind.TAG_FOLDER


def test_tag_folder_wins_over_checkpoint_folder(tmp_path: Path) -> None:
    both = tag(tmp_path / "ck")
    touch(both / "latest", "x")
    assert kind(both) is Kind.TAG_FOLDER  # locate() takes a folder of model_states as the tag


def test_latest_file(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    tag(ck)
    assert kind(touch(ck / "latest", "global_step1")) is Kind.LATEST_FILE
    assert classify(ck / "latest").checkpoint_dir == str(ck)
    assert kind(touch(ck / "latest_universal", "global_step1")) is Kind.LATEST_FILE
    assert (
        kind(touch(tmp_path / "alone" / "latest")) is Kind.LATEST_FILE
    )  # 'latest' makes its folder a checkpoint folder
    stray = touch(tmp_path / "elsewhere" / "latest_universal")  # not beside a checkpoint: a weights file to read
    assert kind(stray) is Kind.WEIGHTS_FILE


def test_weights(tmp_path: Path) -> None:
    assert kind(touch(tmp_path / "w" / "model.safetensors")) is Kind.WEIGHTS_FILE
    assert kind(touch(tmp_path / "w" / "pytorch_model.bin.index.json")) is Kind.WEIGHTS_INDEX
    found = classify(tmp_path / "w")
    assert found.kind is Kind.WEIGHTS_FOLDER and found.weights_file == str(
        tmp_path / "w" / "pytorch_model.bin.index.json"
    )
    touch(tmp_path / "w" / "model.safetensors.index.json")
    assert classify(tmp_path / "w").weights_file == str(tmp_path / "w" / "model.safetensors.index.json")
    single = touch(tmp_path / "s" / "pytorch_model.bin").parent
    touch(single / "model.safetensors")
    assert classify(single).weights_file == str(single / "model.safetensors")  # safetensors before torch


def test_adapter_folder(tmp_path: Path) -> None:
    folder = touch(tmp_path / "a" / "adapter_model.bin").parent
    found = classify(folder)
    assert (
        found.kind is Kind.ADAPTER_FOLDER
        and found.weights_file is None
        and found.adapter_file == str(folder / "adapter_model.bin")
    )
    touch(folder / "adapter_model.safetensors")
    assert classify(folder).adapter_file == str(folder / "adapter_model.safetensors")
    touch(folder / "pytorch_model.bin")
    assert kind(folder) is Kind.WEIGHTS_FOLDER  # model weights before the adapter


def test_swap_folder(tmp_path: Path) -> None:
    nvme = swap(tmp_path / "nvme")
    assert kind(nvme) is Kind.SWAP_FOLDER and kind(nvme / "zero_stage_3") is Kind.SWAP_FOLDER
    touch(nvme / "model.safetensors")
    found = classify(nvme)
    assert found.kind is Kind.SWAP_FOLDER and found.weights_file == str(
        nvme / "model.safetensors"
    )  # swap first; the file is still named
    tag(nvme)
    assert kind(nvme) is Kind.CHECKPOINT_FOLDER  # a checkpoint wins over the swap folder


def test_other_folder(tmp_path: Path) -> None:
    assert kind(touch(tmp_path / "f" / "notes.txt").parent) is Kind.FOLDER
    (tmp_path / "g" / "checkpoint-2").mkdir(parents=True)  # checkpoint-N without a checkpoint inside
    assert kind(tmp_path / "g") is Kind.FOLDER
    assert kind(touch(tmp_path / "d.index.json" / "x").parent) is Kind.FOLDER  # a folder, whatever its name


def test_format_registry() -> None:
    assert [f.value for f in Format] == [*FORMATS, LIGHTNING]  # the CLI's choices are the registry's names
    assert (SAFETENSORS.single_file, SAFETENSORS.pattern.format(suffix="-00001-of-00002"), SAFETENSORS.index_file) == (
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
    )
    assert (TORCH.single_file, TORCH.pattern.format(suffix="-00001-of-00002"), TORCH.index_file) == (
        "pytorch_model.bin",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model.bin.index.json",
    )
    assert weights_format("torch") is TORCH and weights_format(SAFETENSORS) is SAFETENSORS
    with pytest.raises(UsageError, match="unknown format 'npz': choose safetensors or torch"):
        weights_format("npz")
