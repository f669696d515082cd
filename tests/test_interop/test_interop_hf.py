"""A Hugging Face Trainer run resumes from a resharded ``checkpoint-N`` at another process count.

``scripts/hf_trainer_run.py`` (Trainer + DeepSpeed on CPU, AdamW, linear lr schedule) runs 2
processes for 4 steps and saves ``checkpoint-2``, once at ZeRO-2 in fp32 and once at ZeRO-3 in
bf16; ``zckpt.reshard`` rewrites that folder for 3 and for 1 processes (ZeRO-2 -> ZeRO-2,
ZeRO-3 -> ZeRO-3, ZeRO-3 -> ZeRO-2) into a fresh output folder, and the Trainer resumes from it (``resume_from_checkpoint``) for steps 3-4. What the
resumed run holds right after the load is compared with what the original run held at the same
point (its state before step 3, which is what it saved): step counters, Adam steps, lr, and the
fp32 masters and Adam moments of a few params bit for bit. The resumed losses must be those of a
continuation (near the original's steps 3-4, far below the step-1 loss of a fresh model), not
of a restart; they are not expected to equal the original's: 3 or 1 processes see other batches.

Needs DeepSpeed and transformers/accelerate in ``ds_python()``'s interpreter; skipped otherwise.
About 2-3 minutes on 2 cores (6 Trainer runs of a few seconds' training each; the rest is
process start-up).
"""

from __future__ import annotations

import importlib.util
import json
import math
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
from zckpt import reshard

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

SCRIPT = ROOT / "scripts" / "hf_trainer_run.py"
MAX_STEPS, SAVE_STEPS = 4, 2
ORIGINAL_WORLD_SIZE = 2
ORIGINAL_DTYPE = {2: "fp32", 3: "bf16"}  # by the original run's ZeRO stage
# (stage of the original run, processes of the resumed run, its stage)
RESUME_CASES = [(2, 3, 2), (2, 1, 2), (3, 3, 3), (3, 1, 2)]


def hf_python() -> str:
    """The DeepSpeed interpreter, if it also has transformers and accelerate; else skip."""
    python = ds_python()
    if python == sys.executable:
        missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    else:
        probe = subprocess.run(
            [
                python,
                "-c",
                "import importlib.util as u; print(' '.join(m for m in ('transformers', 'accelerate') if u.find_spec(m) is None))",
            ],
            capture_output=True,
            text=True,
        )
        missing = probe.stdout.split() if probe.returncode == 0 else ["transformers"]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed beside DeepSpeed ({python})")
    return python


def run_trainer(
    out: Path, processes: int, stage: int, dtype: str, resume_from: Path | None = None, timeout: float = 300
) -> dict[str, Any]:
    """``scripts/hf_trainer_run.py`` under torchrun; returns its ``run.json``. Leaked shm buffers
    are removed whatever happens."""
    python = hf_python()
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        *launcher(python),
        "--nproc-per-node",
        str(processes),
        "--master-port",
        str(free_port()),
        str(SCRIPT),
        "--out",
        str(out),
        "--max-steps",
        str(MAX_STEPS),
        "--save-steps",
        str(SAVE_STEPS),
        "--stage",
        str(stage),
        "--batch-size",
        "8",
        "--samples",
        "192",
        "--lr",
        "0.02",
    ]
    if dtype == "bf16":
        cmd.append("--bf16")
    if resume_from is not None:
        cmd += ["--resume-from", str(resume_from)]
    return run_hf_job(
        f"hf_trainer_run.py ({processes} processes, ZeRO-{stage} {dtype}, out {out})",
        cmd,
        out,
        processes,
        python,
        log_name="trainer.log",
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, dict]]:
    """original(stage) -> (output folder, run.json) of the 2-process run (made once per stage)."""
    made: dict[int, tuple[Path, dict]] = {}

    def get(stage: int) -> tuple[Path, dict]:
        if stage not in made:
            out = tmp_path_factory.mktemp(f"original_z{stage}")
            made[stage] = (out, run_trainer(out, ORIGINAL_WORLD_SIZE, stage, ORIGINAL_DTYPE[stage]))
        return made[stage]

    return get


def test_original_run_learns_and_saves(original: Callable[[int], tuple[Path, dict]]) -> None:
    """The reference run the resumes are checked against: it saves checkpoint-2 and the loss
    clearly falls after step 1 (else a resume could not be told from a restart)."""
    for stage in (2, 3):
        out, run = original(stage)
        losses = [s["loss"] for s in run["steps"]]
        assert [s["step"] for s in run["steps"]] == [1, 2, 3, 4] and all(map(math.isfinite, losses))
        assert losses[0] - max(losses[2:]) > 0.3, losses
        assert (out / "checkpoint-2" / "global_step2").is_dir() and (out / "checkpoint-2" / "scheduler.pt").is_file()
        probe = run["probes"]["2"]
        assert probe["trainer_global_step"] == probe["engine_global_steps"] == 2 and probe["adam_steps"] == [2.0]


@pytest.mark.parametrize(
    "source_stage,processes,stage",
    RESUME_CASES,
    ids=[f"z{a}ws{ORIGINAL_WORLD_SIZE}-to-z{c}ws{b}-{ORIGINAL_DTYPE[a]}" for a, b, c in RESUME_CASES],
)
def test_trainer_resumes_from_resharded_checkpoint(
    original: Callable[[int], tuple[Path, dict]], tmp_path: Path, source_stage: int, processes: int, stage: int
) -> None:
    import torch

    source_out, source = original(source_stage)
    out = tmp_path / "resumed"
    checkpoint = out / "checkpoint-2"
    result = reshard(source_out / "checkpoint-2", checkpoint, world_size=processes, stage=stage)

    # the Trainer's files came along; RNG states only for processes the new run has
    for name in ("trainer_state.json", "scheduler.pt", "training_args.bin", "config.json"):
        assert name in result.carried and (checkpoint / name).is_file(), name
    kept = sorted(n for n in result.carried if n.startswith("rng_state"))
    # the names the Trainer reads at that process count: rng_state.pth for a single process
    assert kept == (
        ["rng_state.pth"]
        if processes == 1
        else [f"rng_state_{i}.pth" for i in range(min(processes, ORIGINAL_WORLD_SIZE))]
    )
    assert sorted(result.dropped) == [f"rng_state_{i}.pth" for i in range(processes, ORIGINAL_WORLD_SIZE)]
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2

    run = run_trainer(out, processes, stage, ORIGINAL_DTYPE[source_stage], resume_from=checkpoint)
    resume, before = run["resume"], source["probes"]["2"]
    assert resume is not None and resume["num_processes"] == processes

    # counters: a continuation from step 2, not a fresh start
    assert resume["trainer_global_step"] == 2
    assert resume["engine_global_steps"] == 2
    assert resume["engine_global_samples"] == before["engine_global_samples"]
    # Adam: step 2 on every rank, moments loaded (non-zero), not freshly initialised
    assert all(steps == [2.0] for steps in resume["adam_steps_per_rank"]), resume["adam_steps_per_rank"]
    assert all(resume["exp_avg_nonzero"].values()) and all(resume["exp_avg_sq_nonzero"].values())
    # lr scheduler restored (Trainer's scheduler.pt): the lr the original used at step 3
    assert resume["lr"] == source["steps"][2]["lr"] == before["lr"]
    assert [s["lr"] for s in run["steps"]] == [s["lr"] for s in source["steps"][2:]]
    # masters and moments equal those of the original run before step 3, bit for bit
    expected = torch.load(source_out / "probe_step2.pt", weights_only=True)
    loaded = torch.load(out / "probe_step2.pt", weights_only=True)
    for name, tensors in expected.items():
        for key, tensor in tensors.items():
            assert torch.equal(loaded[name][key], tensor), f"{name} {key}"
    # RNG: processes 0..1 found their saved state, the new third one did not have any
    if processes > 1:
        assert resume["rng_files"] == [[f"rng_state_{i}.pth", i < ORIGINAL_WORLD_SIZE] for i in range(processes)]

    # losses of steps 3-4: finite, near the original's, far below a fresh model's step-1 loss
    original_losses = [s["loss"] for s in source["steps"]]
    gap = original_losses[0] - max(original_losses[2:])
    assert [s["step"] for s in run["steps"]] == [3, 4] and run["final_global_step"] == MAX_STEPS
    for entry, reference in zip(run["steps"], original_losses[2:]):
        assert math.isfinite(entry["loss"])
        assert abs(entry["loss"] - reference) < gap / 2, (entry, original_losses)
        assert entry["loss"] < original_losses[0] - gap / 2, (entry, original_losses)
    # and the resumed run saves at its own process count
    saved = out / "checkpoint-4"
    assert json.loads((saved / "trainer_state.json").read_text())["global_step"] == MAX_STEPS
    assert (saved / "global_step4").is_dir()


def test_single_process_target_gets_the_rng_file_the_trainer_reads(
    original: Callable[[int], tuple[Path, dict]], tmp_path: Path
) -> None:
    source_out, _ = original(2)
    reshard(source_out / "checkpoint-2", tmp_path / "checkpoint-2", world_size=1)
    assert (tmp_path / "checkpoint-2" / "rng_state.pth").is_file()
