"""Damaged files (bit flips, truncation, zeroed runs) must end in a ZckptError naming a file,
never in another exception, and inspect must describe rather than raise."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from conftest import sample
from zckpt import ZckptError, consolidate, inspect_path


def damage(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    mode = rng.choice(["flip", "cut", "zero"])
    if mode == "flip":
        for _ in range(rng.randint(1, 20)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif mode == "cut":
        data = data[: rng.randrange(len(data))]
    else:
        start = rng.randrange(len(data))
        data[start : start + rng.randint(1, 500)] = bytes(min(500, len(data) - start))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["z3_fp32_ws2_tied_frozen", "z2_bf16_ws3_frozen_groups", "z3_bf16_ws2_nvmeoffload_frozen_tied_groups"])
@pytest.mark.parametrize("seed", range(25))
def test_damaged_checkpoints_fail_cleanly(tmp_path: Path, name: str, seed: int) -> None:
    rng = random.Random(seed)
    case = sample(name)
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(case.checkpoint, checkpoint)
    files = sorted(p for p in (checkpoint / case.meta["tag"]).rglob("*") if p.is_file())
    victim = rng.choice(files)
    damage(victim, rng)
    report = inspect_path(str(checkpoint))
    assert isinstance(report["complete"], bool)
    try:
        consolidate(checkpoint, tmp_path / "out")
    except ZckptError as exc:
        assert exc.path, exc
        assert not (tmp_path / "out").exists()
