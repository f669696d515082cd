"""ruff, as pyproject.toml configures it (lint rules and the formatter, 120 columns), passes on the
whole tree: the README's test command is also the style check."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_passes(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "No module named ruff" not in done.stderr, "ruff is a test dependency: pip install -e '.[test]'"
    assert done.returncode == 0, done.stdout + done.stderr
