"""``zckpt nvme-plan``: ZeRO-3 NVMe swap settings with which DeepSpeed's swap assertions cannot fire.

Users cannot size ``offload_param``'s swap buffers: a buffer smaller than the largest swapped
partition fails at ``zero.Init`` ("More elements N than buffer size B"), and fewer buffers than
the params one fetch swaps in fails when a library gathers the whole model at init under ZeRO-3
("Not enough buffers 5 for swapping 197"). Given param shapes, :func:`plan_nvme` applies
DeepSpeed's own rules (:mod:`zckpt.deepspeed.swap_rules`) and returns an immutable
:class:`NvmePlan`: the settings, the pinned memory they cost, the swap folder's size, cheaper
alternatives, and what in a given config would fail. :func:`nvme_plan` reads the shapes from a
checkpoint, a weights file or folder, or a Hugging Face ``config.json`` first
(:mod:`zckpt.ops.nvme_shapes`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

from ..core import dtypes
from ..core.errors import UsageError
from ..core.sizes import format_size, parse_size
from ..deepspeed import names as N
from ..deepspeed import swap_rules as R
from ..deepspeed.layout import rank_limit, rank_limit_reason
from ..deepspeed.partition import zero3_sub_groups
from ..deepspeed.run_config import DTYPE_KEYS, STAGE_KEY, RunConfig, load_config, read_run_config
from .nvme_shapes import ParamShape, load_params

DEFAULT_NVME_PATH = "/local_nvme"  # in the snippet when the config names none
ADAM_STATES = 2  # exp_avg, exp_avg_sq


@dataclass(frozen=True)
class SwappedParam:
    name: str
    numel: int
    partition_numel: int  # elements each rank swaps


@dataclass(frozen=True)
class Problem:
    """One setting of the given config that fails, with the error DeepSpeed raises."""

    setting: str  # dotted path in the DeepSpeed config
    value: Any
    needed: Any
    error: str  # DeepSpeed's assertion text, as it would word it
    why: str


@dataclass(frozen=True)
class Alternative:
    what: str
    settings: dict[str, Any]  # dotted setting -> value
    pinned_bytes_per_rank: int
    tradeoff: str


@dataclass(frozen=True)
class Pinned:
    """Page-locked host memory one rank allocates for swapping, by owner."""

    param_swap_buffers: int  # offload_param: buffer_count x aligned buffer_size
    param_cpu_copy: int  # offload_param: trainable partitions kept in CPU (up to max_in_cpu)
    param_swap_out_buffer: int  # offload_param: when trainable params stay on NVMe
    optimizer_swap_buffers: int  # offload_optimizer: buffer_count x the largest sub-group

    @property
    def total(self) -> int:
        return self.param_swap_buffers + self.param_cpu_copy + self.param_swap_out_buffer + self.optimizer_swap_buffers


@dataclass(frozen=True)
class Disk:
    """Bytes of the swap folder (``<nvme_path>/zero_stage_3``) one rank writes."""

    params: int
    optimizer: int  # fp32 masters and optimizer states; gradients at most

    @property
    def total(self) -> int:
        return self.params + self.optimizer


@dataclass(frozen=True)
class NvmePlan:
    model: str
    model_kind: str  # "checkpoint" | "weights" | "hf_config"
    world_size: int
    dtype: str
    params: int
    numel: int
    trainable_numel: int
    swap_threshold_bytes: int
    swapped: tuple[SwappedParam, ...]  # in creation order
    offload_param: dict[str, Any]
    offload_optimizer: dict[str, Any] | None  # None: the config keeps the optimizer off NVMe
    sub_group_size: int
    pinned: Pinned
    disk: Disk
    memory_budget: int | None
    alternatives: tuple[Alternative, ...]
    config: str | None = None
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def fits_budget(self) -> bool | None:
        return None if self.memory_budget is None else self.pinned.total <= self.memory_budget

    @property
    def ok(self) -> bool:
        """The plan fits the budget and the given config (if any) would not fail."""
        return not self.problems and self.fits_budget is not False

    def snippet(self) -> dict[str, Any]:
        """The part of a DeepSpeed config to paste."""
        zero = {
            N.CONFIG_STAGE: 3,
            N.CONFIG_SUB_GROUP_SIZE: self.sub_group_size,
            N.CONFIG_OFFLOAD_PARAM: self.offload_param,
        }
        if self.offload_optimizer is not None:
            zero[N.CONFIG_OFFLOAD_OPTIMIZER] = self.offload_optimizer
        return {N.CONFIG_ZERO: zero}

    def as_dict(self) -> dict[str, Any]:
        largest = max(self.swapped, key=lambda s: s.partition_numel, default=None)
        return {
            "model": self.model,
            "model_kind": self.model_kind,
            "world_size": self.world_size,
            "dtype": self.dtype,
            "params": self.params,
            "numel": self.numel,
            "trainable_numel": self.trainable_numel,
            "swap_threshold_bytes": self.swap_threshold_bytes,
            "swapped": {
                "count": len(self.swapped),
                "largest": asdict(largest) if largest else None,
                "params": [asdict(s) for s in self.swapped],
            },
            "offload_param": self.offload_param,
            "offload_optimizer": self.offload_optimizer,
            "sub_group_size": self.sub_group_size,
            "pinned_bytes_per_rank": {**asdict(self.pinned), "total": self.pinned.total},
            "disk_bytes": {
                "params_per_rank": self.disk.params,
                "optimizer_per_rank": self.disk.optimizer,
                "per_rank": self.disk.total,
                "all_ranks": self.disk.total * self.world_size,
            },
            "memory_budget": self.memory_budget,
            "fits_budget": self.fits_budget,
            "alternatives": [asdict(a) for a in self.alternatives],
            "config": self.config,
            "config_problems": [asdict(p) for p in self.problems],
            "ok": self.ok,
            "notes": list(self.notes),
            "config_snippet": self.snippet(),
        }


# --------------------------------------------------------------------------------------
# Planning: pure, on shapes
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """What DeepSpeed does with the params at one world size, dtype and aio setting."""

    swapped: tuple[SwappedParam, ...]
    trainable_sub_groups: tuple[tuple[int, ...], ...]  # indices into the trainable params
    sub_group_numels: tuple[int, ...]  # per-rank elements of each sub-group
    trainable: tuple[ParamShape, ...]


def _layout(
    params: Sequence[ParamShape], world_size: int, element_size: int, aio: R.Aio, sub_group_size: int
) -> _Layout:
    swapped = tuple(
        SwappedParam(p.name, p.numel, part)
        for p in params
        if R.swapped(part := R.partition_numel(p.numel, world_size), element_size, aio)
    )
    trainable = tuple(p for p in params if p.trainable)
    groups = zero3_sub_groups([[p.numel for p in trainable]], world_size, sub_group_size) if trainable else []
    numels = tuple(sum(R.partition_numel(trainable[i].numel, world_size) for i in g) for g in groups)
    return _Layout(swapped, tuple(tuple(g) for g in groups), numels, trainable)


def _pinned(
    layout: _Layout,
    element_size: int,
    aio: R.Aio,
    buffer_size: int,
    buffer_count: int,
    max_in_cpu: int,
    optimizer_buffer_count: int | None,
) -> Pinned:
    align = aio.numel_alignment(element_size)
    in_cpu, flat = R.cpu_sub_groups(layout.sub_group_numels, max_in_cpu)
    swap_out = 0
    if not all(in_cpu):  # stage3: reserve_partitioned_swap_space of the largest sub-group, by full numel
        largest = max(range(len(layout.sub_group_numels)), key=lambda i: layout.sub_group_numels[i])
        swap_out = (
            sum(R.io_aligned_numel(layout.trainable[i].numel, align) for i in layout.trainable_sub_groups[largest])
            * element_size
        )
    optimizer = 0
    if optimizer_buffer_count is not None and layout.sub_group_numels:
        largest_numel = R.io_aligned_numel(max(layout.sub_group_numels), aio.numel_alignment(R.MASTER_ELEMENT_SIZE))
        optimizer = optimizer_buffer_count * largest_numel * R.MASTER_ELEMENT_SIZE
    return Pinned(
        R.io_aligned_numel(buffer_size, align) * buffer_count * element_size, flat * element_size, swap_out, optimizer
    )


def _disk(layout: _Layout, element_size: int, aio: R.Aio, optimizer_states: int, optimizer_on_nvme: bool) -> Disk:
    """Swap files one rank writes: each swapped param's partition, and per swapped optimizer
    sub-group its fp32 master, its optimizer states and (at most) its gradient."""
    align = aio.numel_alignment(element_size)
    params = sum(R.io_aligned_numel(s.partition_numel, align) for s in layout.swapped) * element_size
    optimizer = 0
    if optimizer_on_nvme:
        master_align = aio.numel_alignment(R.MASTER_ELEMENT_SIZE)
        for numel in layout.sub_group_numels:
            if R.swapped(numel, R.MASTER_ELEMENT_SIZE, aio):
                optimizer += (1 + optimizer_states) * R.io_aligned_numel(numel, master_align) * R.MASTER_ELEMENT_SIZE
                optimizer += numel * R.MASTER_ELEMENT_SIZE  # gradients: their aligned parts are swapped
    return Disk(params, optimizer)


def _small_sub_group_size(layout: _Layout, world_size: int) -> int:
    """A sub_group_size that makes each optimizer sub-group about one param: the largest trainable
    partition (a sub-group closes once it reaches the size)."""
    return max((R.partition_numel(p.numel, world_size) for p in layout.trainable), default=1)


def _max_in_cpu_choices(layout: _Layout) -> list[int]:
    """The values of max_in_cpu that change something: 0 and each sub-group boundary."""
    sums, total = [0], 0
    for numel in layout.sub_group_numels:
        total += numel
        sums.append(total)
    return sums


def plan_nvme(
    params: Sequence[ParamShape],
    *,
    world_size: int = 1,
    dtype: str = "bf16",
    config: dict[str, Any] | None = None,
    memory_budget: int | None = None,
    optimizer_states: int = ADAM_STATES,
    model: str = "",
    model_kind: str = "weights",
    config_path: str | None = None,
    notes: Sequence[str] = (),
) -> NvmePlan:
    """Settings for ZeRO-3 ``offload_param`` and ``offload_optimizer`` on NVMe with which
    DeepSpeed's swap-buffer assertions cannot fire, for `params` (in creation order) at
    `world_size` ranks; `config` (a DeepSpeed config dict, read from `config_path`) supplies aio,
    sub_group_size, pipelining and nvme_path, read as DeepSpeed reads them (a value DeepSpeed
    refuses raises UsageError), and is checked. Pinned memory and `memory_budget` are per rank."""
    if world_size < 1:
        raise UsageError(None, f"world size must be at least 1, not {world_size}")
    if not params:
        raise UsageError(model or None, "no parameters to plan for")
    elements = sum(p.numel for p in params)
    if world_size > rank_limit(elements):
        raise UsageError(None, f"--world-size {world_size}: zckpt plans {rank_limit_reason(elements)}")
    element_size = dtypes.output_dtype(dtype).itemsize
    swap = read_run_config(config or {}, config_path, swaps=True)  # the plan is for a run that swaps
    assert swap.aio is not None
    aio, sub_group_size = swap.aio, swap.sub_group_size
    given_param, given_opt = swap.offload_param, swap.offload_optimizer
    layout = _layout(params, world_size, element_size, aio, sub_group_size)

    buffer_size, buffer_count = R.param_buffers(
        [s.partition_numel for s in layout.swapped], R.SwapRule(aio, element_size)
    )
    pipeline_read = bool(given_opt and given_opt.pipeline_read)
    pipeline_write = bool(given_opt and given_opt.pipeline_write)
    optimizer_buffers = max(
        R.OPTIMIZER_BUFFER_COUNT_DEFAULT, R.optimizer_buffers_needed(optimizer_states, pipeline_read, pipeline_write)
    )
    # the optimizer is planned on NVMe too, unless the given config keeps it elsewhere
    optimizer_on_nvme = config is None or bool(given_opt and given_opt.device == R.NVME)
    all_notes = list(notes) + [
        f'{config_path or "the config"}: {key} is "auto", filled in by {who}: planned as DeepSpeed alone reads it'
        for key, who in swap.filled.items()
        if key not in DTYPE_KEYS + (N.CONFIG_GRADIENT_CLIPPING,)
    ]
    if not optimizer_on_nvme:
        all_notes.append("the config keeps offload_optimizer off NVMe: only offload_param is planned")
    max_in_cpu = given_param.max_in_cpu if given_param else R.MAX_IN_CPU_DEFAULT

    def pinned_at(mic: int, lay: _Layout) -> Pinned:
        return _pinned(
            lay, element_size, aio, buffer_size, buffer_count, mic, optimizer_buffers if optimizer_on_nvme else None
        )

    config_layout = layout  # the given config's problems are judged at its own sub_group_size
    pinned = pinned_at(max_in_cpu, layout)
    if memory_budget is not None and pinned.total > memory_budget:
        # cheaper settings that keep the same params on NVMe: smaller optimizer sub-groups, then fewer
        # trainable partitions held in CPU; the first that fits, changing as little as possible
        small = _small_sub_group_size(layout, world_size)
        for size in dict.fromkeys((sub_group_size, small)):
            lay = _layout(params, world_size, element_size, aio, size)
            fitting = [
                m
                for m in sorted({max_in_cpu, *_max_in_cpu_choices(lay)}, reverse=True)
                if m <= max_in_cpu and pinned_at(m, lay).total <= memory_budget
            ]
            if fitting:
                if size != sub_group_size:
                    all_notes.append(
                        f"sub_group_size lowered to {size} to fit the memory budget: the optimizer swaps smaller sub-groups"
                    )
                if fitting[0] != max_in_cpu:
                    all_notes.append(
                        f"max_in_cpu lowered to {fitting[0]} to fit the memory budget: trainable params beyond it stay "
                        "on NVMe and are read from it at every optimizer step"
                    )
                sub_group_size, layout, max_in_cpu = size, lay, fitting[0]
                pinned = pinned_at(max_in_cpu, lay)
                break

    nvme_path = next((o.nvme_path for o in (given_param, given_opt) if o and o.nvme_path), None) or DEFAULT_NVME_PATH
    plan = NvmePlan(
        model=model,
        model_kind=model_kind,
        world_size=world_size,
        dtype=dtypes.output_dtype(dtype).short,
        params=len(params),
        numel=sum(p.numel for p in params),
        trainable_numel=sum(p.numel for p in layout.trainable),
        swap_threshold_bytes=aio.min_aio_bytes,
        swapped=layout.swapped,
        offload_param=R.offload_param_section(buffer_size, buffer_count, max_in_cpu, nvme_path),
        offload_optimizer=R.offload_optimizer_section(optimizer_buffers, nvme_path, pipeline_read, pipeline_write)
        if optimizer_on_nvme
        else None,
        sub_group_size=sub_group_size,
        pinned=pinned,
        disk=_disk(layout, element_size, aio, optimizer_states, optimizer_on_nvme),
        memory_budget=memory_budget,
        alternatives=(),
        config=config_path,
        notes=tuple(all_notes),
    )
    alternatives = _alternatives(
        params, plan, layout, element_size, aio, sub_group_size, optimizer_buffers if optimizer_on_nvme else None
    )
    problems = _problems(swap, plan, config_layout, element_size, optimizer_states) if config is not None else ()
    return replace(plan, alternatives=alternatives, problems=problems)


def _alternatives(
    params: Sequence[ParamShape],
    plan: NvmePlan,
    layout: _Layout,
    element_size: int,
    aio: R.Aio,
    sub_group_size: int,
    optimizer_buffers: int | None,
) -> tuple[Alternative, ...]:
    """Cheaper settings than the plan's, each with its pinned memory per rank; each combined with
    smaller optimizer sub-groups where that is cheaper still."""
    found: list[Alternative] = []
    param_key = lambda key: R.setting_name(N.CONFIG_OFFLOAD_PARAM, key)  # noqa: E731
    sub_group_key = f"{N.CONFIG_ZERO}.{N.CONFIG_SUB_GROUP_SIZE}"
    max_in_cpu = plan.offload_param[R.MAX_IN_CPU]

    def cheapest(world_size: int, aio_: R.Aio, param_pinned: Any) -> tuple[int, dict[str, Any], _Layout]:
        """(pinned total, extra settings, layout) at the plan's or a one-param sub_group_size."""
        options = []
        for size in dict.fromkeys((sub_group_size, _small_sub_group_size(layout, world_size))):
            lay = _layout(params, world_size, element_size, aio_, size)
            options.append((param_pinned(lay), {} if size == sub_group_size else {sub_group_key: size}, lay))
        return min(options, key=lambda o: o[0])

    def swap_cost(world_size: int, aio_: R.Aio, mic: int) -> Any:
        def cost(lay: _Layout) -> int:
            largest = max((s.partition_numel for s in lay.swapped), default=0)
            size = R.io_aligned_numel(largest, aio_.numel_alignment(element_size)) if largest else 0
            return _pinned(lay, element_size, aio_, size, len(lay.swapped), mic, optimizer_buffers).total

        return cost

    total, extra, lay = cheapest(plan.world_size, aio, swap_cost(plan.world_size, aio, max_in_cpu))
    if extra:
        found.append(
            Alternative(
                f"smaller optimizer sub-groups (sub_group_size {extra[sub_group_key]})",
                extra,
                total,
                f"each optimizer swap buffer holds only the largest sub-group ({len(lay.sub_group_numels)} sub-groups instead of "
                f"{len(layout.sub_group_numels)}); more, smaller NVMe reads per optimizer step",
            )
        )
    if layout.sub_group_numels and max_in_cpu > 0:
        total, extra, _ = cheapest(plan.world_size, aio, swap_cost(plan.world_size, aio, 0))
        found.append(
            Alternative(
                "trainable params on NVMe too (max_in_cpu 0)",
                {param_key(R.MAX_IN_CPU): 0, **extra},
                total,
                "no pinned CPU copy of the trainable params; every optimizer step reads and writes them on NVMe",
            )
        )
    by_size = sorted(layout.swapped, key=lambda s: s.partition_numel, reverse=True)
    if len(by_size) >= 2 and by_size[0].partition_numel > by_size[1].partition_numel:
        # a larger aio block raises DeepSpeed's swap threshold: the params below it stay in CPU memory
        block = (
            1 << (by_size[1].partition_numel * element_size).bit_length()
        )  # next power of two above the second largest
        if block <= by_size[0].partition_numel * element_size:
            aio2 = R.Aio(block, aio.intra_op_parallelism)
            total, extra, lay = cheapest(plan.world_size, aio2, swap_cost(plan.world_size, aio2, max_in_cpu))
            on_nvme = {s.name for s in lay.swapped}
            kept = [p for p in params if p.name not in on_nvme]
            kept_bytes = sum(R.partition_numel(p.numel, plan.world_size) for p in kept) * element_size
            frozen_kept = (
                sum(R.partition_numel(p.numel, plan.world_size) for p in kept if not p.trainable) * element_size
            )
            found.append(
                Alternative(
                    f"only the {len(lay.swapped)} largest tensor(s) on NVMe (aio.block_size {block})",
                    {
                        R.setting_name(R.CONFIG_AIO, R.AIO_BLOCK_SIZE): block,
                        param_key(R.BUFFER_COUNT): len(lay.swapped),
                        **extra,
                    },
                    total + frozen_kept,
                    f"the other params ({format_size(kept_bytes)} per rank) live in CPU memory; DeepSpeed has no setting that keeps "
                    "one large tensor off NVMe while smaller ones swap, so the threshold is raised instead",
                )
            )
    if layout.swapped:
        ws2 = plan.world_size * 2
        total, extra, lay = cheapest(ws2, aio, swap_cost(ws2, aio, max_in_cpu))
        largest2 = max((s.partition_numel for s in lay.swapped), default=0)
        settings = {param_key(R.BUFFER_COUNT): len(lay.swapped), **extra}
        if largest2:
            settings[param_key(R.BUFFER_SIZE)] = R.io_aligned_numel(largest2, aio.numel_alignment(element_size))
        found.append(
            Alternative(
                f"twice the ranks ({ws2}): every partition halves", settings, total, "needs the extra processes"
            )
        )

    def cpu_cost(lay: _Layout) -> int:
        everything = sum(R.partition_numel(p.numel, plan.world_size) for p in params) * element_size
        return everything + _pinned(lay, element_size, aio, 0, 0, 0, optimizer_buffers).optimizer_swap_buffers

    total, extra, _ = cheapest(plan.world_size, aio, cpu_cost)
    found.append(
        Alternative(
            "params in CPU memory instead of NVMe",
            {param_key(R.DEVICE): "cpu", **extra},
            total,
            "no param swap buffers or files; every param partition lives in pinned CPU memory",
        )
    )
    return tuple(a for a in found if a.pinned_bytes_per_rank < plan.pinned.total)


def _problems(
    swap: RunConfig, plan: NvmePlan, layout: _Layout, element_size: int, optimizer_states: int
) -> tuple[Problem, ...]:
    """What in the given config fails, with the assertion DeepSpeed raises."""
    found: list[Problem] = []
    param, opt = swap.offload_param, swap.offload_optimizer
    key = lambda section, k: R.setting_name(section, k)  # noqa: E731
    on_nvme = [(N.CONFIG_OFFLOAD_PARAM, param), (N.CONFIG_OFFLOAD_OPTIMIZER, opt)]
    for section, offload in on_nvme:
        if offload and offload.device == R.NVME and not offload.nvme_path:
            found.append(
                Problem(
                    key(section, R.NVME_PATH),
                    None,
                    "a folder on a fast local disk",
                    R.NVME_PATH_MISSING,
                    "the device is nvme but no nvme_path is set",
                )
            )
        if offload and offload.device == R.NVME and swap.stage != 3 and STAGE_KEY not in swap.filled:
            found.append(
                Problem(
                    f"{N.CONFIG_ZERO}.{N.CONFIG_STAGE}",
                    swap.stage,
                    3,
                    f"{section} to NVMe needs ZeRO stage 3",
                    "DeepSpeed swaps to NVMe only under ZeRO-3",
                )
            )
    if param and param.device == R.NVME and layout.swapped:
        too_big = next((s for s in layout.swapped if s.partition_numel > param.buffer_size), None)
        largest = max(layout.swapped, key=lambda s: s.partition_numel)
        if too_big:
            found.append(
                Problem(
                    key(N.CONFIG_OFFLOAD_PARAM, R.BUFFER_SIZE),
                    param.buffer_size,
                    largest.partition_numel,
                    R.MORE_ELEMENTS.format(numel=too_big.partition_numel, buffer_size=param.buffer_size),
                    f"at zero.Init each swapped partition must fit one buffer; {too_big.name} has {too_big.partition_numel} elements per rank "
                    f"(the largest, {largest.name}, {largest.partition_numel})",
                )
            )
        if param.buffer_count == 0:
            found.append(
                Problem(
                    key(N.CONFIG_OFFLOAD_PARAM, R.BUFFER_COUNT),
                    0,
                    len(layout.swapped),
                    R.NO_SWAP_BUFFERS.format(ds_id=0, numel=layout.swapped[0].partition_numel),
                    "zero.Init needs a buffer to swap out the first param",
                )
            )
        elif param.buffer_count < len(layout.swapped):
            found.append(
                Problem(
                    key(N.CONFIG_OFFLOAD_PARAM, R.BUFFER_COUNT),
                    param.buffer_count,
                    len(layout.swapped),
                    R.NOT_ENOUGH_BUFFERS.format(available=param.buffer_count, count=len(layout.swapped)),
                    f"{len(layout.swapped)} params are swapped and gathering them all at once (transformers and PEFT do at init under "
                    "ZeRO-3; DeepSpeed's own fetches can hold as many) swaps every one in, one buffer each",
                )
            )
        in_cpu, _ = R.cpu_sub_groups(layout.sub_group_numels, param.max_in_cpu)
        if opt and opt.device == R.NVME and opt.fast_init and not all(in_cpu):
            master_align = swap.aio.numel_alignment(R.MASTER_ELEMENT_SIZE)
            needed = R.io_aligned_numel(max(layout.sub_group_numels), master_align)
            have = R.io_aligned_numel(param.buffer_size, swap.aio.numel_alignment(element_size))
            if have < needed:
                found.append(
                    Problem(
                        key(N.CONFIG_OFFLOAD_PARAM, R.BUFFER_SIZE),
                        param.buffer_size,
                        needed,
                        R.FP16_BUFFERS_TOO_SMALL.format(buffers=[have] * param.buffer_count, numel=needed),
                        "with offload_optimizer.fast_init and params beyond max_in_cpu, each param swap buffer must hold "
                        "the largest optimizer sub-group",
                    )
                )
    if (
        opt
        and opt.device == R.NVME
        and any(R.swapped(n, R.MASTER_ELEMENT_SIZE, swap.aio) for n in layout.sub_group_numels)
    ):
        needed = R.optimizer_buffers_needed(optimizer_states, opt.pipeline_read, opt.pipeline_write)
        if opt.buffer_count < needed:
            pipelined = opt.pipeline_read or opt.pipeline_write
            found.append(
                Problem(
                    key(N.CONFIG_OFFLOAD_OPTIMIZER, R.BUFFER_COUNT),
                    opt.buffer_count,
                    needed,
                    R.OPTIMIZER_OUT_OF_BUFFERS if pipelined else R.OPTIMIZER_NO_PINNED_BUFFERS,
                    f"each swapped sub-group needs a buffer for its fp32 master, each of the {optimizer_states} optimizer "
                    f"states and its gradient{', for each swap in flight' if pipelined else ''}",
                )
            )
    if swap.known_dtype not in (None, plan.dtype):
        found.append(
            Problem(
                "bf16/fp16",
                swap.dtype,
                plan.dtype,
                "the plan was made for another dtype",
                f"the config trains in {swap.dtype}; plan with --dtype {swap.dtype}",
            )
        )
    if plan.memory_budget is not None and param and param.device == R.NVME:
        given = _pinned(
            layout,
            element_size,
            swap.aio,
            param.buffer_size,
            param.buffer_count,
            param.max_in_cpu,
            opt.buffer_count if opt and opt.device == R.NVME else None,
        )
        if given.total > plan.memory_budget:
            found.append(
                Problem(
                    "pinned memory",
                    given.total,
                    plan.memory_budget,
                    "over the memory budget",
                    f"this config pins {format_size(given.total)} per rank, more than the budget of {format_size(plan.memory_budget)}",
                )
            )
    return tuple(found)


# --------------------------------------------------------------------------------------
# The entry: MODEL's params read, then planned
# --------------------------------------------------------------------------------------
def nvme_plan(
    model: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    dtype: str | None = None,
    config: str | os.PathLike[str] | None = None,
    memory_budget: str | int | None = None,
    frozen: bool = False,
) -> NvmePlan:
    """Read MODEL's params (and the DeepSpeed config, if given) and plan; writes nothing.

    With `frozen`, every param of MODEL counts as frozen, as the base of a PEFT (LoRA) run is: it
    gets no optimizer state and no CPU copy, and stays on NVMe.

    The dtype is `dtype`, else the config's (bf16/fp16 enabled, else fp32), else the checkpoint's,
    else bf16. The world size is `world_size`, else the checkpoint's, else 1.
    """
    config_dict = load_config(config) if config is not None else None
    config_dtype = (
        read_run_config(config_dict, os.fspath(config), swaps=True).known_dtype if config is not None else None
    )
    loaded = load_params(model)
    params = tuple(replace(p, trainable=False) for p in loaded.params) if frozen else loaded.params
    chosen = dtypes.output_dtype(dtype).short if dtype else config_dtype or loaded.dtype or "bf16"
    notes = [n for n in loaded.notes if not (frozen and "trainable" in n)]
    if frozen:
        notes.append("every param counted as frozen (--frozen): the adapters a PEFT run adds are small and not planned")
    if not dtype and config_dtype is None:
        if config is not None:  # the config leaves the dtype to the Trainer
            notes.append(
                f'{config}: bf16/fp16 "enabled" is "auto", filled in by the Hugging Face Trainer from its arguments: '
                f"the plan takes {chosen} (pass --dtype)"
            )
        elif not loaded.dtype:
            notes.append("dtype bf16 assumed (pass --dtype or --config)")
    return plan_nvme(
        params,
        world_size=world_size or loaded.world_size or 1,
        dtype=chosen,
        config=config_dict,
        memory_budget=parse_size(memory_budget) if memory_budget is not None else None,
        model=os.fspath(model),
        model_kind=loaded.kind,
        config_path=os.fspath(config) if config is not None else None,
        notes=notes,
    )
