"""scripts/roundtrip.py, small: 2 ranks train and save, the checkpoint is consolidated, resharded
to 3 ranks and made universal, 3 ranks resume from each and continue; every check passes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("roundtrip_script", ROOT / "scripts" / "roundtrip.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy
@pytest.mark.slow
def test_roundtrip_two_to_three_ranks(tmp_path, capsys):
    code = _script().main(
        [
            "--from-world",
            "2",
            "--to-world",
            "3",
            "--steps",
            "5",
            "--save-at",
            "3",
            "--layers",
            "1",
            "--dim",
            "16",
            "--heads",
            "2",
            "--vocab",
            "29",
            "--seq-len",
            "8",
            "--sub-group-size",
            "300",
            "--tie-embeddings",
            "--work-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[-1] == "round trip passed" and len(lines) == 9 and all(line.startswith("ok") for line in lines[:-1])


def test_roundtrip_refuses_a_batch_it_cannot_split(tmp_path, capsys):
    code = _script().main(["--from-world", "2", "--to-world", "3", "--micro-batch", "2", "--work-dir", str(tmp_path)])
    assert code == 2 and "cannot be split over 3 ranks" in capsys.readouterr().err


@pytest.mark.heavy
@pytest.mark.slow
def test_roundtrip_with_nvme_two_to_three_ranks(tmp_path, capsys):
    """The same trip with NVMe offload of params, gradients and optimizer state: sub-groups of
    800000 elements, the 4096 x 256 embedding and lm head are swapped at 2 ranks and at 3."""
    code = _script().main(
        [
            "--nvme-params",
            "--from-world",
            "2",
            "--to-world",
            "3",
            "--steps",
            "4",
            "--save-at",
            "2",
            "--layers",
            "1",
            "--dim",
            "256",
            "--heads",
            "4",
            "--vocab",
            "4096",
            "--seq-len",
            "8",
            "--micro-batch",
            "3",
            "--grad-accum",
            "1",
            "--sub-group-size",
            "800000",
            "--work-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[-1] == "round trip passed" and len(lines) == 10 and all(line.startswith("ok") for line in lines[:-1])
    assert (
        "offloaded_tensors/ of the 2 ranks" in out and "sub-group(s) and 2 param(s) per rank on NVMe" in out
    )  # the embedding and the lm head
