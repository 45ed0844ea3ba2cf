"""Sampled RGB frames -> uint8 video patches in Hugging Face's `pixel_values_videos` order.

Each frame is resized as the HF video processors resize: a uint8 [C, H, W] tensor through
`torch.nn.functional.interpolate(mode="bicubic", antialias=True, align_corners=False)`, torch's
native uint8 kernel, which is what torchvision's `resize` runs for uint8 bicubic on CPU. Frames
are grouped in temporal pairs (the last frame repeated when their count is odd, as HF's
`patchify` does) and cut into rows in HF's order: merge blocks of m*m consecutive rows, columns
(c, t, py, px). Unlike images, both frames of a temporal patch are real and stored.

Frames are consumed one at a time: memory holds one temporal group of resized frames plus the
rows already cut, never the whole clip.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..patchify import planes_to_rows


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB uint8 [H, W, 3] -> uint8 [3, height, width], HF's video resize."""
    import torch
    from torch.nn.functional import interpolate

    tensor = torch.from_numpy(frame).permute(2, 0, 1).contiguous()
    if tuple(tensor.shape[1:]) == (height, width):
        return tensor.numpy()
    out = interpolate(tensor[None], size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return out[0].numpy()


def frames_to_patches(frames: Iterable[np.ndarray], num_frames: int, height: int, width: int, *,
                      patch_size: int, merge_size: int, temporal_patch_size: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """`num_frames` RGB frames -> (rows uint8 [grid_t*gh*gw, C*T*P*P], grid (grid_t, gh, gw))."""
    grid_t = -(-num_frames // temporal_patch_size)
    gh, gw = height // patch_size, width // patch_size
    rows = np.empty((grid_t * gh * gw, 3 * temporal_patch_size * patch_size * patch_size), dtype=np.uint8)
    group = np.empty((temporal_patch_size, 3, height, width), dtype=np.uint8)
    seen = 0
    for frame in frames:
        group[seen % temporal_patch_size] = resize_frame(frame, height, width)
        seen += 1
        if seen % temporal_patch_size == 0:
            g = seen // temporal_patch_size - 1
            planes_to_rows(group, patch_size, merge_size, out=rows[g * gh * gw:(g + 1) * gh * gw])
    if seen != num_frames:
        raise ValueError(f"expected {num_frames} frames, got {seen}")
    if seen % temporal_patch_size:
        group[seen % temporal_patch_size:] = group[seen % temporal_patch_size - 1]  # repeat the last frame
        planes_to_rows(group, patch_size, merge_size, out=rows[(grid_t - 1) * gh * gw:])
    return rows, (grid_t, gh, gw)
