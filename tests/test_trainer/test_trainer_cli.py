"""``zckpt train`` as a user runs it: one process, and the README's torchrun chain (2 ranks, then 3 resuming)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer

from helpers import SMALL, runner
from zckpt.cli.app import app
from zckpt.ops import api
from zckpt.trainer import TrainConfig, build_model

STEP_LINE = re.compile(r"^step (\d+)  loss (\d+\.\d{4})  lr \S+  tokens/s [\d,]+")


@pytest.mark.slow
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
    assert (
        result.exit_code == 2
        and result.stderr.strip() == "zckpt: error: --dtype must be one of fp32, bf16, fp16, got 'fp8'"
    )
    result = runner.invoke(app, ["train", "--dim", "10", "--heads", "3"])
    assert result.exit_code == 2 and "--dim 10 is not a multiple of --heads 3" in result.stderr
    result = runner.invoke(app, ["train", "--resume", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "no such checkpoint" in result.stderr


@pytest.mark.slow
def test_resume_takes_the_run_or_refuses_in_one_line(tmp_path: Path) -> None:
    """One process: an option that contradicts the checkpoint is refused (exit 2, one line); a
    checkpoint without model_config.json (as DeepSpeed writes them) needs the shape options and
    then resumes in the checkpoint's dtype."""
    run = tmp_path / "run"
    first = runner.invoke(app, ["train", "--out", str(run), "--steps", "2", "--dtype", "bf16", *SMALL])
    assert first.exit_code == 0, first.output
    refused = runner.invoke(app, ["train", "--out", str(run), "--steps", "4", "--resume", str(run), "--dim", "128"])
    assert refused.exit_code == 2 and refused.stdout == ""
    assert refused.stderr == (
        f"zckpt: error: {run}: --dim 128 contradicts the checkpoint, which has --dim 16: "
        "a resumed run keeps its model, dtype and frozen params (leave --dim out)\n"
    )
    done = runner.invoke(app, ["train", "--out", str(run), "--resume", str(run)])
    assert done.exit_code == 2 and done.stderr.strip().endswith(
        "the checkpoint is at step 2, the end of its run (--steps 2): give a larger --steps to train on"
    )

    (run / "model_config.json").unlink()
    missing = runner.invoke(
        app, ["train", "--out", str(tmp_path / "more"), "--steps", "4", "--resume", str(run), "--layers", "1"]
    )
    assert missing.exit_code == 2 and missing.stderr.count("\n") == 1
    assert missing.stderr.strip().endswith("(missing: --dim --heads --vocab --seq-len)")
    resumed = runner.invoke(
        app, ["train", "--out", str(tmp_path / "more"), "--steps", "4", "--resume", str(run), *SMALL[:-2]]
    )
    assert resumed.exit_code == 0, resumed.output
    assert [int(STEP_LINE.match(line).group(1)) for line in resumed.stdout.splitlines() if STEP_LINE.match(line)] == [
        3,
        4,
    ]
    assert "note:" not in resumed.stderr  # the same world size and batch
    assert sorted(os.listdir(tmp_path / "more" / "global_step4"))[0] == "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _run_group(
    cmd: list[str], env: dict[str, str], timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run torchrun in its own session; on a timeout its ranks are stopped with it."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, cwd=cwd
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


README = Path(__file__).resolve().parents[2] / "docs" / "howto" / "train.md"  # the training how-to
TINY = [
    "--layers",
    "1",
    "--dim",
    "16",
    "--heads",
    "2",
    "--vocab",
    "31",
    "--seq-len",
    "8",
]  # SMALL less --micro-batch: the default batch


def _readme_chain() -> list[str]:
    """The torchrun lines of the training how-to's first example, as written."""
    section = README.read_text().split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in section.splitlines() if line.startswith("torchrun ")]


def _help_chain() -> list[str]:
    """The torchrun lines of `zckpt train --help`'s examples, continuation lines joined."""
    text = runner.invoke(app, ["train", "--help"]).output.split("Examples:", 1)[1].replace("\\\n", " ")
    return [
        " ".join(line.split("#", 1)[0].split()) for line in text.splitlines() if line.strip().startswith("torchrun ")
    ]


def test_help_and_readme_show_the_same_chain():
    assert _help_chain() == [" ".join(line.split()) for line in _readme_chain()]


def test_help_describes_every_option():
    """Every option of `zckpt train` has a help text, and each number it gives as the default is
    TrainConfig's (the CLI passes only the options given; the library holds the defaults)."""
    command = typer.main.get_command(app).commands["train"]
    assert [p.name for p in command.params if not p.help] == []
    defaults = TrainConfig()
    stated = {p.name: m.group(1) for p in command.params if (m := re.search(r"[Dd]efault:? (\d[\d.]*\d|\d)\b", p.help))}
    assert set(stated) == {
        "steps",
        "save_every",
        "layers",
        "dim",
        "heads",
        "vocab",
        "seq_len",
        "micro_batch",
        "grad_accum",
        "lr",
        "warmup",
        "clip",
        "sub_group_size",
        "seed",
    }
    assert {name: str(getattr(defaults, name)) for name in stated} == stated
    assert (defaults.dtype, defaults.device, defaults.tie_embeddings) == (
        "fp32",
        "auto",
        False,
    )  # "fp32 (default)", "auto (default)", "(default: not)"


@pytest.mark.heavy
@pytest.mark.slow
def test_readme_chain_runs_as_written(tmp_path: Path) -> None:
    """The README's two torchrun lines, run as written (in a fresh folder; a tiny model and
    fewer steps, so it stays a quick test): 2 ranks train bf16 with tied embeddings, then 3 ranks
    resume with only --out, --steps and --resume and continue that run: bf16, tied, the global
    batch as close to 2 ranks' 8 as 3 ranks allow (9), said in one note line on rank 0."""
    first, second = (line.split() for line in _readme_chain())
    assert first[:4] == ["torchrun", "--nproc-per-node", "2", "-m"] and second[:4] == [
        "torchrun",
        "--nproc-per-node",
        "3",
        "-m",
    ]
    fewer = {"200": "4", "100": "2", "300": "6"}  # --steps 200 --save-every 100, then --steps 300

    def shrink(words: list[str]) -> list[str]:
        return [fewer.get(w, w) if words[i - 1] in ("--steps", "--save-every") else w for i, w in enumerate(words)]

    # --standalone: torchrun picks a free port (the README's default one may be in use by a parallel test)
    def torchrun(words: list[str]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:]]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = tmp_path / "runs" / "gpt"
    done = _run_group(torchrun(shrink(first)) + TINY, env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [STEP_LINE.match(line).group(1) for line in done.stdout.splitlines() if STEP_LINE.match(line)] == [
        "1",
        "2",
        "3",
        "4",
    ]  # rank 0 only
    files = sorted(os.listdir(run / "global_step4"))
    assert files == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)] + [
        f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)
    ]

    resumed = _run_group(torchrun(shrink(second)), env, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    notes = [line for line in resumed.stderr.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: the checkpoint's global batch of 8 sequences (4 x 2 ranks x 1) cannot be kept at 3 ranks (8 is not a multiple of 3): "
        "using 9 (--micro-batch 3 x 3 ranks x --grad-accum 1), the closest with at most 4 sequences per rank"
    ]
    assert f"`{notes[0]}`" in " ".join(README.read_text().split())  # the README quotes it
    assert [STEP_LINE.match(line).group(1) for line in resumed.stdout.splitlines() if STEP_LINE.match(line)] == [
        "5",
        "6",
    ]
    assert (run / "latest").read_text() == "global_step6"
    files = sorted(os.listdir(run / "global_step6"))
    assert files == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1, 2)] + [
        f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1, 2)
    ]
    model_states = torch.load(run / "global_step6" / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=True)
    config = model_states["ds_config"]
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (9, 3, 1)
    assert config["bf16"]["enabled"] and model_states["global_samples"] == 4 * 8 + 2 * 9
    assert json.loads((run / "model_config.json").read_text())["tie_embeddings"] is True
    weights = api.load_state_dict(run)
    assert torch.equal(weights["lm_head.weight"], weights["wte.weight"])


def test_trains_on_a_file_read_as_bytes(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    result = runner.invoke(
        app,
        [
            "train",
            "--data",
            str(text),
            "--steps",
            "2",
            "--layers",
            "1",
            "--dim",
            "16",
            "--heads",
            "2",
            "--seq-len",
            "8",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len([line for line in result.output.splitlines() if STEP_LINE.match(line)]) == 2
    small = runner.invoke(app, ["train", "--data", str(text), "--vocab", "100"])
    assert small.exit_code == 2 and "--vocab must be at least 256" in small.stderr
