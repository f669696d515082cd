"""DeepSpeed 0.19.8 features that run only on GPU, or whose files no sample holds, and change what a
run saves (issue 35 item 4; the table "Features DeepSpeed runs only on GPU, from its source" in
sample_ckpts/FORMAT_OBSERVED.md): each made from a real sample edited to what the feature saves,
by DeepSpeed's source, and read exactly, refused in one line naming the feature, or noted.

Model-states files are edited with torch.save to the path DeepSpeed saved them to (the archive
keeps its name); optimizer files, which hold DeepSpeed's classes, through zckpt's own reader and
torch-file writer (``carry``), named as torch.save names them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers import as_saved_to_a_stream, copy_checkpoint, rewrite_torch_file, same_bits, sample
from zckpt import load_state_dict
from zckpt.core.errors import LayoutError
from zckpt.deepspeed.reader import open_checkpoint
from zckpt.ops.inspect import inspect_path

Z3_FROZEN = sample("z3_fp32_ws2_tied_frozen")
Z3_SUB_GROUPS = sample("z3_bf16_ws3_subgroups_groups")
Z2 = sample("z2_fp32_ws2_twotags")


def _edit_model_states(tag: Path, change) -> None:  # noqa: ANN001
    for path in sorted(tag.glob("*model_states.pt")):
        state = torch.load(path, weights_only=False)
        change(state)
        torch.save(state, path)


def _edit_optim_states(tag: Path, change) -> None:  # noqa: ANN001
    for path in sorted(tag.glob("*optim_states.pt")):
        rewrite_torch_file(path, lambda tree: change(tree["optimizer_state_dict"]))


def _refusal(checkpoint: Path) -> str:
    with pytest.raises(LayoutError) as refused:
        open_checkpoint(checkpoint)
    message = str(refused.value)
    assert "\n" not in message and "truncated" not in message and "mixed" not in message, message
    return message


def _same_weights(ours: Path, theirs: Path) -> None:
    a, b = load_state_dict(ours, dtype="fp32"), load_state_dict(theirs, dtype="fp32")
    assert sorted(a) == sorted(b) and all(same_bits(a[n], b[n]) for n in a)


def test_zero_quantized_weights_only_change_the_all_gather(tmp_path: Path) -> None:
    """qwZ quantizes the ZeRO-3 all-gather (partitioned_param_coordinator.py:580); the partitions
    stay in the training dtype: the files are a plain run's."""
    tag = copy_checkpoint(tmp_path, Z3_FROZEN)
    _edit_model_states(tag, lambda s: s["ds_config"]["zero_optimization"].update(zero_quantized_weights=True))
    _same_weights(tag.parent, Z3_FROZEN.checkpoint)


def test_zero_quantized_nontrainable_weights_are_refused(tmp_path: Path) -> None:
    """Frozen params kept as CUDAQuantizer's int8 (partition_parameters.py:1838-1840), saved
    without their scales (engine.py:5431): not read as weights."""
    tag = copy_checkpoint(tmp_path, Z3_FROZEN)

    def quantize(state: dict) -> None:
        state["ds_config"]["zero_optimization"]["zero_quantized_nontrainable_weights"] = True
        fragments = state["frozen_param_fragments"]
        for name in fragments:
            fragments[name] = fragments[name].clamp(-100, 100).to(torch.int8)

    _edit_model_states(tag, quantize)
    message = _refusal(tag.parent)
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt" in message and "zero_quantized_nontrainable_weights" in message


def test_partial_offload_without_the_gpu_sub_groups_state_is_refused(tmp_path: Path) -> None:
    """ZeRO-Offload++ (offload_optimizer.ratio < 1) steps its first sub-groups on the GPU with a
    second optimizer whose state is not saved (stage3.py:1100-1108, :1254-1258, :3443)."""
    tag = copy_checkpoint(tmp_path, Z3_SUB_GROUPS)
    _edit_model_states(
        tag, lambda s: s["ds_config"]["zero_optimization"].update(offload_optimizer={"device": "cpu", "ratio": 0.5})
    )

    def drop_gpu_sub_groups(inner: dict) -> None:
        state = inner["optimizer_state_dict"]["state"]
        for index in range(int((1 - 0.5) * len(inner["fp32_flat_groups"]))):
            state.pop(index, None)

    _edit_optim_states(tag, drop_gpu_sub_groups)
    message = _refusal(tag.parent)
    assert "ZeRO-Offload++" in message and "ratio 0.5" in message and "sub-group(s) 0, 1" in message


def test_super_offload_is_noted(tmp_path: Path) -> None:
    """SuperOffload's moments live in its worker process (superoffload_stage3.py:93-108): the saved
    optimizer holds none; read as saved, with a note."""
    tag = copy_checkpoint(tmp_path, Z3_SUB_GROUPS)
    _edit_model_states(
        tag,
        lambda s: s["ds_config"]["zero_optimization"].update(
            offload_optimizer={"device": "cpu", "super_offload": True}
        ),
    )
    _edit_optim_states(tag, lambda inner: inner["optimizer_state_dict"]["state"].clear())
    notes = inspect_path(str(tag.parent))["notes"]
    assert any("SuperOffload" in n and "restart Adam" in n for n in notes), notes
    _same_weights(tag.parent, Z3_SUB_GROUPS.checkpoint)
    assert not any("SuperOffload" in n for n in inspect_path(str(Z3_SUB_GROUPS.checkpoint))["notes"])


def test_fast_writer_names_are_refused_at_zero_1_2(tmp_path: Path) -> None:
    """FastPersist's writer at ZeRO-0/1/2 saves '<file>-<writer rank>.<writers>' through a stream
    (writer_factory.py:130-133, fast_checkpoint_engine.py:37-39)."""
    tag = copy_checkpoint(tmp_path, Z2)
    for path in sorted(tag.glob("*_states.pt")):
        as_saved_to_a_stream(path)
        os.rename(path, f"{path}-0.1")
    message = _refusal(tag.parent)
    assert "FastPersist" in message and "mp_rank_00_model_states.pt-0.1" in message


def test_fast_writer_files_at_zero_3_are_read(tmp_path: Path) -> None:
    """At ZeRO-3 the writer keeps the names (optimize_dp_state false, engine.py:1901); only the
    archive is named "archive", which claims no rank."""
    tag = copy_checkpoint(tmp_path, Z3_FROZEN)
    for path in sorted(tag.glob("*_states.pt")):
        as_saved_to_a_stream(path)
    _same_weights(tag.parent, Z3_FROZEN.checkpoint)
