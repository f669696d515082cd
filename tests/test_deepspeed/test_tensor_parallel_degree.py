"""``reshard --tensor-parallel N`` at a degree other than the run's own or 1 (issue 19, the
moonshot's tensor-parallel half): a Megatron-style run's slices cut again for N tensor ranks as a
plain checkpoint. The independent facts are what the sample's run held (its ranks' live slices,
ds_to_universal's merge), cut as the sample's model cuts its params at N ranks
(:func:`helpers.megatron_slice`); the interop tier has DeepSpeed load the output at 4 tensor ranks
and the files it saves there back at 2 (tests/test_interop/test_interop_parallel.py)."""

from __future__ import annotations

import filecmp
import json
import re
from pathlib import Path

import pytest

from helpers import MEGATRON_SAMPLES, Sample, assert_megatron_slices, run_cli, sample
from zckpt import reshard
from zckpt.core.errors import UsageError
from zckpt.deepspeed.reader import open_training_state
from zckpt.ops.verify import verify
from zckpt.torchfile import reader as torchfile


@pytest.mark.parametrize("case", MEGATRON_SAMPLES, ids=[s.name for s in MEGATRON_SAMPLES])
def test_four_tensor_ranks_hold_the_runs_values_cut_as_the_model_cuts_them(tmp_path: Path, case: Sample) -> None:
    """2 -> 4 tensor ranks over 2 data ranks (ZeRO-1/2/3 inputs, ZeRO-2 output): each rank's slices
    of every master and moment are the model's own cut at 4 ranks of what the run held (the
    vocabulary's 24 saved rows, its padding row included, 6 a rank); verify passes."""
    out = tmp_path / "tp4"
    reshard(case.checkpoint, out, world_size=2, stage=2, tensor_parallel=4)
    state = open_training_state(out)
    assert state.index.topology.dp == 2 and state.global_steps == case.meta["global_steps"]
    assert_megatron_slices(state, case, 4)
    assert verify(str(out)).ok


def _model_states(folder: Path, rank: int) -> dict:
    return torchfile.load(str(next((folder / "global_step3").glob(f"*mp_rank_{rank:02d}_model_states.pt"))))


def test_the_files_are_those_of_a_run_at_four_tensor_ranks(tmp_path: Path) -> None:
    """The rules a Megatron-DeepSpeed model at 4 tensor ranks records (its q/k/v sub-params 2, 1, 1
    rows a rank; 24 padded rows of a 23-row vocabulary), the parallel dimensions and the
    model-parallel world size of 4 ranks, one model-states file and one ZeRO file a rank."""
    out = tmp_path / "tp4"
    reshard(sample("megatron_z1_fp32_tp2").checkpoint, out, world_size=1, tensor_parallel=4)
    assert sorted(p.name for p in (out / "global_step3").iterdir()) == [
        f"{kind}mp_rank_{t:02d}_{what}.pt"
        for kind, what in (("", "model_states"), ("zero_pp_rank_0_", "optim_states"))
        for t in range(4)
    ]
    for t in range(4):
        saved = _model_states(out, t)
        info = saved["universal_checkpoint_info"]
        (pattern,) = info["sub_param_shard_widths"]
        assert info["sub_param_shard_widths"][pattern] == [[2] * 4, [1] * 4, [1] * 4]
        assert (info["original_vocab_size"], info["padded_vocab_size"]) == (23, 24)
        assert saved["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 4}
        assert saved["mp_world_size"] == 4


def test_four_tensor_ranks_and_back_give_the_checkpoint_at_its_own_ranks(tmp_path: Path) -> None:
    """2 -> 4 -> 2 tensor ranks writes, file for file and byte for byte, what a reshard at the run's
    own 2 ranks writes: nothing is lost or moved by the cut and the join."""
    case = sample("megatron_z3_fp32_tp2_dp2")
    reshard(case.checkpoint, tmp_path / "tp4", world_size=1, tensor_parallel=4)
    reshard(tmp_path / "tp4", tmp_path / "back", world_size=2, stage=3, tensor_parallel=2)
    reshard(case.checkpoint, tmp_path / "own", world_size=2, stage=3)
    folders = [tmp_path / name / "global_step3" for name in ("back", "own")]
    names = sorted(p.name for p in folders[0].iterdir())
    assert names == sorted(p.name for p in folders[1].iterdir())
    match, mismatch, errors = filecmp.cmpfiles(*folders, names, shallow=False)
    assert (mismatch, errors) == ([], []) and len(match) == 8


def test_a_padded_vocabulary_asked_is_kept(tmp_path: Path) -> None:
    """`--padded-vocab-size 24` at 4 ranks (the rows saved) is the default's checkpoint; the rules
    say so."""
    case = sample("megatron_z1_fp32_tp2")
    reshard(case.checkpoint, tmp_path / "asked", world_size=1, tensor_parallel=4, padded_vocab_size=24)
    reshard(case.checkpoint, tmp_path / "default", world_size=1, tensor_parallel=4)
    folders = [tmp_path / name / "global_step3" for name in ("asked", "default")]
    names = sorted(p.name for p in folders[0].iterdir())
    assert filecmp.cmpfiles(*folders, names, shallow=False)[1:] == ([], [])


@pytest.mark.parametrize(
    "case, options, message",
    [
        ("megatron_z1_fp32_tp2", {"tensor_parallel": 5}, "embed.word_embeddings.weight holds 24 rows (its padded"),
        ("megatron_z1_fp32_tp2", {"tensor_parallel": 3}, "query_key_value\\.weight ([8, 4, 4] rows) do not split"),
        ("megatron_z1_fp32_tp2", {"tensor_parallel": 4, "padded_vocab_size": 22}, "does not split evenly over 4"),
        ("megatron_z1_fp32_tp2", {"tensor_parallel": 4, "padded_vocab_size": 28}, "holds 24 rows over its tensor"),
        ("autotp_z1_fp32_tp2", {"tensor_parallel": 4}, "an AutoTP run is cut at another degree by its engine"),
        ("z1_fp32_ws2_frozen_tied", {"tensor_parallel": 2}, "tensor ranks of a tensor-parallel run only"),
        ("megatron_z1_fp32_tp2", {"tensor_parallel": 0}, "--tensor-parallel 0: at least 1"),
    ],
)
def test_a_degree_it_cannot_write_is_refused(tmp_path: Path, case: str, options: dict, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        reshard(sample(case).checkpoint, tmp_path / "out", world_size=1, **options)
    assert not (tmp_path / "out").exists()


def test_a_param_that_does_not_split_is_refused(tmp_path: Path) -> None:
    """Rules (``--tp-rules``) without the fused q/k/v's sub-params: at 8 ranks the vocabulary's 24 rows
    and the q/k/v's 16 split, the attention projection's 4 columns do not."""
    case = sample("megatron_z1_fp32_tp2")
    info = dict(
        torchfile.load(str(case.checkpoint / "global_step3" / "mp_rank_00_model_states.pt"))[
            "universal_checkpoint_info"
        ]
    )
    for key in ("parameter_with_sub_params", "sub_param_shard_widths"):
        del info[key]
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps(info))
    message = "--tensor-parallel 8: layers.0.self_attention.dense.weight has 4 columns, which do not split evenly"
    with pytest.raises(UsageError, match=re.escape(message)):
        reshard(case.checkpoint, tmp_path / "out", world_size=1, tensor_parallel=8, tp_rules=rules)
    assert not (tmp_path / "out").exists()


def test_cli(tmp_path: Path) -> None:
    done = run_cli(
        "reshard", sample("megatron_z1_fp32_tp2").checkpoint, tmp_path / "out", "-w", "2", "--tensor-parallel", "4"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "wrote global_step3 for world size 8 (4 tensor ranks x 2 data-parallel ranks) (ZeRO-1)"
    ), done.stdout
