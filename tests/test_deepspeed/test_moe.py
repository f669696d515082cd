"""Mixture-of-experts checkpoints (issue 19): samples written by real DeepSpeed with a native
``deepspeed.moe.layer.MoE`` of 4 experts at expert-parallel degree 2 (scripts/make_parallel_ckpts.py:
ZeRO-2 fp32 on 2 ranks, one rank per expert group; ZeRO-1 bf16 on 4 ranks, expert data-parallel
groups of 2), read as the model with every expert on one rank. The truth is what the live engine
held: every param's fp32 master from DeepSpeed's ``safe_get_full_fp32_param`` on each rank, expert
params under their global ids (``reference/live.safetensors``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import (
    MOE_SAMPLES,
    Sample,
    copy_checkpoint,
    run_cli,
    same_bits,
    same_checkpoint_files,
)
from zckpt import load_state_dict, reshard, to_universal
from zckpt.core.errors import UsageError
from zckpt.core.topology import Topology
from zckpt.deepspeed.reader import open_checkpoint, open_training_state, survey
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader
from zckpt.ops.verify import verify

IDS = [s.name for s in MOE_SAMPLES]
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts.{}.0.weight"


def test_the_samples_are_there() -> None:
    assert {s.name for s in MOE_SAMPLES} >= {"moe_z2_fp32_ep2_dp2", "moe_z1_bf16_ep2_dp4"}


@pytest.mark.parametrize("case", MOE_SAMPLES, ids=IDS)
def test_every_expert_of_every_rank_is_the_live_engines(case: Sample) -> None:
    index = open_checkpoint(case.checkpoint)
    assert index.topology == Topology(ep=case.meta["ep"], dp=case.meta["world_size"])
    assert index.world_size == case.meta["world_size"] and index.zero_stage == case.meta["zero_stage"]
    live = case.live()
    assert sorted(index.names()) == sorted(live)
    assert all(EXPERT.format(e) in live for e in range(case.meta["experts"]))
    state_dict = load_state_dict(case.checkpoint, dtype="fp32")
    for name, value in live.items():
        assert same_bits(state_dict[name], value.float() if value.is_floating_point() else value), name


@pytest.mark.parametrize("case", MOE_SAMPLES, ids=IDS)
def test_the_training_state_keeps_the_expert_group(case: Sample) -> None:
    state = open_training_state(case.checkpoint)
    assert len(state.groups) == 2 and state.global_steps == case.meta["global_steps"]
    experts = [p.name for p in state.params if "deepspeed_experts" in p.name]
    assert list(state.groups[1].params) == experts and {p.group for p in state.params if p.name in experts} == {1}
    assert len(experts) == 4 * case.meta["experts"]  # 2 Linear layers (weight, bias) per expert
    assert state.client_state == {}  # num_experts and ds_autoep_layers are the engine's keys
    assert (
        state.index.names().index(EXPERT.format(0)) == state.index.names().index("moe.deepspeed_moe.gate.wg.weight") + 1
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", MOE_SAMPLES, ids=IDS)
def test_cli_inspect_verify_consolidate(tmp_path: Path, case: Sample) -> None:
    inspected = run_cli("inspect", case.checkpoint)
    assert inspected.returncode == 0 and "mixture-of-experts: 4 experts in 1 MoE layer" in inspected.stdout
    assert verify(case.checkpoint).ok
    done = run_cli("consolidate", case.checkpoint, tmp_path / "out")
    assert done.returncode == 0, done.stderr


BF16 = next(s for s in MOE_SAMPLES if s.name == "moe_z1_bf16_ep2_dp4")


def test_a_missing_rank_file_is_named(tmp_path: Path) -> None:
    tag = copy_checkpoint(tmp_path, BF16)
    (tag / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    found = survey(tag.parent)
    assert found.index is None
    assert any("bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt: missing" in str(p) for p in found.problems), [
        str(p) for p in found.problems
    ]


def test_swapped_expert_rank_files_are_caught(tmp_path: Path) -> None:
    """Ranks 0 and 1 hold different experts under the same local names: swapping their files is
    caught by the slice mappings of the dense groups (each file names its own rank's part)."""
    tag = copy_checkpoint(tmp_path, BF16)
    a, b = (tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    a.rename(tag / "x")
    b.rename(a)
    (tag / "x").rename(b)
    found = survey(tag.parent)
    assert found.index is None and found.problems


@pytest.mark.parametrize("case", MOE_SAMPLES, ids=IDS)
def test_reshard_to_its_own_layout_gives_deepspeeds_files_back(tmp_path: Path, case: Sample) -> None:
    """Every file DeepSpeed wrote, rewritten by zckpt at the run's own ranks: the same pickled trees
    and tensor bytes (its shapes as plain tuples, as a MoE engine saves them; expert files copied)."""
    out = tmp_path / "same"
    reshard(case.checkpoint, out, world_size=case.meta["world_size"])
    assert same_checkpoint_files(case.checkpoint, out) == []


def test_reshard_to_other_ranks_keeps_every_value(tmp_path: Path) -> None:
    out = tmp_path / "two"
    reshard(BF16.checkpoint, out, world_size=2)
    index = open_checkpoint(out)
    assert index.topology == Topology(ep=2, dp=2)
    written = load_state_dict(out, dtype="fp32")
    for name, value in BF16.live().items():
        assert same_bits(written[name], value.float()), name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 3}, "--world-size 3: a multiple of the expert-parallel degree 2"),
        ({"world_size": 2, "stage": 3}, "--stage 3: DeepSpeed runs native mixture-of-experts at ZeRO-0/1/2 only"),
        ({"world_size": 2, "pipeline_stages": 1}, "--pipeline-stages is for pipeline-parallel checkpoints"),
    ],
)
def test_moe_writes_it_cannot_make_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        reshard(BF16.checkpoint, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", MOE_SAMPLES, ids=IDS)
def test_to_universal_stacks_each_local_experts_copies_by_expert_rank(tmp_path: Path, case: Sample) -> None:
    """DeepSpeed's universal loader finds a param's folder by the loading rank's local name: each
    expert param's folder holds its copies on the expert ranks stacked on dim 0 (row e: global
    expert e * per_rank + local), marked for the loader's expert-parallel slicing. Read against
    the files DeepSpeed saved (torch.load of the expert files: the live values' 16-bit weights)
    and the live masters; read back by zckpt (un-stacked), the whole model as saved. DeepSpeed
    resumes it: test_interop_parallel.py."""
    out = tmp_path / "universal"
    to_universal(case.checkpoint, out)
    folder = out / "global_step3_universal" / "zero"
    ep, per_rank = case.meta["ep"], case.meta["experts"] // case.meta["ep"]
    live = case.live()
    for local in range(per_rank):
        name = EXPERT.format(local)
        saved = torch.load(folder / name / "fp32.pt", weights_only=True)
        assert saved["is_expert_param"] is True and saved["ep_num_experts"] == ep and list(saved)[-1] == "param"
        assert saved["param"].shape == (ep, *live[name].shape)
        for e in range(ep):
            assert same_bits(saved["param"][e], live[EXPERT.format(e * per_rank + local)].float()), (local, e)
    assert not (folder / EXPERT.format(per_rank)).exists()  # folders under local names only
    universal, original = open_training_state(out), open_training_state(case.checkpoint)
    assert sorted(p.name for p in universal.params) == sorted(p.name for p in original.params)
    with FileReader() as reader:
        for param in original.params:
            again = universal.param(param.name)
            assert same_bits(read_tensor(reader, again.master), read_tensor(reader, param.master)), param.name
            for key, source in param.states.items():
                assert same_bits(read_tensor(reader, again.states[key]), read_tensor(reader, source)), (param.name, key)
    whole, written = load_state_dict(case.checkpoint, dtype="fp32"), load_state_dict(out, dtype="fp32")
    assert sorted(written) == sorted(whole) and all(same_bits(written[k], v) for k, v in whole.items())
    assert universal.index.topology.ep == ep  # the degree a loading run must keep
    with pytest.raises(UsageError, match="a mixture-of-experts universal folder holds no expert files"):
        reshard(out, tmp_path / "plain", world_size=ep)
    assert not (tmp_path / "plain").exists()


def test_to_universal_of_experts_for_zero3_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--target-stage 3: DeepSpeed runs native mixture-of-experts at ZeRO-0/1/2"):
        to_universal(BF16.checkpoint, tmp_path / "out", target_stage=3)
    assert not (tmp_path / "out").exists()


def test_an_expert_file_linked_outside_never_reaches_an_output(tmp_path: Path) -> None:
    """The writers copy expert files byte for byte: one that is a link to another file is parsed
    first, refused in one line, and nothing is written."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not a checkpoint\n")
    tag = copy_checkpoint(tmp_path, BF16)
    victim = tag / "layer_0_expert_1_mp_rank_00_model_states.pt"
    victim.unlink()
    victim.symlink_to(secret)
    found = survey(tag.parent)
    assert found.index is None and any(str(victim) in str(p) for p in found.problems), [str(p) for p in found.problems]
    done = run_cli("reshard", tag.parent, tmp_path / "out", "-w", "2")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "not a checkpoint" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", MOE_SAMPLES, ids=IDS)
def test_a_changed_expert_weight_is_caught(tmp_path: Path, case: Sample) -> None:
    """An expert file's 16-bit weight edited in one element: its master, in another rank's
    optimizer file, no longer rounds to it; verify names the expert file."""
    tag = copy_checkpoint(tmp_path, case)
    index = open_checkpoint(tag.parent)
    assert {c.name for c, _ in index.rounded_copies} >= {EXPERT.format(e) for e in range(4)}
    copy = next(c for c, _ in index.rounded_copies if c.name == EXPERT.format(3))
    segment = copy.source.segments[0]
    assert segment.path.endswith("layer_0_expert_3_mp_rank_00_model_states.pt")
    with open(segment.path, "r+b") as f:
        f.seek(segment.offset + 2 * copy.source.dtype.itemsize)
        f.write(b"\x00" * copy.source.dtype.itemsize)
    report = verify(tag.parent)
    assert not report.ok
    assert any(
        p.startswith(segment.path) and f"({EXPERT.format(3)}, " in p and "differs in 1 of" in p for p in report.problems
    ), report.problems


def test_a_missing_expert_file_is_named(tmp_path: Path) -> None:
    tag = copy_checkpoint(tmp_path, BF16)
    (tag / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    found = survey(tag.parent)
    assert found.index is None
    assert any(
        "no expert file holds moe.deepspeed_moe.experts.deepspeed_experts.3.0.bias (and 3 more)" in str(p)
        for p in found.problems
    )


@pytest.mark.parametrize("case", MOE_SAMPLES, ids=IDS)
def test_inspect_shows_each_experts_rank(case: Sample) -> None:
    """The placement column: expert E of E experts over ep expert ranks sits on expert rank
    E // (experts / ep), each expert rank data-parallel over world / ep ranks (what the
    generator's run reported, meta.json); dense params have no placement."""
    from zckpt.ops.inspect import inspect_path

    experts, ep, world = case.meta["experts"], case.meta["ep"], case.meta["world_size"]
    report = inspect_path(str(case.checkpoint))
    placements = {p["name"]: p.get("placement") for p in report["parameters"]}
    for expert in range(experts):
        name = EXPERT.format(expert)
        assert placements[name] == (
            f"expert {expert} on expert rank {expert // (experts // ep)} of {ep} "
            f"(data-parallel over {world // ep} rank{'s' * (world // ep != 1)})"
        ), name
    assert placements["embed.weight"] is None and placements["moe.deepspeed_moe.gate.wg.weight"] is None


@pytest.mark.parametrize("ep, world", [(1, 2), (4, 4)], ids=["ep1-of-2", "ep4-of-4"])
def test_reshard_to_another_expert_parallel_degree_keeps_every_value(tmp_path: Path, ep: int, world: int) -> None:
    """Experts moved between expert ranks: the output reads back at the new degree, every expert's
    master and moments are the live engine's and the original's (DeepSpeed's load of it: interop)."""
    case = next(s for s in MOE_SAMPLES if s.name == "moe_z2_fp32_ep2_dp2")
    out = tmp_path / "moved"
    reshard(case.checkpoint, out, world_size=world, expert_parallel=ep)
    index = open_checkpoint(out)
    assert index.topology == Topology(ep=ep, dp=world)
    live = case.live()
    state_dict = load_state_dict(out, dtype="fp32")
    assert all(same_bits(state_dict[n], v.float()) for n, v in live.items())
    moved, original = open_training_state(out), open_training_state(case.checkpoint)
    assert [g.hyperparams.get("name") for g in moved.groups] == ["parameters", f"ep_size_{ep}"]
    with FileReader() as reader:
        for param in original.params:
            for key, source in param.states.items():
                again = moved.param(param.name).states[key]
                assert same_bits(read_tensor(reader, again), read_tensor(reader, source)), (param.name, key)
    # the experts rank 1 of the new run holds, as DeepSpeed names them (local ids) in its optimizer file
    from zckpt.torchfile import reader as torchfile

    optim = torchfile.load(str(out / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    names = list(optim["optimizer_state_dict"]["param_slice_mappings"][1])
    ids = {int(re.search(r"deepspeed_experts\.(\d+)\.", n)[1]) for n in names}
    # ep 4: its one expert, local id 0; ep 1: its half of all 4 experts' flat group (local ids up to 3)
    assert ids == {0} if ep == 4 else ids == {2, 3}


@pytest.mark.parametrize(
    "checkpoint, ep, problem",
    [
        ("moe_z2_fp32_ep2_dp2", 3, "has 4 experts, which do not divide over 3 expert ranks"),
        ("z2_fp32_ws1", 2, "for mixture-of-experts checkpoints; this one has no experts"),
    ],
)
def test_an_expert_parallel_degree_that_cannot_be_is_refused(
    tmp_path: Path, checkpoint: str, ep: int, problem: str
) -> None:
    from helpers import sample

    done = run_cli("reshard", sample(checkpoint).checkpoint, tmp_path / "out", "-w", "3", "--expert-parallel", ep)
    assert done.returncode == 2 and problem in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, world, ep", [("moe_z2_fp32_ep2_dp2", 2, 1), ("moe_z1_bf16_ep2_dp4", 4, 4)])
def test_expert_parallel_round_trip_gives_deepspeeds_files_back(tmp_path: Path, name: str, world: int, ep: int) -> None:
    """To another degree and back: every file DeepSpeed wrote, the same pickled trees and bytes."""
    case = next(s for s in MOE_SAMPLES if s.name == name)
    reshard(case.checkpoint, tmp_path / "there", world_size=world, expert_parallel=ep)
    reshard(tmp_path / "there", tmp_path / "back", world_size=case.meta["world_size"], expert_parallel=case.meta["ep"])
    assert same_checkpoint_files(case.checkpoint, tmp_path / "back") == []
