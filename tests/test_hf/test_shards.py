from __future__ import annotations

import random

import pytest

from zckpt.core.errors import UsageError
from zckpt.core.sizes import parse_size
from zckpt.hf.shards import ShardItem, plan_shards


@pytest.mark.parametrize(
    "text,size",
    [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("1.5KB", 1500), ("2GiB", 2 * 2**30), ("7", 7), (" 3 mb ", 3 * 10**6)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "5 parsecs", "-1GB", "0"])
def test_parse_size_rejects_nonsense(text: str) -> None:
    with pytest.raises(UsageError):
        parse_size(text)


def test_one_shard_has_no_suffix() -> None:
    plan = plan_shards([ShardItem("a", 1), ShardItem("b", 2, alias_of=None)], 100, "model{suffix}.safetensors")
    assert plan.files == (("model.safetensors", ("a", "b")),) and not plan.is_sharded and plan.total_size == 3


def test_oversized_tensor_gets_its_own_shard_before_the_open_one() -> None:
    plan = plan_shards([ShardItem("a", 3), ShardItem("big", 50), ShardItem("c", 3)], 10, "m{suffix}")
    assert [names for _, names in plan.files] == [("big",), ("a", "c")]


def test_aliases_follow_their_source_and_count_once() -> None:
    items = [ShardItem("emb", 6), ShardItem("x", 6), ShardItem("head", 6, alias_of="emb")]
    plan = plan_shards(items, 10, "m{suffix}")
    assert plan.weight_map() == {"emb": "m-00001-of-00002", "head": "m-00001-of-00002", "x": "m-00002-of-00002"}
    assert plan.total_size == 12


@pytest.mark.parametrize("seed", range(50))
def test_matches_huggingface_hub(seed: int) -> None:
    hub = pytest.importorskip("huggingface_hub")
    torch = pytest.importorskip("torch")
    rng = random.Random(seed)
    state, items = {}, []
    for i in range(rng.randint(1, 30)):
        name = f"t{i}"
        if state and rng.random() < 0.15:
            source = rng.choice([n for n in state if not n.startswith("alias")])
            state[f"alias{i}"] = state[source]
            items.append(ShardItem(f"alias{i}", state[source].nbytes, alias_of=source))
            continue
        state[name] = torch.empty(rng.randint(1, 300))
        items.append(ShardItem(name, state[name].nbytes))
    limit = rng.randint(100, 3000)
    expected = hub.split_torch_state_dict_into_shards(state, filename_pattern="m{suffix}.bin", max_shard_size=limit)
    plan = plan_shards(items, limit, "m{suffix}.bin")
    assert plan.weight_map() == expected.tensor_to_filename
    assert {f: list(n) for f, n in plan.files} == expected.filename_to_tensors
    assert plan.total_size == expected.metadata["total_size"]
