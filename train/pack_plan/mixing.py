"""The mixing rule: how many samples each source contributes per epoch, and which ones."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import PackingError


def resolve_weights(sizes: Sequence[int], weights: Sequence[float | None]) -> np.ndarray:
    """The mixing rule's weights: the source sizes when none is given, else missing = 1.0."""
    if all(w is None for w in weights):
        return np.asarray(sizes, dtype=np.float64)
    w = np.array([1.0 if x is None else float(x) for x in weights], dtype=np.float64)
    if (w < 0).any() or not np.isfinite(w).all() or not (w > 0).any():
        raise PackingError(f"mixing weights must be finite, >= 0 and not all 0, got {list(weights)}")
    return w


def mix_counts(sizes: Sequence[int], weights: np.ndarray) -> np.ndarray:
    """Samples drawn from each source per epoch: round(w / sum(w) * total), half up."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.sum() == 0:  # no samples at all (natural weights would all be 0): nothing to draw
        return np.zeros(len(sizes), dtype=np.int64)
    with np.errstate(over="ignore"):
        total = weights.sum()
    if not np.isfinite(total):  # finite weights near the float maximum: their ratios, not their sum
        weights = weights / weights.max()
        total = weights.sum()
    return np.floor(weights / total * sizes.sum() + 0.5).astype(np.int64)


def draw_samples(sizes: Sequence[int], counts: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(source int32 [S], index int64 [S]) per the mixing rule (module docstring)."""
    sources, indices = [], []
    for k, (size, count) in enumerate(zip(sizes, counts)):
        if count == 0:
            continue
        if size == 0:
            raise PackingError(f"source {k} has no samples but a non-zero mixing weight")
        repeats, rest = divmod(int(count), int(size))
        parts = [np.tile(np.arange(size, dtype=np.int64), repeats)] if repeats else []
        if rest:
            parts.append(np.sort(rng.permutation(size)[:rest]))
        idx = np.concatenate(parts)
        sources.append(np.full(len(idx), k, dtype=np.int32))
        indices.append(idx)
    if not sources:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    return np.concatenate(sources), np.concatenate(indices)
