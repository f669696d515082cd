"""Topology (issue 18): rank files keyed by their coordinates (pipeline, tensor, expert, data),
every DeepSpeed rank-file name recognised, and checkpoints of a pipeline, tensor or expert
parallel layout refused by the inventory in one line naming the layout and a file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, sample
from zckpt.core.errors import CorruptFileError, LayoutError
from zckpt.core.topology import RankCoords, Topology
from zckpt.deepspeed import dp_reader
from zckpt.deepspeed import names as N
from zckpt.deepspeed.layout import LayoutParam, zero3_layout, zero12_layout
from zckpt.deepspeed.rank_files import parse_rank_file, scan_rank_files
from zckpt.deepspeed.reader import open_checkpoint, survey

ZERO3 = "z3_fp32_ws2_tied_frozen"
ZERO2 = "z2_fp32_ws2_twotags"
REFUSED = "zckpt reads data-, pipeline- and tensor-parallel ZeRO checkpoints and mixture-of-experts ZeRO-1/2 checkpoints only (experts beside pipeline stages or tensor ranks, and ZeRO-0 experts, are not supported yet)"


# --- names -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, kind, coords, layer",
    [
        ("mp_rank_00_model_states.pt", "model", RankCoords(), None),
        ("zero_pp_rank_3_mp_rank_00_model_states.pt", "model", RankCoords(0, 0, 0, 3), None),
        ("zero_pp_rank_12_mp_rank_00_optim_states.pt", "optim", RankCoords(0, 0, 0, 12), None),
        ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "optim", RankCoords(0, 0, 0, 1), None),
        ("mp_rank_01_model_states.pt", "model", RankCoords(0, 1, 0, 0), None),
        ("zero_pp_rank_2_mp_rank_03_optim_states.pt", "optim", RankCoords(0, 3, 0, 2), None),
        ("layer_01-model_states.pt", "layer", RankCoords(), 1),
        ("layer_07-model_01-model_states.pt", "layer", RankCoords(0, 1, 0, 0), 7),
        ("layer_0_expert_1_mp_rank_00_model_states.pt", "expert", RankCoords(0, 0, 1, 0), 0),
        ("expert_5_mp_rank_02_model_states.pt", "expert", RankCoords(0, 2, 5, 0), None),
        ("expp_rank_1_mp_rank_00_optim_states.pt", "expert_optim", RankCoords(0, 0, 1, 0), None),
    ],
)
def test_rank_file_names_are_parsed(name: str, kind: str, coords: RankCoords, layer: int | None) -> None:
    found = parse_rank_file(os.path.join("tag", name))
    assert found is not None and (found.kind, found.coords, found.layer) == (kind, coords, layer)
    assert found.data_parallel == (kind in ("model", "optim") and coords.tensor == 0)


@pytest.mark.parametrize(
    "name",
    [
        "latest",
        "mp_rank_00_model_states.pt.tmp",
        "layer_01-model-model_states.pt",
        "zero_to_fp32.py",
        "expp_rank_x_mp_rank_00_optim_states.pt",
    ],
)
def test_other_names_are_no_rank_files(name: str) -> None:
    assert parse_rank_file(name) is None


def test_file_names_round_trip() -> None:
    assert N.LAYER_STATES_RE.match(N.layer_states_name(1))["layer"] == "01"
    assert N.LAYER_STATES_RE.match(N.layer_states_name(12, 1))["tp"] == "01"
    assert parse_rank_file(N.optim_states_name(4, bf16=True)).coords == RankCoords.dp(4)
    assert parse_rank_file(N.model_states_name(3, 2)).coords == RankCoords.dp(2)


# --- core types --------------------------------------------------------------------------------
def test_topology() -> None:
    topology = Topology.data_parallel(4)
    assert (topology.pp, topology.tp, topology.ep, topology.dp) == (1, 1, 1, 4)
    assert topology.data_parallel_only and topology.world_size == 4
    assert list(topology.data_ranks()) == [RankCoords(0, 0, 0, r) for r in range(4)]
    assert Topology(pp=2, tp=2, dp=3).world_size == 12 and not Topology(ep=2).data_parallel_only
    with pytest.raises(ValueError):
        Topology(dp=-1)


def test_index_has_the_data_parallel_topology() -> None:
    index = open_checkpoint(sample(ZERO3).checkpoint)
    assert index.topology == Topology.data_parallel(index.world_size) == Topology(1, 1, 1, 2)
    files = scan_rank_files(index.tag_dir, "tag folder")
    assert files.topology == Topology(1, 1, 1, 2) and files.fatal is None
    assert {f.coords for f in files.files} == {RankCoords.dp(0), RankCoords.dp(1)}


def test_flat_groups_carry_their_partition_count_and_ranks() -> None:
    params = [[LayoutParam("a", 5, 0), LayoutParam("b", 4, 0)], [LayoutParam("c", 3, 1)]]
    for layout in (zero12_layout(params, 3, partition_counts=[3, 3]), zero3_layout(params, 3, 10**9)):
        assert [(g.partition_count, g.ranks) for g in layout.flat_groups] == [(3, (0, 1, 2))] * len(layout.flat_groups)
    with pytest.raises(ValueError, match="each group must span every rank"):
        zero12_layout(params, 3, partition_counts=[3, 2])


# --- refusals ----------------------------------------------------------------------------------
def _with_files(tmp_path: Path, name: str, copies: dict[str, str]) -> Path:
    """A copy of sample `name`'s checkpoint with files of its tag folder copied to new names."""
    checkpoint = tmp_path / name
    shutil.copytree(sample(name).checkpoint, checkpoint)
    tag = checkpoint / (checkpoint / "latest").read_text().strip()
    for new, old in copies.items():
        shutil.copy(tag / old, tag / new)
    return checkpoint


Z2_MODEL, Z2_OPTIM = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"
Z3_MODEL, Z3_OPTIM = "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"
CASES = {
    "expert-optim": (
        ZERO2,
        {"expp_rank_1_mp_rank_00_optim_states.pt": Z2_OPTIM},
        ["mixture-of-experts", "expp_rank_1_mp_rank_00_optim_states.pt"],
    ),
    "pipeline-expert": (
        ZERO2,
        {"layer_01-model_states.pt": Z2_MODEL, "expert_0_mp_rank_00_model_states.pt": Z2_MODEL},
        [
            "a pipeline-parallel and mixture-of-experts (expert-parallel) checkpoint (1 stage; 1 layer file: layer_01-model_states.pt; 1 expert file: expert_0_mp_rank_00_model_states.pt)"
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_other_layouts_are_refused_in_one_line(tmp_path: Path, case: str) -> None:
    name, copies, expected = CASES[case]
    checkpoint = _with_files(tmp_path, name, copies)
    found = survey(checkpoint)
    assert len(found.problems) == 1 and found.index is None and found.state is None
    problem = found.problems[0]
    assert isinstance(problem, LayoutError) and problem.path == found.location.tag_dir
    for text in expected + [REFUSED]:
        assert text in str(problem), str(problem)
    with pytest.raises(LayoutError, match="not supported yet"):
        open_checkpoint(checkpoint)


@pytest.mark.parametrize(
    "name, copies, expected",
    [
        (
            ZERO2,
            {"mp_rank_01_model_states.pt": Z2_MODEL, "zero_pp_rank_0_mp_rank_01_optim_states.pt": Z2_OPTIM},
            "a tensor-parallel checkpoint (2 tensor ranks) that does not say how its shards merge: it records no "
            "universal_checkpoint_info",
        ),
        (
            ZERO3,
            {"zero_pp_rank_0_mp_rank_01_optim_states.pt": Z3_OPTIM},
            "zero_pp_rank_0_mp_rank_01_model_states.pt: missing (tensor rank 1 of 2)",
        ),
    ],
    ids=["no-merge-rules", "zero3-missing-rank"],
)
def test_tensor_parallel_files_zckpt_cannot_merge_are_refused(
    tmp_path: Path, name: str, copies: dict[str, str], expected: str
) -> None:
    """mp_rank > 0 files beside a data-parallel run's: read as tensor ranks, and refused in one line
    that says what is missing rather than merged by a guess."""
    checkpoint = _with_files(tmp_path, name, copies)
    found = survey(checkpoint)
    assert found.index is None and found.problems
    assert any(expected in str(p) for p in found.problems), [str(p) for p in found.problems]


def test_expert_files_beside_zero3_files_are_refused(tmp_path: Path) -> None:
    checkpoint = _with_files(tmp_path, ZERO3, {"layer_0_expert_1_mp_rank_00_model_states.pt": Z3_MODEL})
    found = survey(checkpoint)
    assert len(found.problems) == 1 and found.index is None
    assert "expert files (layer_0_expert_1_mp_rank_00_model_states.pt ...) beside ZeRO-3 files" in str(
        found.problems[0]
    )


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ZCKPT_DEBUG"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "zckpt", *map(str, args)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_inspect_and_consolidate_refuse_a_layout_they_do_not_read(tmp_path: Path) -> None:
    name, copies, expected = CASES["pipeline-expert"]
    checkpoint = _with_files(tmp_path, name, copies)
    inspected = _cli("inspect", checkpoint)
    assert inspected.returncode == 3, inspected  # incomplete, as for mp_rank > 0 before
    problems = [line for line in inspected.stdout.splitlines() if line.strip().startswith("problem")]
    assert len(problems) == 1 and expected[0] in problems[0] and REFUSED in problems[0], inspected.stdout
    out = tmp_path / "out"
    consolidated = _cli("consolidate", checkpoint, out)
    lines = consolidated.stderr.strip().splitlines()
    assert consolidated.returncode == 1 and len(lines) == 1 and lines[0].startswith("zckpt: error: "), consolidated
    assert expected[0] in lines[0] and not out.exists()


# --- a bug is not damage -----------------------------------------------------------------------
def test_a_bug_of_zckpt_is_not_reported_as_damage(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AttributeError on one of zckpt's own objects propagates (the CLI says "internal
    error"); one on a value from a pickle is still the damaged-files line."""

    def bug(result, *args):  # noqa: ANN001
        return result.no_such_field

    monkeypatch.setattr(dp_reader, "check_same_run", bug)
    with pytest.raises(AttributeError, match="no_such_field"):
        survey(sample(ZERO3).checkpoint)

    def content(result, *args):  # noqa: ANN001
        return [].get("state")

    monkeypatch.setattr(dp_reader, "check_same_run", content)
    found = survey(sample(ZERO3).checkpoint)
    assert len(found.problems) == 1 and isinstance(found.problems[0], CorruptFileError)
    assert "files not as DeepSpeed writes them (AttributeError: 'list' object has no attribute 'get')" in str(
        found.problems[0]
    )


# --- the writer names rank files from the same coordinates ------------------------------------
def test_rank_file_names_from_coordinates() -> None:
    assert (
        N.rank_model_states_name(3, RankCoords.dp(2))
        == N.model_states_name(3, 2)
        == "zero_pp_rank_2_mp_rank_00_model_states.pt"
    )
    assert N.rank_model_states_name(2, RankCoords()) == "mp_rank_00_model_states.pt"
    assert N.rank_optim_states_name(RankCoords.dp(1), bf16=True) == "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    for coords in (RankCoords(pipe=1), RankCoords(expert=1)):
        with pytest.raises(ValueError):
            N.rank_optim_states_name(coords)


def test_the_writer_plans_rank_files_from_the_topology() -> None:
    from zckpt.deepspeed.reader import open_training_state
    from zckpt.deepspeed.writer import plan_checkpoint, plan_target

    state = open_training_state(sample(ZERO3).checkpoint)
    target = plan_target(state, 3)
    assert target.topology == Topology.data_parallel(3)
    plan = plan_checkpoint(state, target)
    found = [parse_rank_file(f.name) for f in plan.files if f.name.endswith(".pt")]
    assert sorted((f.kind, f.coords) for f in found) == sorted(
        (kind, RankCoords.dp(r)) for kind in ("model", "optim") for r in range(3)
    )
