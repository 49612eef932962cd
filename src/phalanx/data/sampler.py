"""Which sample sits at each position of the global sample stream: a pure function of (sizes, weights, seed).

Position p (step s, row j of the global batch: p = s·global_batch + j) maps to (source, sample index) in
O(1), with no state beyond the seed, so resuming at step 10 or step 10 million costs the same, and the
stream does not depend on the world size, the number of loader threads, or restarts.

- Blending: positions are cut into blocks of ``BLOCK``; each block gives every source its share of the
  slots (largest-remainder rounding of the weights), arranged in one seeded order. Source s's k-th sample
  is therefore at a position computed in O(1), and the realised mix is within 1/BLOCK of the weights
  over any whole number of blocks.
- Shuffling: a source's k-th sample is sample ``perm(k mod n)`` of its epoch ``k // n``, where perm is a
  keyed Feistel permutation of [0, n) (cycle-walking on the next power of 4): a bijection, so an epoch sees
  every sample exactly once, computed per index without materialising a permutation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BLOCK = 1000
ROUNDS = 6
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-distributed 64-bit hash (vectorised)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def feistel_permute(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """Image of ``indices`` (each in [0, n)) under a keyed pseudo-random permutation of [0, n)."""
    if n <= 1:
        return np.zeros_like(indices, dtype=np.int64)
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    half_mask = np.uint64((1 << half_bits) - 1)
    with np.errstate(over="ignore"):
        keys = _mix(np.arange(1, ROUNDS + 1, dtype=np.uint64) + np.uint64(key) * np.uint64(ROUNDS))
    x = np.asarray(indices, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():  # cycle-walk: re-encrypt values that land outside [0, n); expected < 4 rounds
        left, right = x[todo] >> np.uint64(half_bits), x[todo] & half_mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & half_mask)
        x[todo] = (left << np.uint64(half_bits)) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def _key(seed: int, *parts: int) -> int:
    h = np.uint64(seed % 2**64)
    for part in parts:
        h = _mix(np.asarray([h ^ np.uint64(part)], dtype=np.uint64))[0]
    return int(h)


class GlobalSampler:
    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError("one weight per source is needed")
        if min(sizes) <= 0:
            raise ValueError(f"every source needs at least one sample (sizes {list(sizes)})")
        self.sizes, self.seed = np.asarray(sizes, dtype=np.int64), seed
        w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        counts = np.floor(w * BLOCK).astype(np.int64)
        order = np.argsort(-(w * BLOCK - counts), kind="stable")
        counts[order[: BLOCK - counts.sum()]] += 1  # largest remainders get the leftover slots
        self.block_counts = counts
        slots = np.repeat(np.arange(len(sizes)), counts)
        np.random.default_rng(_key(seed, 0xB1E5D)).shuffle(slots)
        self.slot_source = slots
        # rank of each slot among the slots of its own source within the block
        self.slot_rank = np.zeros(BLOCK, dtype=np.int64)
        for s in range(len(sizes)):
            where = slots == s
            self.slot_rank[where] = np.arange(where.sum())

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample index) of each global position."""
        positions = np.asarray(positions, dtype=np.int64)
        block, slot = np.divmod(positions, BLOCK)
        source = self.slot_source[slot]
        k = block * self.block_counts[source] + self.slot_rank[slot]  # source's k-th sample overall
        epoch, within = np.divmod(k, self.sizes[source])
        index = np.empty_like(k)
        for s, e in {(int(s), int(e)) for s, e in zip(source, epoch, strict=True)}:
            sel = (source == s) & (epoch == e)
            index[sel] = feistel_permute(within[sel], int(self.sizes[s]), _key(self.seed, s, e))
        return source, index
