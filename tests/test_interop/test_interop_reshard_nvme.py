"""Interop: stock DeepSpeed 0.19.8, its optimizer offloaded to NVMe, loads ``zckpt reshard``
outputs at a new world size with a plain ``engine.load_checkpoint`` and then holds the values
the original engine held.

Run: ``PYTHONPATH=tests python -m pytest -m deepspeed -p interop_helpers tests/test_interop/test_interop_reshard_nvme.py``
(DS_ACCELERATOR=cpu; async_io must build: libaio-dev).

The probe is scripts/ds_probe.py given a swap folder: this file, run under torchrun, is that
launcher (``__main__`` below); ds_probe itself refuses NVMe cases only for want of one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":  # one rank of the probe, under torchrun; $ZCKPT_NVME_PATH is the swap folder
    _load("make_sample_ckpts").uses_nvme = lambda case: False  # ds_config() puts $ZCKPT_NVME_PATH in
    sys.exit(_load("ds_probe").main())

import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from helpers import Sample, same_bits, sample  # noqa: E402
from zckpt import reshard  # noqa: E402
from zckpt.deepspeed.reader import open_training_state  # noqa: E402
from zckpt.torchfile import reader as torchfile  # noqa: E402

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_helpers import (  # noqa: E402,F401
    ProbeError,
    case_arg,
    ds_env,
    ds_python,
    extensions_for,
    free_port,
    launcher,
    run_logged,
    sample_generator,
    shm_leak_safety_net,
)

GEN = sample_generator()
NVME_SAMPLE = "z3_bf16_ws2_nvmeoffload_frozen_tied_groups"
# a run not in the repository: other sizes and seed; one sub-group per param group, so the decay
# group (about 0.98M elements) is swapped at 1, 2 and 3 ranks and the no-decay group is not
FRESH = GEN.Case(
    "fresh_z3_bf16_ws2_nvme_groups_tied_frozen",
    "ds19",
    3,
    "bf16",
    2,
    tied=True,
    frozen=True,
    groups=True,
    vocab=31,
    dim=61,
    hidden=8009,
    seed=11,
    zero_extra=(("offload_optimizer", {"device": "nvme", "nvme_path": GEN.NVME_PATH}),),
    config_extra=(("zero_force_ds_cpu_optimizer", False),),
)


def run_nvme_probe(
    case, checkpoint: Path, world_size: int, out: Path, train_steps: int = 0, timeout: float = 600
) -> tuple[dict, dict, dict]:
    """ds_probe at `world_size` ranks with an NVMe swap folder of its own: (live, optimizer, state)
    after the load (and `train_steps` more steps: ``out/live_after_train.safetensors``)."""
    from safetensors.torch import load_file

    python = ds_python()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    swap = Path(tempfile.mkdtemp(prefix="zckpt_nvme_probe_"))
    try:
        cmd = [
            *launcher(python),
            "--nproc-per-node",
            str(world_size),
            "--master-port",
            str(free_port()),
            str(Path(__file__).resolve()),
            "--case-json",
            case_arg(case),
            "--checkpoint",
            str(checkpoint.resolve()),
            "--out",
            str(out.resolve()),
        ]
        cmd += ["--train-steps", str(train_steps)] if train_steps else []
        returncode = run_logged(
            cmd, {**ds_env(world_size, python), "ZCKPT_NVME_PATH": str(swap)}, out / "probe.log", timeout
        )
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    if returncode != 0 or not (out / "state.json").exists():
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error_rank*.txt")))
        tail = "\n".join((out / "probe.log").read_text(errors="replace").splitlines()[-40:])
        raise ProbeError(
            f"NVMe probe failed (exit {returncode}, world size {world_size}):\n{errors}\n{tail}", returncode, tail, {}
        )
    state = json.loads((out / "state.json").read_text())
    return load_file(out / "live.safetensors"), load_file(out / "live_optimizer.safetensors"), state


def _swapped_in_engine(state: dict) -> list[int]:
    """Sub-groups the loading engine swaps: it keeps their fp32 partitions empty between steps."""
    return sorted(i for g in state["param_groups"] for i, n in zip(g["sub_groups"], g["flat_numel"]) if n == 0)


def _swapped_in_output(checkpoint: Path) -> tuple[list[int], list[list[str]]]:
    """Sub-groups zckpt saved empty in rank 0's optim file, and each rank's swap files."""
    tag_dir = Path(open_training_state(checkpoint).index.tag_dir)
    optim = torchfile.load(next(tag_dir.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")))["optimizer_state_dict"]
    swapped = [i for i, t in enumerate(optim["fp32_flat_groups"]) if t.shape == (0,)]
    return swapped, [
        sorted(p.name for p in rank.iterdir()) for rank in sorted((tag_dir / "offloaded_tensors").iterdir())
    ]


def _check_loaded(case: Sample, checkpoint: Path, live: dict, state: dict, world_size: int) -> set[str]:
    """What DeepSpeed 0.19.8 restores from an NVMe checkpoint (its own included, see
    test_deepspeed_loads_zckpt_output_as_it_loads_its_own) equals the original run's values:
    the fp32 masters of the swapped sub-groups (from offloaded_tensors/) and the counters; and
    the engine swaps exactly the sub-groups zckpt wrote swap files for. Returns the params
    whose masters were restored (and checked)."""
    assert (state["world_size"], state["zero_stage"]) == (world_size, 3)
    swapped, files = _swapped_in_output(checkpoint)
    assert _swapped_in_engine(state) == swapped
    assert len(files) == world_size and all(len(f) == 3 * len(swapped) for f in files)  # master, exp_avg, exp_avg_sq
    original = open_training_state(case.checkpoint)
    assert (state["global_steps"], state["global_samples"], state["skipped_steps"]) == (
        original.global_steps,
        original.global_samples,
        original.skipped_steps,
    )
    tag_dir = Path(open_training_state(checkpoint).index.tag_dir)
    param_shapes = torchfile.load(tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")[
        "param_shapes"
    ]  # per sub-group
    names = {name for f in swapped for name in param_shapes[f]}
    expected = case.live()
    tied = case.meta["tied"]
    for name in names | {alias for alias, source in tied.items() if source in names}:
        assert same_bits(live[name], expected[name].float()), name
    return names


@pytest.mark.parametrize("world_size", [1, 3])
def test_deepspeed_with_nvme_loads_resharded_sample(world_size: int, tmp_path: Path) -> None:
    case = sample(NVME_SAMPLE)
    reshard(case.checkpoint, tmp_path / "out", world_size=world_size)
    live, _, state = run_nvme_probe(NVME_SAMPLE, tmp_path / "out", world_size, tmp_path / "probe")
    restored = _check_loaded(case, tmp_path / "out", live, state, world_size)
    # at 1 rank the first decay sub-group is swapped; at 3 its partitions are under 1 MiB: none is
    assert restored == ({"embed.weight", "fc1.weight"} if world_size == 1 else set())


def test_deepspeed_loads_zckpt_output_as_it_loads_its_own(tmp_path: Path) -> None:
    """At the sample's own world size, DeepSpeed ends up holding the same values (masters,
    module weights, optimizer states, steps, counters) whether it loads DeepSpeed's checkpoint
    or zckpt's rewrite of it. DeepSpeed 0.19.8 with NVMe optimizer offload never reads the
    optim files and restores Adam moments for no sub-group (its optimizer state is created
    lazily, so the swapper knows no state files to read back): only swapped masters come back."""
    case = sample(NVME_SAMPLE)
    reshard(case.checkpoint, tmp_path / "out", world_size=2)
    theirs = run_nvme_probe(NVME_SAMPLE, case.checkpoint, 2, tmp_path / "probe_theirs", train_steps=1)
    ours = run_nvme_probe(NVME_SAMPLE, tmp_path / "out", 2, tmp_path / "probe_ours", train_steps=1)
    for a, b in zip(theirs[:2], ours[:2]):
        assert sorted(a) == sorted(b) and all(same_bits(a[n], b[n]) for n in a)
    # module weights after the load, and everything after one more step (where the padding
    # DeepSpeed left in its swap files and zckpt's zeros must make no difference)
    for file in ("live_module", "live_after_train", "live_optimizer_after_train"):
        a, b = (load_file(tmp_path / probe / f"{file}.safetensors") for probe in ("probe_theirs", "probe_ours"))
        assert sorted(a) == sorted(b) and all(same_bits(a[n], b[n]) for n in a), file
    keys = (
        "global_steps",
        "global_samples",
        "skipped_steps",
        "param_groups",
        "optimizer_state_keys",
        "lr_scheduler",
        "train",
    )

    def strip(state: dict) -> dict:
        return {k: state[k] for k in keys} | {"train": {k: v for k, v in state["train"].items() if k != "methods"}}

    assert strip(theirs[2]) == strip(ours[2])
    restored = _check_loaded(case, tmp_path / "out", ours[0], ours[2], 2)
    assert restored == {"embed.weight", "fc1.weight", "fc2.weight"}


def test_fresh_nvme_run_resharded_2_to_3(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """A run made now (sizes and seed not in the repository), 2 ranks -> 3 ranks."""
    root = tmp_path_factory.mktemp("fresh_nvme")
    pythons = {"ds19": sys.executable}
    GEN.generate(FRESH, root, pythons, root, extensions=extensions_for(pythons))
    case = Sample(FRESH.name, root / FRESH.name, json.loads((root / FRESH.name / "meta.json").read_text()))
    assert [g["swapped_to_nvme"] for g in case.meta["fp32_sub_groups"]] == [True, False]
    reshard(case.checkpoint, tmp_path / "out", world_size=3)
    live, _, state = run_nvme_probe(dataclasses.asdict(FRESH), tmp_path / "out", 3, tmp_path / "probe")
    restored = _check_loaded(case, tmp_path / "out", live, state, 3)
    assert restored == {"embed.weight", "fc1.weight", "fc2.weight", "pos.weight"}
