"""Live ZeRO-Infinity swap folders: the newest state of a run recovered from ``<nvme_path>``.

The truth is the sample `z3_bf16_ws2_nvme_live_swap`: real DeepSpeed (optimizer and params on
NVMe) saved `checkpoint/` after step 3, trained 2 more steps, then its live swap folder was
copied into `live_swap/` and the engine's fp32 masters, Adam moments and gathered 16-bit params
dumped into `live_swap_reference/` at the same moment. Sub-groups under DeepSpeed's swap
threshold never reach the swap folder: their truth is the engine's values at the checkpoint
(`reference/`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import one_line, run_cli, same_bits, sample
from zckpt.core.errors import CheckpointNotFoundError, CorruptFileError, LayoutError, UsageError
from zckpt.deepspeed.reader import survey
from zckpt.ops import api
from zckpt.ops.consolidate import consolidate
from zckpt.ops.inspect import inspect_path
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal
from zckpt.ops.verify import verify

CASE = sample("z3_bf16_ws2_nvme_live_swap")
CKPT = CASE.checkpoint
LIVE_SWAP = CASE.folder / "live_swap"
TRUTH = CASE.folder / "live_swap_reference"
SWAPPED = [n for g in CASE.meta["fp32_sub_groups"] if g["swapped_to_nvme"] for n in g["params"]]
IN_MEMORY = [n for g in CASE.meta["fp32_sub_groups"] if not g["swapped_to_nvme"] for n in g["params"]]
TIED = CASE.meta["tied"]  # alias -> source


def _live() -> dict[str, torch.Tensor]:
    return load_file(TRUTH / "live.safetensors")


def _live_optimizer() -> dict[str, torch.Tensor]:
    return load_file(TRUTH / "live_optimizer.safetensors")


def _at_checkpoint() -> dict[str, torch.Tensor]:
    return CASE.live()


def _at_checkpoint_optimizer() -> dict[str, torch.Tensor]:
    return load_file(CASE.folder / "reference" / "live_optimizer.safetensors")


def _expected_fp32(name: str) -> torch.Tensor:
    """The newest value zckpt can know: the engine's at the copy for swapped params (and aliases
    of them), the engine's at the checkpoint for everything that never reaches the swap folder."""
    source = TIED.get(name, name)
    return (_live() if source in SWAPPED else _at_checkpoint())[name].float()


@pytest.fixture
def swap_copy(tmp_path: Path):
    """A copy of the sample's live swap folder that a test may damage."""
    target = tmp_path / "nvme"
    shutil.copytree(LIVE_SWAP, target)
    return target


def test_the_sample_is_mixed_and_moved_on() -> None:
    """The sample exercises what matters: swapped and in-memory sub-groups, 16-bit param swaps,
    gradient files, and masters that moved since the checkpoint."""
    assert SWAPPED and IN_MEMORY and CASE.meta["frozen"] and TIED
    files = CASE.meta["live_swap"]["files"]
    assert any("params/" in f for f in files) and any("_gradient_" in f for f in files)
    live, old = _live(), _at_checkpoint()
    assert all(not torch.equal(live[n], old[n]) for n in SWAPPED)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_consolidate_gives_the_engines_masters_at_the_copy(dtype: str, tmp_path: Path) -> None:
    consolidate(CKPT, tmp_path / "out", swap_folder=LIVE_SWAP, dtype=dtype)
    out = load_file(tmp_path / "out" / "model.safetensors")
    live, old = _live(), _at_checkpoint()
    assert set(out) == set(live)
    for name, value in out.items():
        if not value.is_floating_point():  # integer buffers
            assert torch.equal(value, old[name]), name
            continue
        expected = _expected_fp32(name) if name not in CASE.meta["buffers"] else old[name].float()
        if dtype == "bf16":
            expected = expected.to(torch.bfloat16)  # torch's round to nearest even
        assert same_bits(value, expected), name


def test_api_reads_the_live_optimizer_states() -> None:
    optim, optim_old = _live_optimizer(), _at_checkpoint_optimizer()
    seen = set()
    for name, value in api.iter_tensors(CKPT, swap_folder=LIVE_SWAP, states=True):
        if name.endswith((".exp_avg", ".exp_avg_sq")):
            param = name.rsplit(".", 1)[0]
            truth = (optim if param in SWAPPED else optim_old)[name]
            assert same_bits(value, truth), name
            seen.add(param)
    assert seen == set(SWAPPED) | set(IN_MEMORY)


def test_to_universal_writes_the_live_state(tmp_path: Path) -> None:
    to_universal(CKPT, tmp_path / "uc", swap_folder=LIVE_SWAP)
    folder = tmp_path / "uc" / (CKPT / "latest").read_text().strip()
    folder = folder.with_name(folder.name + "_universal")
    live, optim = _live(), _live_optimizer()
    for name in SWAPPED:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            value = torch.load(folder / "zero" / name / f"{state}.pt", weights_only=True)
            truth = live[name] if state == "fp32" else optim[f"{name}.{state}"]
            assert same_bits(value.reshape(truth.shape), truth.float()), (name, state)


def test_reshard_to_three_ranks_carries_the_live_state(tmp_path: Path) -> None:
    """Read back with zckpt (its reader matches DeepSpeed's own files, test_reshard) and with
    DeepSpeed's raw partition math: every Adam moment equals the engine's at the copy."""
    out = tmp_path / "ws3"
    reshard(
        CKPT,
        out,
        world_size=3,
        swap_folder=LIVE_SWAP,
        config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
    )
    live, optim = _live(), _live_optimizer()
    optim_old = _at_checkpoint_optimizer()
    got = dict(api.iter_tensors(out, states=True))
    for name in SWAPPED + IN_MEMORY:
        for state in ("exp_avg", "exp_avg_sq"):
            truth = (optim if name in SWAPPED else optim_old)[f"{name}.{state}"]
            assert same_bits(got[f"{name}.{state}"], truth), (name, state)
    for name in SWAPPED:
        assert same_bits(got[name], live[name].float()), name


def test_without_the_swap_folder_the_checkpoint_is_read() -> None:
    """The same checkpoint alone gives the values of the save (the swap folder is the only source
    of the newer ones)."""
    state = dict(api.iter_tensors(CKPT))
    old = _at_checkpoint()
    assert all(same_bits(state[n], old[n].float()) for n in SWAPPED)


def test_notes_say_where_data_came_from() -> None:
    found = survey(CKPT, None, LIVE_SWAP)
    assert found.complete and found.swap is not None
    notes = "\n".join(found.index.notes)
    assert "2 swapped sub-group(s) read from the live swap folder" in notes
    assert f"{len(IN_MEMORY)} param(s)" in notes and "may be older" in notes
    assert "Adam steps" in notes and "step 3" in notes


def _independent_16bit_differences() -> tuple[int, int]:
    """Differing elements between the 16-bit param swaps and the engine's masters rounded by
    torch, read with numpy at DeepSpeed's per-rank share ceil(numel / world)."""
    live, ids, world = _live(), CASE.meta["ds_ids"], CASE.meta["world_size"]
    differing = elements = 0
    for name in SWAPPED:
        share = -(-live[name].numel() // world)
        parts = []
        for rank in range(world):
            path = LIVE_SWAP / "zero_stage_3" / "bfloat16params" / f"rank{rank}" / f"{ids[name]}_param.tensor.swp"
            if not path.exists():
                break
            parts.append(torch.from_numpy(np.fromfile(path, dtype=np.int16)[:share].copy()).view(torch.bfloat16))
        if len(parts) != world:
            continue
        stored = torch.cat(parts)[: live[name].numel()]
        rounded = live[name].reshape(-1).to(torch.bfloat16)
        differing += int((stored.view(torch.int16) != rounded.view(torch.int16)).sum())
        elements += live[name].numel()
    return differing, elements


def test_inspect_names_every_file_and_counts_16bit_disagreement() -> None:
    report = inspect_path(LIVE_SWAP, checkpoint=CKPT)
    assert report["kind"] == "swap_folder" and report["complete"], report["problems"]
    on_disk = sorted(p for p in (LIVE_SWAP / "zero_stage_3").rglob("*") if p.is_file())
    assert report["total_bytes"] == sum(p.stat().st_size for p in on_disk)
    listed = {(r["rank"], r["folder"], r["name"]): r for rank in report["ranks"] for r in rank["files"]}
    assert len(listed) == len(on_disk) == len(CASE.meta["live_swap"]["files"])
    assert len(report["gradient_files"]) == sum("_gradient_" in f for f in CASE.meta["live_swap"]["files"])
    fc2 = listed[(0, "optimizer", "exp_avg-7_7.tensor.swp")]
    assert fc2["holds"] == "exp_avg of sub-group 1 (fc2.weight)"
    assert listed[(1, "bfloat16params", "3_param.tensor.swp")]["holds"] == "16-bit partition of fc1.weight"
    assert [g["swapped"] for g in report["sub_groups"]] == [g["swapped_to_nvme"] for g in CASE.meta["fp32_sub_groups"]]
    differing, elements = _independent_16bit_differences()
    assert report["agreement_16bit"]["differing"] == differing and report["agreement_16bit"]["elements"] == elements
    assert "no checksum" in report["checksums"]


def test_inspect_without_checkpoint_shows_ids(tmp_path: Path) -> None:
    result = run_cli("inspect", LIVE_SWAP / "zero_stage_3", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = [r for rank in report["ranks"] for r in rank["files"]]
    assert {r["holds"] for r in rows if r["name"] == "3_param.tensor.swp"} == {"16-bit partition of param ds_id 3"}
    assert report["sub_groups"] == [] and report["agreement_16bit"] is None


@pytest.mark.slow
def test_verify_passes_and_says_swap_files_have_no_crc(tmp_path: Path) -> None:
    result = run_cli("verify", CKPT, "--swap-folder", LIVE_SWAP, "--scan", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no checksum" in result.stdout and "ok   layout" in result.stdout and "ok   values" in result.stdout
    assert "16-bit param swaps" in result.stdout


def test_verify_fails_on_a_truncated_swap_file(swap_copy: Path, tmp_path: Path) -> None:
    victim = swap_copy / "zero_stage_3" / "optimizer" / "rank1" / "exp_avg_sq-0_3.tensor.swp"
    victim.write_bytes(victim.read_bytes()[:1000])
    report = verify(swap_copy, checkpoint=CKPT)
    assert not report.ok
    assert any(str(victim) in p and "truncated" in p for p in report.problems), report.problems
    assert any(str(victim) in p for p in report.problems if "rank 0's has" in p)  # the no-checkpoint check too


def test_verify_scan_finds_nan(swap_copy: Path) -> None:
    victim = swap_copy / "zero_stage_3" / "optimizer" / "rank0" / "7_7.tensor.swp"
    data = bytearray(victim.read_bytes())
    data[400:404] = np.array([np.nan], dtype=np.float32).tobytes()
    victim.write_bytes(bytes(data))
    report = verify(swap_copy, checkpoint=CKPT, scan=True)
    assert any("fc2.weight holds 1 NaN/Inf" in p for p in report.problems), report.problems


# --- refusals: one line naming the file, exit 1, no output -----------------------------------


def _refused(tmp_path: Path, swap: Path, checkpoint: Path = CKPT) -> str:
    out = tmp_path / "out"
    result = run_cli("consolidate", checkpoint, out, "--swap-folder", swap, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert not out.exists() or not any(out.iterdir())
    return one_line(result)


@pytest.mark.slow
def test_refuses_a_missing_file(swap_copy: Path, tmp_path: Path) -> None:
    victim = swap_copy / "zero_stage_3" / "optimizer" / "rank0" / "exp_avg-7_7.tensor.swp"
    victim.unlink()
    line = _refused(tmp_path, swap_copy)
    assert str(victim) in line and "missing" in line


@pytest.mark.slow
def test_refuses_a_short_file(swap_copy: Path, tmp_path: Path) -> None:
    victim = swap_copy / "zero_stage_3" / "optimizer" / "rank1" / "0_3.tensor.swp"
    victim.write_bytes(victim.read_bytes()[:4096])
    line = _refused(tmp_path, swap_copy)
    assert str(victim) in line and "truncated" in line


@pytest.mark.slow
def test_refuses_another_world_size(swap_copy: Path, tmp_path: Path) -> None:
    optimizer = swap_copy / "zero_stage_3" / "optimizer"
    shutil.copytree(optimizer / "rank1", optimizer / "rank2")
    line = _refused(tmp_path, swap_copy)
    assert "ranks 0, 1, 2" in line and "saved by 2 ranks" in line


@pytest.mark.slow
def test_refuses_a_longer_file(swap_copy: Path, tmp_path: Path) -> None:
    victim = swap_copy / "zero_stage_3" / "optimizer" / "rank0" / "7_7.tensor.swp"
    victim.write_bytes(victim.read_bytes() + bytes(4096))
    line = _refused(tmp_path, swap_copy)
    assert str(victim) in line and "another run" in line


def test_refuses_a_foreign_sub_group_file(swap_copy: Path, tmp_path: Path) -> None:
    folder = swap_copy / "zero_stage_3" / "optimizer" / "rank0"
    shutil.copyfile(folder / "7_7.tensor.swp", folder / "9_12.tensor.swp")
    line = _refused(tmp_path, swap_copy)
    assert "9_12.tensor.swp" in line and "not in the checkpoint's layout" in line


def test_refuses_the_swap_folder_of_another_run(tmp_path: Path) -> None:
    """The other NVMe sample's checkpoint: other sub-groups, other sizes."""
    other = sample("z3_bf16_ws2_nvmeoffload_frozen_tied_groups").checkpoint
    line = _refused(tmp_path, LIVE_SWAP, other)
    assert (
        "live_swap" in line
        and "missing" in line
        and "it holds sub-groups 0_3, 7_7: the swap folder of another run" in line
    )


@pytest.mark.slow
def test_refuses_a_checkpoint_without_nvme_offload(tmp_path: Path) -> None:
    line = _refused(tmp_path, LIVE_SWAP, sample("z3_bf16_ws3_subgroups_groups").checkpoint)
    assert "without offload_optimizer on NVMe" in line


def test_refuses_a_folder_that_is_no_swap_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="not a DeepSpeed swap folder"):
        survey(CKPT, None, CKPT)


def test_library_errors_are_of_the_error_family(swap_copy: Path) -> None:
    (swap_copy / "zero_stage_3" / "optimizer" / "rank0" / "0_3.tensor.swp").write_bytes(b"\0" * 8)
    with pytest.raises(CorruptFileError):
        consolidate(CKPT, swap_copy.parent / "out", swap_folder=swap_copy)
    shutil.rmtree(swap_copy / "zero_stage_3" / "optimizer" / "rank1")
    with pytest.raises(LayoutError):
        consolidate(CKPT, swap_copy.parent / "out", swap_folder=swap_copy)


@pytest.mark.slow
def test_cli_usage_errors(tmp_path: Path) -> None:
    result = run_cli("inspect", CKPT, "--checkpoint", CKPT, cwd=tmp_path)
    assert result.returncode == 2 and "--checkpoint goes with a swap folder" in one_line(result)
    with pytest.raises(UsageError):
        verify(LIVE_SWAP, checkpoint=CKPT, swap_folder=LIVE_SWAP)
