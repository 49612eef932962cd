"""A learnable synthetic token source for runs without a dataset: each sample is an arithmetic progression
modulo the vocabulary (random start and stride), so loss falls as the model learns to infer the stride.

Sample i of a run is a pure function of (seed, i): the global batch of step s is samples
[s·B, (s+1)·B), whatever the world size, and a data-parallel rank reads only its contiguous slice.
"""

from __future__ import annotations

import torch


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_len: int, seed: int, max_stride: int = 8):
        self.vocab_size, self.seq_len, self.seed, self.max_stride = vocab_size, seq_len, seed, max_stride

    def sample(self, index: int) -> torch.Tensor:
        """seq_len + 1 tokens: inputs are [:-1], targets [1:]."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(0, self.vocab_size, (1,), generator=g)
        stride = torch.randint(1, self.max_stride + 1, (1,), generator=g)
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size

    def local_batch(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """This data-parallel rank's rows of the global batch of ``step``: [global_batch / dp_size, seq_len + 1]."""
        per_rank = global_batch // dp_size
        first = step * global_batch + dp_rank * per_rank
        return torch.stack([self.sample(first + j) for j in range(per_rank)])
