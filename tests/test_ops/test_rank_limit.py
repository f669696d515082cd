"""Absurd target layouts (issue 36 item 4): a world size, a pipeline stage count or a tensor degree
whose run would have more ranks than the model has elements (``zckpt.deepspeed.layout.rank_limit``)
is refused in one line, exit 2, before anything is planned or written; one at the limit plans.
Times are bounded generously (loaded machines): the refusal used to plan for minutes."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import sample
from zckpt.cli.app import app
from zckpt.core.errors import UsageError
from zckpt.deepspeed.layout import MAX_RANKS, LayoutParam, rank_limit, zero3_layout
from zckpt.deepspeed.reader import open_training_state
from zckpt.ops.nvme_plan import plan_nvme
from zckpt.ops.nvme_shapes import ParamShape
from zckpt.ops.reshard import plan_reshard, reshard

HUGE = 1_000_000_000
QUICK = 20.0  # seconds: the refusal takes well under one; before, planning ran for minutes


def _elements(checkpoint: Path) -> int:
    """The elements of the model's params, trainable and frozen, counted from the index alone."""
    index = open_training_state(checkpoint).index
    return sum(e.source.numel for e in index.entries if e.kind in ("param", "frozen"))


def test_cli_refuses_a_billion_ranks_at_once(tmp_path: Path) -> None:
    checkpoint = sample("z3_fp32_ws2_tied_frozen").checkpoint
    limit = _elements(checkpoint)
    start = time.monotonic()
    result = CliRunner().invoke(app, ["reshard", str(checkpoint), str(tmp_path / "out"), "-w", str(HUGE)])
    elapsed = time.monotonic() - start
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zckpt: error: --world-size 1000000000: "), result.output
    assert "1,000,000,000 ranks" in lines[0] and f"at most {limit:,} ranks" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    assert elapsed < QUICK


def test_api_refuses_before_planning(tmp_path: Path) -> None:
    checkpoint = sample("z3_fp32_ws2_tied_frozen").checkpoint
    start = time.monotonic()
    with pytest.raises(UsageError, match=r"at most [\d,]+ ranks, the elements the model has"):
        reshard(checkpoint, tmp_path / "out", world_size=HUGE)
    with pytest.raises(UsageError, match="1,000,000,000 ranks"):
        plan_reshard(checkpoint, world_size=HUGE, stage=1)
    assert time.monotonic() - start < QUICK
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name,world_size,options,asked",
    [
        ("pp2_z1_fp32_dp1", 1, {"pipeline_stages": HUGE}, "--world-size 1 x 1000000000 pipeline stages"),
        ("megatron_z1_fp32_tp2", 1, {"tensor_parallel": HUGE}, "--world-size 1 x 1000000000 tensor ranks"),
        # the input's own stages and tensor ranks count too: 2 x 2 x world size
        ("pp2_megatron_z1_fp32_tp2", HUGE // 4, {}, "--world-size 250000000 x 2 pipeline stages x 2 tensor ranks"),
    ],
)
def test_every_degree_counts(name: str, world_size: int, options: dict, asked: str) -> None:
    start = time.monotonic()
    with pytest.raises(UsageError) as refused:
        plan_reshard(sample(name).checkpoint, world_size=world_size, **options)
    assert time.monotonic() - start < QUICK
    assert str(refused.value).startswith(f"{asked}: a target run of 1,000,000,000 ranks; zckpt plans at most ")


def test_the_limit_itself_plans(tmp_path: Path) -> None:
    """A world size equal to the model's elements is a legal (if wasteful) ZeRO layout: planned,
    every rank's files, quickly (the ZeRO-3 layout costs its pieces, not ranks x params); one more
    is refused."""
    checkpoint = sample("z3_fp32_ws2_tied_frozen").checkpoint
    limit = _elements(checkpoint)
    start = time.monotonic()
    plan = plan_reshard(checkpoint, world_size=limit)
    assert time.monotonic() - start < 60
    assert plan.target.world_size == limit
    assert len([f for f in plan.files if "optim_states" in f.name]) == limit
    stage1 = plan_reshard(checkpoint, world_size=limit, stage=1)
    assert len([f for f in stage1.files if "optim_states" in f.name]) == limit
    with pytest.raises(UsageError, match=f"a target run of {limit + 1:,} ranks"):
        plan_reshard(checkpoint, world_size=limit + 1)


def test_zero3_layout_cost_does_not_grow_with_ranks() -> None:
    """The layout of a few small params at a huge world size: pieces only where elements are."""
    params = [[LayoutParam("a", 5, 0), LayoutParam("b", 4, 0)]]
    start = time.monotonic()
    layout = zero3_layout(params, 10**6, 10**9)
    assert time.monotonic() - start < QUICK
    assert [(p.param, p.rank, p.param_offset, p.length) for p in layout.pieces] == [(0, r, r, 1) for r in range(5)] + [
        (1, r, r, 1) for r in range(4)
    ]


def test_the_bound_is_stated_once() -> None:
    assert MAX_RANKS == 2**31 - 1  # torch.distributed's C int
    assert rank_limit(2610) == 2610 and rank_limit(0) == 1 and rank_limit(7 * 10**9) == MAX_RANKS


def test_nvme_plan_refuses_a_billion_ranks() -> None:
    params = [ParamShape("w", (64, 64)), ParamShape("b", (64,), trainable=False)]
    elements = sum(math.prod(p.shape) for p in params)
    with pytest.raises(UsageError, match=f"--world-size {HUGE}: zckpt plans at most {elements:,} ranks"):
        plan_nvme(params, world_size=HUGE)
    assert plan_nvme(params, world_size=elements).world_size == elements


@pytest.mark.slow
def test_a_write_at_the_limit_loads(tmp_path: Path) -> None:
    """The whole command at the limit (ZeRO-1: one optim file per rank) writes every file."""
    from zckpt.ops.consolidate import consolidate

    checkpoint = sample("z3_fp32_ws2_tied_frozen").checkpoint
    limit = _elements(checkpoint)
    result = reshard(checkpoint, tmp_path / "out", world_size=limit, stage=1)
    assert len([f for f in result.files if "optim_states" in f]) == limit
    consolidate(tmp_path / "out", tmp_path / "weights")
    assert (tmp_path / "weights" / "model.safetensors").stat().st_size > 0
