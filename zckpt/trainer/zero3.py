"""ZeRO-3 on torch.distributed: every param partitioned as DeepSpeed partitions it, gathered
just before a module uses it, freed right after, its gradient reduce-scattered to its owners.

The partition of each param comes from the format layer's layout (:func:`zero3_layout`), the
same code the reader and the writer use, so what a rank holds *is* its slice of DeepSpeed's flat
partitions: rank r owns elements ``[r * share, (r + 1) * share)`` of every param
(``share = ceil(numel / world)``, the last ranks zero-padded).

How a param lives:

- at rest, each module's param attribute is an empty placeholder and the rank keeps only its
  `share` elements, in memory or in a param swap file (:class:`ParamStore`);
  :attr:`ShardedModel.shards` are the leaf tensors autograd accumulates gradients into (for a
  swapped share a view of one shared zero buffer: autograd needs its shape, never its values);
- a forward pre-hook gathers the full param (:class:`_Gather`, an autograd function whose
  backward reduce-scatters the gradient), a forward hook frees it;
- the ops that save a gathered param for backward save a handle instead (saved-tensor hooks),
  and backward gathers it again when it needs it, so a full param lives only while used.

With one process every collective is the identity: the same code path, no process group.

On a CUDA run (`device`) the shares, their gradients and the optimizer stay in host memory: a
gather copies the share to the device and all-gathers there (nccl), a gradient is
reduce-scattered on the device and its share copied back, as DeepSpeed's offload does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import UsageError
from ..deepspeed.layout import LayoutParam, ZeroLayout, zero3_layout
from ..deepspeed.partition import zero3_partition
from .param_store import ParamStore

DECAY, NO_DECAY = "decay", "no_decay"
# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only those
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    """The data-parallel group: rank, world size and the three collectives ZeRO-3 needs."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.world = dist.get_world_size(group) if self.active else 1

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        if self.world == 1:
            out.copy_(shard)
        else:
            _all_gather(out, shard.contiguous(), group=self.group)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        if self.world == 1:
            out.copy_(full)
        else:
            _reduce_scatter(out, full.contiguous(), group=self.group)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)


@dataclass(frozen=True)
class ParamSpec:
    """A param of the model: its first state-dict name, shape, and the share each rank holds."""

    name: str
    shape: tuple[int, ...]
    share: int
    trainable: bool
    group: str | None  # DECAY or NO_DECAY; None for a frozen param

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Zero3Plan:
    """Which params exist, how they are grouped and where each element lives: pure data."""

    world_size: int
    params: tuple[ParamSpec, ...]  # module order (the order DeepSpeed numbers them: ds_id)
    group_names: tuple[str, ...]  # the optimizer's param groups, in order (DECAY, NO_DECAY)
    layout: ZeroLayout  # trainable params only, in optimizer order, cut into sub-groups
    tied: dict[str, str]  # alias -> name of the param it shares
    module_names: tuple[str, ...]  # the model's state-dict keys, in order

    def spec(self, name: str) -> ParamSpec:
        return self.params[[p.name for p in self.params].index(name)]


def plan_zero3(model: nn.Module, world_size: int, sub_group_size: int, freeze: str | None = None) -> Zero3Plan:
    """Group and partition `model`'s params. Matrices (and embeddings) get weight decay, biases
    and norms do not (nanoGPT's rule); params whose name matches `freeze` are frozen."""
    pattern = re.compile(freeze) if freeze else None
    seen: dict[int, str] = {}
    tied: dict[str, str] = {}
    specs: list[ParamSpec] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied[name] = seen[id(param)]
            continue
        seen[id(param)] = name
        trainable = param.requires_grad and not (pattern and pattern.search(name))
        group = (DECAY if param.dim() >= 2 else NO_DECAY) if trainable else None
        specs.append(
            ParamSpec(name, tuple(param.shape), zero3_partition(param.numel(), world_size)[0], bool(trainable), group)
        )
    if not any(s.trainable for s in specs):
        raise UsageError(None, f"--freeze {freeze!r} freezes every param: nothing to train")
    group_names = tuple(g for g in (DECAY, NO_DECAY) if any(s.group == g for s in specs))
    groups = [[LayoutParam(s.name, s.numel, i) for s in specs if s.group == g] for i, g in enumerate(group_names)]
    layout = zero3_layout(groups, world_size, sub_group_size)
    return Zero3Plan(world_size, tuple(specs), group_names, layout, tied, tuple(model.state_dict().keys()))


class _Gather(torch.autograd.Function):
    """shard -> full param; the gradient of the full param is reduce-scattered back to shards."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, model: "ShardedModel", index: int) -> torch.Tensor:  # type: ignore[override]
        ctx.model, ctx.index = model, index
        return model.gather(index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return ctx.model.scatter_grad(ctx.index, grad), None, None


class ShardedModel(nn.Module):
    """`model` with every param replaced by this rank's partition of it (see the module doc).

    `store` holds param i's `share` elements (the plan's order) in the compute dtype, in memory
    or in param swap files; `shards[i]` is its autograd leaf (trainable ones require grad).
    `values(i)`, if given, is param i's initial value (the model's params may then be on the
    meta device: one param is materialised at a time). `grad_ready(i, grad)` is called with
    each shard's gradient (already summed over ranks and divided by the world size) as soon as
    backward has it. Full params live on `device` (forward and backward run there); shards and
    their gradients are always host tensors.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Zero3Plan,
        comm: Comm,
        dtype: torch.dtype,
        grad_ready: Callable[[int, torch.Tensor], None] | None = None,
        store: ParamStore | None = None,
        values: Callable[[int], torch.Tensor] | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        if comm.world != plan.world_size:
            raise ValueError(f"plan for {plan.world_size} ranks used by a group of {comm.world}")
        self.module, self.plan, self.comm, self.dtype = model, plan, comm, dtype
        self.device = device or torch.device("cpu")
        self.grad_ready = grad_ready
        self.store = store or ParamStore([s.share for s in plan.params], dtype)
        index_of = {s.name: i for i, s in enumerate(plan.params)}
        full = dict(model.named_parameters())
        values = values or (lambda index: full[plan.params[index].name].detach())
        stand_in = torch.zeros(max((plan.params[i].share for i in self.store.swapped), default=0), dtype=dtype)
        shards: list[nn.Parameter] = []
        for index, spec in enumerate(plan.params):
            flat = values(index).reshape(-1)
            start = min(spec.numel, comm.rank * spec.share)
            data = torch.zeros(spec.share, dtype=dtype)
            data[: max(0, min(spec.share, spec.numel - start))] = flat[start : start + spec.share]
            self.store.write(index, data)
            held = self.store.view(index)
            shard = nn.Parameter(held if held is not None else stand_in[: spec.share], requires_grad=spec.trainable)
            if spec.trainable:
                shard.register_post_accumulate_grad_hook(self._make_grad_hook(len(shards)))
            shards.append(shard)
        self.shards = nn.ParameterList(shards)
        self._users: dict[nn.Module, list[tuple[str, int]]] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for attr, param in list(module._parameters.items()):
                if param is None:
                    continue
                name = f"{module_name}.{attr}" if module_name else attr
                index = index_of[plan.tied.get(name, name)]
                self._users.setdefault(module, []).append((attr, index))
        for module, attrs in self._users.items():
            for attr, _ in attrs:
                del module._parameters[attr]
                setattr(module, attr, self._placeholder())
            module.register_forward_pre_hook(self._gather_hook)
            module.register_forward_hook(self._free_hook)
        self._live: dict[int, int] = {}  # storage address of a gathered param -> its index

    def _placeholder(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device)

    def _make_grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(shard: torch.Tensor) -> None:
            if self.grad_ready is not None and shard.grad is not None:
                self.grad_ready(index, shard.grad)
                shard.grad = None  # handed over: the optimizer keeps its own (fp32) gradient

        return hook

    # --- collectives -------------------------------------------------------------------------
    def gather(self, index: int) -> torch.Tensor:
        """The full param `index`, gathered from every rank's shard (a fresh tensor on the
        compute device)."""
        spec = self.plan.params[index]
        buffer = torch.empty(spec.share * self.comm.world, dtype=self.dtype, device=self.device)
        self.comm.all_gather(buffer, self.store.read(index).to(self.device))
        return buffer[: spec.numel].view(spec.shape)

    def scatter_grad(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """This rank's share of the gradient summed over ranks, divided by the world size
        (DeepSpeed averages over data-parallel ranks); a host tensor, as the shard is."""
        spec = self.plan.params[index]
        if spec.numel == spec.share * self.comm.world:  # no padding: the gradient itself (autograd is done with it)
            full = grad.reshape(-1)
        else:
            full = torch.zeros(spec.share * self.comm.world, dtype=grad.dtype, device=grad.device)
            full[: spec.numel] = grad.reshape(-1)
        out = torch.empty(spec.share, dtype=grad.dtype, device=grad.device)
        self.comm.reduce_scatter(out, full)
        if self.comm.world > 1:
            out.div_(self.comm.world)
        return out.cpu()

    # --- hooks ---------------------------------------------------------------------------------
    def _gather_hook(self, module: nn.Module, args: tuple) -> None:
        for attr, index in self._users[module]:
            shard = self.shards[index]
            full = (
                _Gather.apply(shard, self, index)
                if shard.requires_grad and torch.is_grad_enabled()
                else self.gather(index)
            )
            self._live[full.untyped_storage().data_ptr()] = index
            setattr(module, attr, full)

    def _free_hook(self, module: nn.Module, args: tuple, output: object) -> None:
        for attr, _ in self._users[module]:
            full = getattr(module, attr)
            self._live.pop(full.untyped_storage().data_ptr(), None)
            setattr(module, attr, self._placeholder())

    def _pack(self, tensor: torch.Tensor) -> object:
        """A gathered param (or a view of one) saved for backward is kept as a handle."""
        index = self._live.get(tensor.untyped_storage().data_ptr()) if tensor.layout == torch.strided else None
        if index is None:
            return tensor
        return (_Handle, index, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, tuple) and packed and packed[0] is _Handle:
            _, index, shape, stride, offset = packed
            return self.gather(index).as_strided(shape, stride, offset)
        return packed  # type: ignore[return-value]

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    # --- state -----------------------------------------------------------------------------------
    def full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every param gathered, one at a time, as a host tensor (a collective: every rank must
        iterate)."""
        with torch.no_grad():
            for index, spec in enumerate(self.plan.params):
                yield spec.name, self.gather(index).cpu()


class _Handle:
    """Marks a packed saved tensor as a gathered param (see ShardedModel._pack)."""
