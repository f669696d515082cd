"""zckpt reshard for a run that offloads its optimizer to NVMe: ``offloaded_tensors/rankRR/``
written for M ranks, checked against facts DeepSpeed wrote.

* M = 2 (the sample's own world size and config): every file as DeepSpeed saved it. The optim
  and model files key for key and tensor for tensor (swapped sub-groups saved empty, with their
  ``ds_id`` attributes); the swap files byte for byte, except the ZeRO-3 per-param padding
  elements of rank 1, which DeepSpeed leaves holding what its optimizer made of uninitialised
  gradient padding (see ``_padding_positions``) and zckpt writes as zeros.
* M = 1, 3, 4: the swap files hold the live engine values (``live.safetensors``,
  ``live_optimizer.safetensors``) partitioned by DeepSpeed's ZeRO-3 rule, the swapped sub-groups
  being those DeepSpeed's rule picks (``_deepspeed_sub_groups`` below, an independent
  re-statement of ``stage3._create_fp16_sub_groups`` and ``OptimizerSwapper.is_swappable_tensor``,
  itself checked against the sample's own sub-groups here and against a live DeepSpeed engine
  in tests/test_interop/test_interop_reshard_nvme.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from helpers import ZERO3_PADDED, compare_trees, run_zckpt_torchrun, same_bits, sample, tag_files
from zckpt import inspect_path
from zckpt.deepspeed.reader import open_training_state
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal
from zckpt.torchfile import reader as torchfile

NAME = "z3_bf16_ws2_nvmeoffload_frozen_tied_groups"
CASE = sample(NAME)
MIN_SWAP_ELEMENTS = (1 << 20) // 4  # 1 MiB of fp32 (swap_tensor/utils.py MIN_AIO_BYTES, default aio block_size)
FILE_ALIGN_ELEMENTS = 1024 // 4  # AIO_ALIGNED_BYTES * intra_op_parallelism (1), in fp32 elements


def _param_groups() -> list[list[str]]:
    """The run's param groups, params in order: the sample's sub-groups (meta.json, from the
    engine) joined by the param group DeepSpeed's optim file lists them in."""
    optim = torchfile.load(next(p for n, p in tag_files(CASE.checkpoint).items() if "optim" in n))
    sub_groups = CASE.meta["fp32_sub_groups"]
    return [
        [name for i in group["params"] for name in sub_groups[i]["params"]]
        for group in optim["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]
    ]


def _numels() -> dict[str, int]:
    return {name: t.numel() for name, t in CASE.live().items()}


def _deepspeed_sub_groups(world_size: int, sub_group_size: int) -> list[dict]:
    """DeepSpeed 0.19.8's sub-groups at `world_size`: per param group, params in order, a
    sub-group closed once its per-rank share reaches `sub_group_size` (the whole group when it
    is smaller); swapped when its per-rank fp32 bytes reach 1 MiB."""
    numels, ids = _numels(), CASE.meta["ds_ids"]
    out = []
    for group in _param_groups():
        shares = [math.ceil(numels[n] / world_size) for n in group]
        cuts = [group] if sub_group_size >= sum(shares) else []
        if not cuts:
            current, filled = [], 0
            for position, (name, share) in enumerate(zip(group, shares)):
                current.append(name)
                filled += share
                if filled >= sub_group_size or position == len(group) - 1:
                    cuts.append(current)
                    current, filled = [], 0
        for params in cuts:
            numel = sum(math.ceil(numels[n] / world_size) for n in params)
            out.append(
                {
                    "params": params,
                    "partition_numel": numel,
                    "ds_id": f"{ids[params[0]]}_{ids[params[-1]]}",
                    "swapped_to_nvme": numel >= MIN_SWAP_ELEMENTS,
                }
            )
    return out


def _expected_partition(values: dict, params: list[str], rank: int, world_size: int) -> np.ndarray:
    """A rank's flat partition of a sub-group from full values: ZeRO-3 gives each rank
    ceil(numel / M) elements of every param (zeros past the end), concatenated."""
    parts = []
    for name in params:
        flat = values[name].float().reshape(-1).numpy()
        share = math.ceil(flat.size / world_size)
        padded = np.zeros(share * world_size, dtype=np.float32)
        padded[: flat.size] = flat
        parts.append(padded[rank * share : (rank + 1) * share])
    return np.concatenate(parts)


def _padding_positions(params: list[str], rank: int, world_size: int) -> np.ndarray:
    """Elements of a rank's partition that are ZeRO-3 per-param padding, not param values.

    DeepSpeed's reduce-scatter pads each gradient with ``torch.empty`` (runtime/comm/
    coalesced_collectives.py ``reduce_scatter_coalesced``), so the padding element of rank 1's
    share of an odd-sized param receives an uninitialised gradient, and AdamW turns it into
    non-zero moments and a non-zero master there. The engine never reads those elements back
    (a param is gathered and truncated to its numel), so zckpt writes zeros.
    """
    numels, positions, offset = _numels(), [], 0
    for name in params:
        share = math.ceil(numels[name] / world_size)
        real = max(0, min(share, numels[name] - rank * share))
        positions.extend(range(offset + real, offset + share))
        offset += share
    return np.array(positions, dtype=np.int64)


def _live_values() -> dict[str | None, dict]:
    """Full values per swap file kind: None (fp32 masters) and each Adam moment."""
    live, optim = CASE.live(), load_file(CASE.folder / "reference" / "live_optimizer.safetensors")
    out: dict[str | None, dict] = {None: live}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = {name[: -len(key) - 1]: t for name, t in optim.items() if name.endswith("." + key)}
    return out


def _swap_name(ds_id: str, key: str | None) -> str:
    return f"{key + '-' if key else ''}{ds_id}.tensor.swp"


def test_the_rule_restated_here_gives_the_samples_sub_groups() -> None:
    """The test's own statement of DeepSpeed's rule reproduces what the engine built (meta.json)."""
    sub_groups = _deepspeed_sub_groups(2, CASE.meta["sub_group_size"])
    assert sub_groups == [
        {k: g[k] for k in ("params", "partition_numel", "ds_id", "swapped_to_nvme")}
        for g in CASE.meta["fp32_sub_groups"]
    ]


def test_identity_reshard_rebuilds_deepspeeds_nvme_checkpoint(tmp_path: Path) -> None:
    """Same world size, the run's own config: every file DeepSpeed wrote, and nothing else."""
    out = tmp_path / "out"
    reshard(CASE.checkpoint, out, world_size=2)
    tag = CASE.meta["tag"]
    listing = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())  # noqa: E731
    assert listing(out / tag) == listing(CASE.checkpoint / tag)
    original, ours = tag_files(CASE.checkpoint), tag_files(out)
    padded = set(ZERO3_PADDED)
    with FileReader() as reader:
        for name in original:
            assert (
                compare_trees(torchfile.load(original[name]), torchfile.load(ours[name]), reader, padded=padded) == []
            ), name
    for group in CASE.meta["fp32_sub_groups"]:
        if not group["swapped_to_nvme"]:
            continue
        for rank in range(2):
            padding = _padding_positions(group["params"], rank, 2)
            for key in (None, "exp_avg", "exp_avg_sq"):
                relative = Path("offloaded_tensors") / f"rank{rank:02d}" / _swap_name(group["ds_id"], key)
                theirs = np.fromfile(CASE.checkpoint / tag / relative, dtype="<u4")
                mine = np.fromfile(out / tag / relative, dtype="<u4")
                assert mine.size == theirs.size == 1049600 // 4
                differ = np.flatnonzero(mine != theirs)
                assert set(differ) <= set(padding), (relative, differ[:5])
                assert not mine[padding].any(), relative  # zeros where DeepSpeed left garbage
                if rank == 1 and key is None:  # the documented case: the padding DeepSpeed saved is not all zero
                    assert differ.size > 0
                if rank == 0:
                    assert differ.size == 0 and padding.size == 0


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_swap_files_hold_the_live_values_at_other_world_sizes(world_size: int, tmp_path: Path) -> None:
    out = tmp_path / "out"
    reshard(CASE.checkpoint, out, world_size=world_size)
    tag_dir = out / CASE.meta["tag"]
    sub_groups = _deepspeed_sub_groups(world_size, CASE.meta["sub_group_size"])
    values = _live_values()
    expected_files = set()
    for flat, group in enumerate(sub_groups):
        for rank in range(world_size):
            optim = torchfile.load(tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")[
                "optimizer_state_dict"
            ]
            saved = optim["fp32_flat_groups"][flat]
            assert saved.attributes == {"ds_id": group["ds_id"]}
            state = optim["optimizer_state_dict"]["state"][flat]
            if not group["swapped_to_nvme"]:
                assert saved.shape == (group["partition_numel"],) and state["exp_avg"].shape == (
                    group["partition_numel"],
                )
                continue
            assert saved.shape == (0,) and state["step"].shape == ()
            for key in ("exp_avg", "exp_avg_sq"):
                assert state[key].shape == (0,) and state[key].attributes == {"ds_id": f"{key}-{group['ds_id']}"}
            for key, full in values.items():
                relative = f"offloaded_tensors/rank{rank:02d}/{_swap_name(group['ds_id'], key)}"
                expected_files.add(relative)
                data = np.fromfile(tag_dir / relative, dtype="<f4")
                numel = group["partition_numel"]
                assert data.size == math.ceil(numel / FILE_ALIGN_ELEMENTS) * FILE_ALIGN_ELEMENTS
                expected = _expected_partition(full, group["params"], rank, world_size)
                assert np.array_equal(data[:numel].view("<u4"), expected.view("<u4")), relative
                assert not data[numel:].view("<u4").any(), relative
    written = {str(p.relative_to(tag_dir)) for p in (tag_dir / "offloaded_tensors").rglob("*") if p.is_file()}
    assert written == expected_files
    # every rank's folder exists, empty or not: DeepSpeed saves its swap folder whole and copies
    # offloaded_tensors/rankRR/ back on load, failing where it is missing
    assert sorted(p.name for p in (tag_dir / "offloaded_tensors").iterdir()) == [
        f"rank{r:02d}" for r in range(world_size)
    ]
    # which sub-groups swap depends on the world size: at 1 rank the first decay sub-group only
    # (fc2.weight alone stays under 1 MiB); at 3 and 4 ranks every partition is too small
    assert [g["swapped_to_nvme"] for g in sub_groups] == (
        [True, False, False, False] if world_size == 1 else [False] * len(sub_groups)
    )


@pytest.mark.parametrize("world_size", [1, 3])
def test_nvme_output_reads_back_as_the_live_state(world_size: int, tmp_path: Path) -> None:
    """zckpt's own reader sees the written checkpoint as NVMe-offloaded with the live values."""
    reshard(CASE.checkpoint, tmp_path / "out", world_size=world_size)
    state = open_training_state(tmp_path / "out")
    assert (state.index.world_size, state.index.zero_stage, state.index.offload) == (world_size, 3, "nvme")
    report = inspect_path(str(tmp_path / "out"))
    assert report["complete"] and (report["offload"], report["world_size"]) == ("nvme", world_size)
    live, values = CASE.live(), _live_values()
    original = open_training_state(CASE.checkpoint)
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(read_tensor(reader, param.master), live[param.name].float()), param.name
            for key, source in param.states.items():
                assert same_bits(read_tensor(reader, source), values[key][param.name]), (param.name, key)
        for before, after in zip(original.groups, state.groups):
            assert (
                read_tensor(reader, before.scalars["step"].tensor).item()
                == read_tensor(reader, after.scalars["step"].tensor).item()
            )


def test_larger_aio_block_size_keeps_sub_groups_in_memory(tmp_path: Path) -> None:
    """aio.block_size raises the swap threshold: 2 MiB leaves the 1 MiB sub-group in the optim files."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"aio": {"block_size": 2 << 20}}))
    reshard(CASE.checkpoint, tmp_path / "out", world_size=2, config=config)
    tag_dir = tmp_path / "out" / CASE.meta["tag"]
    assert [list(p.iterdir()) for p in sorted((tag_dir / "offloaded_tensors").iterdir())] == [[], []]
    optim = torchfile.load(tag_dir / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert [t.shape for t in optim["fp32_flat_groups"]] == [(262176,), (158,), (6318,)]


def test_intra_op_parallelism_widens_the_file_alignment(tmp_path: Path) -> None:
    """Swap files are padded to AIO_ALIGNED_BYTES (1024) times aio.intra_op_parallelism."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"aio": {"intra_op_parallelism": 3}}))
    reshard(CASE.checkpoint, tmp_path / "out", world_size=2, config=config)
    swap = tmp_path / "out" / CASE.meta["tag"] / "offloaded_tensors" / "rank01" / "0_7.tensor.swp"
    assert swap.stat().st_size == math.ceil(262176 * 4 / 3072) * 3072


def test_stage_1_and_2_targets_get_plain_files(tmp_path: Path) -> None:
    """ZeRO-1/2 optimizers do not swap ("nvme" means CPU offload there): no offloaded_tensors/."""
    reshard(CASE.checkpoint, tmp_path / "out", world_size=3, stage=2)
    assert not list((tmp_path / "out").rglob("offloaded_tensors"))
    state = open_training_state(tmp_path / "out")
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(read_tensor(reader, param.master), CASE.live()[param.name].float()), param.name


def test_inspect_and_to_universal_read_the_nvme_sample(tmp_path: Path) -> None:
    report = inspect_path(str(CASE.checkpoint))
    assert report["complete"] and report["offload"] == "nvme" and report["world_size"] == 2
    to_universal(CASE.checkpoint, tmp_path / "uc")
    state = open_training_state(tmp_path / "uc")
    values = _live_values()
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(
                read_tensor(reader, param.master).reshape(-1), CASE.live()[param.name].float().reshape(-1)
            ), param.name
            for key, source in param.states.items():
                assert same_bits(read_tensor(reader, source).reshape(-1), values[key][param.name].reshape(-1)), (
                    param.name,
                    key,
                )


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_plain_input_gets_swap_files_for_an_nvme_target(stage: int, tmp_path: Path) -> None:
    """NVMe -> plain files at 3 ranks (ZeRO-3 with CPU offload, or ZeRO-2) -> ZeRO-3 with NVMe
    (--config, 1 rank): the swap files equal those of the direct reshard byte for byte; the
    optim files hold the same tensors."""
    cpu = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    reshard(CASE.checkpoint, tmp_path / "plain", world_size=3, stage=stage, config=cpu)
    assert not list((tmp_path / "plain").rglob("*.swp"))
    nvme = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": CASE.meta["ds_config"]["zero_optimization"]["offload_optimizer"],
        }
    }
    reshard(tmp_path / "plain", tmp_path / "back", world_size=1, config=nvme)
    reshard(CASE.checkpoint, tmp_path / "direct", world_size=1)
    tag = CASE.meta["tag"]
    swaps = lambda root: {str(p.relative_to(root)): p.read_bytes() for p in (root / tag).rglob("*.swp")}  # noqa: E731
    assert swaps(tmp_path / "back") == swaps(tmp_path / "direct") != {}
    with FileReader() as reader:
        a = torchfile.load(tmp_path / "direct" / tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")[
            "optimizer_state_dict"
        ]
        b = torchfile.load(tmp_path / "back" / tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")[
            "optimizer_state_dict"
        ]
        assert compare_trees(a, b, reader) == []


@pytest.mark.slow
def test_torchrun_processes_write_the_swap_files_byte_identically(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m zckpt reshard ...` to an NVMe target: the processes split
    swap files and pickles between them; the result equals the single-process run, empty rank
    folders included."""
    reshard(CASE.checkpoint, tmp_path / "single", world_size=1)
    run_zckpt_torchrun("reshard", str(CASE.checkpoint), str(tmp_path / "multi"), "-w", "1")
    tree = lambda root: {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}  # noqa: E731
    single, multi = tree(tmp_path / "single"), tree(tmp_path / "multi")
    assert single == multi and any(name.endswith(".swp") for name in single)


@pytest.mark.slow
def test_truncated_swap_file_leaves_no_output(copy_checkpoint, tmp_path: Path) -> None:
    """A damaged input swap file: one line naming it, exit 1, no output folder."""
    import subprocess
    import sys

    ckpt = copy_checkpoint(NAME)
    swap = ckpt / CASE.meta["tag"] / "offloaded_tensors" / "rank01" / "exp_avg-0_7.tensor.swp"
    swap.write_bytes(swap.read_bytes()[:4096])
    result = subprocess.run(
        [sys.executable, "-m", "zckpt", "reshard", str(ckpt), str(tmp_path / "out"), "-w", "1"],
        capture_output=True,
        text=True,
    )
    lines = result.stderr.strip().splitlines()
    assert (
        result.returncode == 1
        and len(lines) == 1
        and "rank01/exp_avg-0_7.tensor.swp" in lines[0]
        and "truncated" in lines[0]
    ), result.stderr
    assert not (tmp_path / "out").exists()
