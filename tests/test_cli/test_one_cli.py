"""One CLI (issue 37 item 5): -q, --json and -d/--debug on every command, writing ones included;
one exit-code table rendered by the help; every command takes a checkpoint's 'latest' file; shell
completion on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer.main

from helpers import run_cli, runner, sample
from zckpt.cli import exit_codes, shared
from zckpt.cli.app import app
from zckpt.core.errors import ZckptError

COMMANDS = typer.main.get_command(app).commands
WRITERS = ("consolidate", "reshard", "to-universal", "to-dcp")
WRITE_KEYS = {"schema", "command", "inputs", "outputs", "files", "bytes", "tensors", "seconds", "notes"}


def argv(command: str, checkpoint: str, tmp_path: Path) -> list[str]:
    """`command` run on `checkpoint` (a ZeRO-2 sample that every command reads)."""
    out = str(tmp_path / command)
    return {
        "consolidate": ["consolidate", checkpoint, out],
        "reshard": ["reshard", checkpoint, out, "-w", "2"],
        "to-universal": ["to-universal", checkpoint, out],
        "to-dcp": ["to-dcp", checkpoint, out],
        "inspect": ["inspect", checkpoint],
        "verify": ["verify", checkpoint],
        "diff": ["diff", checkpoint, checkpoint],
        "nvme-plan": ["nvme-plan", checkpoint],
        "train": ["train", "--steps", "1", "--out", out],
    }[command]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_json_is_one_object_and_nothing_else(tmp_path: Path, command: str) -> None:
    checkpoint = str(sample("z2_fp32_ws1").checkpoint)
    result = runner.invoke(app, [*argv(command, checkpoint, tmp_path), "--json"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    report = json.loads(result.stdout)  # the whole of stdout is the one object
    assert isinstance(report, dict) and report["schema"] == f"zckpt.{command}/1"
    assert result.stderr == ""
    if command in (*WRITERS, "train"):
        assert WRITE_KEYS <= set(report) and report["command"] == command
        assert report["files"] and report["bytes"] == sum(f["bytes"] for f in report["files"])
        assert isinstance(report["seconds"], float) and isinstance(report["notes"], list)
        for row in report["files"]:
            assert (tmp_path / command / row["path"]).stat().st_size == row["bytes"]
        if command in ("consolidate", "to-dcp"):
            assert report["tensors"] > 0


def test_json_of_reading_commands_keeps_its_keys(tmp_path: Path) -> None:
    """--json of inspect, verify, diff and nvme-plan: the report as before, a schema key added."""
    checkpoint = sample("z2_fp32_ws1").checkpoint
    from zckpt.ops.inspect import inspect_path

    before = inspect_path(checkpoint, None, False)
    after = json.loads(runner.invoke(app, ["inspect", str(checkpoint), "--json"]).stdout)
    assert set(after) == set(before) | {"schema"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_json_error_is_one_line_on_stderr_with_its_code(tmp_path: Path, command: str) -> None:
    missing = str(tmp_path / "missing")
    args = argv(command, missing, tmp_path)
    if command == "train":
        args = ["train", "--resume", missing]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == (2 if command == "train" else 1), (result.stdout, result.stderr)  # --resume: an option
    assert result.stdout == ""
    assert result.stderr.startswith("zckpt: error: ") and result.stderr.count("\n") == 1, result.stderr
    usage = runner.invoke(app, [*args, "--json", "--no-such-option"])
    assert usage.exit_code == 2 and usage.stdout == ""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_quiet_prints_nothing_and_keeps_the_exit_code(tmp_path: Path, command: str) -> None:
    checkpoint = str(sample("z2_fp32_ws1").checkpoint)
    result = runner.invoke(app, [*argv(command, checkpoint, tmp_path), "-q"])
    assert result.exit_code == 0 and result.stdout == "" and result.stderr == "", (result.stdout, result.stderr)


def test_quiet_answer_no_is_still_3(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "latest").write_text("global_step9")
    (tmp_path / "a.json").write_text("{}")
    for args in (
        ["inspect", str(folder), "-q"],
        ["diff", str(sample("z2_fp32_ws1").checkpoint), str(sample("z1_fp32_ws2_frozen_tied").checkpoint), "-q"],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code in (1, 3) and result.stdout == "", (args, result.stdout)
    budget = runner.invoke(app, ["nvme-plan", str(sample("z2_fp32_ws1").checkpoint), "--memory-budget", "1KB", "-q"])
    assert budget.exit_code == 3 and budget.stdout == ""


@pytest.mark.parametrize("command", ["diff", "consolidate", "reshard", "to-universal", "to-dcp"])
def test_quiet_and_json_turn_the_progress_bar_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    asked: list[bool] = []
    real = shared.progress_bar

    def recording(quiet: bool, description: str) -> Any:
        asked.append(quiet)
        return real(quiet, description)

    monkeypatch.setattr(shared, "progress_bar", recording)
    checkpoint = str(sample("z2_fp32_ws1").checkpoint)
    for extra, out in (([], "a"), (["-q"], "b"), (["--json"], "c")):
        assert runner.invoke(app, [*argv(command, checkpoint, tmp_path / out), *extra]).exit_code == 0
    assert asked == [False, True, True]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_debug_on_every_command_shows_the_error_itself(tmp_path: Path, command: str) -> None:
    """-d/--debug lets the library's error through (the traceback), as ZCKPT_DEBUG=1 does."""
    missing = str(tmp_path / "missing")
    args = ["train", "--resume", missing] if command == "train" else argv(command, missing, tmp_path)
    plain = runner.invoke(app, args)
    assert plain.exit_code in (1, 2) and not isinstance(plain.exception, ZckptError)
    result = runner.invoke(app, [*args, "--debug"])
    assert isinstance(result.exception, ZckptError), (command, result.exception, result.stderr)
    short = runner.invoke(app, [*args, "-d"])
    assert isinstance(short.exception, ZckptError)


def test_debug_in_a_shell_prints_the_traceback(tmp_path: Path) -> None:
    result = run_cli("reshard", tmp_path / "missing", tmp_path / "out", "-w", "2", "--debug", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr


@pytest.mark.parametrize("command", [*WRITERS, "inspect", "verify", "diff", "nvme-plan"])
def test_every_command_takes_the_latest_file(tmp_path: Path, command: str) -> None:
    """CHECKPOINT's 'latest' file stands for its folder, at the tag it names, in every command."""
    checkpoint = sample("z2_fp32_ws2_twotags").checkpoint
    folder = runner.invoke(app, [*argv(command, str(checkpoint), tmp_path / "folder"), "--json"])
    latest = runner.invoke(app, [*argv(command, str(checkpoint / "latest"), tmp_path / "latest"), "--json"])
    assert folder.exit_code == latest.exit_code == 0, (latest.stdout, latest.stderr)
    a, b = json.loads(folder.stdout), json.loads(latest.stdout)
    if command in WRITERS:
        assert a["inputs"]["tag"] == b["inputs"]["tag"]
        assert [f["bytes"] for f in a["files"]] == [f["bytes"] for f in b["files"]]


def test_latest_universal_file_names_its_tag(tmp_path: Path) -> None:
    checkpoint = str(sample("z2_fp32_ws1").checkpoint)
    assert runner.invoke(app, ["to-universal", checkpoint, str(tmp_path / "u"), "-q"]).exit_code == 0
    (tmp_path / "u" / "latest").write_text("nothing-here")  # the folder's own `latest` is not what was named
    result = runner.invoke(
        app, ["consolidate", str(tmp_path / "u" / "latest_universal"), str(tmp_path / "c"), "--json"]
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["inputs"]["tag"] == "global_step3_universal"


def test_one_exit_code_table_rendered_by_the_help() -> None:
    top = runner.invoke(app, ["--help"]).output
    assert top.count("Exit codes:") == 1
    flat = " ".join(top.split())
    for row in exit_codes.EXIT_CODES:
        assert " ".join(f"{row.code} {row.meaning}".split()) in flat, row.code
    assert "verify" in flat and "nvme-plan" in flat and "130" in flat and "143" in flat
    for name in COMMANDS:
        shown = " ".join(runner.invoke(app, [name, "--help"]).output.split())
        assert shown.count("Exit codes:") == 1, name  # its line of the table, no copy of its own
        assert " ".join(exit_codes.command_line(name).split()) in shown, name
        assert ("3 " in exit_codes.command_line(name)) == (name in ("inspect", "verify", "diff", "nvme-plan"))


def test_the_commands_exit_with_the_tables_codes() -> None:
    from zckpt.cli import errors

    assert (errors.EXIT_BAD_INPUT, errors.EXIT_USAGE, errors.EXIT_INCOMPLETE, errors.EXIT_DIFFERENT) == (1, 2, 3, 3)
    assert {row.code for row in exit_codes.EXIT_CODES} == {"0", "1", "2", "3", "128+N"}


def test_shell_completion_is_on(tmp_path: Path) -> None:
    top = runner.invoke(app, ["--help"]).output
    assert "--install-completion" in top and "--show-completion" in top
    result = run_cli("--show-completion", "bash", cwd=tmp_path)
    assert result.returncode == 0 and "zckpt" in result.stdout and "complete" in result.stdout, result.stderr


def test_completion_offers_the_shown_spellings_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """What bash's completion function asks: the options of to-universal starting --t."""
    monkeypatch.setenv("_ZCKPT_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "zckpt to-universal --t")
    monkeypatch.setenv("COMP_CWORD", "2")
    result = runner.invoke(app, [], prog_name="zckpt")
    assert result.stdout.split() == ["--tag", "--tp-rules", "--tensor-parallel"], result.stdout  # not --target-stage


def test_train_resumes_from_the_latest_file(tmp_path: Path) -> None:
    assert runner.invoke(app, ["train", "--steps", "1", "--out", str(tmp_path / "run"), "-q"]).exit_code == 0
    result = runner.invoke(app, ["train", "--steps", "2", "--resume", str(tmp_path / "run" / "latest"), "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["global_steps"] == 2 and report["inputs"]["resume"] == str(tmp_path / "run" / "global_step1")
