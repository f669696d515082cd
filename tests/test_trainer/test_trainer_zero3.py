"""ZeRO-3 trainer against plain torch: the sharded step equals torch.optim.AdamW on the whole
model (world sizes 1, 2, 3; params not divisible by the world size and smaller than it), bit for
bit at one rank; at 2 and 3 ranks the losses equal a one-process run on the same global batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zckpt.trainer import TrainConfig, Trainer, build_model
from zckpt.trainer.data import TokenData
from zckpt.trainer.optim import ShardedAdamW, param_group_defaults
from zckpt.trainer.ranks import run_ranks
from zckpt.trainer.zero3 import Comm, ShardedModel, plan_zero3

# numels 170, 70, 10, 300, 30, ...: none divisible by 3, most not by 2
TINY = dict(
    layers=1,
    dim=10,
    heads=2,
    vocab=17,
    seq_len=7,
    micro_batch=2,
    grad_accum=2,
    lr=1e-2,
    warmup=2,
    clip=0.0,
    steps=4,
    seed=3,
)


def _gpt_run(rank: int, world: int, options: dict) -> dict:
    trainer = Trainer(TrainConfig(**options))
    logs = [trainer.train_step() for _ in range(options["steps"])]
    params = {name: tensor.clone() for name, tensor in trainer.model.full_params()}
    return {"losses": [log.loss for log in logs], "lrs": [log.lr for log in logs], "params": params}


def _reference(options: dict, world: int, lrs: list[float]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training on the unsharded model with torch.optim.AdamW, one process, one thread
    like the ranks (a thread count changes the order of sums inside matmuls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(options, world, lrs)
    finally:
        torch.set_num_threads(threads)


def _reference_run(options: dict, world: int, lrs: list[float]) -> tuple[list[float], dict[str, torch.Tensor]]:
    config = TrainConfig(**options)
    model = build_model(config.model_config(), seed=config.seed)
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
    )
    data = TokenData(config.vocab, config.seq_len, config.seed)
    global_micro = config.micro_batch * world
    losses = []
    for step, lr in enumerate(lrs):
        total = 0.0
        for micro in range(config.grad_accum):
            inputs, targets = data.micro_batch((step * config.grad_accum + micro) * global_micro, 0, global_micro)
            loss = model(inputs, targets)
            (loss / config.grad_accum).backward()
            total += float(loss.detach())
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / config.grad_accum)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _both_runs(rank: int, world: int) -> dict:
    return {"gpt": _gpt_run(rank, world, TINY), "toy": _toy_run(rank, world, 3)}


_RUNS: dict[int, list[dict]] = {}


def _runs(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each world size's ranks are started once for all the tests here (start-up dominates)."""
    if world not in _RUNS:
        _RUNS[world] = run_ranks(world, tmp_path_factory.mktemp(f"ws{world}"), _both_runs)
    return _RUNS[world]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_adamw_equals_torch_adamw(tmp_path_factory, world):
    """At 2 and 3 ranks this is also the world-size check: same global batch, same losses."""
    results = [r["gpt"] for r in _runs(world, tmp_path_factory)]
    ours = results[0]
    for other in results[1:]:  # every rank gathered the same params and logged the same losses
        assert other["losses"] == ours["losses"]
        assert all(torch.equal(other["params"][n], t) for n, t in ours["params"].items())
    losses, params = _reference(TINY, world, ours["lrs"])
    assert (
        ours["lrs"][:2] == [0.0, 0.0] and ours["lrs"][2] > 0
    )  # DeepSpeed's WarmupDecayLR, stepped as the engine steps it
    if world == 1:  # the same operations in the same order: the same bits
        assert ours["losses"] == losses
        for name, tensor in params.items():
            assert torch.equal(ours["params"][name], tensor), name
    else:
        # The gradient is summed across ranks in another order: rounding-level differences. Adam
        # divides by sqrt(exp_avg_sq), so an element whose gradient nearly cancels can move by a
        # small fraction of lr per step more or less: the bound is in units of lr (1e-2 here).
        assert ours["losses"] == pytest.approx(losses, rel=1e-5)
        for name, tensor in params.items():
            torch.testing.assert_close(ours["params"][name], tensor, rtol=1e-5, atol=1e-3 * TINY["lr"])


class _Toy(nn.Module):
    """Params of 15, 3, 2 and 1 elements: at 3 ranks, two are smaller than the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)
        self.gain = nn.Parameter(torch.tensor([1.5, -0.5]))
        self.offset = nn.Parameter(torch.tensor([0.25]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return ((y[:, :2] * self.gain).sum(1) + self.offset).pow(2).mean()


def _toy_run(rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = _Toy()
    comm = Comm()
    plan = plan_zero3(model, world, sub_group_size=4)  # several sub-groups
    hyper = [param_group_defaults(0.05, (0.9, 0.99), 1e-8, wd) for wd in (0.1, 0.0)]
    optimizer = ShardedAdamW(plan, comm, hyper)
    sharded = ShardedModel(model, plan, comm, torch.float32, grad_ready=optimizer.accumulate)
    optimizer.load_masters(sharded.store)
    inputs = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        sharded(inputs[rank * 6 // world : (rank + 1) * 6 // world]).backward()
        optimizer.step([0.05, 0.05])
        optimizer.copy_to_shards(sharded.store)
    return {"params": dict(sharded.full_params()), "sub_groups": len(plan.layout.flat_groups)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_params_smaller_than_world_size(tmp_path_factory, world):
    result = _runs(world, tmp_path_factory)[0]["toy"]
    torch.manual_seed(0)
    model = _Toy()
    named = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [named["linear.weight"]], "weight_decay": 0.1},
            {"params": [named["linear.bias"], named["gain"], named["offset"]], "weight_decay": 0.0},
        ],
        lr=0.05,
        betas=(0.9, 0.99),
    )
    inputs = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    torch.set_num_threads(1)
    for _ in range(3):
        # the ranks' losses are means over equal slices: their average is the global mean
        sum(model(inputs[r * 6 // world : (r + 1) * 6 // world]) for r in range(world)).div(world).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert result["sub_groups"] > 1
    for name, tensor in named.items():
        torch.testing.assert_close(result["params"][name], tensor.detach(), rtol=1e-6, atol=1e-7)
