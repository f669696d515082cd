"""AdamW on each rank's fp32 master partitions, one ZeRO-3 sub-group at a time.

Per sub-group a rank keeps DeepSpeed's three flat fp32 tensors (master, ``exp_avg``,
``exp_avg_sq``: its shares of the sub-group's params, concatenated, padding included) and an
fp32 gradient of the same shape that the micro-steps accumulate into. The step mirrors
DeepSpeed's ZeRO-3 optimizer: unscale and clip by the global norm (``stage3.unscale_and_clip_grads``),
skip the step on an fp16 overflow, then ``torch.optim.AdamW``'s own update on each flat tensor, and
finally the new masters, rounded to the compute dtype, become the shards the model gathers.

The masters and moments live in a :class:`MemoryArena`: a memory file, so the checkpoint writer
streams them with the same code that copies file bytes (no copy, no scratch file). With NVMe
offload, the sub-groups DeepSpeed would swap live in swap files instead (:mod:`.swap`), their
fp32 gradients too, and the step streams them through the swapper's buffer pool.

The global gradient norm is summed share by share (float64, in the plan's param order), each
share's square taken when its last micro-step's gradient is in: the same sum whether a
gradient is in memory or in a swap file, so NVMe training is in-memory training bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.optim.adamw import adamw

from ..deepspeed.swap_rules import SwapRule
from .arena import MemoryArena
from .param_store import ParamStore
from .swap import OptimizerSwapper, SwappedGroup
from .zero3 import Comm, Zero3Plan

ADAM_STATES = ("exp_avg", "exp_avg_sq")


@dataclass
class DynamicLossScale:
    """DeepSpeed's DynamicLossScaler (fp16): same fields, same update rule, so it is saved and
    loaded as DeepSpeed's own object."""

    cur_scale: float = 2.0**16
    scale_window: int = 1000
    min_scale: float = 1.0
    delayed_shift: int = 2
    consecutive_hysteresis: bool = False
    raise_error_at_min_scale: bool = True
    cur_iter: int = 0
    last_overflow_iter: int = -1
    scale_factor: float = 2.0
    cur_hysteresis: int = 2
    dynamic: bool = True

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise FloatingPointError("fp16 loss scale is at its minimum and gradients still overflow")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


@dataclass(frozen=True)
class LRSchedule:
    """DeepSpeed's WarmupDecayLR with linear warmup, stepped as the engine steps it: the lr of
    optimizer step k (1-based) is the scheduler's value at iteration k - 2 (``min_lr`` before 0)."""

    max_lr: float
    warmup_steps: int
    total_steps: int
    min_lr: float = 0.0

    def at(self, iteration: int) -> float:
        if iteration < 0:
            return self.min_lr
        warmup = max(2, self.warmup_steps)
        if iteration < warmup:
            gamma = iteration / warmup
        else:
            gamma = max(0.0, (self.total_steps - iteration) / max(1.0, self.total_steps - warmup))
        return self.min_lr + (self.max_lr - self.min_lr) * gamma

    def ds_scheduler(self) -> dict:
        params = {
            "total_num_steps": self.total_steps,
            "warmup_min_lr": self.min_lr,
            "warmup_max_lr": self.max_lr,
            "warmup_num_steps": max(1, self.warmup_steps),
            "warmup_type": "linear",
        }
        return {"type": "WarmupDecayLR", "params": params}


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool


@dataclass(frozen=True)
class Slot:
    """Where a trainable param's share lies: flat group `flat`, element `offset`."""

    flat: int
    offset: int
    share: int


def param_group_defaults(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> dict:
    """A param group's hyperparameters exactly as torch.optim.AdamW keeps (and saves) them."""
    group = dict(
        torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay).param_groups[0]
    )
    group.pop("params")
    return group


@dataclass
class ShardedAdamW:
    plan: Zero3Plan
    comm: Comm
    hyperparams: list[dict]  # per param group (plan.group_names), torch AdamW's keys
    clip: float = 0.0
    loss_scale: DynamicLossScale | None = None  # fp16 only
    swap_folder: str | None = None  # NVMe offload: this rank's live swap folder
    swap_rule: SwapRule | None = None  # which sub-groups are swapped (DeepSpeed's rule)
    arena: MemoryArena = field(init=False)

    def __post_init__(self) -> None:
        layout = self.plan.layout
        rule = self.swap_rule if self.swap_folder is not None else None
        self.swapped = frozenset(
            f for f, g in enumerate(layout.flat_groups) if rule is not None and rule.swapped(g.partition)
        )
        sizes = [
            0 if f in self.swapped else g.partition * 4 for f, g in enumerate(layout.flat_groups) for _ in range(3)
        ]
        self.arena = MemoryArena(sizes)
        count = len(layout.flat_groups)
        # swapped sub-groups hold nothing here (empty tensors): their bytes are in the swap files
        self.masters = [
            self.arena.tensor(3 * f, 0 if f in self.swapped else g.partition) for f, g in enumerate(layout.flat_groups)
        ]
        self.states = {
            key: [
                self.arena.tensor(3 * f + 1 + k, 0 if f in self.swapped else g.partition)
                for f, g in enumerate(layout.flat_groups)
            ]
            for k, key in enumerate(ADAM_STATES)
        }
        self.swapper: OptimizerSwapper | None = None
        if self.swap_folder is not None and rule is not None:
            ds_id = {
                s.name: i for i, s in enumerate(self.plan.params)
            }  # module order, tied params once: DeepSpeed's ds_id
            groups = [
                SwappedGroup(
                    f,
                    g.partition,
                    rule.file_numel(g.partition),
                    ds_id[layout.params[g.params[0]].name],
                    ds_id[layout.params[g.params[-1]].name],
                )
                for f, g in enumerate(layout.flat_groups)
                if f in self.swapped
            ]
            self.swapper = OptimizerSwapper(self.swap_folder, groups)
        # fp32 gradients: swapped sub-groups' are in their gradient swap files
        self.grads = [torch.zeros(0 if f in self.swapped else g.partition) for f, g in enumerate(layout.flat_groups)]
        self.steps = [torch.tensor(0.0) for _ in range(count)]
        self.last_micro_step = True  # whether the gradients backward hands over now are the step's last
        self._written: set[int] = set()  # swapped shares with a gradient in their file this step
        self._square_sums: dict[int, tuple[float, bool]] = {}  # param -> (sum of squares, all finite)
        index_of = {s.name: i for i, s in enumerate(self.plan.params)}
        self.slots: dict[int, Slot] = {}
        self._spec_index: dict[int, int] = {}  # layout param -> plan param
        for f, group in enumerate(layout.flat_groups):
            offset = 0
            for member in group.params:
                spec_index = index_of[layout.params[member].name]
                share = self.plan.params[spec_index].share
                self.slots[spec_index] = Slot(f, offset, share)
                self._spec_index[member] = spec_index
                offset += share

    def load_masters(self, store: ParamStore) -> None:
        """Masters from the model's initial shards (fp32 copies of them)."""
        for index, slot in self.slots.items():
            self.write_share(index, "master", store.read(index).float())

    def read_share(self, index: int, key: str = "master") -> torch.Tensor:
        """This rank's share of param `index`'s fp32 master (or Adam state `key`), padding included."""
        slot = self.slots[index]
        if slot.flat in self.swapped:
            assert self.swapper is not None
            return torch.from_numpy(self.swapper.read_range(slot.flat, _file_key(key), slot.offset, slot.share))
        flats = self.masters if key == "master" else self.states[key]
        return flats[slot.flat][slot.offset : slot.offset + slot.share]

    def write_share(self, index: int, key: str, values: torch.Tensor) -> None:
        """Set this rank's share of param `index`'s master (or Adam state `key`) to `values`."""
        slot = self.slots[index]
        if slot.flat in self.swapped:
            assert self.swapper is not None
            self.swapper.write_range(slot.flat, _file_key(key), slot.offset, values.numpy())
        else:
            flats = self.masters if key == "master" else self.states[key]
            flats[slot.flat][slot.offset : slot.offset + slot.share].copy_(values)

    def begin_micro_step(self, last: bool) -> None:
        """Say whether the coming backward is the optimizer step's last micro-step (its
        gradients are then final: their squares go into the norm as they arrive). Before the
        last one, the swapper starts reading the first swapped sub-groups' states, which the
        step needs first, while this micro-step computes."""
        self.last_micro_step = last
        if last and self.swapper is not None:
            self.swapper.read_ahead(sorted(self.swapped))

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add param `index`'s reduce-scattered share `grad` (any float dtype) to its fp32
        gradient: in memory, or in the sub-group's gradient swap file (the first micro-step
        writes, later ones add)."""
        slot = self.slots[index]
        if slot.flat not in self.swapped:
            self.grads[slot.flat][slot.offset : slot.offset + slot.share].add_(grad)
            return
        assert self.swapper is not None
        accumulate = index in self._written
        self._written.add(index)
        on_written = (
            (lambda values: self._square_sums.__setitem__(index, _square_sum(values))) if self.last_micro_step else None
        )
        self.swapper.put_gradient(slot.flat, slot.offset, grad.detach().float(), accumulate, on_written)

    def zero_grad(self) -> None:
        for grad in self.grads:
            grad.zero_()
        self._written.clear()
        self._square_sums.clear()

    def _norm_terms(self) -> tuple[float, bool]:
        """The sum of the squared gradients of this rank's shares and whether all are finite."""
        if self.swapper is not None:
            self.swapper.drain_gradients()
        total, finite = 0.0, True
        for index, slot in sorted(self.slots.items()):
            if slot.flat in self.swapped:
                square, ok = self._square_sums.get(index, (0.0, True))  # no gradient: zeros
            else:
                square, ok = _square_sum(self.grads[slot.flat][slot.offset : slot.offset + slot.share])
            total += square
            finite = finite and ok
        return total, finite

    def _zero_missing_gradients(self, flat: int, grad: torch.Tensor) -> None:
        """Shares of a swapped sub-group that got no gradient this step hold an older one in the
        file: zero them in the buffer (in memory, zero_grad did)."""
        for member in self.plan.layout.flat_groups[flat].params:
            index = self._spec_index[member]
            if index not in self._written:
                slot = self.slots[index]
                grad[slot.offset : slot.offset + slot.share].zero_()

    def step(self, lrs: Sequence[float], shards: ParamStore | None = None) -> StepResult:
        """One AdamW step on every sub-group; with `shards`, the new masters (rounded to the
        compute dtype) become the model's shares as each sub-group is done (while a swapped one
        is still in its buffer)."""
        scale = self.loss_scale.cur_scale if self.loss_scale else 1.0
        square, finite = self._norm_terms()
        local = torch.tensor([square, float(not finite)], dtype=torch.float64)
        self.comm.all_reduce(local)
        overflow = bool(local[1] > 0) or not math.isfinite(float(local[0]))
        norm = math.sqrt(float(local[0])) if not overflow else float("inf")
        if self.loss_scale is not None:
            self.loss_scale.update(overflow)
        if overflow:
            if self.swapper is not None:
                self.swapper.drop_ahead()
            self.zero_grad()
            return StepResult(norm, True)
        combined = scale
        if self.clip > 0:
            combined = max(1.0, (norm / scale + 1e-6) / self.clip) * scale
        flats = self.plan.layout.flat_groups
        in_memory = [
            (f, [self.masters[f], self.states["exp_avg"][f], self.states["exp_avg_sq"][f], self.grads[f]])
            for f in range(len(flats))
            if f not in self.swapped
        ]
        streamed = self.swapper.stream(sorted(self.swapped)) if self.swapper is not None else iter(())
        for source in (streamed, iter(in_memory)):
            for f, (master, exp_avg, exp_avg_sq, grad) in source:
                if f in self.swapped:
                    self._zero_missing_gradients(f, grad)
                if combined != 1.0:
                    grad.mul_(1.0 / combined)
                group = flats[f]
                hyper = self.hyperparams[group.param_group]
                # torch's own AdamW update (it counts the step itself), on this sub-group's flat tensors
                adamw(
                    [master],
                    [grad],
                    [exp_avg],
                    [exp_avg_sq],
                    [],
                    [self.steps[f]],
                    foreach=False,
                    amsgrad=False,
                    beta1=hyper["betas"][0],
                    beta2=hyper["betas"][1],
                    lr=lrs[group.param_group],
                    weight_decay=hyper["weight_decay"],
                    eps=hyper["eps"],
                    maximize=False,
                )
                if shards is not None:
                    self._copy_flat_to_shards(f, master, shards)
        self.zero_grad()
        return StepResult(norm / scale, False)

    def _copy_flat_to_shards(self, flat: int, master: torch.Tensor, shards: ParamStore) -> None:
        with torch.no_grad():
            for member in self.plan.layout.flat_groups[flat].params:
                index = self._spec_index[member]
                slot = self.slots[index]
                shards.write(index, master[slot.offset : slot.offset + slot.share])

    def full_state(self, index: int, key: str = "master") -> torch.Tensor:
        """Param `index`'s whole fp32 master (or Adam state `key`), gathered from every rank (a
        collective: every rank calls it)."""
        spec, slot = self.plan.params[index], self.slots[index]
        out = torch.empty(slot.share * self.comm.world)
        self.comm.all_gather(out, self.read_share(index, key))
        return out[: spec.numel].view(spec.shape)

    def copy_to_shards(self, shards: ParamStore) -> None:
        """The masters, rounded to the compute dtype, become the shares the model gathers."""
        with torch.no_grad():
            for index in self.slots:
                shards.write(index, self.read_share(index))

    def close(self) -> None:
        """Close the swap files (they stay on the disk, as DeepSpeed leaves its swap folder)."""
        if self.swapper is not None:
            self.swapper.close()


def _square_sum(grad: torch.Tensor) -> tuple[float, bool]:
    """A gradient share's contribution to the global norm: its sum of squares (float64) and
    whether it is all finite."""
    return float(grad.double().pow(2).sum()), bool(torch.isfinite(grad).all())


def _file_key(key: str) -> int:
    """Which of a swapped sub-group's files holds `key`: 0 the master, then the Adam moments."""
    return 0 if key == "master" else 1 + ADAM_STATES.index(key)
