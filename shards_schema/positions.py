"""M-RoPE (t, h, w) position ids, computed offline so the trainer never calls HF.

The shards store `position_ids` int32 [3, L] per sample; they must equal Hugging Face
`get_rope_index` (transformers 5.x) for the Qwen3-VL and Qwen2.5-VL image path, which is
the same rule in both families:

* a text run of length n takes positions cur .. cur+n-1 on all three axes; cur += n;
* an image run (the contiguous pad tokens of image k, grid (t, h, w) in patches, merge m)
  has t*(h/m)*(w/m) tokens in raster order (t, row, col) with
  T = cur + t_idx, H = cur + row, W = cur + col; then cur += max(h/m, w/m).
  (cur does not account for t: with t > 1, T can exceed what the next text starts at;
  that is HF's rule and images always have t == 1 anyway.)

vision_start / vision_end are ordinary text tokens. Videos are out of scope.

Only numpy is imported: `shards_schema` is the contract shared by `preprocess` and `train`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mrope_position_ids", "text_position_ids"]


def text_position_ids(length: int) -> np.ndarray:
    """Positions of a text-only sample: arange(length) on all three axes, int32 [3, L]."""
    return np.ascontiguousarray(np.broadcast_to(np.arange(length, dtype=np.int32), (3, length)))


def mrope_position_ids(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    *,
    image_pad_id: int,
    merge_size: int,
) -> np.ndarray:
    """HF `get_rope_index` for one sample with images only; returns int32 [3, L], C-contiguous.

    `input_ids` is the expanded token row [L]; `image_grid_thw` is [K, 3] in patches, one row
    per image in order of appearance (K may be 0). Each maximal run of `image_pad_id` is one
    image, so two images must be separated by at least one other token (the chat template
    always puts vision_end / vision_start between them). Raises ValueError when the runs do
    not match the grids, rather than producing positions HF would reject or silently differ on.

    Vectorised over tokens: every token's base position is (#text tokens before it) +
    (sum of max(h/m, w/m) over images that ended before it); inside an image run this base is
    constant and equals the image's starting `cur`, to which the (t, row, col) offsets are
    added through a per-image (not per-token) loop of broadcast adds.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be 1-D, got shape {ids.shape}")
    grids = np.asarray(image_grid_thw if image_grid_thw is not None else [], dtype=np.int64)
    if grids.size == 0:
        grids = grids.reshape(0, 3)
    if grids.ndim != 2 or grids.shape[1] != 3:
        raise ValueError(f"image_grid_thw must have shape [K, 3], got {grids.shape}")
    m = int(merge_size)
    if m < 1:
        raise ValueError(f"merge_size must be >= 1, got {merge_size}")

    n_tokens = ids.shape[0]
    is_img = ids == image_pad_id
    padded = np.zeros(n_tokens + 2, dtype=bool)
    padded[1:-1] = is_img
    flips = np.flatnonzero(padded[1:] != padded[:-1])
    starts, ends = flips[0::2], flips[1::2]  # runs are [start, end)
    if len(starts) != len(grids):
        raise ValueError(
            f"found {len(starts)} image-pad runs (token {image_pad_id}) but {len(grids)} image grids"
        )

    t, h, w = grids[:, 0], grids[:, 1], grids[:, 2]
    if (grids <= 0).any() or (grids[:, 1:] % m).any():
        raise ValueError(
            f"image grids must be positive with h, w divisible by merge_size {m}: {grids.tolist()}"
        )
    gh, gw = h // m, w // m
    expected = t * gh * gw
    run_len = ends - starts
    if (run_len != expected).any():
        k = int(np.argmax(run_len != expected))
        raise ValueError(
            f"image {k}: pad run of {int(run_len[k])} tokens at {int(starts[k])} but grid "
            f"{grids[k].tolist()} with merge {m} needs {int(expected[k])} tokens"
        )

    is_text = ~is_img
    text_before = np.cumsum(is_text, dtype=np.int64) - is_text
    advance = np.zeros(n_tokens + 1, dtype=np.int64)
    advance[ends] = np.maximum(gh, gw)  # ends are distinct; takes effect from the next token on
    base = text_before + np.cumsum(advance[:n_tokens])

    out = np.empty((3, n_tokens), dtype=np.int32)
    out[:] = base
    for s, e, tk, hk, wk in zip(starts.tolist(), ends.tolist(), t.tolist(), gh.tolist(), gw.tolist()):
        # contiguous slices reshape to views over the image's (t, row, col) raster
        out[0, s:e].reshape(tk, hk, wk)[...] += np.arange(tk, dtype=np.int32)[:, None, None]
        out[1, s:e].reshape(tk, hk, wk)[...] += np.arange(hk, dtype=np.int32)[None, :, None]
        out[2, s:e].reshape(tk, hk, wk)[...] += np.arange(wk, dtype=np.int32)
    return out
