"""Which device the trainer computes on and which backend its ranks use.

This machine has no GPU: the CUDA path's choices are checked here as pure functions, a CPU run
keeps every tensor on the host, and a device-keyed group runs the host side as plain gloo;
running the CUDA path itself needs a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import SMALL, runner
from zckpt.cli.app import app
from zckpt.core.errors import UsageError
from zckpt.trainer import TrainConfig, Trainer
from zckpt.trainer.devices import compute_device, process_group_backend, rank_device
from zckpt.trainer.ranks import run_ranks


def test_auto_is_the_ranks_gpu_when_there_is_one() -> None:
    assert compute_device("auto", 0, cuda_available=False) == torch.device("cpu")
    assert compute_device("auto", 1, cuda_available=True) == torch.device("cuda", 1)
    assert compute_device("cuda", 3, cuda_available=True) == torch.device("cuda", 3)
    assert compute_device("cpu", 1, cuda_available=True) == torch.device("cpu")


def test_cuda_without_a_gpu_and_unknown_devices_are_refused() -> None:
    with pytest.raises(UsageError, match="--device cuda: torch sees no CUDA device"):
        compute_device("cuda", 0, cuda_available=False)
    with pytest.raises(UsageError, match="--device must be one of auto, cpu, cuda, got 'tpu'"):
        compute_device("tpu", 0, cuda_available=True)
    with pytest.raises(UsageError, match="--device must be one of"):
        TrainConfig(device="gpu")


def test_a_cuda_run_routes_host_tensors_to_gloo_and_device_tensors_to_nccl() -> None:
    assert process_group_backend(torch.device("cpu")) == "gloo"
    assert process_group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    # torch parses the mixed form as a device -> backend map (what init_process_group is given)
    config = torch.distributed.BackendConfig(torch.distributed.Backend("cpu:gloo,cuda:nccl"))
    assert config.get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


def _device_in_a_gloo_group(rank: int, world: int, choice: str) -> str:
    try:
        return str(rank_device(choice))
    except UsageError as exc:
        return f"error: {exc}"


@pytest.mark.slow
def test_a_callers_gloo_group_keeps_auto_on_cpu(tmp_path: Path) -> None:
    assert run_ranks(2, tmp_path / "auto", _device_in_a_gloo_group, "auto") == ["cpu", "cpu"]
    assert (
        run_ranks(2, tmp_path / "cuda", _device_in_a_gloo_group, "cuda")
        == ["error: --device cuda in a gloo process group: nccl is needed to move CUDA tensors"] * 2
    )


def test_cpu_run_keeps_every_tensor_on_the_host() -> None:
    trainer = Trainer(TrainConfig(steps=1, layers=1, dim=16, heads=2, vocab=31, seq_len=8, micro_batch=2, device="cpu"))
    assert trainer.device == torch.device("cpu")
    log = trainer.train_step()
    assert log.step == 1 and log.loss > 0
    assert all(shard.device.type == "cpu" for shard in trainer.model.shards)
    assert all(value.device.type == "cpu" for _, value in trainer.model.full_params())
    trainer.close()


def test_cli_device_options_are_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", "--device", "tpu", *SMALL])
    assert (
        result.exit_code == 2
        and result.stderr.strip() == "zckpt: error: --device must be one of auto, cpu, cuda, got 'tpu'"
    )
    if not torch.cuda.is_available():
        result = runner.invoke(app, ["train", "--device", "cuda", "--steps", "1", *SMALL])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == "zckpt: error: --device cuda: torch sees no CUDA device here (use --device cpu)"
    result = runner.invoke(app, ["train", "--device", "CPU", "--steps", "1", *SMALL])
    assert result.exit_code == 0, result.output


def test_a_callers_mixed_group_is_read_by_its_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True)
    torch.distributed.init_process_group("cpu:gloo", store=store, rank=0, world_size=1)
    try:
        assert rank_device("auto") == torch.device("cpu")  # gloo for host tensors, no nccl: CPU
        with pytest.raises(UsageError, match="--device cuda in a cpu:gloo process group: nccl is needed"):
            rank_device("cuda")
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")  # a caller's nccl-only group
        with pytest.raises(UsageError, match="host-side collectives need gloo, the process group is 'nccl'"):
            rank_device("auto")
    finally:
        monkeypatch.undo()
        torch.distributed.destroy_process_group()


def _train_in_group(rank: int, world: int, folder: str) -> tuple[tuple[float, ...], str]:
    """Train and save in the process group run_ranks made (its backend is the case)."""
    backend = str(torch.distributed.get_backend())
    config = TrainConfig(
        steps=3,
        layers=1,
        dim=16,
        heads=2,
        vocab=31,
        seq_len=8,
        micro_batch=2,
        grad_accum=2,
        dtype="bf16",
        out=f"{folder}/{backend.replace(':', '-')}",
        sub_group_size=64,
    )
    trainer = Trainer(config)
    losses = tuple(trainer.train_step().loss for _ in range(config.steps))
    trainer.save()
    trainer.close()
    return losses, str(torch.distributed.get_backend())


@pytest.mark.heavy
@pytest.mark.slow
def test_a_device_keyed_group_runs_the_host_side_as_plain_gloo(tmp_path: Path) -> None:
    """What a CUDA run's group does with host tensors, checked on CPU: a group given in the
    device-keyed form ('cpu:gloo', as 'cpu:gloo,cuda:nccl' is) routes every collective of a
    CPU run (gathers, reduce-scatters, norm, checkpoint barriers) to gloo: same losses, same
    checkpoint bytes as a plain gloo group."""
    keyed = run_ranks(2, tmp_path / "keyed", _train_in_group, str(tmp_path), backend="cpu:gloo")
    plain = run_ranks(2, tmp_path / "plain", _train_in_group, str(tmp_path), backend="gloo")
    assert [backend for _, backend in keyed] == ["cpu:gloo"] * 2 and [backend for _, backend in plain] == ["gloo"] * 2
    assert keyed[0][0] == plain[0][0] and len(keyed[0][0]) == 3
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        assert (tmp_path / "cpu-gloo" / "global_step3" / name).read_bytes() == (
            tmp_path / "gloo" / "global_step3" / name
        ).read_bytes()
