"""How a training run's ranks were arranged, in zckpt's own words: the degrees of pipeline,
tensor, expert and data parallelism (:class:`Topology`) and one rank file's place in them
(:class:`RankCoords`). zckpt reads and writes data-parallel checkpoints (every degree but the
data one is 1); the other degrees are named so that a checkpoint of another layout is told
apart and refused in one place rather than misread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True, order=True)
class RankCoords:
    """A rank file's coordinates: pipeline stage, tensor rank, expert rank, data-parallel rank."""

    pipe: int = 0
    tensor: int = 0
    expert: int = 0
    data: int = 0

    @classmethod
    def dp(cls, rank: int) -> "RankCoords":
        """The coordinates of data-parallel rank `rank` of a data-parallel-only run."""
        return cls(0, 0, 0, rank)

    @property
    def data_parallel_only(self) -> bool:
        return self.pipe == 0 and self.tensor == 0 and self.expert == 0


@dataclass(frozen=True)
class Topology:
    """The degrees of parallelism of a run: pipeline stages, tensor ranks, expert ranks, and
    data-parallel ranks (each >= 1)."""

    pp: int = 1
    tp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} degree must be a non-negative integer, got {value!r}")

    @classmethod
    def data_parallel(cls, world_size: int) -> "Topology":
        """A data-parallel-only run of `world_size` ranks: (1, 1, 1, world_size)."""
        return cls(1, 1, 1, world_size)

    @property
    def data_parallel_only(self) -> bool:
        return self.pp == 1 and self.tp == 1 and self.ep == 1

    @property
    def world_size(self) -> int:
        """The ranks of the run: experts are spread over the data-parallel ranks, so they add none."""
        return self.pp * self.tp * self.dp

    def describe(self) -> str:
        """The layout in words: "a pipeline-parallel checkpoint (2 stages x 1 data-parallel rank)"."""
        kinds, parts = [], []
        if self.pp > 1:
            kinds.append("pipeline-parallel")
            parts.append(f"{self.pp} stages")
        if self.tp > 1:
            kinds.append("tensor-parallel")
            parts.append(f"{self.tp} tensor ranks")
        if self.ep > 1:
            kinds.append("mixture-of-experts")
            parts.append(f"expert-parallel degree {self.ep}")
        parts.append(f"{self.dp} data-parallel rank{'s' * (self.dp != 1)}")
        return f"a {' and '.join(kinds) or 'data-parallel'} checkpoint ({' x '.join(parts)})"

    def data_ranks(self) -> Iterator[RankCoords]:
        """The coordinates of every data-parallel rank of stage 0, tensor rank 0."""
        return (RankCoords.dp(rank) for rank in range(self.dp))
