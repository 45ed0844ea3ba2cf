"""Stored uint8 patches -> Hugging Face's float32 `pixel_values` / `pixel_values_videos`, bit for bit.

`Qwen2VLImageProcessorPil` computes, per byte v of the resized image and channel c,

    x = float32(float64(v) * (1/255))                  # rescale: float64, then cast
    y = (x - float32(mean_c)) / float32(std_c)         # normalize: float32 arithmetic

so `pixel_values` takes only 256 distinct values per channel. A [C, 256] lookup table
computed with exactly those operations (numpy, IEEE float32) and a gather reproduce it
exactly on any device, with no float arithmetic on the device at all. HF then repeats each
patch `temporal_patch_size` times along a T axis right after C: columns (c, t, py, px).

Videos go through HF's torchvision-backed video processors, which fuse rescale into
normalisation: mean and std are scaled by 1/rescale_factor = 255 in float32, and then

    y = (float32(v) - float32(float32(mean_c) * 255)) / float32(float32(std_c) * 255)

Stored video rows already hold both frames of each temporal patch, columns (c, t, py, px), so
only the lookup applies (`video_pixel_values_from_patches`).

Only numpy is imported at module load; torch is imported inside the torch path, so the
preprocessing side can import this module without torch.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

HF_RESCALE_FACTOR = 1 / 255  # BaseImageProcessor.rescale_factor


def normalization_lut(image_mean, image_std) -> np.ndarray:
    """float32 [C, 256]: HF's rescaled-and-normalised value of byte v in channel c."""
    rescaled = (np.arange(256, dtype=np.float64) * HF_RESCALE_FACTOR).astype(np.float32)
    mean = np.asarray(image_mean, dtype=np.float32)[:, None]
    std = np.asarray(image_std, dtype=np.float32)[:, None]
    return (rescaled[None, :] - mean) / std


def video_normalization_lut(image_mean, image_std) -> np.ndarray:
    """float32 [C, 256]: the value HF's video processors give byte v in channel c."""
    scale = np.float32(1.0 / HF_RESCALE_FACTOR)
    mean = (np.asarray(image_mean, dtype=np.float32) * scale)[:, None]
    std = (np.asarray(image_std, dtype=np.float32) * scale)[:, None]
    return (np.arange(256, dtype=np.float32)[None, :] - mean) / std


def video_pixel_values_from_patches(video_patches, image_mean, image_std, channels: int = 3, dtype=None):
    """uint8 [N, C*T*P*P] -> HF `pixel_values_videos` [N, C*T*P*P], float32 (or `dtype` afterwards).

    A torch tensor (any device) gives a torch tensor on that device; a numpy array gives numpy."""
    if len(video_patches.shape) != 2 or video_patches.shape[1] % channels:
        raise ValueError(f"video patches must be [N, C*T*P*P], got shape {tuple(video_patches.shape)}")
    n, width = video_patches.shape
    if isinstance(video_patches, np.ndarray):
        lut = _video_lut(_key(image_mean), _key(image_std))
        if video_patches.dtype != np.uint8:
            raise TypeError(f"video patches must be uint8, got {video_patches.dtype}")
        values = lut[np.arange(channels)[None, :, None], video_patches.reshape(n, channels, width // channels)]
        values = values.reshape(n, width)
        return values.astype(dtype) if dtype is not None else values
    import torch

    if video_patches.dtype != torch.uint8:
        raise TypeError(f"video patches must be uint8, got {video_patches.dtype}")
    flat = _torch_video_lut(_key(image_mean), _key(image_std), video_patches.device)
    offsets = torch.arange(channels, device=video_patches.device, dtype=torch.int32).mul_(256).view(1, channels, 1)
    index = video_patches.reshape(n, channels, width // channels).to(torch.int32).add_(offsets)
    values = flat.index_select(0, index.reshape(-1)).view(n, width)
    return values.to(dtype) if dtype is not None else values


@lru_cache(maxsize=16)
def _video_lut(image_mean: tuple[float, ...], image_std: tuple[float, ...]) -> np.ndarray:
    lut = video_normalization_lut(image_mean, image_std)
    lut.setflags(write=False)
    return lut


def pixel_values_from_patches(
    pixel_patches,
    image_mean,
    image_std,
    patch_size: int,
    temporal_patch_size: int,
    channels: int = 3,
    dtype=None,
):
    """uint8 [N, C*P*P] -> HF `pixel_values` [N, C*T*P*P].

    A torch tensor (any device) gives a torch tensor on that device, float32 or `dtype`
    (cast after the exact float32 lookup, so bfloat16 equals HF's float32 cast to bfloat16);
    a numpy array gives numpy (see `pixel_values_from_patches_np`).
    """
    if isinstance(pixel_patches, np.ndarray):
        return pixel_values_from_patches_np(
            pixel_patches, image_mean, image_std, patch_size, temporal_patch_size, channels, dtype
        )
    import torch

    area = patch_size * patch_size
    n = _check_shape(pixel_patches, channels, area)
    if pixel_patches.dtype != torch.uint8:
        raise TypeError(f"pixel_patches must be uint8, got {pixel_patches.dtype}")
    lut = _torch_lut(_key(image_mean), _key(image_std), pixel_patches.device)  # flat [C*256]
    offsets = torch.arange(channels, device=pixel_patches.device, dtype=torch.int32).mul_(256).view(1, channels, 1)
    index = pixel_patches.reshape(n, channels, area).to(torch.int32).add_(offsets)
    values = lut.index_select(0, index.reshape(-1)).view(n, channels, 1, area)
    if dtype is not None:
        values = values.to(dtype)
    return values.expand(n, channels, temporal_patch_size, area).reshape(n, channels * temporal_patch_size * area)


def pixel_values_from_patches_np(
    pixel_patches: np.ndarray,
    image_mean,
    image_std,
    patch_size: int,
    temporal_patch_size: int,
    channels: int = 3,
    dtype=None,
) -> np.ndarray:
    """numpy twin of `pixel_values_from_patches` (float32, or `dtype` cast afterwards)."""
    area = patch_size * patch_size
    n = _check_shape(pixel_patches, channels, area)
    if pixel_patches.dtype != np.uint8:
        raise TypeError(f"pixel_patches must be uint8, got {pixel_patches.dtype}")
    lut = _numpy_lut(_key(image_mean), _key(image_std))
    values = lut[np.arange(channels)[None, :, None], pixel_patches.reshape(n, channels, area)]
    if dtype is not None:
        values = values.astype(dtype)
    tiled = np.broadcast_to(values[:, :, None, :], (n, channels, temporal_patch_size, area))
    return tiled.reshape(n, channels * temporal_patch_size * area)


def _check_shape(pixel_patches, channels: int, area: int) -> int:
    if len(pixel_patches.shape) != 2 or pixel_patches.shape[1] != channels * area:
        raise ValueError(
            f"pixel_patches must be [N, {channels * area}] (C*P*P), got shape {tuple(pixel_patches.shape)}"
        )
    return int(pixel_patches.shape[0])


def _key(values) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


@lru_cache(maxsize=16)
def _numpy_lut(image_mean: tuple[float, ...], image_std: tuple[float, ...]) -> np.ndarray:
    lut = normalization_lut(image_mean, image_std)
    lut.setflags(write=False)
    return lut


@lru_cache(maxsize=64)
def _torch_lut(image_mean: tuple[float, ...], image_std: tuple[float, ...], device):
    return _torch_table(_numpy_lut(image_mean, image_std), device)


@lru_cache(maxsize=64)
def _torch_video_lut(image_mean: tuple[float, ...], image_std: tuple[float, ...], device):
    return _torch_table(_video_lut(image_mean, image_std), device)


def _torch_table(lut: np.ndarray, device):
    """A [C, 256] table flattened onto `device`."""
    import torch

    return torch.from_numpy(lut.reshape(-1).copy()).to(device)
