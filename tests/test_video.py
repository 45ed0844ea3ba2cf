"""Video frames, sampling, sizes and pixels against Hugging Face's own video processing.

Oracles: `transformers.video_utils.load_video(..., backend="pyav")` for decoded frames,
`Qwen3VLVideoProcessor` / `Qwen2VLVideoProcessor` (their `sample_frames`, `smart_resize` and
the whole `__call__`) for indices, grids and `pixel_values_videos`, and qwen-vl-utils' own
`smart_nframes` / `smart_resize` for the qwen-vl-utils sampling mode. Videos are made in the
test with PyAV: several codecs and containers, frame rates 1-60, 1-400 frames, odd sizes,
portrait and landscape, short keyframe intervals (so reading seeks), variable frame rate.
"""

from __future__ import annotations

import math
import random
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("av", reason="video tests need PyAV (the test extra installs it)")
torch = pytest.importorskip("torch")
pytest.importorskip("torchvision", reason="HF's video processors need torchvision (the test extra installs it)")

from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor  # noqa: E402
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_qwen3_smart_resize  # noqa: E402
from transformers.video_processing_utils import BaseVideoProcessor  # noqa: E402
from transformers.video_utils import VideoMetadata, load_video  # noqa: E402

from preprocess.examples import VIDEO_CODECS, synthetic_video_frames, write_video  # noqa: E402
from preprocess.video import BUILTIN_VIDEO, VideoOptions, VideoRequest, plan_video, timestamps_for  # noqa: E402
from preprocess.video.decode import VideoReader  # noqa: E402
from preprocess.video.patches import frames_to_patches  # noqa: E402
from shards_schema.builtin import BUILTIN_VISION  # noqa: E402
from shards_schema.pixels import video_pixel_values_from_patches  # noqa: E402

FAMILIES = ("qwen3-vl", "qwen2.5-vl")


def hf_processor(family: str, **overrides):
    """The family's HF video processor with its published settings (and `overrides`)."""
    vision, video = BUILTIN_VISION[family], BUILTIN_VIDEO[family]
    cls = Qwen3VLVideoProcessor if family == "qwen3-vl" else Qwen2VLVideoProcessor
    kwargs = dict(size={"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels},
                  patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                  merge_size=vision.merge_size, image_mean=list(video.image_mean), image_std=list(video.image_std),
                  fps=video.fps, min_frames=video.min_frames, max_frames=video.max_frames, do_sample_frames=True)
    kwargs.update(overrides)
    return cls(**kwargs)


def plan(family: str, total: int, fps: float, height: int, width: int, request=VideoRequest(), **options):
    vision = BUILTIN_VISION[family]
    return plan_video(total, fps, height, width, request=request, options=VideoOptions(**options), family=family,
                      defaults=BUILTIN_VIDEO[family], patch_size=vision.patch_size, merge_size=vision.merge_size,
                      temporal_patch_size=vision.temporal_patch_size)


# ---------------------------------------------------------------------------------------------
# sampling and sizes from metadata: many random cases, no decoding


def _random_meta(rng: random.Random):
    total = rng.choice([rng.randint(1, 12), rng.randint(12, 400), rng.randint(400, 20000)])
    fps = rng.choice([1, 2, 5, 12.5, 23.976, 24, 25, 29.97, 30, 50, 59.94, 60, rng.uniform(0.5, 120)])
    height, width = rng.randint(16, 2200), rng.randint(16, 2200)
    if rng.random() < 0.2:
        height, width = rng.randint(32, 4000), rng.randint(32, 4000)
    return total, float(fps), height, width


def _hf_size(family, processor, num_frames, height, width, cap):
    """The size HF's `resize` picks for `num_frames` frames of height x width: its own code,
    with the final pixel resize (the base class's) replaced by a recorder of the size asked."""
    vision = BUILTIN_VISION[family]
    asked = {}

    def record(self, image, size, resample, **kwargs):
        asked["size"] = (size.height, size.width)
        return image

    video = torch.zeros((1, 1, 3, 1, 1), dtype=torch.uint8).expand(1, num_frames, 3, height, width)
    with mock.patch.object(BaseVideoProcessor, "resize", record):
        processor.resize(video, size=processor.size, resample=processor.resample,
                         factor=vision.patch_size * vision.merge_size, temporal_factor=vision.temporal_patch_size,
                         cap_pixels_per_frame=cap)
    return asked["size"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cap", [False, True])
def test_sampled_indices_and_sizes_equal_the_hf_processor(family, cap):
    rng = random.Random(f"{family}{cap}")
    processor = hf_processor(family)
    checked = 0
    for _ in range(400):
        total, fps, height, width = _random_meta(rng)
        meta = VideoMetadata(total_num_frames=total, fps=fps, height=height, width=width)
        try:
            want = np.asarray(processor.sample_frames(meta, fps=processor.fps))
        except (ValueError, ZeroDivisionError):  # HF refuses this video: so must we
            with pytest.raises(Exception):
                plan(family, total, fps, height, width, cap_pixels_per_frame=cap)
            continue
        if len(want) < 2 and family == "qwen3-vl":
            with pytest.raises(Exception):  # HF's smart_resize refuses fewer frames than a temporal patch
                plan(family, total, fps, height, width, cap_pixels_per_frame=cap)
            continue
        try:
            want_size = _hf_size(family, processor, len(want), height, width, cap)
        except ValueError:
            continue  # aspect ratio: HF raises, we reject (tested below)
        got = plan(family, total, fps, height, width, cap_pixels_per_frame=cap)
        assert got.indices.tolist() == want.tolist(), (total, fps)
        assert (got.height, got.width) == want_size, (total, fps, height, width)
        checked += 1
    assert checked > 200


@pytest.mark.parametrize("family", FAMILIES)
def test_per_part_options_equal_the_hf_processor_built_with_them(family):
    rng = random.Random(family)
    vision = BUILTIN_VISION[family]
    for _ in range(150):
        total, fps, height, width = _random_meta(rng)
        total = max(total, 8)
        min_frames, max_frames = rng.choice([(4, 768), (2, 16), (8, 32), (1, 8)])
        min_pixels = rng.choice([None, 4096, 128 * 28 * 28, 256 * 256])
        max_pixels = rng.choice([None, 64 * 64 * 8, 28 * 28 * 300, 25165824])
        fps_or_n = rng.choice([("fps", rng.choice([0.5, 1, 2, 4])), ("nframes", rng.choice([2, 4, 6, 8]))])
        request = VideoRequest(min_frames=min_frames, max_frames=max_frames, min_pixels=min_pixels,
                               max_pixels=max_pixels, **{fps_or_n[0]: fps_or_n[1]})
        defaults = BUILTIN_VIDEO[family]
        size = {"shortest_edge": min_pixels or defaults.min_pixels, "longest_edge": max_pixels or defaults.max_pixels}
        if size["shortest_edge"] > size["longest_edge"]:
            continue
        processor = hf_processor(family, min_frames=min_frames, max_frames=max_frames, size=size)
        meta = VideoMetadata(total_num_frames=total, fps=fps, height=height, width=width)
        kw = {"fps": fps_or_n[1]} if fps_or_n[0] == "fps" else {"num_frames": fps_or_n[1]}
        try:
            want = np.asarray(processor.sample_frames(meta, **kw))
            want_size = _hf_size(family, processor, len(want), height, width, False)
        except (ValueError, ZeroDivisionError):
            continue
        got = plan(family, total, fps, height, width, request)
        assert got.indices.tolist() == want.tolist(), (total, fps, request)
        assert (got.height, got.width) == want_size
        assert got.grid == (math.ceil(len(want) / vision.temporal_patch_size), want_size[0] // vision.patch_size,
                            want_size[1] // vision.patch_size)


def test_qwen3_smart_resize_is_hfs():
    rng = random.Random(3)
    from preprocess.video.sampling import qwen3_video_smart_resize

    for _ in range(2000):
        t, h, w = rng.randint(2, 800), rng.randint(16, 5000), rng.randint(16, 5000)
        if max(h, w) / min(h, w) > 150:
            continue
        lo, hi = rng.choice([(4096, 25165824), (128 * 32 * 32, 768 * 32 * 32), (1024, 1024 * 64)])
        assert qwen3_video_smart_resize(t, h, w, 2, 32, lo, hi) == hf_qwen3_smart_resize(t, h, w, 2, 32, lo, hi)


def test_timestamps_equal_the_hf_processor():
    from transformers import Qwen3VLProcessor

    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 60)
        indices = sorted(rng.randint(0, 5000) for _ in range(n))
        fps = rng.choice([1.0, 12.5, 24.0, 29.97, 60.0, rng.uniform(0.5, 90)])
        want = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
        assert timestamps_for(indices, fps, 2) == want


# ---------------------------------------------------------------------------------------------
# decoded frames and pixels: real videos


def reference_frames(path):
    """Every frame and HF's metadata: `load_video(backend="pyav")` where the container records
    its frame count; Matroska/WebM record none (HF's reader then reports 0 frames and fails),
    so there the same full decode from the start is done here, with the real frame count."""
    import av

    with av.open(str(path)) as container:
        recorded = container.streams.video[0].frames
    if recorded:
        return load_video(str(path), backend="pyav",
                          sample_indices_fn=lambda metadata, **kw: np.arange(metadata.total_num_frames))
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        meta = VideoMetadata(total_num_frames=len(frames), fps=float(stream.average_rate), height=stream.height,
                             width=stream.width, video_backend="pyav")
    meta.frames_indices = np.arange(len(frames))
    return frames, meta


def _video(tmp_path, rng, name, num_frames, fps, width, height, container="mp4", gop=None, pts_step=None):
    codec = VIDEO_CODECS[container]
    return write_video(tmp_path / f"{name}.{container}", synthetic_video_frames(rng, num_frames, width, height), fps,
                       codec=codec, gop=gop, pts_step=pts_step)


def test_frames_equal_the_reference_decoder_wherever_reading_seeks(tmp_path):
    """Frames read by seeking equal the frames a full decode from the start gives (HF's pyav reader)."""
    nprng = np.random.default_rng(0)
    rng = random.Random(0)
    cases = [("mp4", 150, 30.0, 8), ("mkv", 97, 25.0, 10), ("webm", 64, 12.0, 16), ("avi", 41, 7.0, None),
             ("mp4", 90, 29.97, 250), ("mp4", 1, 5.0, None)]
    for k, (container, n, fps, gop) in enumerate(cases):
        path = _video(tmp_path, nprng, f"v{k}", n, fps, rng.randint(40, 130), rng.randint(40, 130), container, gop)
        frames, meta = reference_frames(path)
        with VideoReader(path) as reader:
            assert reader.info.total_frames == n == meta.total_num_frames
            assert reader.info.fps == pytest.approx(meta.fps)
            for _ in range(5):
                wanted = sorted(rng.randint(0, n - 1) for _ in range(rng.randint(1, 12)))
                got = list(reader.frames(wanted))
                assert [i for i, _ in got] == wanted
                for i, frame in got:
                    assert np.array_equal(frame, frames[i]), (container, i)


def _hf_videos(family, path, processor, **call_kwargs):
    frames, meta = reference_frames(path)
    out = processor(videos=[frames], video_metadata=[meta], return_metadata=True, return_tensors="pt", **call_kwargs)
    return out


def _ours(family, path, request=VideoRequest(), **options):
    vision, video = BUILTIN_VISION[family], BUILTIN_VIDEO[family]
    with VideoReader(path) as reader:
        info = reader.info
        p = plan(family, info.total_frames, info.fps, info.height, info.width, request, **options)
        rows, grid = frames_to_patches((f for _, f in reader.frames(p.indices)), len(p.indices), p.height, p.width,
                                       patch_size=vision.patch_size, merge_size=vision.merge_size,
                                       temporal_patch_size=vision.temporal_patch_size)
    values = video_pixel_values_from_patches(rows, video.image_mean, video.image_std)
    return p, rows, grid, values


@pytest.mark.parametrize("family", FAMILIES)
def test_pixel_values_and_grids_equal_the_hf_processor_bit_for_bit(family, tmp_path):
    nprng = np.random.default_rng(1)
    rng = random.Random(family)
    compared = 0
    for k in range(10):
        container = rng.choice(list(VIDEO_CODECS))
        n = rng.choice([2, 3, 5, rng.randint(6, 80), rng.randint(80, 400)])
        fps = rng.choice([1.0, 2.0, 10.0, 24.0, 29.97, 60.0])
        portrait = rng.random() < 0.5
        w, h = rng.randint(30, 180), rng.randint(30, 180)
        w, h = (min(w, h), max(w, h)) if portrait else (max(w, h), min(w, h))
        path = _video(tmp_path, nprng, f"c{k}", n, fps, w, h, container, gop=rng.choice([None, 6, 12]))
        cap = rng.random() < 0.5
        processor = hf_processor(family)
        try:
            want = _hf_videos(family, path, processor, cap_pixels_per_frame=cap)
        except (ValueError, ZeroDivisionError):  # e.g. fewer frames than a temporal patch: we must reject too
            with pytest.raises(Exception):
                _ours(family, path, cap_pixels_per_frame=cap)
            continue
        p, rows, grid, values = _ours(family, path, cap_pixels_per_frame=cap)
        assert list(grid) == want["video_grid_thw"][0].tolist(), (container, n, fps)
        assert p.indices.tolist() == list(want["video_metadata"][0].frames_indices)
        hf_values = want["pixel_values_videos"].numpy()
        assert values.shape == hf_values.shape and values.dtype == hf_values.dtype
        assert np.array_equal(values, hf_values), f"{container} {n} frames @ {fps}: pixel_values_videos differ"
        compared += 1
    assert compared >= 7


def test_variable_frame_rate_odd_counts_and_short_videos(tmp_path):
    nprng = np.random.default_rng(2)
    vfr = _video(tmp_path, nprng, "vfr", 45, 25.0, 64, 48, "mkv", pts_step=lambda k: 40 if k % 3 else 90)
    for family in FAMILIES:
        want = _hf_videos(family, vfr, hf_processor(family), cap_pixels_per_frame=False)
        p, rows, grid, values = _ours(family, vfr)
        assert np.array_equal(values, want["pixel_values_videos"].numpy())
    short = _video(tmp_path, nprng, "short", 3, 2.0, 64, 64)  # fewer frames than min_frames (4)
    for family in FAMILIES:
        want = _hf_videos(family, short, hf_processor(family), cap_pixels_per_frame=False)
        p, rows, grid, values = _ours(family, short)
        assert list(grid) == want["video_grid_thw"][0].tolist()
        assert np.array_equal(values, want["pixel_values_videos"].numpy())
