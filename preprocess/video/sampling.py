"""Which frames of a video are sampled, and the size they are resized to.

Two modes, each the exact arithmetic of its reference:

* `hf` (the default): the Hugging Face video processor of the family with frame sampling on:
  its `sample_frames` for the indices and its `smart_resize` for the size, including the
  optional per-frame pixel cap (`cap_pixels_per_frame`); each family's module of
  `preprocess.families` holds its processor's arithmetic;
* `qwen-vl-utils`: `qwen_vl_utils.smart_nframes` for the frame count, its `linspace`
  indices over the `video_start`/`video_end` window, and its pixel budget
  (`min_pixels`/`max_pixels`/`total_pixels`) for the size: what Qwen's own fine-tuning and
  inference scripts feed the processor.

Everything here works from the container's metadata (frame count and average frame rate), so
a video's token count is known before one frame is decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import RejectError
from ..images import MAX_ASPECT_RATIO
from ..media import check_bounds

SAMPLING_MODES = ("hf", "qwen-vl-utils")

# qwen-vl-utils' module constants (vision_process.py).
QVU_FRAME_FACTOR = 2
QVU_FPS = 2.0
QVU_FPS_MIN_FRAMES = 4
QVU_FPS_MAX_FRAMES = 768
QVU_VIDEO_MIN_TOKEN_NUM = 128
QVU_VIDEO_MAX_TOKEN_NUM = 768
QVU_MODEL_SEQ_LEN = 128000


@dataclass(frozen=True)
class VideoRequest:
    """A video part's sampling options (qwen-vl-utils / HF names); None means the default."""

    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    video_start: float | None = None
    video_end: float | None = None


@dataclass(frozen=True)
class SamplePlan:
    """The frames to read and what they become."""

    indices: np.ndarray  # int64 frame indices into the decoded stream, in order (may repeat)
    height: int  # resized frame size
    width: int


def sampling_error(message: str) -> RejectError:
    return RejectError("video_sampling", message)


def check_option_bounds(low_name: str, low, high_name: str, high) -> None:
    """A minimum sampling option must not exceed the maximum in force (`bad_video_option`)."""
    check_bounds(low_name, low, high_name, high, "bad_video_option",
                 "the sampling options (the part's, else the --video-* flags', else the profile's)")


# ---------------------------------------------------------------------------------------------
# qwen-vl-utils mode


def _round_by(n: float, f: int) -> int:
    return round(n / f) * f


def _ceil_by(n: float, f: int) -> int:
    return math.ceil(n / f) * f


def _floor_by(n: float, f: int) -> int:
    return math.floor(n / f) * f


def qvu_nframes(request: VideoRequest, total_frames: int, video_fps: float) -> int:
    """`qwen_vl_utils.smart_nframes` (frames of the window, `total_frames`)."""
    if request.fps is not None and request.nframes is not None:
        raise sampling_error("`fps` and `nframes` are mutually exclusive: give one")
    if request.nframes is not None:
        nframes = _round_by(request.nframes, QVU_FRAME_FACTOR)
    else:
        fps = request.fps if request.fps is not None else QVU_FPS
        min_frames = _ceil_by(request.min_frames if request.min_frames is not None else QVU_FPS_MIN_FRAMES,
                              QVU_FRAME_FACTOR)
        max_frames = _floor_by(request.max_frames if request.max_frames is not None
                               else min(QVU_FPS_MAX_FRAMES, total_frames), QVU_FRAME_FACTOR)
        nframes = total_frames / video_fps * fps
        nframes = min(min(max(nframes, min_frames), max_frames), total_frames)
        nframes = _floor_by(nframes, QVU_FRAME_FACTOR)
    if not (QVU_FRAME_FACTOR <= nframes <= total_frames):
        raise sampling_error(f"the video samples {nframes} frames; {QVU_FRAME_FACTOR} to {total_frames} "
                              "(its frame count) are possible: check `nframes`, `fps` and the video's length")
    return nframes


def qvu_window(request: VideoRequest, total_frames: int, video_fps: float) -> tuple[int, int]:
    """First and last frame of the `video_start`/`video_end` window, in seconds clamped to the
    video (qwen-vl-utils' `calculate_video_frame_range`)."""
    if request.video_start is None and request.video_end is None:
        return 0, total_frames - 1
    duration = total_frames / video_fps
    start_frame = 0
    if request.video_start is not None:
        start_frame = math.ceil(max(0.0, min(request.video_start, duration)) * video_fps)
    end_frame = total_frames - 1
    if request.video_end is not None:
        end_frame = min(math.floor(max(0.0, min(request.video_end, duration)) * video_fps), total_frames - 1)
    if start_frame >= end_frame:
        raise sampling_error(
            f"window video_start={request.video_start} video_end={request.video_end} s holds at most one frame "
            f"of a video of {duration:.2f} s ({total_frames} frames at {video_fps:g} fps)")
    return start_frame, end_frame


def qvu_indices(request: VideoRequest, total_frames: int, video_fps: float) -> np.ndarray:
    """qwen-vl-utils' `torch.linspace(start, end, nframes).round().long()` over the window."""
    import torch

    start_frame, end_frame = qvu_window(request, total_frames, video_fps)
    nframes = qvu_nframes(request, end_frame - start_frame + 1, video_fps)
    return torch.linspace(start_frame, end_frame, nframes).round().long().numpy()


def qvu_resize(request: VideoRequest, num_frames: int, height: int, width: int, patch_size: int,
               merge_size: int) -> tuple[int, int]:
    """qwen-vl-utils' `fetch_video` size: per-frame bounds from `min_pixels`, `max_pixels` and
    the `total_pixels` budget shared by the frames."""
    factor = patch_size * merge_size
    min_pixels = request.min_pixels if request.min_pixels is not None else QVU_VIDEO_MIN_TOKEN_NUM * factor * factor
    total_pixels = request.total_pixels if request.total_pixels is not None else QVU_MODEL_SEQ_LEN * factor * factor * 0.9
    max_pixels = max(min(QVU_VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / num_frames * QVU_FRAME_FACTOR),
                     int(min_pixels * 1.05))
    if request.max_pixels is not None:
        max_pixels = min(request.max_pixels, max_pixels)
    return qvu_smart_resize(height, width, factor, min_pixels, max_pixels)


def qvu_smart_resize(height: int, width: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """`qwen_vl_utils.smart_resize` (floor/ceil by factor after scaling, float bounds allowed)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise RejectError("aspect_ratio", f"video {width}x{height}: aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h_bar = max(factor, _round_by(height, factor))
    w_bar = max(factor, _round_by(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = _floor_by(height / beta, factor)
        w_bar = _floor_by(width / beta, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = _ceil_by(height * beta, factor)
        w_bar = _ceil_by(width * beta, factor)
    return h_bar, w_bar
