"""Video parts: source -> sampled frames -> uint8 patches, grid and timing, as HF computes them.

Two stages, like images, so a row is judged before any frame is decoded:

* `open_video` resolves the source, opens the container and demuxes it (no decoding), and
  `plan_video` turns its frame count and frame rate into the sampled frame indices, the
  resized size and so the grid: the video's token count;
* `VideoPlan.load` decodes just the sampled frames and cuts them into patches.

A video given as a list of frame images skips decoding: its frames are the images, in order
(qwen-vl-utils' rule: padded to an even count with the last frame, sampled at `sample_fps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from shards_schema.builtin import VideoDefaults
from shards_schema.flags import setting
from shards_schema.storage import FetchPolicy

from ..errors import RejectError
from ..media import (MIN_FPS, check_bounds, check_unsupported_size_options, count_flag, fps_flag, frames_flag,
                     part_number)
from .decode import VideoInfo, VideoReader
from .sampling import (
    QVU_VIDEO_MIN_TOKEN_NUM,
    SAMPLING_MODES,
    VideoRequest,
    check_option_bounds,
    qvu_indices,
    qvu_resize,
    qvu_window,
)

__all__ = ["DEFAULT_FRAME_LIST_FPS", "DEFAULT_MAX_VIDEO_BYTES", "SAMPLING_MODES", "FrameList", "VideoDefaults",
           "VideoOptions", "VideoPlan", "VideoRequest", "open_video_source", "plan_video", "timestamps_for"]

# A video file is streamed by the decoder, never read whole: the cap bounds disk reads and time.
DEFAULT_MAX_VIDEO_BYTES = 4 * 2**30
# Frames given as a list of images carry no frame rate: qwen-vl-utils' default `sample_fps`.
DEFAULT_FRAME_LIST_FPS = 2.0


@dataclass(frozen=True)
class VideoOptions:
    """Job-wide video settings (recorded in the manifest): the defaults a part's own options override."""

    sampling: str = setting(
        "hf", group="videos", choices=SAMPLING_MODES,
        help="how frames are sampled and sized: 'hf' (default), as the family's Hugging Face video "
             "processor does; 'qwen-vl-utils', as qwen_vl_utils.fetch_video does")
    # HF's `cap_pixels_per_frame` (qwen-vl-utils' per-frame cap), hf mode
    cap_pixels_per_frame: bool = setting(
        False, group="videos", name="--video-pixel-cap", action="store_true",
        help="hf sampling: cap each frame's pixels as qwen-vl-utils does (HF's cap_pixels_per_frame=True); "
             "off by default, as in the transformers release the tests pin")
    fps: float | None = setting(None, group="videos", type=fps_flag,
                                help="frames sampled per second where a video part gives neither fps nor nframes "
                                     "(default: the profile's, 2)")
    max_frames: int | None = setting(
        None, group="videos", type=frames_flag,
        help="most frames sampled from a video part that gives no max_frames (default: the profile's, 768)")
    max_pixels: int | None = setting(
        None, group="videos", type=count_flag,
        help="max_pixels of a video part that gives none (hf sampling: the processor's size['longest_edge']; "
             "qwen-vl-utils: per frame)")
    total_pixels: int | None = setting(None, group="videos", type=count_flag,
                                       help="pixel budget shared by a video's frames, for parts that give no "
                                            "total_pixels")

    def request(self, part: VideoRequest) -> VideoRequest:
        """The part's options with the job's flags filling what the part leaves out."""
        fill = {}
        if part.fps is None and part.nframes is None and self.fps is not None:
            fill["fps"] = self.fps
        for name in ("max_frames", "max_pixels", "total_pixels"):
            if getattr(part, name) is None and getattr(self, name) is not None:
                fill[name] = getattr(self, name)
        return replace(part, **fill)


@dataclass(frozen=True)
class VideoPlan:
    """One video's sampled frames and what they become (known before decoding)."""

    indices: np.ndarray  # frame indices into the stream, non-decreasing
    fps: float  # the stream's average frame rate
    height: int  # resized frame size
    width: int
    grid: tuple[int, int, int]  # (grid_t, gh, gw) in patches
    second_per_grid_t: float  # seconds one temporal patch spans (Qwen2.5-VL's temporal positions)


def timestamps_for(indices, fps: float, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's `<t seconds>` of each temporal group: the mean time of its first and last
    frame (`Qwen3VLProcessor._calculate_timestamps`; the last group padded with its last frame)."""
    indices = [int(i) for i in indices]
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def plan_video(total_frames: int, fps: float, height: int, width: int, *, request: VideoRequest,
               options: VideoOptions, family, defaults: VideoDefaults, patch_size: int, merge_size: int,
               temporal_patch_size: int, all_frames: bool = False) -> VideoPlan:
    """The sampled frame indices and resized size of a video, from its metadata alone.
    `family` (a `preprocess.families` object) gives its HF video processor's sampling and resize
    rules; `all_frames`: a list of frame images, which is used whole (neither reference samples one)."""
    request = options.request(request)
    qvu = options.sampling == "qwen-vl-utils"
    # A minimum the part asks for must not exceed the maximum in force; a maximum under a default
    # minimum is fine (the maximum wins, as in HF's smart_resize), except in qwen-vl-utils mode,
    # whose smart_resize asserts max_pixels >= min_pixels.
    if qvu:
        factor = patch_size * merge_size
        check_option_bounds("min_pixels", request.min_pixels if request.min_pixels is not None
                            else QVU_VIDEO_MIN_TOKEN_NUM * factor * factor, "max_pixels", request.max_pixels)
    else:
        check_option_bounds("min_pixels", request.min_pixels,
                            "max_pixels", request.max_pixels if request.max_pixels is not None else defaults.max_pixels)
    if all_frames:
        indices = np.arange(total_frames)
        if qvu:
            size = qvu_resize(request, total_frames, height, width, patch_size, merge_size)
        else:
            size = family.hf_resize(total_frames, height, width, patch_size=patch_size, merge_size=merge_size,
                                    temporal_patch_size=temporal_patch_size,
                                    min_pixels=request.min_pixels if request.min_pixels is not None else defaults.min_pixels,
                                    max_pixels=request.max_pixels if request.max_pixels is not None else defaults.max_pixels,
                                    max_video_tokens=defaults.max_video_tokens,
                                    cap_pixels_per_frame=options.cap_pixels_per_frame)
        sampled_fps = fps
    elif qvu:
        if request.nframes is None:
            check_option_bounds("min_frames", request.min_frames, "max_frames", request.max_frames)
        indices = qvu_indices(request, total_frames, fps)
        size = qvu_resize(request, len(indices), height, width, patch_size, merge_size)
        sampled_fps = len(indices) / _window(request, total_frames, fps)[1] * fps
    else:
        start, window = _window(request, total_frames, fps)
        min_frames = request.min_frames if request.min_frames is not None else defaults.min_frames
        max_frames = request.max_frames if request.max_frames is not None else defaults.max_frames
        if request.nframes is None:
            check_option_bounds("min_frames", request.min_frames, "max_frames", max_frames)
        sample_fps = request.fps if request.fps is not None or request.nframes is not None else defaults.fps
        indices = family.hf_frame_indices(window, fps, sample_fps, request.nframes, min_frames, max_frames,
                                          temporal_patch_size)
        indices = indices + start
        min_pixels = request.min_pixels if request.min_pixels is not None else defaults.min_pixels
        max_pixels = request.max_pixels if request.max_pixels is not None else defaults.max_pixels
        cap, max_video_tokens = options.cap_pixels_per_frame, defaults.max_video_tokens
        if request.total_pixels is not None:
            max_pixels = family.hf_max_pixels_within_total(request, min_pixels=min_pixels, max_pixels=max_pixels,
                                                           num_frames=len(indices),
                                                           temporal_patch_size=temporal_patch_size)
        size = family.hf_resize(len(indices), height, width, patch_size=patch_size, merge_size=merge_size,
                                temporal_patch_size=temporal_patch_size, min_pixels=min_pixels, max_pixels=max_pixels,
                                max_video_tokens=max_video_tokens, cap_pixels_per_frame=cap)
        sampled_fps = len(indices) / window * fps
    if len(indices) == 0:
        raise RejectError("video_sampling", f"a video of {total_frames} frames at {fps:g} fps samples no frame")
    if min(size) < patch_size * merge_size:  # qwen-vl-utils floors a small max_pixels to nothing
        raise RejectError("video_sampling", f"frames of {width}x{height} resized to {size[1]}x{size[0]}: less than one "
                          f"{patch_size * merge_size}x{patch_size * merge_size} block of patches; raise max_pixels")
    grid = (math.ceil(len(indices) / temporal_patch_size), size[0] // patch_size, size[1] // patch_size)
    return VideoPlan(indices=np.asarray(indices, dtype=np.int64), fps=fps, height=size[0], width=size[1], grid=grid,
                     second_per_grid_t=temporal_patch_size / sampled_fps)


def _window(request: VideoRequest, total_frames: int, fps: float) -> tuple[int, int]:
    """(first frame, frame count) of the `video_start`/`video_end` window (whole video if unset)."""
    if request.video_start is None and request.video_end is None:
        return 0, total_frames
    start, end = qvu_window(request, total_frames, fps)
    return start, end - start + 1


# A video part's numeric options: (name, integer). Counts and pixel numbers are positive
# integers, a frame rate at least MIN_FPS, window bounds (seconds) not negative.
VIDEO_OPTIONS = (("fps", False), ("nframes", True), ("min_frames", True), ("max_frames", True),
                 ("min_pixels", True), ("max_pixels", True), ("total_pixels", True), ("video_start", False),
                 ("video_end", False))


def request_from_part(part: dict, where: str) -> VideoRequest:
    """A content part's sampling options, checked: numbers of the right kind and range
    (`part_number`), bounds that do not contradict each other, no option vlmpack would ignore."""
    check_unsupported_size_options(part, "unsupported_field", where)
    values = {name: part_number(part, name, integer=integer, minimum=MIN_FPS if name == "fps" else 0.0,
                                code="bad_video_option", where=where)
              for name, integer in VIDEO_OPTIONS}
    if values["fps"] is not None and values["nframes"] is not None:
        raise RejectError("bad_video_option", f"{where}: `fps` and `nframes` are mutually exclusive: give one")
    check_bounds("min_frames", values["min_frames"], "max_frames", values["max_frames"], "bad_video_option", where)
    check_bounds("min_pixels", values["min_pixels"], "max_pixels", values["max_pixels"], "bad_video_option", where)
    return VideoRequest(**values)


class FrameList:
    """A video given as a list of frame images: every frame is used, in order (no sampling).
    Headers are read at once (the frames must share one size); pixels when `frames` asks."""

    def __init__(self, sources: list[str], fps: float, open_image, decode_image):
        self._decode = decode_image
        self._images = []
        for k, source in enumerate(sources):
            try:
                self._images.append(open_image(source))
            except RejectError as exc:
                raise RejectError(exc.code, f"frame {k}: {exc.message}") from None
        sizes = {(im.height, im.width) for im in self._images}
        if len(sizes) > 1:
            raise RejectError("bad_video", f"the {len(sources)} frames differ in size ({', '.join(f'{w}x{h}' for h, w in sorted(sizes))}): "
                              "resize them to one size")
        (height, width), = sizes
        self.info = VideoInfo(total_frames=len(sources), fps=fps, width=width, height=height, codec="images",
                              container="frame list")

    def frames(self, indices):
        for i in indices:
            image, self._images[i] = self._images[i], None  # each decoded frame is freed once used
            yield i, np.array(self._decode(image))  # writable, as torch.from_numpy wants

    def close(self) -> None:
        self._images = []


def open_video_source(source, *, request: VideoRequest, media_root, max_video_bytes: int, open_image, decode_image,
                      remote: FetchPolicy | None = None, max_frame_pixels: int | None = None):
    """A video part's source -> an object with `info` (a `VideoInfo`), `frames(indices)` and
    `close()`: a `VideoReader` on a file or inline bytes, or a `FrameList`. `remote`: how URLs
    are fetched (None rejects them); `max_frame_pixels`: the frame size refused from the header."""
    from ..media import resolve_media

    if isinstance(source, list):
        fps = request.fps if request.fps is not None else DEFAULT_FRAME_LIST_FPS
        return FrameList(source, fps, open_image, decode_image)
    return VideoReader(resolve_media(source, media_root, max_video_bytes, kind="video", remote=remote),
                       max_frame_pixels=max_frame_pixels)
