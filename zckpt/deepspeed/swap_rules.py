"""DeepSpeed's NVMe swap rules (ZeRO-3 ``offload_param`` / ``offload_optimizer`` on ``"nvme"``), on ints.

Read from DeepSpeed 0.19.8 (``runtime/swap_tensor/``, ``runtime/zero/``; file:line references in
sample_ckpts/FORMAT_OBSERVED.md, "NVMe swap buffers: DeepSpeed's rules") and checked against the
swap folders and buffers of real runs (tests/data/nvme_plan_measured.json). Pure: no files, no
tensors; :mod:`zckpt.ops.nvme_plan` plans with them.

Worked example, the issue's Qwen3-0.6B at one rank in bf16 (2-byte elements)::

    swap threshold  = max(1 MiB, aio.block_size) = 1 MiB  -> partitions of >= 524288 elements
    embed_tokens    = 151936 x 1024 = 155582464 elements  -> swapped, needs buffer_size >= 155582464
    k_proj          = 1024 x 1024   = 1048576 (2 MiB)     -> swapped
    q_norm          = 128                                  -> stays in memory
    swapped params  = 1 + 28 layers x 7 matrices = 197     -> a whole-model gather needs buffer_count >= 197
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from . import names as N
from .partition import zero3_partition

MIN_AIO_BYTES = 1 << 20  # swap_tensor/utils.py: smaller tensors are never swapped
AIO_ALIGNED_BYTES = 1024  # swap_tensor/utils.py: each I/O thread reads and writes this alignment
AIO_BLOCK_SIZE_DEFAULT = 1 << 20  # swap_tensor/constants.py
AIO_INTRA_OP_PARALLELISM_DEFAULT = 1
MASTER_ELEMENT_SIZE = 4  # fp32 masters, optimizer states and gradients of the optimizer swapper

# DeepSpeed's config keys and defaults (runtime/zero/offload_config.py, runtime/swap_tensor/constants.py)
CONFIG_AIO = N.CONFIG_AIO
AIO_BLOCK_SIZE = N.CONFIG_AIO_BLOCK_SIZE
AIO_INTRA_OP_PARALLELISM = N.CONFIG_AIO_INTRA_OP_PARALLELISM
DEVICE = N.CONFIG_OFFLOAD_DEVICE
NVME = N.OFFLOAD_DEVICE_NVME
NVME_PATH = "nvme_path"
BUFFER_SIZE = "buffer_size"
BUFFER_COUNT = "buffer_count"
MAX_IN_CPU = "max_in_cpu"
PIPELINE_READ = "pipeline_read"
PIPELINE_WRITE = "pipeline_write"
FAST_INIT = "fast_init"
PARAM_BUFFER_SIZE_DEFAULT = 100_000_000
PARAM_BUFFER_COUNT_DEFAULT = 5
MAX_IN_CPU_DEFAULT = 1_000_000_000
OPTIMIZER_BUFFER_COUNT_DEFAULT = 4

# DeepSpeed's assertion messages, as it words them
MORE_ELEMENTS = "More elements {numel} than buffer size {buffer_size}"  # partitioned_param_swapper.get_buffer
NOT_ENOUGH_BUFFERS = "Not enough buffers {available} for swapping {count}"  # partitioned_param_swapper.swap_in
NO_SWAP_BUFFERS = "No swap buffers to allocate for fp16 param {ds_id} of numel = {numel}"  # get_buffer
FP16_BUFFERS_TOO_SMALL = (
    "numel of fp16 buffers {buffers} is too small for initializing fp32 params {numel}"  # optimizer_utils
)
NVME_PATH_MISSING = '"nvme_path" in DeepSpeed Config cannot be None if remote device is nvme'  # partition_parameters.py
OPTIMIZER_OUT_OF_BUFFERS = "PipelinedOptimizerSwapper ran out of swap buffers, try increasing 'buffer_count'"
OPTIMIZER_NO_PINNED_BUFFERS = (
    "AssertionError at `assert pinned_buffers is not None` (PartitionedOptimizerSwapper.swap_in_optimizer_state)"
)


@dataclass(frozen=True)
class Aio:
    """The ``aio`` settings that decide what is swapped and how swap files are aligned."""

    block_size: int = AIO_BLOCK_SIZE_DEFAULT
    intra_op_parallelism: int = AIO_INTRA_OP_PARALLELISM_DEFAULT

    @property
    def min_aio_bytes(self) -> int:
        """A tensor is swapped only from this many bytes on (``max(MIN_AIO_BYTES, block_size)``)."""
        return max(MIN_AIO_BYTES, self.block_size)

    def numel_alignment(self, element_size: int) -> int:
        """Swap buffers and files are padded to this many elements.

        >>> Aio().numel_alignment(2), Aio().numel_alignment(4)
        (512, 256)
        """
        return AIO_ALIGNED_BYTES * self.intra_op_parallelism // element_size


def io_aligned_numel(numel: int, alignment: int) -> int:
    """``_io_aligned_numel``: `numel` rounded up to a multiple of `alignment`.

    >>> io_aligned_numel(7373856, 256), io_aligned_numel(512, 512)
    (7374080, 512)
    """
    return alignment * math.ceil(numel / alignment)


def partition_numel(numel: int, world_size: int) -> int:
    """Elements of one ZeRO-3 param each rank holds (and swaps)."""
    return zero3_partition(numel, world_size)[0]


def swapped(partition: int, element_size: int, aio: Aio) -> bool:
    """``swappable_tensor``: whether a partition of `partition` elements goes to NVMe at ``zero.Init``.

    >>> swapped(524288, 2, Aio()), swapped(524287, 2, Aio())
    (True, False)
    """
    return partition * element_size >= aio.min_aio_bytes


@dataclass(frozen=True)
class SwapRule:
    """Which ZeRO-3 optimizer sub-groups DeepSpeed keeps on NVMe, and how long their swap files are.

    ``OptimizerSwapper``: a sub-group is swapped iff its per-rank fp32 partition holds at least
    ``max(MIN_AIO_BYTES, aio.block_size)`` bytes (``is_swappable_tensor``); its master and each
    per-element optimizer state are then written whole to a file padded to a multiple of
    ``AIO_ALIGNED_BYTES * aio.intra_op_parallelism`` bytes (``_io_aligned_numel``). Worked
    example with the default aio settings and 262176 fp32 elements per rank::

        262176 * 4 = 1048704 bytes >= 1048576  -> swapped
        1024 // 4  = 256-element alignment      -> file of 262400 elements (1049600 bytes)

    >>> rule = SwapRule(Aio())
    >>> rule.swapped(262176), rule.swapped(6318), rule.file_numel(262176)
    (True, False, 262400)
    """

    aio: Aio
    itemsize: int = 4  # the swapped dtype: fp32 masters and states

    def swapped(self, numel: int) -> bool:
        return numel > 0 and swapped(numel, self.itemsize, self.aio)

    def file_numel(self, numel: int) -> int:
        return io_aligned_numel(numel, self.aio.numel_alignment(self.itemsize))


def param_buffers(swapped_partitions: Sequence[int], rule: SwapRule) -> tuple[int, int]:
    """``offload_param`` (buffer_size, buffer_count) with which swapping in every partition of
    `swapped_partitions` at once (a whole-model gather) cannot fail: the largest partition's
    swap file, one buffer each.

    >>> param_buffers([524288, 300000], SwapRule(Aio(), itemsize=2))
    (524288, 2)
    """
    largest = max(swapped_partitions, default=0)
    return rule.file_numel(largest) if largest else rule.aio.numel_alignment(rule.itemsize), max(
        1, len(swapped_partitions)
    )


def optimizer_buffers_needed(state_count: int, pipeline_read: bool, pipeline_write: bool) -> int:
    """``offload_optimizer.buffer_count`` one sub-group's swap-in takes: the fp32 master, each
    optimizer state and the gradient, times the swaps in flight at once when pipelined.

    >>> optimizer_buffers_needed(2, False, False), optimizer_buffers_needed(2, True, True)
    (4, 12)
    """
    return (1 + state_count + 1) * (1 + int(pipeline_read) + int(pipeline_write))


def cpu_sub_groups(sub_group_numels: Sequence[int], max_in_cpu: int) -> tuple[list[bool], int]:
    """Which trainable sub-groups ``offload_param`` keeps in a pinned CPU flat buffer (the rest stay
    on NVMe), and that buffer's elements (stage3 ``_create_param_groups_fp16_flat_cpu_memory``,
    one param group): the buffer holds ``min(total, max_in_cpu)`` elements and a sub-group is in
    CPU when it fits whole after the ones before it.

    >>> cpu_sub_groups([10, 10, 10], 25)
    ([True, True, False], 25)
    """
    total = sum(sub_group_numels)
    flat = min(total, max_in_cpu)
    held, offset = [], 0
    for numel in sub_group_numels:
        held.append(offset + numel <= flat)
        offset += numel
    return held, flat


# --- writing a DeepSpeed config ----------------------------------------------------------------
def offload_param_section(buffer_size: int, buffer_count: int, max_in_cpu: int, nvme_path: str) -> dict[str, Any]:
    """``zero_optimization.offload_param`` as a DeepSpeed config spells it."""
    return {
        DEVICE: NVME,
        NVME_PATH: nvme_path,
        BUFFER_SIZE: buffer_size,
        BUFFER_COUNT: buffer_count,
        MAX_IN_CPU: max_in_cpu,
    }


def offload_optimizer_section(
    buffer_count: int, nvme_path: str, pipeline_read: bool = False, pipeline_write: bool = False
) -> dict[str, Any]:
    """``zero_optimization.offload_optimizer`` as a DeepSpeed config spells it."""
    return {
        DEVICE: NVME,
        NVME_PATH: nvme_path,
        BUFFER_COUNT: buffer_count,
        PIPELINE_READ: pipeline_read,
        PIPELINE_WRITE: pipeline_write,
    }


def setting_name(section: str, key: str) -> str:
    """A setting's dotted path in a DeepSpeed config: ``zero_optimization.offload_param.buffer_size``."""
    return f"{N.CONFIG_ZERO}.{section}.{key}" if section != CONFIG_AIO else f"{CONFIG_AIO}.{key}"
