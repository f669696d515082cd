"""Shared fixtures: the bundled sample checkpoints and their DeepSpeed reference outputs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def default_signals() -> None:
    """preexec_fn for a child that is signalled: SIGINT, SIGTERM and SIGHUP at their default
    dispositions, whatever this run inherited (a background or nohup test run has SIGINT or
    SIGHUP ignored, which zckpt then keeps ignoring, as it should)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
SAMPLES = ROOT / "sample_ckpts"


@dataclass(frozen=True)
class Sample:
    name: str
    folder: Path
    meta: dict

    @property
    def checkpoint(self) -> Path:
        return self.folder / self.meta.get("checkpoint", "checkpoint")

    @property
    def reference_file(self) -> Path:
        return self.folder / "reference" / "zero_to_fp32" / "pytorch_model.bin"

    @property
    def has_reference(self) -> bool:
        """False where DeepSpeed's own tool failed on the checkpoint (meta.json says how)."""
        return not self.meta.get("reference_error")

    def reference(self) -> dict[str, torch.Tensor]:
        """DeepSpeed zero_to_fp32.py's output (plain tensors, safe to load weights_only)."""
        if not self.has_reference:
            pytest.skip(f"zero_to_fp32.py failed on this checkpoint: {self.meta['reference_error']}")
        return torch.load(self.reference_file, weights_only=True)

    def expected_fp32(self) -> dict[str, torch.Tensor]:
        """What fp32 consolidation must give: zero_to_fp32.py's output where it has one, else
        the live values with floating tensors widened to fp32 (exact)."""
        if self.has_reference:
            return self.reference()
        return {n: t.float() if t.is_floating_point() else t for n, t in self.live().items()}

    def live(self) -> dict[str, torch.Tensor]:
        """fp32 masters, frozen params and buffers read from the live engine before saving."""
        from safetensors.torch import load_file

        return load_file(self.folder / "reference" / "live.safetensors")


def load_samples() -> list[Sample]:
    samples = []
    for meta_file in sorted(SAMPLES.glob("*/meta.json")):
        samples.append(Sample(meta_file.parent.name, meta_file.parent, json.loads(meta_file.read_text())))
    return samples


SAMPLE_LIST = load_samples()


def sample(name: str) -> Sample:
    return next(s for s in SAMPLE_LIST if s.name == name)


@pytest.fixture(params=SAMPLE_LIST, ids=lambda s: s.name)
def any_sample(request: pytest.FixtureRequest) -> Sample:
    return request.param


@pytest.fixture
def copy_checkpoint(tmp_path: Path):
    """Copy a sample's checkpoint folder somewhere it may be damaged."""

    def make(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(sample(name).checkpoint, target)
        return target

    return make


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and every bit (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))) if a.numel() else True


def run_zckpt_torchrun(*args: str, processes: int = 2) -> "subprocess.CompletedProcess[str]":
    """`torchrun --nproc-per-node <processes> -m zckpt <args>` on a free port; fails the test
    with the processes' stderr when they fail."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port", str(port), "-m", "zckpt", *args],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result
