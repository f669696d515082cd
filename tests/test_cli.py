"""The command line as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import Sample, sample
from zckpt.cli import app
from test_bad_input import run_cli

runner = CliRunner()


def test_help_explains_options_with_examples() -> None:
    result = runner.invoke(app, ["consolidate", "--help"])
    assert result.exit_code == 0
    for option in ("--tag", "--dtype", "--format", "--max-shard-size", "--exclude-frozen", "--overwrite", "--quiet", "Examples"):
        assert option in result.output
    assert "Examples" in runner.invoke(app, ["inspect", "--help"]).output
    assert "Exit codes" in (Path(__file__).parent.parent / "README.md").read_text()


def test_consolidate_prints_one_summary_line(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    result = runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 1 and "model.safetensors" in result.output
    quiet = runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "q"), "--quiet"])
    assert quiet.exit_code == 0 and quiet.output == ""


def test_bad_option_value_is_a_usage_error(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    assert runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "o"), "--dtype", "fp8"]).exit_code == 2
    result = run_cli("consolidate", case.checkpoint, tmp_path / "o", "--max-shard-size", "lots", cwd=tmp_path)
    assert result.returncode == 2 and "lots" in result.stderr and not (tmp_path / "o").exists()


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
    trainable = {n: t for n, t in live.items() if n not in meta["frozen"] and n not in meta["buffers"] and n not in meta["tied"]}
    assert report["trainable_numel"] == sum(t.numel() for t in trainable.values())
    assert report["params"] == len(trainable) + len(meta["frozen"])
    listed = {p["name"]: p for p in report["parameters"]}
    for name, tensor in live.items():
        assert listed[name]["shape"] == list(tensor.shape) and listed[name]["numel"] == tensor.numel()


def test_inspect_weights_files(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    assert runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "one"), "-q"]).exit_code == 0
    assert runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "many"), "-q", "--max-shard-size", "3KB"]).exit_code == 0
    assert runner.invoke(app, ["consolidate", str(case.checkpoint), str(tmp_path / "pt"), "-q", "--format", "torch"]).exit_code == 0
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
    assert json.loads(runner.invoke(app, ["inspect", str(tmp_path / "one" / "model.safetensors"), "--json"]).output)["tied"] == case.meta["tied"]
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

    from conftest import ROOT

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_MININTERVAL="0")
    process = subprocess.Popen([sys.executable, "-m", "zckpt", *args], stdin=follower, stdout=follower, stderr=follower, env=env)
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


def test_progress_bar_on_a_terminal_only_without_quiet(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    shown = _run_in_terminal("consolidate", str(case.checkpoint), str(tmp_path / "a"))
    assert "consolidating" in shown and "%|" in shown
    quiet = _run_in_terminal("consolidate", str(case.checkpoint), str(tmp_path / "b"), "--quiet")
    assert "consolidating" not in quiet and "wrote" not in quiet
