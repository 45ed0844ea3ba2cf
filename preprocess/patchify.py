"""Planar uint8 pixels -> the rows a shard stores, in Hugging Face's Qwen-VL patch order.

Rows come in merge-block order (m*m consecutive rows per LLM token) with columns
(c, t, py, px), which is HF's `patchify` order for both images (t = 1, the temporal repeat
not stored) and video (t = temporal_patch_size, both frames real).

The copy moves whole px-runs of P bytes: the planes are viewed as P-byte void items, so
numpy's strided copy handles P bytes per element rather than one. On a 640 x 608 image
this is about 5x faster than transposing uint8 pixels one byte at a time.
"""

from __future__ import annotations

import numpy as np


def planes_to_rows(planes: np.ndarray, patch_size: int, merge_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [T, C, H, W] -> rows uint8 [gh*gw, C*T*P*P]; written into `out` when given."""
    t, c, h, w = planes.shape
    p, m = patch_size, merge_size
    gh, gw = h // p, w // p
    if gh * p != h or gw * p != w or gh % m or gw % m:
        raise ValueError(f"planes of {h}x{w} do not split into {p}-pixel patches in {m}x{m} merge blocks")
    run = np.dtype((np.void, p))
    runs = np.ascontiguousarray(planes).view(run).reshape(t, c, gh // m, m, p, gw // m, m)
    # (block row, block col, row in block, col in block, channel, t, py); px inside each run
    ordered = runs.transpose(2, 5, 3, 6, 1, 0, 4)
    if out is None:
        out = np.empty((gh * gw, c * t * p * p), dtype=np.uint8)
    elif out.shape != (gh * gw, c * t * p * p) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint8 array of shape {(gh * gw, c * t * p * p)}")
    np.copyto(out.view(run).reshape(ordered.shape), ordered)
    return out
