"""pytest fixtures over the bundled samples (helpers.py holds the plain functions and data)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import SAMPLE_LIST, Sample, sample


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
