"""The cost-curve benchmark's synthetic checkpoints (scripts/synthetic_ckpt.py) have the layout real
DeepSpeed writes for the same model (issue 21): DeepSpeed 0.19.8 trains ``zckpt train``'s GPT of
the same shapes one step with the same config (scripts/ds_train_gpt.py) and saves; every file of
the two tag folders has the same name, the same pickled tree (keys, types, tensor dtypes and
shapes) and the same storage records (count and sizes), but for one difference of zckpt's writer:
its ZeRO-1/2 16-bit module weights have a storage each, where DeepSpeed's are views into one flat
buffer per param group (the same bytes here, the same values loaded). The values differ (noise,
step 1000 vs 1). Needs DeepSpeed: ``pytest -m deepspeed -p interop_helpers
tests/test_interop/test_interop_synthetic.py`` (two 2-rank runs of ~15 s).
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ROOT

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_helpers import (  # noqa: E402,F401
    _load_script,
    ds_env,
    free_port,
    launcher,
    run_logged,
    shm_leak_safety_net,
)

synthetic = _load_script("synthetic_ckpt")


def shape_of(value: Any, where: str = "") -> Any:
    """A loaded object with every leaf replaced by what a layout is: a tensor by its dtype and
    shape, anything else by its type; dict keys and list lengths kept."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape))
    if isinstance(value, dict):
        return (type(value).__name__, [(k, shape_of(v, f"{where}/{k}")) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [shape_of(v) for v in value])
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return (type(value).__name__, shape_of(vars(value)))
    return type(value).__name__


def records(path: Path) -> list[tuple[str, int]]:
    """The storage records of a torch.save archive: names (after the archive's own) and sizes."""
    with zipfile.ZipFile(path) as archive:
        return sorted((i.filename.split("/", 1)[1], i.file_size) for i in archive.infolist() if "/data/" in i.filename)


@pytest.mark.parametrize("stage", [3, 2])
def test_synthetic_checkpoint_has_the_layout_deepspeed_writes(stage: int, tmp_path: Path) -> None:
    config = synthetic.gpt_config(None, layers=2, dim=64, vocab=256, seq_len=64)
    ours = tmp_path / "synthetic"
    synthetic.write_synthetic(ours, config, 2, stage, "bf16", tmp_path / "noise")
    theirs = tmp_path / "deepspeed"
    cmd = [*launcher(sys.executable), "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += [str(ROOT / "scripts" / "ds_train_gpt.py"), "--model-config", str(ours / "model_config.json")]
    cmd += ["--ds-config", str(ours / "ds_config.json"), "--out", str(tmp_path / "run"), "--save", str(theirs)]
    cmd += ["--train-steps", "1", "--no-live"]
    env = {**ds_env(2, sys.executable), "PYTHONPATH": str(ROOT)}
    assert run_logged(cmd, env, tmp_path / "run.log", timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
    our_tag, their_tag = ours / f"global_step{synthetic.STEPS}", theirs / "global_step1"
    names = sorted(p.name for p in our_tag.iterdir())
    assert names == sorted(p.name for p in their_tag.iterdir())
    assert len(names) == (4 if stage == 3 else 3)
    for name in names:
        if stage < 3 and name == "mp_rank_00_model_states.pt":
            # DeepSpeed's ZeRO-1/2 16-bit weights are views into one flat buffer per param group
            # (2 records); zckpt's writer gives each its own storage: the same bytes in all
            # (these shapes need no padding), the same values once loaded
            ours_bytes, theirs_bytes = records(our_tag / name), records(their_tag / name)
            assert (len(ours_bytes), len(theirs_bytes)) == (28, 2)
            assert sum(n for _, n in ours_bytes) == sum(n for _, n in theirs_bytes)
        else:
            assert records(our_tag / name) == records(their_tag / name), name
        mine = torch.load(our_tag / name, weights_only=False)
        deepspeeds = torch.load(their_tag / name, weights_only=False)
        assert shape_of(mine) == shape_of(deepspeeds), name
