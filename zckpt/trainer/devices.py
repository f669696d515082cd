"""Where the trainer computes and how its ranks talk: CPU with gloo, or a CUDA device per rank.

On CUDA the model's forward and backward run on the rank's GPU (``cuda:LOCAL_RANK``) and the
param gathers and gradient reduce-scatters go through nccl; the param shares, the fp32 masters,
the Adam moments and their NVMe swap files stay in host memory, as DeepSpeed keeps them with
``offload_optimizer`` (and ``offload_param``). The process group is then ``cpu:gloo,cuda:nccl``:
torch routes each collective by its tensor's device, so the host-side ones (gradient norm,
overflow flag, loss sum, checkpoint barriers) keep using gloo exactly as on CPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..core.errors import UsageError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def check_device_choice(choice: str) -> None:
    if choice not in DEVICE_CHOICES:
        raise UsageError(None, f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")


def compute_device(choice: str, local_rank: int, cuda_available: bool) -> torch.device:
    """The device this rank computes on: ``auto`` is its own GPU when torch sees CUDA, else CPU."""
    check_device_choice(choice)
    if choice == "cuda" and not cuda_available:
        raise UsageError(None, "--device cuda: torch sees no CUDA device here (use --device cpu)")
    if choice == "cpu" or not cuda_available:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def process_group_backend(device: torch.device) -> str:
    """gloo for a CPU run; gloo for host tensors and nccl for device tensors on a CUDA run."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def rank_device(choice: str) -> torch.device:
    """:func:`compute_device` for this process (torchrun's LOCAL_RANK picks its GPU), made current.

    A process group that already exists (a caller's own) must have gloo for host tensors; one
    without nccl keeps ``auto`` on CPU: its collectives could not move device tensors."""
    cuda = torch.cuda.is_available()
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())
        if backend != "gloo" and "cpu:gloo" not in backend:
            raise UsageError(
                None,
                f"the trainer's host-side collectives need gloo, the process group is {backend!r} (use 'cpu:gloo,cuda:nccl')",
            )
        if "nccl" not in backend:
            if choice == "cuda":
                raise UsageError(
                    None, f"--device cuda in a {backend} process group: nccl is needed to move CUDA tensors"
                )
            cuda = False
    device = compute_device(choice, int(os.environ.get("LOCAL_RANK", "0")), cuda)
    if device.type == "cuda":
        # every rank of the node checks its node's count, so all refuse before the rendezvous
        # (one rank refusing alone leaves the others waiting there for it)
        per_node = max(device.index + 1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if per_node > torch.cuda.device_count():
            raise UsageError(
                None,
                f"{per_node} processes on this node but torch sees {torch.cuda.device_count()} CUDA device(s): "
                "start at most one process per GPU (--nproc-per-node), or --device cpu",
            )
        torch.cuda.set_device(device)
    return device
