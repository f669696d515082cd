"""DeepSpeed's Muon (MuonWithAuxAdam) at ZeRO-1/2: its momentum_buffer is kept per whole param (the
full momentum of every param a rank's partition touches), not per element of the partition
(zckpt/deepspeed/muon.py, sample_ckpts/FORMAT_OBSERVED.md). Read exactly, checked across the ranks
that hold a param, and re-laid by reshard for every world size and stage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import load_with_stand_ins, same_bits, sample
from zckpt import reshard
from zckpt.deepspeed.reader import open_training_state
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader
from zckpt.ops.verify import verify

# ZeRO-3 and BF16_Optimizer keep the momentum per element, as exp_avg
MUON = [
    "z1_bf16_ws2_muon",
    "z2_fp32_ws3_muon",
    "z3_bf16_ws2_muon",
    "z1_bf16_ws3_muon_bf16optimizer",
    "z2_fp32_ws3_muon_cpuoffload",
]


def _states_equal_live(name: str, checkpoint: Path) -> int:
    """Every param's master and optimizer states in `checkpoint` equal the live engine's, dtype
    included (Muon's momentum in the gradient's dtype); returns the states compared."""
    case = sample(name)
    live, live_optim = case.live(), load_file(case.folder / "reference" / "live_optimizer.safetensors")
    state = open_training_state(checkpoint)
    compared = 0
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(read_tensor(reader, param.master).reshape(param.shape), live[param.name]), param.name
            assert sorted(param.states) == sorted(case.param_state_names(param.name, live_optim)), param.name
            for key, source in param.states.items():
                value = read_tensor(reader, source).reshape(param.shape)
                assert same_bits(value, live_optim[f"{param.name}.{key}"]), (param.name, key)
                compared += 1
    return compared


@pytest.mark.parametrize("name", MUON)
def test_muon_momentum_read_whole_and_its_copies_checked(name: str) -> None:
    case = sample(name)
    assert _states_equal_live(name, case.checkpoint) == len(
        load_file(case.folder / "reference" / "live_optimizer.safetensors")
    )
    state = open_training_state(case.checkpoint)
    # ZeRO-1/2: a param cut between ranks has its full momentum on both; ZeRO-3 keeps one share each
    config = case.meta["ds_config"]
    bf16_optimizer = (config.get("data_types") or {}).get("grad_accum_dtype") == "fp32"
    offload = "offload_optimizer" in config["zero_optimization"]
    assert bool(state.state_copies) == (case.meta["zero_stage"] != 3 and not bf16_optimizer and not offload)
    report = verify(case.checkpoint)
    assert report.ok and any(c.name == "state copies" and c.ok for c in report.checks) == bool(state.state_copies)


@pytest.mark.parametrize("name", MUON)
@pytest.mark.parametrize("world_size,stage", [(1, 1), (2, 2), (3, 1), (4, 2), (2, 3)])
def test_muon_reshard_relays_each_ranks_momentum(name: str, world_size: int, stage: int, tmp_path: Path) -> None:
    """Each rank's momentum_buffer is the full momenta of the params its new partition touches, in
    flat order (ZeRO-3: per element of the partition, as exp_avg); read back, every state is the
    live engine's; and back to the input's layout, the same again."""
    case = sample(name)
    out = tmp_path / "out"
    reshard(case.checkpoint, out, world_size=world_size, stage=stage)
    _states_equal_live(name, out)
    tag = out / (out / "latest").read_text().strip()
    model = load_with_stand_ins(next(tag.glob("*model_states.pt")))
    for rank in range(world_size):
        inner = load_with_stand_ins(next(tag.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")))
        inner = inner["optimizer_state_dict"]
        torch_state = inner.get("base_optimizer_state") or inner["optimizer_state_dict"]
        for g, group in enumerate(torch_state["param_groups"]):
            per_element = (
                "zero_stage" not in inner or "offload_optimizer" in case.meta["ds_config"]["zero_optimization"]
            )
            if not group.get("use_muon") or stage == 3 or per_element:  # BF16_Optimizer, offload: per element
                continue
            mappings = inner["param_slice_mappings"][g]  # the params this rank's partition touches
            touched = [n for n in model["param_shapes"][g] if n in mappings]
            held = torch_state["state"].get(g, {}).get("momentum_buffer")
            if not touched:
                assert held is None
                continue
            assert held.numel() == sum(torch.Size(model["param_shapes"][g][n]).numel() for n in touched), rank
    back = tmp_path / "back"
    reshard(out, back, world_size=case.meta["world_size"], stage=case.meta["zero_stage"])
    _states_equal_live(name, back)


def test_a_differing_copy_of_a_muon_momentum_is_found(tmp_path: Path) -> None:
    """fc1.weight is cut between the two ranks: each keeps its full momentum. A file whose copy
    differs (another save's, or damaged) is named by verify."""
    case = sample("z1_bf16_ws2_muon")
    copy = tmp_path / "checkpoint"
    shutil.copytree(case.checkpoint, copy)
    state = open_training_state(copy)
    name, key, source = state.state_copies[0]
    segment = source.segments[0]
    with open(segment.path, "r+b") as f:  # flip one element's low bits: the CRC is then off as well
        f.seek(segment.offset)
        byte = f.read(1)
        f.seek(segment.offset)
        f.write(bytes([byte[0] ^ 0x01]))
    report = verify(copy)
    problems = " ".join(report.problems)
    assert not report.ok and f"{name}'s {key}" in problems, problems
