"""Accelerate ``save_state`` folders as zckpt input.

``scripts/accelerate_run.py`` trains a tiny Llama with ``accelerate.Accelerator`` under DeepSpeed on
CPU (2 processes, 3 steps), then calls ``accelerator.save_state(RUN/state)`` and dumps every
parameter's full fp32 master. accelerate 1.15 saves through ``engine.save_checkpoint(dir,
"pytorch_model")``: the folder holds ``latest`` naming the tag ``pytorch_model``, the tag folder,
accelerate's ``random_states_<rank>.pkl`` (torch.save zip files despite the name) and
``scheduler.bin``, plus the ``config.json`` the script writes with ``save_pretrained``. Two runs:
ZeRO-2 fp32 with untied embeddings and ZeRO-3 bf16 with tied ones.

Checked through the real CLI (``python -m zckpt``): ``inspect``, ``verify``, ``consolidate`` (the
output loads with ``AutoModelForCausalLM.from_pretrained`` in fp32, every weight the engine's
master bit for bit), ``diff`` against the output (equal), and ``reshard -w 1`` (accelerate's files
carried along byte for byte, ``latest`` still naming ``pytorch_model``, and its consolidation the
same masters again). A ``project_dir/checkpoints`` folder of ``checkpoint_<i>`` save_state folders
(``automatic_checkpoint_naming``) reads its newest one.

Needs DeepSpeed and transformers/accelerate in this interpreter and in ``ds_python()``'s; skipped
otherwise. About a minute on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ROOT
from interop_helpers import (  # noqa: F401 (autouse fixture)
    ds_python,
    free_port,
    launcher,
    run_hf_job,
    shm_leak_safety_net,
)

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

SCRIPT = ROOT / "scripts" / "accelerate_run.py"
STEPS = 3
RUNS = {
    "z2-fp32-untied": ["--stage", "2", "--untied"],
    "z3-bf16-tied": ["--stage", "3", "--bf16"],
}
# what accelerate's save_state writes beside the DeepSpeed tag folder (2 processes, a torch lr
# scheduler prepared), and what the run adds for from_pretrained
ACCELERATE_FILES = ("random_states_0.pkl", "random_states_1.pkl", "scheduler.bin")
MODEL_FILES = ("config.json", "generation_config.json")


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, Any]]]:
    """accelerate_run(name) -> (run folder, run.json), made once per name."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    python = ds_python()
    made: dict[str, tuple[Path, dict[str, Any]]] = {}

    def get(name: str) -> tuple[Path, dict[str, Any]]:
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            cmd = [
                *launcher(python),
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                str(SCRIPT),
                "--out",
                str(out),
                "--steps",
                str(STEPS),
                *RUNS[name],
            ]
            made[name] = (out, run_hf_job(f"accelerate_run.py {name}", cmd, out, 2, python))
        return made[name]

    return get


def zckpt(*args: str | Path) -> subprocess.CompletedProcess:
    """The real CLI in this interpreter; fails the test with its output on a non-zero exit."""
    proc = subprocess.run(
        [sys.executable, "-m", "zckpt", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (
        f"zckpt {' '.join(map(str, args))}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )
    return proc


def check_loads_masters(folder: Path, masters: dict[str, Any], tied: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert model.dtype == torch.float32
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = model.state_dict()
    assert set(state) == set(masters) | {"lm_head.weight"}
    differing = [k for k, v in masters.items() if not torch.equal(state[k], v)]
    assert not differing, differing
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_save_state_folder_through_the_cli(accelerate_run: Callable, name: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run, record = accelerate_run(name)
    assert record["global_steps"] == STEPS and record["done"], record
    state = run / "state"
    tied = "--untied" not in RUNS[name]
    masters = load_file(run / "masters.safetensors")
    assert ("lm_head.weight" in masters) != tied
    # what accelerate 1.15 writes: tag "pytorch_model", named by `latest`, and its own files
    assert (state / "latest").read_text().strip() == "pytorch_model"
    assert len(list((state / "pytorch_model").glob("*optim_states.pt"))) == 2
    for file in ACCELERATE_FILES + MODEL_FILES:
        assert (state / file).is_file(), file

    shown = zckpt("inspect", state, "--json")
    report = json.loads(shown.stdout)
    text = json.dumps(report)
    assert "pytorch_model" in text and report.get("complete", True) is not False
    zckpt("verify", state)

    out = tmp_path / "model"
    wrote = zckpt("consolidate", state, out)
    assert "pytorch_model" in wrote.stdout + wrote.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    check_loads_masters(out, masters, tied)
    same = zckpt("diff", state, out)
    assert "equal" in same.stdout, same.stdout

    # reshard to one process: accelerate's files come along untouched, `latest` keeps its tag
    one = tmp_path / "ws1"
    zckpt("reshard", state, one, "-w", "1")
    assert (one / "latest").read_text().strip() == "pytorch_model"
    assert len(list((one / "pytorch_model").glob("*optim_states.pt"))) == 1
    for file in ACCELERATE_FILES + MODEL_FILES:
        assert (one / file).read_bytes() == (state / file).read_bytes(), file
    zckpt("verify", one)
    zckpt("consolidate", one, tmp_path / "model_ws1")
    assert (tmp_path / "model_ws1" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_automatic_checkpoint_naming_folder(accelerate_run: Callable, tmp_path: Path) -> None:
    """``ProjectConfiguration(automatic_checkpoint_naming=True)`` puts save_state folders in
    ``project_dir/checkpoints/checkpoint_<i>``: that folder as CHECKPOINT reads the newest one."""
    import shutil

    run, _ = accelerate_run("z2-fp32-untied")
    checkpoints = tmp_path / "project" / "checkpoints"
    for i in (2, 9, 10):
        shutil.copytree(run / "state", checkpoints / f"checkpoint_{i}")
    wrote = zckpt("consolidate", checkpoints, tmp_path / "model")
    assert "read checkpoint_10, the newest of 3" in wrote.stderr, wrote.stderr  # by number, not by name
    zckpt("consolidate", run / "state", tmp_path / "direct")
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == (
        tmp_path / "direct" / "model.safetensors"
    ).read_bytes()
