"""Hugging Face-style shard planning on plain integers.

Mirrors ``huggingface_hub.split_state_dict_into_shards_factory`` (which DeepSpeed's
zero_to_fp32.py uses), so the same tensors land in the same shard files: tensors are taken in
order; one larger than the limit gets a shard of its own; a tensor that would overflow the
current shard starts a new one; aliases of a tied tensor go where their source went.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ShardItem:
    name: str
    nbytes: int
    alias_of: str | None = None  # a tied alias: stored with, and not counted apart from, its source


@dataclass(frozen=True)
class ShardPlan:
    files: tuple[tuple[str, tuple[str, ...]], ...]  # (file name, tensor names) in writing order
    total_size: int  # bytes of distinct tensors, as huggingface_hub counts them

    @property
    def is_sharded(self) -> bool:
        return len(self.files) > 1

    def weight_map(self) -> dict[str, str]:
        return {name: filename for filename, names in self.files for name in names}


def plan_shards(items: Sequence[ShardItem], max_shard_size: int, filename_pattern: str) -> ShardPlan:
    """Split tensors into shard files.

    `filename_pattern` holds ``{suffix}``: ``"model{suffix}.safetensors"`` gives
    ``model.safetensors`` alone, or ``model-00001-of-00003.safetensors`` etc.

    >>> plan = plan_shards([ShardItem("a", 6), ShardItem("b", 6), ShardItem("c", 2)], 10, "m{suffix}.bin")
    >>> plan.files
    (('m-00001-of-00002.bin', ('a',)), ('m-00002-of-00002.bin', ('b', 'c')))
    """
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    total = 0
    aliases: dict[str, list[str]] = {}
    for item in items:
        if item.alias_of is not None:
            aliases.setdefault(item.alias_of, []).append(item.name)
            continue
        if item.nbytes > max_shard_size:
            total += item.nbytes
            shards.append([item.name])
            continue
        if current_size + item.nbytes > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(item.name)
        current_size += item.nbytes
        total += item.nbytes
    if current or not shards:
        shards.append(current)
    sources_in_order = [item.name for item in items if item.name in aliases]
    for source in sources_in_order:
        names = aliases[source]
        for shard in shards:
            if source in shard:
                shard.extend(names)
                break
    if len(shards) == 1:
        return ShardPlan(((filename_pattern.format(suffix=""), tuple(shards[0])),), total)
    count = len(shards)
    files = tuple(
        (filename_pattern.format(suffix=f"-{i + 1:05d}-of-{count:05d}"), tuple(shard)) for i, shard in enumerate(shards)
    )
    return ShardPlan(files, total)
