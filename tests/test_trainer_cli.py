"""``zckpt train`` as a user runs it: one process, and two under torchrun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

from zckpt import api
from zckpt.cli import app
from zckpt.trainer import build_model

try:  # click < 8.2 mixes stderr into output unless told not to
    runner = CliRunner(mix_stderr=False)
except TypeError:
    runner = CliRunner()

SMALL = ["--layers", "1", "--dim", "16", "--heads", "2", "--vocab", "31", "--seq-len", "8", "--micro-batch", "2"]
STEP_LINE = re.compile(r"^step (\d+)  loss (\d+\.\d{4})  lr \S+  tokens/s [\d,]+")


def test_one_process_logs_each_step_and_saves(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", "--out", str(tmp_path / "run"), "--steps", "3", "--save-every", "2", *SMALL])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [int(STEP_LINE.match(line).group(1)) for line in lines[:3]] == [1, 2, 3]
    assert "saved global_step2" in lines[1] and "saved global_step3" in lines[2]
    assert lines[3].startswith("wrote ")
    assert (tmp_path / "run" / "latest").read_text() == "global_step3"
    model = build_model(tmp_path / "run" / "model_config.json")
    model.load_state_dict(api.load_state_dict(tmp_path / "run"))


def test_bad_options_are_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", "--dtype", "fp8"])
    assert result.exit_code == 2 and result.stderr.strip() == "zckpt: error: --dtype must be one of fp32, bf16, fp16, got 'fp8'"
    result = runner.invoke(app, ["train", "--dim", "10", "--heads", "3"])
    assert result.exit_code == 2 and "--dim 10 is not a multiple of --heads 3" in result.stderr
    result = runner.invoke(app, ["train", "--resume", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "no such checkpoint" in result.stderr


def _run_group(cmd: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run torchrun in its own session; on a timeout its ranks are stopped with it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_torchrun_two_ranks(tmp_path: Path) -> None:
    """The README's command: two ranks, rank 0 logs, each rank writes its own files."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    done = _run_group([*torchrun, "-m", "zckpt", "train", "--out", str(out), "--steps", "2", "--dtype", "bf16", "--tie-embeddings", *SMALL], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [STEP_LINE.match(line).group(1) for line in done.stdout.splitlines() if STEP_LINE.match(line)] == ["1", "2"]  # rank 0 only
    files = sorted(os.listdir(out / "global_step2"))
    assert files == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)] + [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)]
    weights = api.load_state_dict(out)
    assert torch.equal(weights["lm_head.weight"], weights["wte.weight"])


def test_trains_on_a_file_read_as_bytes(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    result = runner.invoke(app, ["train", "--data", str(text), "--steps", "2", "--layers", "1", "--dim", "16", "--heads", "2", "--seq-len", "8"])
    assert result.exit_code == 0, result.output
    assert len([line for line in result.output.splitlines() if STEP_LINE.match(line)]) == 2
    small = runner.invoke(app, ["train", "--data", str(text), "--vocab", "100"])
    assert small.exit_code == 2 and "--vocab must be at least 256" in small.stderr
