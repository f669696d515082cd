"""Every example in README.md, BENCHMARKS.md and docs/**/*.md runs: each ```bash and ```python block is executed
against copies of the bundled samples, and where the page shows the output, the output is compared.

Markers, an HTML comment on the line(s) before a block, several joined by ``;``:

- ``<!-- test: output -->`` before a ```text block: the output of the example block above it
  (stdout and stderr together). ``...`` alone on a line stands for any lines (timings, long
  listings); ``...`` inside a line for any text on that line. Trailing spaces are ignored.
- ``<!-- test: exit=3 -->``: the block's exit status (default 0).
- ``<!-- test: interop -->``: needs DeepSpeed, torchrun, transformers or Lightning; generated with
  the ``deepspeed`` marker, so it runs in the interop tier only.
- ``<!-- test: slow -->``: a slow example (every example is marked ``slow`` anyway: each is a real
  process, so the inner loop, ``-m "not slow"``, keeps only the checks of the markers themselves).
- ``<!-- test: ci -->``: an install step that ``.ci/run`` runs; checked to be there.
- ``<!-- test: skip REASON -->``: cannot run anywhere; kept few (MAX_SKIPS).

A page's blocks run in order in one folder (a later block may use an earlier one's output). Paths
``sample_ckpts/<name>`` are copies of the bundled samples; a page may name other paths at its top,
``<!-- test-workspace: runs/ckpt=z2_fp32_ws1/checkpoint out/old=z1_fp32_ws2_frozen_tied/checkpoint -->``,
each a copy of that sample path. ``.venv`` is the interpreter running the tests.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import ROOT, SAMPLES

MAX_SKIPS = 6
EXAMPLE_LANGS = {"bash", "sh", "python"}
KNOWN = {"output", "interop", "slow", "ci", "skip", "exit"}


@dataclass
class Block:
    page: str  # path from the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    markers: dict[str, str] = field(default_factory=dict)
    output: str | None = None  # the expected output, from a following ```text block marked output

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse_markers(comment: str) -> dict[str, str]:
    markers: dict[str, str] = {}
    for part in comment.split(";"):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.partition("=") if "=" in part.split()[0] else part.partition(" ")
        assert key in KNOWN, f"unknown docs test marker {key!r} in <!-- test: {comment} -->"
        markers[key] = value.strip()
    return markers


def parse(path: Path) -> tuple[list[Block], dict[str, str]]:
    """The page's example blocks (each with its markers and expected output) and its workspace."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    workspace: dict[str, str] = {}
    pending: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := re.fullmatch(r"\s*<!-- test-workspace:(.*)-->\s*", line):
            for pair in m[1].split():
                name, _, source = pair.partition("=")
                workspace[name.rstrip("/")] = source
        elif m := re.fullmatch(r"\s*<!-- test:(.*)-->\s*", line):
            pending.update(parse_markers(m[1]))
        elif m := re.fullmatch(r"(\s*)```(\S*)\s*", line):
            indent, lang, start = len(m[1]), m[2], i
            body: list[str] = []
            i += 1
            while i < len(lines) and not re.fullmatch(r"\s*```\s*", lines[i]):
                body.append(lines[i][indent:])
                i += 1
            text = "\n".join(body) + "\n"
            if "output" in pending:
                assert blocks and lang == "text", f"{page}:{start + 1}: an output block follows no example"
                assert blocks[-1].output is None, f"{page}:{start + 1}: a second output for one example"
                blocks[-1].output = text
            elif lang in EXAMPLE_LANGS:
                blocks.append(Block(page, start + 1, lang, text, pending))
            else:
                assert not pending, f"{page}:{start + 1}: markers {pending} before a ```{lang} block"
            pending = {}
        elif line.strip() and pending:
            raise AssertionError(f"{page}:{i + 1}: markers {pending} followed by text, not a block")
        i += 1
    return blocks, workspace


PAGES = {str(p.relative_to(ROOT)): parse(p) for p in doc_pages()}
BLOCKS = [b for blocks, _ in PAGES.values() for b in blocks]


def params() -> list:
    out = []
    for b in BLOCKS:
        marks = [pytest.mark.slow]
        if "interop" in b.markers:
            marks.append(pytest.mark.deepspeed)
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


# --- running ---------------------------------------------------------------------------------------


def output_pattern(expected: str) -> re.Pattern[str]:
    parts = []
    for line in expected.rstrip("\n").splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in line.rstrip().split("...")) + r"\n")
    return re.compile("".join(parts), flags=re.S)


def normalise(output: str) -> str:
    return "".join(line.rstrip() + "\n" for line in output.splitlines())


def copy_sample(workspace: Path, name: str, source: str) -> None:
    target = workspace / name
    if target.exists():
        return
    origin = SAMPLES / source
    assert origin.exists(), f"workspace entry {name}: no sample path {source}"
    target.parent.mkdir(parents=True, exist_ok=True)
    if origin.is_dir():
        shutil.copytree(origin, target, symlinks=True)
    else:
        shutil.copy2(origin, target)


def prepare(workspace: Path, page: str, block: Block) -> None:
    for name in set(re.findall(r"sample_ckpts/([\w.=-]+)", block.text + (block.output or ""))):
        copy_sample(workspace, f"sample_ckpts/{name}", name)
    for name, source in PAGES[page][1].items():
        if re.search(rf"(?<![\w/.-]){re.escape(name)}(?![\w.-])", block.text):
            copy_sample(workspace, name, source)


def run_block(workspace: Path, block: Block) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ZCKPT_DEBUG", "COLUMNS")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if block.lang == "python":
        script = workspace / f".example_{block.line}.py"
        script.write_text(block.text)
        argv = [sys.executable, script.name]
    else:
        script = workspace / f".example_{block.line}.sh"
        script.write_text("set -eo pipefail\n" + block.text)
        argv = ["bash", script.name]
    return subprocess.run(
        argv, cwd=workspace, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )


_workspaces: dict[str, tuple[Path, set[int]]] = {}


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory: pytest.TempPathFactory):
    yield _workspaces
    _workspaces.clear()


def workspace_for(page: str, upto: Block, factory: pytest.TempPathFactory) -> Path:
    """The page's folder with every runnable block before ``upto`` already run."""
    if page not in _workspaces:
        root = factory.mktemp(re.sub(r"\W", "_", page))
        (root / ".venv").symlink_to(sys.prefix, target_is_directory=True)
        _workspaces[page] = (root, set())
    root, done = _workspaces[page]
    for block in PAGES[page][0]:
        if block is upto:
            break
        if block.line in done or set(block.markers) & {"skip", "ci"}:
            continue
        if "interop" in block.markers and "interop" not in upto.markers:
            continue  # the default tier cannot run it; later default-tier blocks must not need it
        prepare(root, page, block)
        done.add(block.line)
        result = run_block(root, block)
        assert result.returncode == int(block.markers.get("exit", 0)), (
            f"{block.id} (run before {upto.id}) exited {result.returncode}:\n{result.stdout}"
        )
    done.add(upto.line)
    return root


@pytest.mark.parametrize("block", params())
def test_example_runs(block: Block, workspaces, tmp_path_factory: pytest.TempPathFactory) -> None:
    if "skip" in block.markers:
        pytest.skip(block.markers["skip"] or "marked skip")
    if "ci" in block.markers:
        check_in_ci(block)
        return
    if "interop" in block.markers and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed: an interop example (the deepspeed tier runs it)")
    root = workspace_for(block.page, block, tmp_path_factory)
    prepare(root, block.page, block)
    result = run_block(root, block)
    expected = int(block.markers.get("exit", 0))
    assert result.returncode == expected, f"{block.id}: exit {result.returncode}, expected {expected}\n{result.stdout}"
    if block.output is not None:
        actual = normalise(result.stdout)
        matched = output_pattern(block.output).fullmatch(actual) is not None
        assert matched, (
            f"{block.id}: the output differs from the page's.\n--- page:\n{block.output}--- actual:\n{actual}"
        )


def check_in_ci(block: Block) -> None:
    """An install step the page shows is one .ci/run runs (CI pins torch and quiets pip)."""
    ci = [
        re.sub(r"\s+", " ", line.replace(" -q", "").replace(" torch==2.13.0", "")).strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
    ]
    for line in block.text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            assert line in ci, f"{block.id}: {line!r} is not a step of .ci/run"


# --- the markers themselves ------------------------------------------------------------------------


def test_skips_are_few_and_say_why() -> None:
    skips = [b for b in BLOCKS if "skip" in b.markers]
    assert all(b.markers["skip"] for b in skips), [b.id for b in skips if not b.markers["skip"]]
    assert len(skips) <= MAX_SKIPS, f"{len(skips)} examples skipped: {[b.id for b in skips]}"


def test_every_page_has_runnable_examples_where_it_shows_commands() -> None:
    """A shell or Python example written in any other fence (``console``, none) would escape the
    runner: every fence of README and docs names a language, and commands go in bash blocks."""
    for page in doc_pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if m := re.fullmatch(r"\s*```(\S*)\s*", line):
                assert m[1] != "console" and m[1] != "shell", f"{page.relative_to(ROOT)}:{n}: use ```bash"


def test_the_runner_finds_examples() -> None:
    assert len([b for b in BLOCKS if b.page == "README.md"]) >= 8
    assert any(b.output for b in BLOCKS)
