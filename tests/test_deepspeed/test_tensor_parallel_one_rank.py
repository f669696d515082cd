"""``reshard --tensor-parallel 1`` (issue 19, the moonshot's tensor-parallel half): a tensor-parallel
run (AutoTP, Megatron-style) written as the unsharded model's plain checkpoint, for a run without
tensor parallelism. The independent fact is DeepSpeed's own merge of each sample
(``ds_to_universal``'s, ``reference/universal.safetensors``); the interop tier has DeepSpeed load
the output plainly (tests/test_interop/test_interop_parallel.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import (
    MEGATRON_SAMPLES,
    TENSOR_PARALLEL_SAMPLES,
    Sample,
    assert_holds_the_merge,
    assert_padded_vocabulary_is_live,
    run_cli,
    sample,
)
from zckpt import reshard
from zckpt.core.errors import UsageError
from zckpt.core.topology import Topology
from zckpt.deepspeed.reader import open_training_state
from zckpt.ops.verify import verify
from zckpt.torchfile import reader as torchfile

CASES = TENSOR_PARALLEL_SAMPLES + MEGATRON_SAMPLES


@pytest.mark.parametrize("case", CASES, ids=[s.name for s in CASES])
def test_one_tensor_rank_holds_deepspeeds_merge(tmp_path: Path, case: Sample) -> None:
    """Every param's master and moments are DeepSpeed's merge of the tensor ranks, in one
    data-parallel checkpoint over the run's data ranks (model states named mp_rank_00 only), which
    verify passes (the 16-bit module weights their masters rounded)."""
    out = tmp_path / "tp1"
    dp = case.meta["dp"]
    reshard(case.checkpoint, out, world_size=dp, tensor_parallel=1)
    state = open_training_state(out)
    assert state.index.topology == Topology.data_parallel(dp) and state.tensor_shards == ()
    assert {p.name for p in (out / "global_step3").iterdir() if "mp_rank_01" in p.name} == set()
    reference = load_file(case.folder / "reference" / "universal.safetensors")
    assert sorted(p.name for p in state.params) == sorted(
        k for k in reference if not k.endswith(("exp_avg", "exp_avg_sq"))
    )
    assert_holds_the_merge(state, reference, masters=True)
    assert verify(str(out)).ok


def _model_states(folder: Path) -> dict:
    return torchfile.load(str(next((folder / "global_step3").glob("*mp_rank_00_model_states.pt"))))


def test_the_merge_rules_are_those_of_one_tensor_rank(tmp_path: Path) -> None:
    """Megatron-style rules kept as a one-rank run of the model records them: each fused q/k/v
    sub-param one width (the rule's own shape: 8, 4, 4 rows), the vocabulary unpadded; AutoTP's
    affine map (the old ranks' pieces) left out, as a run without AutoTP saves none."""
    megatron, autotp = tmp_path / "megatron", tmp_path / "autotp"
    reshard(sample("megatron_z1_fp32_tp2").checkpoint, megatron, world_size=1, tensor_parallel=1)
    reshard(sample("autotp_z1_fp32_tp2").checkpoint, autotp, world_size=1, tensor_parallel=1)
    saved = _model_states(megatron)
    info = saved["universal_checkpoint_info"]
    (pattern,) = info["sub_param_shard_widths"]
    assert info["sub_param_shard_widths"][pattern] == [[8], [4], [4]]
    assert info["padded_vocab_size"] == info["original_vocab_size"] == 23
    assert saved["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 1}
    assert saved["mp_world_size"] == 1
    assert "universal_checkpoint_info" not in _model_states(autotp)


def test_a_padded_vocabulary_keeps_the_rows_the_run_saved(tmp_path: Path) -> None:
    """`--padded-vocab-size 24`: the vocabulary params keep 24 rows, the tensor ranks' live slices
    joined (the padding row the run trained included), the rest is DeepSpeed's merge; the rules
    say 24 padded rows of a 23-row vocabulary."""
    case = sample("megatron_z1_fp32_tp2")
    out = tmp_path / "tp1"
    reshard(case.checkpoint, out, world_size=1, tensor_parallel=1, padded_vocab_size=24)
    assert_padded_vocabulary_is_live(open_training_state(out), case)
    info = _model_states(out)["universal_checkpoint_info"]
    assert (info["original_vocab_size"], info["padded_vocab_size"]) == (23, 24)
    assert verify(str(out)).ok


@pytest.mark.parametrize(
    "case, options, message",
    [
        (
            "megatron_z1_fp32_tp2",
            {"tensor_parallel": 1, "padded_vocab_size": 25},
            "holds 24 rows over its tensor ranks",
        ),
        (
            "megatron_z1_fp32_tp2",
            {"tensor_parallel": 1, "padded_vocab_size": 22},
            "smaller than the vocabulary (23 rows",
        ),
        (
            "megatron_z1_fp32_tp2",
            {"padded_vocab_size": 24},
            "for a tensor-parallel run written at another tensor-parallel degree",
        ),
        (
            "autotp_z1_fp32_tp2",
            {"tensor_parallel": 1, "padded_vocab_size": 64},
            "for a Megatron-style tensor-parallel run",
        ),
    ],
)
def test_a_padded_vocabulary_it_cannot_write_is_refused(tmp_path: Path, case: str, options: dict, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        reshard(sample(case).checkpoint, tmp_path / "out", world_size=1, **options)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "case, tensor_parallel, message",
    [
        ("z1_fp32_ws2_frozen_tied", 2, "--tensor-parallel 2: zckpt writes tensor ranks of a tensor-parallel run only"),
    ],
)
def test_a_tensor_parallel_degree_it_cannot_write_is_refused(
    tmp_path: Path, case: str, tensor_parallel: int, message: str
) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        reshard(sample(case).checkpoint, tmp_path / "out", world_size=1, tensor_parallel=tensor_parallel)
    assert not (tmp_path / "out").exists()


def test_cli(tmp_path: Path) -> None:
    done = run_cli(
        "reshard", sample("autotp_z1_fp32_tp2").checkpoint, tmp_path / "out", "-w", "2", "--tensor-parallel", "1"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote global_step3 for world size 2 (ZeRO-1)"), done.stdout
