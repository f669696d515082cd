"""Training tokens: deterministic synthetic sequences, or windows of a local file read as bytes.

Every sequence is a function of (seed, global sample number) alone, and rank r of W takes rows
``r * micro_batch ...`` of each global micro-batch: runs at different world sizes with the same
global batch see the same data, and a resumed run sees what the uninterrupted one would have.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..core.errors import CorruptFileError, UsageError

_SEED_STRIDE = 1_000_003


class TokenData:
    def __init__(self, vocab: int, seq_len: int, seed: int, path: str | os.PathLike[str] | None = None) -> None:
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.tokens: np.ndarray | None = None
        if path is not None:
            if vocab < 256:
                raise UsageError(None, f"--data reads bytes (256 symbols): --vocab must be at least 256, got {vocab}")
            try:
                self.tokens = (
                    np.memmap(os.fspath(path), dtype=np.uint8, mode="r")
                    if os.path.getsize(path)
                    else np.zeros(0, np.uint8)
                )
            except OSError as exc:
                raise CorruptFileError(os.fspath(path), f"cannot read the training data: {exc.strerror}") from None
            if len(self.tokens) < seq_len + 1:
                raise CorruptFileError(
                    os.fspath(path), f"holds {len(self.tokens)} bytes; one sequence needs {seq_len + 1}"
                )

    def sample(self, number: int) -> torch.Tensor:
        """Sequence `number` of the run: seq_len + 1 tokens (inputs, then targets shifted by one)."""
        rng = np.random.default_rng((self.seed, number))
        if self.tokens is not None:
            start = int(rng.integers(0, len(self.tokens) - self.seq_len))
            return torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        # an arithmetic progression modulo the vocabulary: learnable, so the loss visibly falls
        first, stride = int(rng.integers(0, self.vocab)), int(rng.integers(1, 8))
        return torch.from_numpy((first + stride * np.arange(self.seq_len + 1, dtype=np.int64)) % self.vocab)

    def micro_batch(self, first_sample: int, rank: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global micro-batch that starts at sample `first_sample`."""
        start = first_sample + rank * micro_batch
        rows = torch.stack([self.sample(start + i) for i in range(micro_batch)])
        return rows[:, :-1], rows[:, 1:]
