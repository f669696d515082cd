"""A param name DeepSpeed allows but zckpt cannot put in a file name: what DeepSpeed's own
universal tools do with it, and what zckpt does instead (README, "What an untrusted checkpoint
cannot do"). Needs DeepSpeed: ``pytest -m deepspeed -p interop_helpers tests/test_interop/test_interop_untrusted.py``.

torch refuses only '.' and '' in module and param names, so ``add_module("adapter/v2", ...)``
gives params ``adapter/v2.0.weight``, and DeepSpeed trains and saves them. Its ``ds_to_universal``
then writes ``zero/adapter/v2.0.weight/`` (nested folders: the name is split at '/'), and its
universal loader reads exactly that path. zckpt refuses to use such a name as a folder: an
encoded name (``adapter%2Fv2.0.weight``) is shown here to break DeepSpeed's loader, and a nested
layout is no one-to-one naming (a param ``a`` and a module ``a/b`` would share ``zero/a/``).
The same checkpoint still consolidates and reshards, and DeepSpeed loads the reshard.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import ROOT, Sample, same_bits

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_checks import DS_TO_UNIVERSAL, GEN, _check_resumed  # noqa: E402
from interop_helpers import (  # noqa: E402,F401 (autouse fixture)
    ProbeError,
    ds_env,
    ds_python,
    extensions_for,
    run_logged,
    run_probe,
    shm_leak_safety_net,
)
from zckpt import reshard  # noqa: E402

SLASHED = GEN.Case(
    "fresh_slash_names_z2_fp32_ws2",
    "ds19",
    2,
    "fp32",
    2,
    adapter_name="adapter/v2",
    vocab=19,
    dim=23,
    hidden=13,
    seed=5,
)
NAME = "adapter/v2.0.weight"  # one of the params the '/' is in


@pytest.fixture(scope="module")
def slashed(tmp_path_factory: pytest.TempPathFactory) -> Sample:
    root = tmp_path_factory.mktemp("slashed")
    pythons = {"ds19": ds_python(), "ds14": ds_python()}
    GEN.generate(SLASHED, root, pythons, root, extensions=extensions_for(pythons))
    found = Sample(SLASHED.name, root / SLASHED.name, json.loads((root / SLASHED.name / "meta.json").read_text()))
    assert NAME in found.live()  # DeepSpeed trained and saved it under that name
    return found


def zckpt(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "zckpt", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def ds_to_universal(checkpoint: Path, out: Path) -> Path:
    """DeepSpeed's ds_to_universal of `checkpoint` into `out` (the folder it makes, beside a copy)."""
    tag = (checkpoint / "latest").read_text().strip()
    shutil.copytree(checkpoint, out)
    folder = out / f"{tag}_universal"
    python = ds_python()
    log = out.parent / "ds_to_universal.log"
    rc = run_logged(
        [python, "-c", DS_TO_UNIVERSAL, json.dumps({"case": [str(out / tag), str(folder)]})],
        ds_env(1, python),
        log,
        timeout=600,
    )
    results = json.loads(
        next(x for x in log.read_text().splitlines() if x.startswith("RESULTS ")).removeprefix("RESULTS ")
    )
    assert rc == 0 and results["case"] is None, results
    shutil.rmtree(out / tag)
    (out / "latest").unlink()  # only latest_universal: the probe's load_universal finds it
    return folder


def test_zckpt_refuses_a_name_with_a_slash_as_a_folder(slashed: Sample, tmp_path: Path) -> None:
    result = zckpt("to-universal", slashed.checkpoint, tmp_path / "uc", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert (
        "param name 'adapter/v2." in lines[0]
        and "holds '/'" in lines[0]
        and str(slashed.checkpoint / "global_step3") in lines[0]
    )
    assert not (tmp_path / "uc").exists()


def test_deepspeed_nests_such_a_name_and_reads_it_only_there(slashed: Sample, tmp_path: Path) -> None:
    """ds_to_universal splits the name into folders; DeepSpeed's loader finds the param there and
    nowhere else (an encoded single folder is not found), and zckpt refuses to read it."""
    folder = ds_to_universal(slashed.checkpoint, tmp_path / "uc")
    assert (folder / "zero" / "adapter" / "v2.0.weight" / "fp32.pt").is_file()
    assert not any("/" in p.name for p in (folder / "zero").iterdir())
    live, optim, state = run_probe(SLASHED, tmp_path / "uc", 2, tmp_path / "probe", load_universal=True)
    _check_resumed(slashed, SLASHED, live, optim, state, world_size=2, stage=2, universal=True)

    result = zckpt("inspect", tmp_path / "uc", cwd=tmp_path)
    assert result.returncode == 3 and "param name 'adapter/v2." in result.stdout, result.stdout
    result = zckpt("consolidate", tmp_path / "uc", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 1 and "holds '/'" in result.stderr and not (tmp_path / "out").exists(), result.stderr

    # a reversible encoding of the name, one folder per param: DeepSpeed's loader cannot find it
    for nested in sorted((folder / "zero" / "adapter").iterdir()):
        shutil.move(nested, folder / "zero" / f"adapter%2F{nested.name}")
    (folder / "zero" / "adapter").rmdir()
    with pytest.raises(ProbeError) as failed:
        run_probe(SLASHED, tmp_path / "uc", 2, tmp_path / "probe_encoded", load_universal=True)
    assert "adapter/v2" in failed.value.error_text


def test_deepspeed_loads_zckpts_reshard_of_such_a_checkpoint(slashed: Sample, tmp_path: Path) -> None:
    """Where a name is only a key (consolidate, reshard) it is taken as it is: the reshard to
    3 ranks loads in DeepSpeed with every master and Adam moment, '/' names included."""
    reshard(slashed.checkpoint, tmp_path / "rs", world_size=3)
    live, optim, state = run_probe(SLASHED, tmp_path / "rs", 3, tmp_path / "probe")
    _check_resumed(slashed, SLASHED, live, optim, state, world_size=3, stage=2, universal=False)
    result = zckpt("consolidate", slashed.checkpoint, tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    written, expected = load_file(tmp_path / "out" / "model.safetensors"), slashed.live()
    assert same_bits(written[NAME], expected[NAME])
