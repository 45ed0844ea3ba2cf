"""M-RoPE (t, h, w) position ids, computed offline so the trainer never calls HF.

The shards store `position_ids` int32 [3, L] per sample; they must equal Hugging Face
`get_rope_index` (transformers 5.x) for Qwen3-VL and Qwen2.5-VL:

* a text run of length n takes positions cur .. cur+n-1 on all three axes; cur += n;
* a vision run (the contiguous pad tokens of one image, or of one video's temporal group on
  Qwen3-VL, or of one whole video on Qwen2.5-VL; grid (t, h, w) in patches, merge m) has
  t*(h/m)*(w/m) tokens in raster order (t, row, col) with T = cur + dt(t_idx),
  H = cur + row, W = cur + col; then cur += max(h/m, w/m) (t does not advance cur: HF's rule);
* dt(k) = k for images and Qwen3-VL frames (each has t = 1: Qwen3-VL splits a video into one
  run per temporal group, separated by `<t seconds>` text); for Qwen2.5-VL videos
  dt(k) = int(float32(k) * float32(tokens_per_second * second_per_grid_t)), HF's float32
  arithmetic truncated toward zero.

vision_start / vision_end are ordinary text tokens.

Only numpy is imported: `shards_schema` is the contract shared by `preprocess` and `train`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["VideoPositions", "mrope_position_ids", "text_position_ids", "token_runs"]


@dataclass(frozen=True)
class VideoPositions:
    """What a sample's videos add to `mrope_position_ids`."""

    video_pad_id: int
    video_grid_thw: np.ndarray  # [V, 3]
    second_per_grid_ts: np.ndarray | None = None  # [V] float32 (Qwen2.5-VL)
    tokens_per_second: int | None = None  # Qwen2.5-VL's vision_config.tokens_per_second
    split_frames: bool = False  # each temporal group is its own run (Qwen3-VL; a family's rule, shards_schema.families)


def text_position_ids(length: int) -> np.ndarray:
    """Positions of a text-only sample: arange(length) on all three axes, int32 [3, L]."""
    return np.ascontiguousarray(np.broadcast_to(np.arange(length, dtype=np.int32), (3, length)))


def token_runs(is_pad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of each maximal run of True in `is_pad` (e.g. one pad token), as two arrays."""
    padded = np.zeros(is_pad.shape[0] + 2, dtype=bool)
    padded[1:-1] = is_pad
    flips = np.flatnonzero(padded[1:] != padded[:-1])
    return flips[0::2], flips[1::2]  # runs are [start, end)


def _grid_array(grid, what: str) -> np.ndarray:
    grids = np.asarray(grid if grid is not None else [], dtype=np.int64)
    if grids.size == 0:
        grids = grids.reshape(0, 3)
    if grids.ndim != 2 or grids.shape[1] != 3:
        raise ValueError(f"{what} must have shape [K, 3], got {grids.shape}")
    return grids


def mrope_position_ids(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    *,
    image_pad_id: int,
    merge_size: int,
    video: VideoPositions | None = None,
) -> np.ndarray:
    """HF `get_rope_index` for one sample; returns int32 [3, L], C-contiguous.

    `input_ids` is the expanded token row [L]; `image_grid_thw` is [K, 3] in patches, one row
    per image in order of appearance (K may be 0); `video` describes the sample's videos. Each
    maximal run of a pad token is one image (or video run), so two must be separated by at
    least one other token (the chat template always puts vision_end / vision_start between
    them). Raises ValueError when the runs do not match the grids, rather than producing
    positions HF would reject or silently differ on.

    Vectorised over tokens: every token's base position is (#text tokens before it) +
    (sum of max(h/m, w/m) over runs that ended before it); inside a run this base is constant
    and equals the run's starting `cur`, to which the (t, row, col) offsets are added through a
    per-run (not per-token) loop of broadcast adds.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be 1-D, got shape {ids.shape}")
    m = int(merge_size)
    if m < 1:
        raise ValueError(f"merge_size must be >= 1, got {merge_size}")
    image_grids = _grid_array(image_grid_thw, "image_grid_thw")
    is_img = ids == image_pad_id
    starts, ends = token_runs(is_img)
    if len(starts) != len(image_grids):
        raise ValueError(f"found {len(starts)} image-pad runs (token {image_pad_id}) but {len(image_grids)} image grids")
    runs = [(int(s), int(e), g, 1.0, "image", k) for k, (s, e, g) in enumerate(zip(starts, ends, image_grids))]
    is_vision = is_img
    if video is not None:
        runs += _video_runs(ids, video)
        is_vision = is_img | (ids == video.video_pad_id)
    runs.sort(key=lambda run: run[0])

    grids = np.asarray([run[2] for run in runs], dtype=np.int64).reshape(-1, 3)
    if (grids <= 0).any() or (grids[:, 1:] % m).any():
        raise ValueError(f"grids must be positive with h, w divisible by merge_size {m}: {grids.tolist()}")
    t, gh, gw = grids[:, 0], grids[:, 1] // m, grids[:, 2] // m
    run_start = np.asarray([run[0] for run in runs], dtype=np.int64)
    run_end = np.asarray([run[1] for run in runs], dtype=np.int64)
    run_len, expected = run_end - run_start, t * gh * gw
    if (run_len != expected).any():
        k = int(np.argmax(run_len != expected))
        _, _, grid, _, what, index = runs[k]
        raise ValueError(
            f"{what} {index}: pad run of {int(run_len[k])} tokens at {int(run_start[k])} but grid "
            f"{list(map(int, grid))} with merge {m} needs {int(expected[k])} tokens"
        )

    n_tokens = ids.shape[0]
    is_text = ~is_vision
    text_before = np.cumsum(is_text, dtype=np.int64) - is_text
    advance = np.zeros(n_tokens + 1, dtype=np.int64)
    advance[run_end] = np.maximum(gh, gw)  # ends are distinct; takes effect from the next token on
    base = text_before + np.cumsum(advance[:n_tokens])

    out = np.empty((3, n_tokens), dtype=np.int32)
    out[:] = base
    for (s, e, _, interval, _, _), tk, hk, wk in zip(runs, t.tolist(), gh.tolist(), gw.tolist()):
        steps = np.arange(tk, dtype=np.int32)
        if interval != 1.0:
            steps = (np.arange(tk, dtype=np.float32) * np.float32(interval)).astype(np.int32)
        # contiguous slices reshape to views over the run's (t, row, col) raster
        out[0, s:e].reshape(tk, hk, wk)[...] += steps[:, None, None]
        out[1, s:e].reshape(tk, hk, wk)[...] += np.arange(hk, dtype=np.int32)[None, :, None]
        out[2, s:e].reshape(tk, hk, wk)[...] += np.arange(wk, dtype=np.int32)
    return out


def _video_runs(ids: np.ndarray, video: VideoPositions) -> list[tuple]:
    """(start, end, grid, temporal interval, "video", index) of each video run."""
    grids = _grid_array(video.video_grid_thw, "video_grid_thw")
    starts, ends = token_runs(ids == video.video_pad_id)
    if video.split_frames:
        per_run = [(k, np.asarray([1, g[1], g[2]])) for k, g in enumerate(grids) for _ in range(int(g[0]))]
        intervals = [1.0] * len(per_run)
    else:
        per_run = list(enumerate(grids))
        seconds = np.asarray(video.second_per_grid_ts if video.second_per_grid_ts is not None else np.ones(len(grids)),
                             dtype=np.float32)
        if len(seconds) != len(grids):
            raise ValueError(f"{len(seconds)} second_per_grid_ts for {len(grids)} videos")
        tps = video.tokens_per_second if video.tokens_per_second is not None else 1
        intervals = [float(np.float32(tps) * s) for s in seconds]
    if len(starts) != len(per_run):
        raise ValueError(f"found {len(starts)} video-pad runs (token {video.video_pad_id}) but the video grids "
                         f"{grids.tolist()} make {len(per_run)}")
    return [(int(s), int(e), g, interval, "video", k)
            for (k, g), s, e, interval in zip(per_run, starts, ends, intervals)]
