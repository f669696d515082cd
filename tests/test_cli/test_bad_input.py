"""Bad input through the real command line: one line naming the file and the problem, exit 1,
no traceback, and no output folder or temp file left behind."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, run_cli, sample
from zckpt import OutputError, consolidate

ZERO3 = "z3_fp32_ws2_tied_frozen"  # 2 ranks, one model-states file per rank
ZERO2 = "z2_fp32_ws2_twotags"  # 2 ranks, two tags


def assert_refused(checkpoint: Path, *expected: str, tag: str | None = None) -> None:
    out = checkpoint.parent / "out"
    args = [checkpoint, out] + (["--tag", tag] if tag else [])
    result = run_cli("consolidate", *args, cwd=checkpoint.parent)
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zckpt: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert not out.exists(), "a failed run left an output folder behind"


def tag_dir(checkpoint: Path) -> Path:
    return checkpoint / (checkpoint / "latest").read_text().strip()


def test_truncated_rank_file(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO3)
    victim = tag_dir(ckpt) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert_refused(ckpt, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "truncated")


def test_garbled_file(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO3)
    victim = tag_dir(ckpt) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    data[100:400] = os.urandom(300)  # inside the pickle record: its CRC no longer matches
    victim.write_bytes(bytes(data))
    assert_refused(ckpt, "zero_pp_rank_0_mp_rank_00_model_states.pt")


def test_missing_rank_file(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO3)
    (tag_dir(ckpt) / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert_refused(ckpt, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "missing", "world size 2")


def test_missing_zero3_model_states_of_one_rank(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO3)
    (tag_dir(ckpt) / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    assert_refused(ckpt, "zero_pp_rank_1_mp_rank_00_model_states.pt", "missing")


def test_rank_files_of_two_saves_mixed(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO2)
    meta = sample(ZERO2).meta
    older = [t for t in meta["tags"] if t != meta["tag"]][0]
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(ckpt / older / name, tag_dir(ckpt) / name)
    assert_refused(ckpt, name, "mixed")


def test_rank_file_of_another_world_size_mixed_in(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO3)
    other = sample("z3_bf16_ws3_subgroups_groups")
    shutil.copy(
        other.checkpoint / other.meta["tag"] / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
        tag_dir(ckpt) / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
    )
    assert_refused(ckpt, "zero_pp_rank_2_mp_rank_00_optim_states.pt", "mixed")


def test_missing_nvme_swap_file(copy_checkpoint) -> None:
    ckpt = copy_checkpoint("z3_bf16_ws2_nvmeoffload_frozen_tied_groups")
    (tag_dir(ckpt) / "offloaded_tensors" / "rank01" / "0_7.tensor.swp").unlink()
    assert_refused(ckpt, "rank01/0_7.tensor.swp", "missing", "NVMe")


def test_truncated_nvme_swap_file(copy_checkpoint) -> None:
    ckpt = copy_checkpoint("z3_bf16_ws2_nvmeoffload_frozen_tied_groups")
    swap = tag_dir(ckpt) / "offloaded_tensors" / "rank00" / "0_7.tensor.swp"
    swap.write_bytes(swap.read_bytes()[:1000])
    assert_refused(ckpt, "rank00/0_7.tensor.swp", "truncated")


@pytest.mark.slow
def test_unsupported_layouts_are_named(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO3)
    shutil.copy(
        tag_dir(ckpt) / "zero_pp_rank_0_mp_rank_00_model_states.pt",
        tag_dir(ckpt) / "layer_0_expert_0_mp_rank_00_model_states.pt",
    )
    assert_refused(ckpt, "layer_0_expert_0_mp_rank_00_model_states.pt", "mixture-of-experts")
    (tag_dir(ckpt) / "layer_0_expert_0_mp_rank_00_model_states.pt").unlink()
    shutil.copy(
        tag_dir(ckpt) / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        tag_dir(ckpt) / "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    )
    # an optimizer file of tensor rank 1 alone: read as a ZeRO-3 tensor-parallel run, its model states named missing
    assert_refused(ckpt, "zero_pp_rank_0_mp_rank_01_model_states.pt", "missing (tensor rank 1 of 2)")


def test_latest_names_a_missing_tag(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO3)
    (ckpt / "latest").write_text("global_step999")
    assert_refused(ckpt, "latest", "global_step999")


@pytest.mark.slow
def test_unknown_tag_option(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO3)
    assert_refused(ckpt, "global_step7", "not found", tag="global_step7")


@pytest.mark.slow
def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert_refused(tmp_path / "empty", "empty", "no DeepSpeed checkpoint")


@pytest.mark.slow
def test_missing_path(tmp_path: Path) -> None:
    assert_refused(tmp_path / "nowhere", "nowhere", "no such file")


@pytest.mark.slow
def test_unknown_pickle_global(copy_checkpoint) -> None:
    """A call of a function that is not zckpt's own rebuild (here collections.Counter, harmless,
    but a call all the same) is refused by name; instances of unknown classes are data (see
    tests/test_torchfile/test_pickle_safety.py)."""
    import collections

    ckpt = copy_checkpoint(ZERO3)
    victim = tag_dir(ckpt) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {}, "counts": collections.Counter("ab")}, victim)
    assert_refused(ckpt, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "collections.Counter")


class _Payload:
    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


@pytest.mark.slow
def test_payload_in_a_pickle_never_runs(copy_checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(ZERO3)
    canary = tmp_path / "pwned"
    victim = tag_dir(ckpt) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"module": {}, "param_shapes": [], "x": _Payload(str(canary))}, victim)
    assert_refused(ckpt, "zero_pp_rank_0_mp_rank_00_model_states.pt", "system")
    assert not canary.exists()


@pytest.mark.slow
def test_inspect_reports_problems_instead_of_failing(copy_checkpoint) -> None:
    import json

    ckpt = copy_checkpoint(ZERO3)
    (tag_dir(ckpt) / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    result = run_cli("inspect", ckpt, "--json", cwd=ckpt.parent)
    assert result.returncode == 3, result.stderr
    report = json.loads(result.stdout)
    assert report["complete"] is False and report["zero_stage"] == 3 and report["world_size"] == 2
    assert any("zero_pp_rank_1_mp_rank_00_optim_states.pt" in p and "missing" in p for p in report["problems"])
    assert report["params"] == len([p for p in report["parameters"] if p["kind"] in ("param", "frozen")]) > 0


@pytest.mark.slow
def test_inspect_verify_finds_corrupted_tensor_data(copy_checkpoint) -> None:
    """A flipped bit inside tensor data parses fine; --verify's CRC-32 check catches it."""
    import json

    ckpt = copy_checkpoint(ZERO3)
    victim = tag_dir(ckpt) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    from zckpt.torchfile import reader as torchfile

    flat = torchfile.load(victim)["optimizer_state_dict"]["fp32_flat_groups"][0]
    data = bytearray(victim.read_bytes())
    data[flat.offset + 5] ^= 0x10
    victim.write_bytes(bytes(data))
    assert run_cli("inspect", ckpt, cwd=ckpt.parent).returncode == 0  # parsing alone cannot tell
    result = run_cli("inspect", ckpt, "--verify", "--json", cwd=ckpt.parent)
    assert result.returncode == 3
    report = json.loads(result.stdout)
    assert report["verified"] and not report["complete"]
    assert any("zero_pp_rank_1_mp_rank_00_optim_states.pt" in p and "CRC-32" in p for p in report["problems"])
    assert run_cli("inspect", sample(ZERO3).checkpoint, "--verify", cwd=ckpt.parent).returncode == 0


@pytest.mark.slow
def test_existing_weights_are_not_overwritten_silently(tmp_path: Path) -> None:
    case = sample(ZERO3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    result = run_cli("consolidate", case.checkpoint, out, cwd=tmp_path)
    assert result.returncode == 1 and "--overwrite" in result.stderr
    assert (out / "model.safetensors").read_bytes() == b"precious"
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stale shard")
    assert run_cli("consolidate", case.checkpoint, out, "--overwrite", cwd=tmp_path).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_disk_full_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC in the middle of a shard: the error names the file and no output remains."""
    import zckpt.io.materialize as materialize

    calls = {"n": 0}
    real_write = os.write

    def full_disk(fd: int, data) -> int:
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(materialize.os, "write", full_disk)
    monkeypatch.setattr(
        materialize.os,
        "copy_file_range",
        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EXDEV, "x")),
        raising=False,
    )
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="no space left"):
        consolidate(sample(ZERO3).checkpoint, out, max_shard_size="4KB")
    assert not out.exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    calls["n"] = 0
    with pytest.raises(OutputError):
        consolidate(sample(ZERO3).checkpoint, tmp_path / "kept", max_shard_size="4KB")
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]


def test_not_enough_free_space_is_refused_up_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    import zckpt.io.output as output

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(output.shutil, "disk_usage", lambda _p: usage(100, 90, 10))
    with pytest.raises(OutputError, match="free"):
        consolidate(sample(ZERO3).checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_debug_env_shows_the_traceback(tmp_path: Path) -> None:
    env = dict(os.environ, ZCKPT_DEBUG="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "zckpt", "consolidate", str(tmp_path / "nope"), str(tmp_path / "o")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "Traceback" in result.stderr


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 28 KiB tmpfs: passes the up-front free-space check for a ~18 KB model, then fills up
    while many small shards are written (each takes whole pages). Needs mount rights."""
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=28k", "tmpfs", str(mountpoint)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_real_full_disk(tiny_disk: Path, fmt: str) -> None:
    result = run_cli(
        "consolidate",
        sample(ZERO3).checkpoint,
        tiny_disk / "out",
        "--format",
        fmt,
        "--max-shard-size",
        "2KB",
        cwd=tiny_disk.parent,
    )
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no space left on device" in lines[0] and str(tiny_disk / "out") in lines[0]
    assert list(tiny_disk.iterdir()) == []
