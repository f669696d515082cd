"""scripts/same_outputs.py, the refactor proof: what it hashes, what it masks, and that a one-byte
change of a message between two trees is reported (exit 1) while everything else compares equal."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("same_outputs_script", ROOT / "scripts" / "same_outputs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_manifest_has_paths_modes_empty_folders_and_links(script, tmp_path: Path) -> None:
    (tmp_path / "a" / "empty").mkdir(parents=True)
    (tmp_path / "a" / "f.bin").write_bytes(b"\x00\x01")
    (tmp_path / "link").symlink_to("a/f.bin")
    manifest = script.tree_manifest(tmp_path)
    assert set(manifest) == {"a/", "a/empty/", "a/f.bin", "link"}
    assert manifest["link"] == "link a/f.bin" and manifest["a/empty/"].startswith("dir ")
    before = manifest["a/f.bin"]
    (tmp_path / "a" / "f.bin").write_bytes(b"\x00\x02")
    assert script.tree_manifest(tmp_path)["a/f.bin"] != before


def test_normalise_masks_side_folders_and_the_measured_rate_only(script, tmp_path: Path) -> None:
    side = script.Side("before", "test", tmp_path / "side")
    run_dir = side.runs / "r"
    text = f"wrote {run_dir}/out from {side.tree}/sample_ckpts in {side.root}/tmp\nstep 2  loss 4.5604  lr 1.000e-03  tokens/s 1,141  saved global_step2\n"
    assert script.normalise(text, side.replacements(run_dir)) == (
        "wrote <RUN>/out from <TREE>/sample_ckpts in <SIDE>/tmp\nstep 2  loss 4.5604  lr 1.000e-03  tokens/s <rate>  saved global_step2\n"
    )


def test_compare_counts_and_names_each_difference(script) -> None:
    def result(stderr: str, digest: str) -> object:
        return script.RunResult(
            "consolidate.x",
            "consolidate",
            [script.CommandResult(["zckpt", "consolidate"], 1, "", stderr, 0.1)],
            {"out/": "dir 755", "out/model.safetensors": f"file 644 {digest}"},
            0.1,
        )

    same, counts = script.compare({"consolidate.x": result("e\n", "aa")}, {"consolidate.x": result("e\n", "aa")})
    assert same == [] and counts["consolidate"] == {"runs": 1, "files": 2, "consoles": 1, "identical": 3}
    differences, counts = script.compare({"consolidate.x": result("e\n", "aa")}, {"consolidate.x": result("E\n", "ab")})
    assert [d.entry for d in differences] == ["<command 1: exit, stdout, stderr>", "out/model.safetensors"]
    assert "-e" in differences[0].detail and "+E" in differences[0].detail
    assert counts["consolidate"]["differing"] == 2


def test_flip_byte_changes_one_byte_inside_the_record(script, tmp_path: Path) -> None:
    source = (
        ROOT
        / "sample_ckpts"
        / "z2_fp32_ws1"
        / "checkpoint"
        / "global_step3"
        / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
    shutil.copyfile(source, tmp_path / "f.pt")
    script.FlipByte("f.pt", "data/3").apply(tmp_path)
    old, new = source.read_bytes(), (tmp_path / "f.pt").read_bytes()
    assert len(old) == len(new) and sum(a != b for a, b in zip(old, new)) == 1
    with zipfile.ZipFile(tmp_path / "f.pt") as archive:
        assert archive.testzip() == "zero_pp_rank_0_mp_rank_00_optim_states/data/3"


def test_run_list_covers_every_sample_with_unique_names(script) -> None:
    samples = script.find_samples(ROOT / "sample_ckpts")
    runs = script.build_runs(samples, quick=False, only=None)
    names = {run.name for run in runs}
    assert len(names) == len(runs)
    for sample in samples:
        assert {
            f"consolidate.{sample.name}.fp32",
            f"reshard.{sample.name}.w4.s3",
            f"to-universal.{sample.name}.default",
        } <= names
    assert {
        "peft.peft_lora.llama_z3_bf16_ws2.merge",
        "consolidate.z3_bf16_ws2_nvme_live_swap.swap-folder",
        "train.fp32-ws2",
    } <= names
    assert runs[0].heavy and len(script.build_runs(samples, quick=True, only=None)) < len(runs) / 2


@pytest.mark.heavy
@pytest.mark.slow
def test_a_one_byte_message_change_is_reported(script, tmp_path: Path, capsys) -> None:
    """Two folder trees (the package and an empty sample_ckpts), one help line changed by a byte."""
    for name in ("before", "after"):
        shutil.copytree(ROOT / "zckpt", tmp_path / name / "zckpt", ignore=shutil.ignore_patterns("__pycache__"))
        (tmp_path / name / "sample_ckpts").mkdir()
    cli = tmp_path / "after" / "zckpt" / "cli" / "consolidate.py"
    text = cli.read_text()
    assert text.count("Leave out params that were frozen") == 1
    cli.write_text(text.replace("Leave out params that were frozen", "Leave out params that were Frozen"))
    code = script.main(
        [
            "--before",
            str(tmp_path / "before"),
            "--after",
            str(tmp_path / "after"),
            "--work",
            str(tmp_path / "work"),
            "--only",
            "^help$",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert (
        "DIFFERENT: 1 entries in 1 run(s)" in out
        and "help: <command 5: exit, stdout, stderr>" in out
        and "params that were Frozen" in out
    )
    assert not (tmp_path / "work" / "before").exists()  # removed without --keep
