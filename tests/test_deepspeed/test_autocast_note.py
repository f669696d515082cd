"""torch_autocast with float16 and ZeRO off (issue 35 item 4): DeepSpeed 0.19.8 scales the loss
with its own torch GradScaler (runtime/engine.py:666-672) and saves none of it; a real 2-rank run
(DS_ACCELERATOR=cpu) saved files that differ from a plain fp32 ZeRO-0 run's only in
``ds_config``. zckpt reads them as saved and says the scale restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import copy_checkpoint, sample
from zckpt.ops.inspect import inspect_path

Z0 = sample("z0_fp32_ws2_tied")


def _with_autocast(tmp_path: Path, autocast: dict) -> Path:
    tag = copy_checkpoint(tmp_path, Z0)
    for path in sorted(tag.glob("*model_states.pt")):
        state = torch.load(path, weights_only=False)
        state["ds_config"]["torch_autocast"] = autocast
        torch.save(state, path)
    return tag.parent


@pytest.mark.parametrize("dtype", ["float16", "fp16", "torch.float16", "half"])
def test_fp16_autocast_without_zero_notes_the_unsaved_grad_scaler(tmp_path: Path, dtype: str) -> None:
    info = inspect_path(str(_with_autocast(tmp_path, {"enabled": True, "dtype": dtype})))
    assert any("GradScaler" in note and "torch_autocast" in note for note in info["notes"]), info["notes"]
    assert not info["problems"]


@pytest.mark.parametrize("autocast", [{"enabled": True, "dtype": "bfloat16"}, {"enabled": False, "dtype": "float16"}])
def test_other_autocast_settings_have_no_note(tmp_path: Path, autocast: dict) -> None:
    info = inspect_path(str(_with_autocast(tmp_path, autocast)))
    assert not any("GradScaler" in note for note in info["notes"]), info["notes"]
