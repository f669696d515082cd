"""The command line as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import Sample, run_cli, runner, sample
from zckpt.cli.app import app


def test_help_explains_options_with_examples() -> None:
    result = runner.invoke(app, ["consolidate", "--help"])
    assert result.exit_code == 0
    for option in (
        "--tag",
        "--dtype",
        "--format",
        "--max-shard-size",
        "--exclude-frozen",
        "--overwrite",
        "--quiet",
        "Examples",
    ):
        assert option in result.output
    assert "Examples" in runner.invoke(app, ["inspect", "--help"]).output
    assert "Exit codes:" in runner.invoke(app, ["--help"]).output  # the one table (zckpt.cli.exit_codes)


def test_consolidate_prints_one_summary_line(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    result = runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 1 and "model.safetensors" in result.output
    quiet = runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "q"), "--quiet"])
    assert quiet.exit_code == 0 and quiet.output == ""


@pytest.mark.slow
def test_bad_option_value_is_a_usage_error(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    assert (
        runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "o"), "--dtype", "fp8"]).exit_code == 2
    )
    result = run_cli("consolidate", case.checkpoint, tmp_path / "o", "--max-shard-size", "lots", cwd=tmp_path)
    assert result.returncode == 2 and "lots" in result.stderr and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_inspect_json_describes_the_checkpoint(any_sample: Sample) -> None:
    result = runner.invoke(app, ["inspect", str(any_sample.checkpoint), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    meta = any_sample.meta
    assert report["zero_stage"] == meta["zero_stage"]
    assert report["world_size"] == meta["world_size"]
    assert report["dtype"] == meta["dtype"]
    assert report["tag"] == meta["tag"] and report["tags"] == meta["tags"]
    assert report["ds_version"] == meta["deepspeed_version"]
    zero = meta["ds_config"]["zero_optimization"]
    devices = {(zero.get(k) or {}).get("device") for k in ("offload_optimizer", "offload_param")}
    assert report["offload"] == ("nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none")
    assert sorted(report["frozen"]) == sorted(meta["frozen"])
    assert report["tied"] == meta["tied"]
    assert report["complete"] is True and report["problems"] == []
    live = any_sample.live()
    trainable = {
        n: t for n, t in live.items() if n not in meta["frozen"] and n not in meta["buffers"] and n not in meta["tied"]
    }
    assert report["trainable_numel"] == sum(t.numel() for t in trainable.values())
    assert report["params"] == len(trainable) + len(meta["frozen"])
    listed = {p["name"]: p for p in report["parameters"]}
    for name, tensor in live.items():
        assert listed[name]["shape"] == list(tensor.shape) and listed[name]["numel"] == tensor.numel()


def test_inspect_weights_files(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    assert runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "one"), "-q"]).exit_code == 0
    assert (
        runner.invoke(
            app, ["consolidate", str(case.checkpoint), str(tmp_path / "many"), "-q", "--max-shard-size", "3KB"]
        ).exit_code
        == 0
    )
    assert (
        runner.invoke(
            app, ["consolidate", str(case.checkpoint), str(tmp_path / "pt"), "-q", "--format", "torch"]
        ).exit_code
        == 0
    )
    names = set(case.reference())
    for path, kind in (
        (tmp_path / "one" / "model.safetensors", "safetensors"),
        (tmp_path / "many", "safetensors_index"),
        (tmp_path / "pt" / "pytorch_model.bin", "torch"),
    ):
        result = runner.invoke(app, ["inspect", str(path), "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["kind"] == kind and report["complete"]
        assert {p["name"] for p in report["parameters"]} == names
    assert (
        json.loads(runner.invoke(app, ["inspect", str(tmp_path / "one" / "model.safetensors"), "--json"]).output)[
            "tied"
        ]
        == case.meta["tied"]
    )
    shard = sorted((tmp_path / "many").glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    broken = runner.invoke(app, ["inspect", str(tmp_path / "many"), "--json"])
    assert broken.exit_code == 3
    assert any(shard.name in p for p in json.loads(broken.output)["problems"])


def test_inspect_text_summary() -> None:
    result = runner.invoke(app, ["inspect", str(sample("z3_fp32_ws2_tied_frozen").checkpoint)])
    assert result.exit_code == 0
    assert "ZeRO stage     3" in result.output and "complete       yes" in result.output


def _run_in_terminal(*args: str) -> str:
    """Run the CLI with stdout/stderr on a 120-column pseudo-terminal; return what it showed."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from helpers import ROOT

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_MININTERVAL="0")
    process = subprocess.Popen(
        [sys.executable, "-m", "zckpt", *args], stdin=follower, stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    process.wait(timeout=60)
    os.close(leader)
    return shown.decode(errors="replace")


@pytest.mark.slow
def test_progress_bar_on_a_terminal_only_without_quiet(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    shown = _run_in_terminal("consolidate", str(case.checkpoint), str(tmp_path / "a"))
    assert "consolidating" in shown and "%|" in shown
    quiet = _run_in_terminal("consolidate", str(case.checkpoint), str(tmp_path / "b"), "--quiet")
    assert "consolidating" not in quiet and "wrote" not in quiet


# --- the command line zero_to_fp32.py's users know (issue #10) ---------------------------

FROZEN = "z3_fp32_ws2_tied_frozen"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _floating_dtypes(weights: Path) -> set[str]:
    """The safetensors dtype codes of the floating tensors in a weights file."""
    data = weights.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return {
        v["dtype"] for k, v in header.items() if k != "__metadata__" and v["dtype"] in ("F32", "BF16", "F16", "F64")
    }


def test_zero_to_fp32_spellings_are_the_same_options(tmp_path: Path) -> None:
    case = sample(FROZEN)
    assert case.meta["frozen"], "the sample must have frozen params for --exclude_frozen_parameters to matter"
    tag = case.meta["tag"]
    ours = runner.invoke(
        app,
        [
            "consolidate",
            str(case.checkpoint),
            str(tmp_path / "ours"),
            "-q",
            "--max-shard-size",
            "3KB",
            "--exclude-frozen",
            "--tag",
            tag,
        ],
    )
    assert ours.exit_code == 0, ours.output
    theirs = runner.invoke(
        app,
        [
            "consolidate",
            str(case.checkpoint),
            str(tmp_path / "theirs"),
            "-q",
            "--max_shard_size",
            "3KB",
            "--exclude_frozen_parameters",
            "--safe_serialization",
            "-t",
            tag,
            "-d",
        ],
    )
    assert theirs.exit_code == 0, theirs.output
    assert _files(tmp_path / "ours") == _files(tmp_path / "theirs")
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    names = set(json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())["weight_map"])
    assert names and not names & set(case.meta["frozen"])


def test_safe_serialization_contradicting_format_torch_is_a_usage_error(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "consolidate",
            str(sample(FROZEN).checkpoint),
            str(tmp_path / "o"),
            "--safe_serialization",
            "--format",
            "torch",
        ],
    )
    assert result.exit_code == 2 and "--safe_serialization" in result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    plain = run_cli("consolidate", tmp_path / "nope", tmp_path / "o", cwd=tmp_path)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    for flag in ("-d", "--debug"):
        debug = run_cli("consolidate", tmp_path / "nope", tmp_path / "o", flag, cwd=tmp_path)
        assert debug.returncode == 1 and "Traceback" in debug.stderr and "CheckpointNotFoundError" in debug.stderr


@pytest.mark.parametrize(
    "name,expected",
    [
        ("fp32", "F32"),
        ("float32", "F32"),
        ("bf16", "BF16"),
        ("bfloat16", "BF16"),
        ("fp16", "F16"),
        ("float16", "F16"),
        ("BF16", "BF16"),
    ],
)
def test_dtype_takes_short_and_torch_names(tmp_path: Path, name: str, expected: str) -> None:
    result = runner.invoke(app, ["consolidate", str(sample(FROZEN).checkpoint), str(tmp_path / "o"), "--dtype", name])
    assert result.exit_code == 0, result.output
    short = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}[expected]
    assert f", {short})" in result.stdout
    assert _floating_dtypes(tmp_path / "o" / "model.safetensors") == {expected}


@pytest.mark.parametrize("bad", ["fp8", "float64", "int8", "half-precision"])
def test_unknown_dtype_is_a_usage_error_before_reading(tmp_path: Path, bad: str) -> None:
    result = runner.invoke(app, ["consolidate", str(tmp_path / "missing"), str(tmp_path / "o"), "--dtype", bad])
    assert result.exit_code == 2 and bad in result.stderr and "bfloat16" in result.stderr


def test_api_takes_dtype_names_and_torch_dtypes(tmp_path: Path) -> None:
    import torch

    import zckpt

    checkpoint = sample(FROZEN).checkpoint
    for given, wanted in (
        ("bfloat16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        ("float16", torch.float16),
        (torch.float32, torch.float32),
        ("float32", torch.float32),
    ):
        streamed = dict(zckpt.iter_tensors(checkpoint, dtype=given))
        whole = zckpt.load_state_dict(checkpoint, dtype=given)
        for state in (streamed, whole):
            assert {t.dtype for t in state.values() if t.is_floating_point()} == {wanted}, given
    zckpt.consolidate(checkpoint, tmp_path / "o", dtype=torch.float16)
    assert _floating_dtypes(tmp_path / "o" / "model.safetensors") == {"F16"}
    for bad in (torch.float64, torch.int8, "fp8"):
        with pytest.raises(zckpt.UsageError, match="choose fp32, bf16 or fp16"):
            zckpt.load_state_dict(checkpoint, dtype=bad)


def test_version(tmp_path: Path) -> None:
    import zckpt

    result = run_cli("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"zckpt {zckpt.__version__}" and result.stderr == ""


COMMANDS = ("consolidate", "inspect", "reshard", "to-universal")


@pytest.mark.slow
@pytest.mark.parametrize("columns", [None, "200", "60"])
def test_help_is_plain_readable_and_80_columns_wide(tmp_path: Path, columns: str | None) -> None:
    import os
    import re
    import subprocess
    import sys

    from helpers import ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(ROOT)
    if columns:
        env["COLUMNS"] = columns
    for command in ("", *COMMANDS):
        argv = [sys.executable, "-m", "zckpt", *([command] if command else []), "--help"]
        shown = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )  # stdout is a pipe
        assert shown.returncode == 0, shown.stderr
        text = shown.stdout
        lines = text.splitlines()
        assert max(map(len, lines)) <= 80, (command, max(lines, key=len))
        assert not re.search(r"[─│╭╮╰╯]", text), "rich boxes"
        assert not re.search(r"<(bool|str|text|path|int|integer|float)>", text), f"type placeholder in {command} --help"
        assert "{" not in lines[0] and "python -m" not in lines[0]
        usage = {
            "": "Usage: zckpt [OPTIONS] COMMAND [ARGS]...",
            "consolidate": "Usage: zckpt consolidate [OPTIONS] CHECKPOINT OUTPUT_DIR",
            "inspect": "Usage: zckpt inspect [OPTIONS] PATH",
            "reshard": "Usage: zckpt reshard [OPTIONS] CHECKPOINT OUTPUT_DIR",
            "to-universal": "Usage: zckpt to-universal [OPTIONS] CHECKPOINT OUTPUT_DIR",
        }[command]
        assert lines[0] == usage
        if command:
            assert "Examples:" in text
        options = lines[lines.index("Options:") + 1 :]
        options = options[: options.index("")] if "" in options else options
        for flag in (
            "--overwrite",
            "--quiet",
            "--exclude-frozen",
            "--json",
            "--verify",
            "--safe_serialization",
            "--debug",
            "--version",
        ):
            for line in options:
                if re.match(rf"\s+(-\w, )?{flag}\b", line):  # a flag's line: its name, then its help, no value
                    assert re.match(rf"\s+(-\w, )?{flag}(, --[\w-]+)?(\s{{2,}}\S|$)", line), line
    consolidate = subprocess.run(
        [sys.executable, "-m", "zckpt", "consolidate", "-h"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for alias in (
        "--max_shard_size",
        "--exclude_frozen_parameters",
        "--safe_serialization",
        "-t, --tag",
        "-d, --debug",
        "bfloat16",
    ):
        assert alias in consolidate


@pytest.mark.slow
def test_summary_line_stays_short_however_many_shards(tmp_path: Path) -> None:
    case = sample(FROZEN)
    result = run_cli("consolidate", case.checkpoint, tmp_path / "o", "--max-shard-size", "1KB", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shards = sorted(p.name for p in (tmp_path / "o").glob("model-*.safetensors"))
    assert len(shards) > 5
    line = result.stdout.strip()
    assert "\n" not in line and len(line) < 200 + len(str(tmp_path)), line
    assert line.endswith(f": {shards[0]} ... ({len(shards) + 1} files)"), line
    single = run_cli("consolidate", case.checkpoint, tmp_path / "one", cwd=tmp_path)
    assert single.stdout.strip().endswith(": model.safetensors"), single.stdout


# --- exit codes: the same problem gives the same code in every command --------------------

TWO_TAGS = "z2_fp32_ws2_twotags"


def _setup(case: str, tmp_path: Path) -> tuple[list[str], str | None]:
    """The CHECKPOINT argument and options of one problem; the second item is the expected
    stderr text."""
    import shutil

    checkpoint = sample(TWO_TAGS).checkpoint
    if case == "missing":
        return [str(tmp_path / "nope")], "no such file or directory"
    if case == "a file":
        return [str(next((checkpoint / "global_step2").glob("*model_states.pt")))], "got a file"
    if case == "empty folder":
        (tmp_path / "empty").mkdir()
        return [str(tmp_path / "empty")], "no DeepSpeed checkpoint"
    if case == "unknown tag":
        return [str(checkpoint), "--tag", "global_step7"], "global_step7"
    if case == "several tags, no latest":
        shutil.copytree(checkpoint, tmp_path / "ckpt")
        (tmp_path / "ckpt" / "latest").unlink()
        return [str(tmp_path / "ckpt")], "pass --tag"
    if case == "tag folder and another --tag":
        return [str(checkpoint / "global_step2"), "--tag", "global_step3"], "is the folder of tag"
    if case == "unknown option":
        return [str(checkpoint), "--no-such-option"], "No such option"
    if case == "missing option value":
        return [str(checkpoint), "--tag"], "requires an argument"
    raise AssertionError(case)


EXIT_CASES = {
    "missing": 1,
    "a file": 1,
    "empty folder": 1,
    "unknown tag": 1,
    "several tags, no latest": 2,
    "tag folder and another --tag": 2,
    "unknown option": 2,
    "missing option value": 2,
}


@pytest.mark.parametrize(
    "case,command",
    [(case, command) for case in EXIT_CASES for command in COMMANDS if (case, command) != ("a file", "inspect")],
)  # inspect reads single files: a file is its input
def test_same_problem_same_exit_code_in_every_command(tmp_path: Path, command: str, case: str) -> None:
    args, text = _setup(case, tmp_path)
    out = tmp_path / "out"
    argv = [
        command,
        args[0],
        *([] if command == "inspect" else [str(out)]),
        *(["-w", "1"] if command == "reshard" else []),
        *args[1:],
    ]
    result = runner.invoke(app, argv)
    assert result.exit_code == EXIT_CASES[case], (result.exit_code, result.output)
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert text in result.stderr, result.stderr
    if "zckpt: error:" in result.stderr:
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists(), "a refused run left output behind"


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "inspect"])
def test_missing_argument_and_existing_output_same_code_in_every_command(tmp_path: Path, command: str) -> None:
    extra = ["-w", "1"] if command == "reshard" else []
    assert runner.invoke(app, [command, str(sample("z2_fp32_ws1").checkpoint), *extra]).exit_code == 2  # no OUTPUT_DIR
    args = [command, str(sample("z2_fp32_ws1").checkpoint), str(tmp_path / "out"), "-q", *extra]
    assert runner.invoke(app, args).exit_code == 0
    again = runner.invoke(app, args)
    assert again.exit_code == 1 and again.stderr.startswith("zckpt: error: ") and "--overwrite" in again.stderr
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0


@pytest.mark.parametrize(
    "command,args",
    [
        ("consolidate", ["--max-shard-size", "lots"]),
        ("consolidate", ["--format", "pickle"]),
        ("consolidate", ["--dtype", "fp8"]),
        ("reshard", ["-w", "0"]),
        ("reshard", ["-w", "two"]),
        ("reshard", ["-w", "1", "--stage", "4"]),
        ("reshard", ["-w", "1", "--workers", "0"]),
        ("to-universal", ["--target-stage", "0"]),
        ("to-universal", ["--workers", "-1"]),
    ],
)
def test_bad_option_values_are_usage_errors_in_every_command(tmp_path: Path, command: str, args: list[str]) -> None:
    result = runner.invoke(app, [command, str(sample("z2_fp32_ws1").checkpoint), str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "out").exists()
