"""``zckpt verify`` passes every intact sample and catches each kind of damage, naming the file."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from helpers import SAMPLE_LIST, as_saved_to_a_stream, data_records, flip, record_start, sample
from zckpt import consolidate
from zckpt.cli.app import app
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal
from zckpt.ops.verify import verify


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["verify", *args])
    return result.exit_code, result.output


@pytest.mark.slow
@pytest.mark.parametrize("case", SAMPLE_LIST, ids=lambda s: s.name)
def test_every_intact_sample_verifies(case) -> None:
    report = verify(case.checkpoint, scan=True)
    assert report.ok, report.problems
    assert {c.name for c in report.checks} >= {"layout", "checksums", "rank identity", "optimizer state", "values"}
    assert all(c.ok is not False for c in report.checks)
    # ZeRO-1/2 keep the module's weights beside the masters: DeepSpeed's are the masters rounded
    assert ("module weights" in {c.name for c in report.checks}) == (case.meta["zero_stage"] in (1, 2))
    code, output = run_cli(str(case.checkpoint), "--json")
    assert code == 0 and json.loads(output)["ok"] is True


def _copy(tmp_path: Path, name: str) -> tuple[Path, Path]:
    case = sample(name)
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(case.checkpoint, checkpoint)
    return checkpoint, checkpoint / case.meta["tag"]


def _fails(checkpoint: Path, *words: str) -> list[str]:
    report = verify(checkpoint)
    assert not report.ok
    text = " ".join(report.problems)
    for word in words:
        assert word in text, report.problems
    code, output = run_cli(str(checkpoint))
    assert code == 3 and "problem:" in output, output
    return list(report.problems)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["z3_fp32_ws2_tied_frozen", "z2_bf16_ws3_frozen_groups", "z1_bf16_ws3_bf16optimizer_frozen"]
)
def test_a_flipped_byte_in_any_record_fails_naming_the_file(tmp_path: Path, name: str) -> None:
    """Including records no command reads (exp_avg of a consolidation, 16-bit module params)."""
    checkpoint, tag = _copy(tmp_path, name)
    for victim in sorted(tag.glob("*.pt")):
        info = max(data_records(victim), key=lambda i: i.file_size)
        flip(victim, record_start(victim, info) + info.file_size // 3)
        problems = _fails(checkpoint, "CRC-32")
        assert any(str(victim) in p for p in problems)
        flip(victim, record_start(victim, info) + info.file_size // 3)  # undo
    assert verify(checkpoint).ok


def test_truncated_and_missing_rank_files_fail(tmp_path: Path) -> None:
    checkpoint, tag = _copy(tmp_path, "z3_bf16_ws3_subgroups_groups")
    victim = sorted(tag.glob("*rank_2_*optim_states.pt"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    _fails(checkpoint, victim.name)
    victim.unlink()
    _fails(checkpoint, "rank_2")


@pytest.mark.parametrize("kind", ["optim", "model"])
def test_swapped_zero3_rank_files_fail_by_the_names_they_were_saved_under(tmp_path: Path, kind: str) -> None:
    """Ranks 0 and 1 of 3 hold no padding, and ZeRO-3 model states no partition: only the name
    torch.save recorded inside each file tells them apart."""
    checkpoint, tag = _copy(tmp_path, "z3_bf16_ws3_subgroups_groups")
    first, second = sorted(tag.glob(f"*rank_0_*{kind}_states.pt"))[0], sorted(tag.glob(f"*rank_1_*{kind}_states.pt"))[0]
    held = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(held)
    problems = _fails(checkpoint, f"was saved as {first.name}", "swapped, copied or renamed")
    assert any(str(first) in p and f"saved as {second.name}" in p for p in problems), problems


@pytest.mark.parametrize("name", ["z3_bf16_ws3_subgroups_groups", "z2_fp16_ws4_tied"])
def test_a_rank_file_copied_over_another_fails(tmp_path: Path, name: str) -> None:
    checkpoint, tag = _copy(tmp_path, name)
    source, target = sorted(tag.glob("*rank_0_*optim_states.pt"))[0], sorted(tag.glob("*rank_1_*optim_states.pt"))[0]
    shutil.copyfile(source, target)
    _fails(checkpoint, target.name)


def test_swapped_zero12_rank_files_fail(tmp_path: Path) -> None:
    checkpoint, tag = _copy(tmp_path, "z2_bf16_ws3_frozen_groups")
    first, second = sorted(tag.glob("*rank_0_*optim_states.pt"))[0], sorted(tag.glob("*rank_1_*optim_states.pt"))[0]
    held = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(held)
    _fails(checkpoint, f"was saved as {second.name}", "swapped")
    for path in (first, second):  # no names to tell by: the slice mappings still name the rank
        as_saved_to_a_stream(path)
    _fails(checkpoint, "param_slice_mappings", "swapped")


def test_zero3_files_saved_to_a_stream_are_read_and_said_to_be_untellable(tmp_path: Path) -> None:
    """DeepSpeed's FastPersist writer saves through a stream: the archives are named "archive",
    and nothing in a ZeRO-3 file tells its rank. The checkpoint reads as it is, and verify says so."""
    checkpoint, tag = _copy(tmp_path, "z3_fp32_ws2_tied_frozen")
    for path in sorted(tag.glob("*.pt")):
        as_saved_to_a_stream(path)
    report = verify(checkpoint)
    assert report.ok, report.problems
    assert any("saved to a stream" in note and "nothing in them tells which rank" in note for note in report.notes)


def test_model_states_of_another_save_fail(tmp_path: Path) -> None:
    """The model-states file of DeepSpeed's earlier save (global_step2) beside the optimizer files
    of its later one: every file is intact and of the same run, and only the module's weights,
    which are not the optimizer's masters rounded, tell that they are of another step."""
    checkpoint, tag = _copy(tmp_path, "z2_fp32_ws2_twotags")
    assert tag.name == "global_step3"
    shutil.copyfile(checkpoint / "global_step2" / "mp_rank_00_model_states.pt", tag / "mp_rank_00_model_states.pt")
    problems = _fails(checkpoint, "mp_rank_00_model_states.pt: 15 of its 15 module weights are not their masters")
    assert len(problems) == 1 and "not of the same step" in problems[0], problems


@pytest.mark.parametrize(
    "name", ["z2_bf16_ws3_frozen_groups", "z1_bf16_ws3_bf16optimizer_frozen", "z2_fp16_ws4_tied", "ds14_z1_fp16_ws2"]
)
def test_one_changed_module_weight_is_named(tmp_path: Path, name: str) -> None:
    """One element of one 16-bit weight in DeepSpeed's model-states file set to another value:
    verify names the file, the param and the count (besides the record's checksum)."""
    checkpoint, tag = _copy(tmp_path, name)
    from zckpt.deepspeed.reader import open_checkpoint

    copy, _ = open_checkpoint(checkpoint).rounded_copies[0]
    segment = copy.source.segments[0]
    with open(segment.path, "r+b") as f:
        f.seek(segment.offset)
        held = f.read(copy.source.dtype.itemsize)
        f.seek(segment.offset)
        f.write(bytes(b ^ 0x40 for b in held))
    _fails(checkpoint, "mp_rank_00_model_states.pt: 1 of its", f"({copy.name}, ", "differs in 1 of")


def test_leftovers_of_a_killed_run_fail(tmp_path: Path) -> None:
    checkpoint, _ = _copy(tmp_path, "z2_fp32_ws1")
    from zckpt.io.output import owner_tag

    host = owner_tag().rsplit("-", 1)[0]  # this host, a pid that is not running: a dead owner
    (checkpoint / f".model.safetensors.zckpt-tmp-{host}-999999999").write_bytes(b"partial")
    _fails(checkpoint, "zckpt-tmp")


def test_needs_are_what_the_operations_write(tmp_path: Path) -> None:
    """The disk figures equal the bytes each operation then writes."""
    case = sample("z3_bf16_ws3_subgroups_groups")
    needs = {n.operation: n for n in verify(case.checkpoint).needs}

    def size(folder: Path) -> int:
        return sum(
            p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name not in ("latest", "latest_universal")
        )

    consolidate(case.checkpoint, tmp_path / "fp32")
    assert needs["consolidate --dtype fp32"].disk_bytes == size(tmp_path / "fp32")
    consolidate(case.checkpoint, tmp_path / "bf16", dtype="bf16")
    assert needs["consolidate --dtype bf16"].disk_bytes == size(tmp_path / "bf16")
    reshard(case.checkpoint, tmp_path / "re", world_size=case.meta["world_size"])
    assert needs["reshard (about the same at any world size)"].disk_bytes == size(tmp_path / "re")
    to_universal(case.checkpoint, tmp_path / "uc")
    assert needs["to-universal"].disk_bytes == size(tmp_path / "uc")
    assert all(0 < n.memory_bytes < 1 << 30 for n in needs.values())


def test_universal_folders_verify_and_damage_is_caught(tmp_path: Path) -> None:
    case = sample("z2_bf16_ws3_frozen_groups")
    to_universal(case.checkpoint, tmp_path / "uc")
    assert verify(tmp_path / "uc").ok
    victim = next((tmp_path / "uc").rglob("exp_avg.pt"))
    info = max(data_records(victim), key=lambda i: i.file_size)
    flip(victim, record_start(victim, info) + 1)
    _fails(tmp_path / "uc", str(victim), "CRC-32")


def test_weights_outputs(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    consolidate(case.checkpoint, tmp_path / "st", max_shard_size="4KB")
    assert verify(tmp_path / "st", scan=True).ok
    consolidate(case.checkpoint, tmp_path / "pt", format="torch")
    assert verify(tmp_path / "pt", scan=True).ok
    # a shard gone
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "st" / gone).unlink()
    _fails(tmp_path / "st", gone)
    # damage inside a torch file's tensor data
    victim = tmp_path / "pt" / "pytorch_model.bin"
    info = max(data_records(victim), key=lambda i: i.file_size)
    flip(victim, record_start(victim, info) + 5)
    _fails(tmp_path / "pt", "CRC-32")


def test_scan_finds_nan_and_inf(tmp_path: Path) -> None:
    values = torch.zeros(10)
    values[3], values[7] = math.nan, math.inf
    save_file(
        {
            "w": values,
            "h": torch.ones(4, dtype=torch.bfloat16) * float("inf"),
            "ok": torch.ones(3, dtype=torch.float16),
        },
        tmp_path / "model.safetensors",
    )
    assert verify(tmp_path).ok  # without --scan, values are not judged
    report = verify(tmp_path, scan=True)
    assert not report.ok
    assert any("w holds 2 NaN/Inf of 10" in p for p in report.problems), report.problems
    assert any("h holds 4 NaN/Inf of 4" in p for p in report.problems), report.problems
    assert not any(" ok holds" in p for p in report.problems)


def test_missing_path_is_bad_input(tmp_path: Path) -> None:
    code, output = run_cli(str(tmp_path / "nothing"))
    assert code == 1 and "no such file" in output


def test_records_checked_in_pieces_say_what_whole_records_say(tmp_path: Path, monkeypatch) -> None:
    """verify cuts records into pieces (shared by threads and torchrun processes) and joins their
    CRC-32s: the counts and the problem named equal check_archive's, which reads records whole."""
    from zckpt.io.checksums import check_archive
    from zckpt.ops import verify as verify_module

    checkpoint, tag = _copy(tmp_path, "z2_bf16_ws3_frozen_groups")
    victim = sorted(tag.glob("*optim_states.pt"))[0]
    info = max(data_records(victim), key=lambda i: i.file_size)
    flip(victim, record_start(victim, info) + info.file_size - 3)  # in the record's last piece
    monkeypatch.setattr(verify_module, "_PIECE_BYTES", 1000)
    files = sorted(str(p) for p in tag.glob("*.pt"))
    pieces = verify_module._archive_crcs(files, 2, verify_module.job_share(str(checkpoint))[2])
    assert pieces == [check_archive(f) for f in files]
    assert pieces[files.index(str(victim))][2] is not None and "CRC-32" in pieces[files.index(str(victim))][2]


@pytest.mark.slow
def test_torchrun_processes_share_the_reading_with_the_same_report(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m zckpt verify`: each process checks its share of the
    records; the first prints the report one process prints, and every process exits alike."""
    import re

    from helpers import run_zckpt_torchrun

    checkpoint, tag = _copy(tmp_path, "z3_fp32_ws2_tied_frozen")
    for damaged in (False, True):
        if damaged:
            victim = sorted(tag.glob("*optim_states.pt"))[-1]
            info = max(data_records(victim), key=lambda i: i.file_size)
            flip(victim, record_start(victim, info) + info.file_size // 3)
        code, single = run_cli(str(checkpoint), "--scan")
        multi = run_zckpt_torchrun("verify", str(checkpoint), "--scan", check=False)
        assert multi.stdout == single, (multi.stdout, single)
        if not damaged:
            assert code == 0 and multi.returncode == 0, multi.stderr[-2000:]
        else:  # torchrun says each process's exit code
            assert code == 3 and re.findall(r"^\s*exitcode\s*:\s*(\d+)", multi.stderr, re.M) == ["3", "3"], (
                multi.stderr[-2000:]
            )
            assert f"problem: {victim}: record " in single and "fails its CRC-32 check" in single
