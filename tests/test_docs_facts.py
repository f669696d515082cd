"""Facts in the docs that can go stale, checked against the code and the repository: the exit-code
table (docs/reference/exit-codes.md) run row by row through the real CLI, the command-line
reference (docs/reference/cli.md) against a fresh generation from the live CLI, every help text's
width, the sample folder's count and size (docs/explanation/samples.md), the package map against
the tree (docs/explanation/how-it-works.md), and the documented `inspect --json` keys
(docs/reference/json.md) against a real report."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from helpers import ROOT, SAMPLES
from zckpt.cli.app import app

DOCS = ROOT / "docs"
COMMANDS = typer.main.get_command(app).commands


def page(path: str) -> str:
    return (DOCS / path).read_text()


# --- the exit-code table -------------------------------------------------------------------------


def exit_code_rows() -> list[tuple[int, str]]:
    rows = re.findall(r"^\| (\d) \|[^|]*\| `(zckpt [^`]+)` \|$", page("reference/exit-codes.md"), flags=re.M)
    return [(int(code), command) for code, command in rows]


ROWS = exit_code_rows()


def test_the_table_covers_every_code_and_command() -> None:
    assert {code for code, _ in ROWS} == {0, 1, 2, 3}
    assert len(ROWS) >= 30
    assert {"consolidate", "reshard", "to-universal", "inspect", "verify", "diff", "nvme-plan"} <= {
        c.split()[1] for _, c in ROWS
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the exit-code table describes."""
    root = tmp_path_factory.mktemp("readme")
    runs = root / "runs"
    shutil.copytree(SAMPLES / "z2_fp32_ws1" / "checkpoint", runs / "ckpt")
    shutil.copytree(SAMPLES / "z2_fp32_ws1" / "checkpoint", runs / "damaged")
    optim = runs / "damaged" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    shutil.copytree(SAMPLES / "z1_fp32_ws2_frozen_tied" / "checkpoint", runs / "other")
    shutil.copytree(SAMPLES / "z2_fp32_ws2_twotags" / "checkpoint", runs / "two-tags")
    (runs / "two-tags" / "latest").unlink()
    shutil.copytree(SAMPLES / "z2_fp32_ws1" / "checkpoint", runs / "escape")
    (runs / "escape" / "latest").write_text("../x")
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("mine")
    (root / "done").mkdir()
    (root / "done" / "model.safetensors").write_bytes(b"weights of an earlier run")
    return root


@pytest.mark.parametrize("code, command", ROWS, ids=[c for _, c in ROWS])
def test_exit_code_as_the_docs_say(workdir: Path, tmp_path: Path, code: int, command: str) -> None:
    """Each row of the table, run as written (in a fresh copy of the folder it describes)."""
    here = tmp_path / "cwd"
    shutil.copytree(workdir, here, symlinks=True)
    env = {k: v for k, v in os.environ.items() if k != "ZCKPT_DEBUG"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = shlex.split(command)
    done = subprocess.run(
        [sys.executable, "-m", "zckpt", *argv[1:]], cwd=here, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == code, f"{command}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    if code in (1, 2):  # one line, the CLI's own
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("zckpt: error: "), done.stderr
    if code == 0 and argv[1] == "consolidate":
        assert (here / argv[3] / "model.safetensors").is_file()
    if code in (1, 2) and argv[1] in ("consolidate", "reshard", "to-universal", "to-dcp"):  # nothing written
        assert not (here / "out").exists() and not (here / "runs" / "ckpt" / "out").exists()
        assert (here / "done" / "model.safetensors").read_bytes() == b"weights of an earlier run"


# --- the command-line reference --------------------------------------------------------------------


def test_cli_reference_is_generated_from_the_live_cli() -> None:
    """docs/reference/cli.md is what scripts/gen_cli_reference.py writes now: a renamed or new
    option changes the page, and this test says to regenerate it."""
    spec = importlib.util.spec_from_file_location("gen_cli_reference", ROOT / "scripts" / "gen_cli_reference.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert page("reference/cli.md") == generator.render(), (
        "docs/reference/cli.md is stale: run python scripts/gen_cli_reference.py"
    )
    assert page("reference/exit-codes.md") == generator.exit_page(page("reference/exit-codes.md")), (
        "docs/reference/exit-codes.md's table is stale: run python scripts/gen_cli_reference.py"
    )


@pytest.mark.slow  # eight CLI processes
def test_json_schemas_page_is_generated_from_the_live_cli() -> None:
    """docs/reference/json-schemas.md is what scripts/gen_json_reference.py writes now."""
    spec = importlib.util.spec_from_file_location("gen_json_reference", ROOT / "scripts" / "gen_json_reference.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert page("reference/json-schemas.md") == generator.render(), (
        "docs/reference/json-schemas.md is stale: run python scripts/gen_json_reference.py"
    )


def test_every_command_and_visible_option_is_in_the_reference() -> None:
    text = page("reference/cli.md")
    for name, command in COMMANDS.items():
        assert f"## zckpt {name}\n" in text, name
        for param in command.params:
            if param.param_type_name == "option" and not getattr(param, "hidden", False):
                assert re.search(rf"`{re.escape(param.opts[0])}[` ]", text), f"{name}: {param.opts[0]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["", *sorted(COMMANDS)])
def test_help_fits_80_columns(name: str, tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "zckpt", *([name] if name else []), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    wide = [line for line in done.stdout.splitlines() if len(line) > 80]
    assert not wide, f"zckpt {name} --help: {len(wide)} lines over 80 columns, e.g. {wide[0]!r}"


# --- the samples -----------------------------------------------------------------------------------


def test_sample_count_and_size_as_the_docs_say() -> None:
    found = re.search(r"`sample_ckpts/` \((\d+) MB\) holds (\d+) small checkpoints", page("explanation/samples.md"))
    assert found, "the samples page's sentence on sample_ckpts/ changed: update this test with it"
    megabytes, count = int(found[1]), int(found[2])
    checkpoints = [p.parent for p in SAMPLES.rglob("latest")]
    size = sum(p.stat().st_size for p in SAMPLES.rglob("*") if p.is_file())
    assert count == len(checkpoints), f"the docs say {count} checkpoints, sample_ckpts/ holds {len(checkpoints)}"
    assert megabytes == round(size / 1e6), f"the docs say {megabytes} MB, sample_ckpts/ holds {size / 1e6:.1f} MB"


# --- the package map -----------------------------------------------------------------------------


def package_map() -> tuple[list[str], list[str]]:
    """The files and folders the tree map at the top of docs/explanation/how-it-works.md names, as paths
    from the repository root: one entry per line, indented two spaces a folder level; a line
    names a folder (``core/``) or modules (``errors.py, dtypes.py``), then says what they do."""
    block = page("explanation/how-it-works.md").split("```")[1]
    files: list[str] = []
    folders: list[str] = []
    parents: list[str] = []  # the folder of each indentation level so far
    for line in block.strip("\n").splitlines():
        level = (len(line) - len(line.lstrip(" "))) // 2
        names = [n.strip() for n in re.split(r"\s{2,}", line.strip())[0].split(",")]
        del parents[level:]
        here = "/".join(parents)
        for name in names:
            assert re.fullmatch(r"[\w.]+\.py|\w+/", name), (
                f"the map's line {line.strip()!r}: {name!r} is no module or folder"
            )
            (folders if name.endswith("/") else files).append(f"{here}/{name}".lstrip("/").rstrip("/"))
        if names[0].endswith("/"):
            parents.append(names[0].rstrip("/"))
    return files, folders


def test_the_package_map_is_the_tree() -> None:
    """Every module file appears in the map once, and the map names nothing that is not there
    (a folder's line stands for its __init__.py; the package's own __init__.py is listed)."""
    files, folders = package_map()
    package = ROOT / "zckpt"
    modules = sorted(
        str(p.relative_to(ROOT)) for p in package.rglob("*.py") if p.name != "__init__.py" or p.parent == package
    )
    packages = sorted(str(p.parent.relative_to(ROOT)) for p in package.rglob("__init__.py"))
    assert sorted(set(files)) == sorted(files), (
        f"the map lists {sorted({f for f in files if files.count(f) > 1})} twice"
    )
    assert sorted(folders) == packages, (
        f"the map's folders {sorted(set(folders) ^ set(packages))} differ from the package's"
    )
    missing, absent = sorted(set(modules) - set(files)), sorted(set(files) - set(modules))
    assert not missing and not absent, f"the map lacks {missing} and names {absent}, which do not exist"


# --- the documented --json keys --------------------------------------------------------------------


def test_inspect_json_keys_are_documented() -> None:
    """Every key a real `inspect --json` report has is in docs/reference/json.md's table, and the
    table names no key the report lacks."""
    table = page("reference/json.md").split("<!-- keys: inspect -->", 1)[1].split("\n\n", 1)[0]
    documented = {key for row in table.splitlines()[2:] for key in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    done = subprocess.run(
        [sys.executable, "-m", "zckpt", "inspect", str(SAMPLES / "z2_fp32_ws1" / "checkpoint"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    emitted = set(json.loads(done.stdout))
    assert emitted <= documented, f"inspect --json emits {sorted(emitted - documented)}, undocumented"
    assert documented <= emitted, f"the docs list {sorted(documented - emitted)}, which inspect --json lacks"


# --- the compatibility matrix ----------------------------------------------------------------------

MATRIX_COMMANDS = {
    "C": "consolidate",
    "I": "inspect",
    "V": "verify",
    "R": "reshard",
    "U": "to-universal",
    "D": "to-dcp",
}


def matrix_rows() -> list[tuple[str, str, str, str]]:
    """(layout, sample folder, command, cell) for every non-empty cell of the layouts table."""
    table = page("compatibility.md").split("## Layouts and commands", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        layout, samples = cells[0], re.findall(r"`([^`]+)`", cells[1])
        for letter, cell in zip(head[2:], cells[2:]):
            if cell:
                for pattern in samples:
                    found = sorted(p for p in SAMPLES.glob(pattern) if p.is_dir())
                    assert found, f"{layout}: no sample matches {pattern}"
                    rows.append((layout, found[0].name, MATRIX_COMMANDS[letter], cell))
    return rows


def checkpoint_of(sample: Path) -> tuple[Path, list[str]]:
    """The sample's checkpoint folder (the first holding `latest`), and the options it needs."""
    if (sample / "live_swap").is_dir():
        return sample / "checkpoint", ["--swap-folder", str(sample / "live_swap")]
    latest = sorted(p.parent for p in sample.rglob("latest"))
    return latest[0], []


@pytest.mark.slow
@pytest.mark.parametrize("layout, name, command, cell", matrix_rows(), ids=lambda v: str(v)[:40])
def test_compatibility_matrix_cell_runs(tmp_path: Path, layout: str, name: str, command: str, cell: str) -> None:
    """Each filled cell of docs/compatibility.md, run on the first sample its row names: exit 0."""
    ckpt, extra = checkpoint_of(SAMPLES / name)
    if command == "inspect" and extra:  # a swap folder, described against a checkpoint of its run
        argv = [command, extra[1], "--checkpoint", str(ckpt)]
    elif command == "verify" and extra:
        argv = [command, str(ckpt), *extra]
    elif command in ("inspect", "verify"):
        argv = [command, str(ckpt)]
    else:
        argv = [command, str(ckpt), str(tmp_path / "out"), *extra]
    if command == "reshard":
        argv += ["-w", "4" if name.startswith("moe_") else "2"]
        if re.search(r"(^|_)z0_", name):  # ZeRO-0 runs are written as ZeRO files ("to ZeRO-1/2/3")
            argv += ["--stage", "1"]
    if command == "to-universal" and ("megatron" in name or "autotp" in name) and "z3" in name:
        argv += ["--target-stage", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "zckpt", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{layout} / {command} on {name}: exit {done.returncode}\n{done.stderr[-2000:]}"


# --- the troubleshooting page ----------------------------------------------------------------------


def test_troubleshooting_quotes_zckpts_own_messages() -> None:
    """Each zckpt message the troubleshooting page quotes is in the package's source, so a
    reworded message makes the page's entry fail here rather than go unfound by a search."""
    text = page("troubleshooting.md").split("## zckpt's messages", 1)[1]
    quoted = re.findall(r'^### "(.+)"', text, flags=re.M)
    assert len(quoted) >= 6
    source = " ".join(p.read_text() for p in (ROOT / "zckpt").rglob("*.py"))
    for message in quoted:
        for fragment in re.split(r"\.\.\.|\(\.\.\.\)|\d+|--\w+", message):
            fragment = fragment.strip(" ;()'")
            if len(fragment) >= 8:
                assert fragment in source, f"troubleshooting quotes {message!r}: {fragment!r} is in no zckpt message"
