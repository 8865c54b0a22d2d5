"""The pipeline's order: a keyed bijection of a source's windows per epoch (a Feistel network
seeded by seed, source and epoch: every window once per epoch, O(1) memory) and the mixture's
exact interleave of sources by weight (Grain's `MapDataset.mix`, vectorised)."""

from __future__ import annotations

import functools

import numpy as np

from train.data.sources import hash_u64

ROUNDS = 6


@functools.lru_cache(maxsize=256)
def round_keys(seed: int, stream: int, epoch: int) -> np.ndarray:
    return np.random.SeedSequence([seed, stream, epoch]).generate_state(ROUNDS, np.uint64)


def permute(i: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of [0, n), applied to i (int array): a Feistel network on the smallest
    even-bit domain >= n (at most 4n), cycle-walking values that land outside [0, n)."""
    if n <= 1:
        return np.zeros(np.shape(i), np.int64)
    half = ((n - 1).bit_length() + 1) // 2
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)

    def feistel(x):
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (hash_u64(right ^ k) & mask)
        return (left << shift) | right

    x = feistel(np.asarray(i, np.uint64))
    out = x >= n
    while out.any():
        x[out] = feistel(x[out])
        out = x >= n
    return x.astype(np.int64)


def proportions(weights: list[float]) -> tuple[int, ...]:
    """Weights -> integers as Grain's MapDataset.mix makes them (the smallest becomes 100)."""
    scale = 100 / min(weights)
    return tuple(int(w * scale) for w in weights)


def mix(g: np.ndarray, props: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Global rows g -> (source k, index j of that row within source k); vectorised form of Grain's
    `_dataset_and_key_of_next_element`, so `grain.MapDataset.mix` with the same weights agrees."""
    g = np.asarray(g, np.int64)
    src, key = np.zeros(g.shape, np.int64), np.zeros(g.shape, np.int64)
    todo = np.ones(g.shape, bool)
    remaining, k, k1 = sum(props), g, g + 1
    for i, p in enumerate(props):
        nk, nk1 = k * (remaining - p) // remaining, k1 * (remaining - p) // remaining
        hit = todo & ((k - nk) != (k1 - nk1))
        src[hit], key[hit] = i, (k1 - nk1)[hit] - 1
        todo &= ~hit
        remaining, k, k1 = remaining - p, nk, nk1
    return src, key


def rows_per_source(g: int, props: tuple[int, ...]) -> list[int]:
    """How many of the global rows 0..g-1 each source supplied."""
    out, remaining, k = [], sum(props), int(g)
    for p in props:
        nk = k * (remaining - p) // remaining
        out.append(k - nk)
        remaining, k = remaining - p, nk
    return out
