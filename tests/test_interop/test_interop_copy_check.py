"""The rank-copy check against a ZeRO-3 checkpoint real DeepSpeed wrote whose per-rank records are
all small frozen slices plus a buffer (issue 17, item 6). Needs DeepSpeed:
``pytest -m deepspeed -p interop_helpers tests/test_interop/test_interop_copy_check.py``.

The model has what the report's checkpoint (saved by PyTorch Lightning's ``DeepSpeedStrategy``)
had: a frozen LayerNorm of 33 elements (17 bf16, 34 bytes, per rank at 2 ranks), a persistent buffer, and one
tiny trainable layer. The buffer is alike in every rank's model-states file, so a check that
skipped the small frozen slices judged the buffer alone and called the files copies, while
DeepSpeed's zero_to_fp32 reads them. Everything here is compared with what DeepSpeed wrote: its
rank files, its zero_to_fp32 output, a real rank file copied over another. One 2-rank DeepSpeed
run for the module (15-35 s).
"""

from __future__ import annotations

import importlib.util
import shutil
import zipfile
from pathlib import Path

import pytest

from helpers import as_saved_to_a_stream, load_output, same_bits

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_helpers import (  # noqa: E402,F401 (autouse fixture)
    ds_env,
    ds_python,
    free_port,
    launcher,
    run_logged,
    shm_leak_safety_net,
)
from zckpt import ZckptError, consolidate, inspect_path, reshard  # noqa: E402
from zckpt.ops.verify import verify  # noqa: E402

TAG = "global_step2"
MODEL_STATES = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)]

# Runs under torchrun, one process per rank: train 2 steps, save, and on rank 0 DeepSpeed's own
# zero_to_fp32 of what was saved (the function its script runs, with the script's defaults).
WORKER = r'''
import os
import sys
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch
from torch import nn

out = Path(sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo")


class Model(nn.Module):
    """A frozen LayerNorm of 33 (pretrained values), a persistent buffer, a tiny trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(33)
        self.head = nn.Linear(33, 1)
        self.register_buffer("position_ids", torch.arange(48))
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)
            self.norm.bias.normal_(0.0, 0.1)
        self.norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x) + self.position_ids[: x.shape[-1]].to(x.dtype) / 100)


torch.manual_seed(11)
model = Model()
config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3},
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
data = torch.Generator().manual_seed(100 + dist.get_rank())
for _ in range(2):
    x = torch.randn(2, 33, generator=data).to(torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(str(out / "checkpoint"))
dist.barrier()
if dist.get_rank() == 0:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    convert_zero_checkpoint_to_state_dict(str(out / "checkpoint"), str(out / "zero_to_fp32"))
dist.barrier()
# leave at once (torch 2.13's gloo threads can abort the interpreter's exit: see ds_probe.py)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding DeepSpeed's checkpoint/ and its zero_to_fp32 output, zero_to_fp32/."""
    out = tmp_path_factory.mktemp("small_frozen")
    script = out / "worker.py"
    script.write_text(WORKER)
    python = ds_python()
    cmd = [
        *launcher(python),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(script),
        str(out),
    ]
    log = out / "run.log"
    returncode = run_logged(cmd, ds_env(2, python), log, timeout=600)
    if returncode != 0 or not (out / "zero_to_fp32" / "pytorch_model.bin").is_file():
        pytest.fail(
            f"DeepSpeed run: exit status {returncode}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        )
    return out


def _records(path: Path) -> dict[str, tuple[int, int]]:
    """(size, CRC-32) of each tensor record, as the zip directory says (Python's zipfile)."""
    with zipfile.ZipFile(path) as archive:
        return {
            info.filename.split("/", 1)[1]: (info.file_size, info.CRC)
            for info in archive.infolist()
            if "/data/" in info.filename and info.file_size
        }


def test_deepspeed_wrote_small_frozen_slices_beside_one_buffer(made: Path) -> None:
    """The trigger, as DeepSpeed wrote it: the rank files' records that differ are all under 64
    bytes, and what is bigger (the buffer) is the same on both ranks."""
    tag = made / "checkpoint" / TAG
    assert sorted(p.name for p in tag.iterdir()) == sorted(
        [*MODEL_STATES, *(f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2))]
    )
    first, second = (_records(tag / name) for name in MODEL_STATES)
    assert first.keys() == second.keys()
    differing = [name for name in first if first[name] != second[name]]
    assert differing and all(first[name][0] < 64 for name in differing)
    assert [first[name][0] for name in first if name not in differing] == [48 * 8]  # position_ids, int64


def test_consolidate_inspect_and_verify_accept_it(made: Path, tmp_path: Path) -> None:
    consolidate(made / "checkpoint", tmp_path / "out")
    ours = load_output(tmp_path / "out")
    reference = load_output(made / "zero_to_fp32")
    assert set(ours) == set(reference) >= {"norm.weight", "norm.bias", "head.weight", "head.bias", "position_ids"}
    for name, tensor in reference.items():
        assert same_bits(ours[name], tensor), name
    report = inspect_path(str(made / "checkpoint"))
    assert report["complete"] and sorted(report["frozen"]) == ["norm.bias", "norm.weight"], report
    checked = verify(made / "checkpoint")
    assert checked.ok, checked.problems


def test_reshard_accepts_it(made: Path, tmp_path: Path) -> None:
    reshard(made / "checkpoint", tmp_path / "rs", world_size=3)
    consolidate(tmp_path / "rs", tmp_path / "out")
    ours = load_output(tmp_path / "out")
    for name, tensor in load_output(made / "zero_to_fp32").items():
        assert same_bits(ours[name], tensor), name


@pytest.mark.parametrize("source,victim", [(0, 1), (1, 0)])
def test_a_model_states_file_copied_over_another_is_refused(
    made: Path, tmp_path: Path, source: int, victim: int
) -> None:
    """Saved to a stream (no file name recorded), its 34-byte frozen slices are all that tells the
    ranks apart, and they do; saved to their paths, as DeepSpeed saves them, the name inside the
    copy tells first."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(made / "checkpoint", checkpoint)
    tag = checkpoint / TAG
    shutil.copyfile(tag / MODEL_STATES[source], tag / MODEL_STATES[victim])
    with pytest.raises(ZckptError, match=f"was saved as {MODEL_STATES[source]}"):
        consolidate(checkpoint, tmp_path / "out")
    for name in MODEL_STATES:
        as_saved_to_a_stream(tag / name)
    with pytest.raises(ZckptError) as caught:
        consolidate(checkpoint, tmp_path / "out")
    assert caught.value.path == str(tag / MODEL_STATES[max(source, victim)])
    assert "frozen-param partitions are byte-identical" in str(caught.value) and "copied over another" in str(
        caught.value
    )
    assert not (tmp_path / "out").exists()
    checked = verify(checkpoint)
    assert not checked.ok and any("copied over another" in p for p in checked.problems), checked.problems
