"""zckpt as a package: one version, the public API visible to dir(), and the built wheel installed
into a fresh venv outside the checkout, where it consolidates a sample as the checkout does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from helpers import ROOT, SAMPLES, run_cli

SAMPLE = SAMPLES / "z3_bf16_ws3_subgroups_groups" / "checkpoint"


def test_dir_lists_the_public_api() -> None:
    # the API is imported on first use (_Package.__getattr__); dir() and tab completion still show it
    names = dir(zckpt)
    assert set(zckpt.__all__) <= set(names), sorted(set(zckpt.__all__) - set(names))
    assert names == sorted(names) and "__version__" in names


def test_dir_imports_nothing_heavy() -> None:
    code = "import sys, zckpt; dir(zckpt); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


def test_one_version_source() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "zckpt.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", zckpt.__version__)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{zckpt.__version__}]" in changelog, "CHANGELOG.md has no section for the current version"


def _venv_bin(venv: Path, name: str) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / name


def _build(out: Path) -> tuple[Path, Path]:
    """`python -m build` of the checkout: the sdist, then the wheel built from the sdist (so the sdist
    is proven complete). --no-isolation: the test extra's setuptools and build, no package index."""
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.fail("build is a test dependency: pip install -e '.[test]'")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,) = out.glob("zckpt-*.tar.gz")
    (wheel,) = out.glob("zckpt-*.whl")
    return sdist, wheel


def _fresh_venv(venv: Path) -> Path:
    """A venv outside the checkout that sees torch and the other dependencies through a .pth file
    naming this interpreter's site-packages (installing torch again costs minutes and gigabytes). A
    path in a .pth file is only appended to sys.path: the .pth files there (an editable install's
    finder) are not run, and the venv's own site-packages, where the wheel goes, comes first."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = _venv_bin(venv, "python")
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    Path(site, "zz_dependencies.pth").write_text("".join(f"{path}\n" for path in deps))
    return python


@pytest.mark.heavy
@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    dist.mkdir()
    sdist, wheel = _build(dist)
    assert wheel.name == f"zckpt-{zckpt.__version__}-py3-none-any.whl"

    # the sdist: sources, license and documents; no tests or samples
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "zckpt/__init__.py"} <= names
    assert not [name for name in names if name.startswith(("tests/", "sample_ckpts/", "scripts/", "docs/"))]

    # the wheel: the package and its metadata only
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"zckpt-{zckpt.__version__}.dist-info/METADATA").decode()
    dist_info = f"zckpt-{zckpt.__version__}.dist-info/"
    assert not [name for name in names if not name.startswith(("zckpt/", dist_info))]
    assert "zckpt/cli/app.py" in names and f"{dist_info}licenses/LICENSE" in names
    assert f"Version: {zckpt.__version__}\n" in metadata and "License-Expression: Apache-2.0\n" in metadata

    venv = tmp_path / "venv"
    python = _fresh_venv(venv)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    # run as a user would: the venv's own command, from a folder outside the checkout, no PYTHONPATH
    work = tmp_path / "work"
    shutil.copytree(SAMPLE, work / "checkpoint")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZCKPT_DEBUG")}
    env["PYTHONNOUSERSITE"] = "1"

    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*map(str, args)], cwd=work, env=env, capture_output=True, text=True, timeout=300)

    where = run(python, "-c", "import zckpt; print(zckpt.__file__)")
    assert where.returncode == 0, where.stderr
    location = Path(where.stdout.strip()).resolve()
    assert location.is_relative_to(venv.resolve()) and not location.is_relative_to(ROOT), location

    command = _venv_bin(venv, "zckpt")
    version = run(command, "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"zckpt {zckpt.__version__}", version
    consolidated = run(command, "consolidate", work / "checkpoint", work / "out")
    assert consolidated.returncode == 0, consolidated.stderr
    inspected = run(command, "inspect", work / "out")
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr

    # the same output as the checkout's own command
    reference = run_cli("consolidate", SAMPLE, tmp_path / "reference", cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr
    files = sorted(path.name for path in (work / "out").iterdir())
    assert files == sorted(path.name for path in (tmp_path / "reference").iterdir()) and "model.safetensors" in files
    for name in files:
        if not name.endswith(".safetensors"):
            continue
        ours, theirs = load_file(work / "out" / name), load_file(tmp_path / "reference" / name)
        assert ours.keys() == theirs.keys() and ours
        for key, tensor in ours.items():
            assert tensor.dtype == theirs[key].dtype and torch.equal(tensor, theirs[key]), key
