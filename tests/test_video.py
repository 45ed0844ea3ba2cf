"""Video frames, sampling, sizes and pixels against Hugging Face's own video processing.

Oracles: `transformers.video_utils.load_video(..., backend="pyav")` for decoded frames,
`Qwen3VLVideoProcessor` / `Qwen2VLVideoProcessor` (their `sample_frames`, `smart_resize` and
the whole `__call__`) for indices, grids and `pixel_values_videos`, and qwen-vl-utils' own
`smart_nframes` / `smart_resize` for the qwen-vl-utils sampling mode. Videos are made in the
test with PyAV: several codecs and containers, frame rates 1-60, 1-400 frames, odd sizes,
portrait and landscape, short keyframe intervals (so reading seeks), variable frame rate.
"""

from __future__ import annotations

import dataclasses
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

from preprocess.errors import RejectError  # noqa: E402
from preprocess.examples import VIDEO_CODECS, synthetic_video_frames, write_video  # noqa: E402
from preprocess.families import family_named  # noqa: E402
from preprocess.video import VideoOptions, VideoRequest, plan_video, timestamps_for  # noqa: E402
from preprocess.video.decode import VideoReader  # noqa: E402
from preprocess.video.patches import frames_to_patches  # noqa: E402
from shards_schema.builtin import BUILTIN_VISION  # noqa: E402
from shards_schema.pixels import video_pixel_values_from_patches  # noqa: E402
from tests.helpers.video import random_video_row, reference_frames  # noqa: E402

FAMILIES = ("qwen3-vl", "qwen2.5-vl")


def hf_processor(family: str, **overrides):
    """The family's HF video processor with its published settings (and `overrides`)."""
    vision, video = BUILTIN_VISION[family], family_named(family).builtin_video
    cls = Qwen3VLVideoProcessor if family == "qwen3-vl" else Qwen2VLVideoProcessor
    kwargs = dict(size={"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels},
                  patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                  merge_size=vision.merge_size, image_mean=list(video.image_mean), image_std=list(video.image_std),
                  fps=video.fps, min_frames=video.min_frames, max_frames=video.max_frames, do_sample_frames=True)
    kwargs.update(overrides)
    return cls(**kwargs)


def plan(family: str, total: int, fps: float, height: int, width: int, request=VideoRequest(), **options):
    vision = BUILTIN_VISION[family]
    return plan_video(total, fps, height, width, request=request, options=VideoOptions(**options),
                      family=family_named(family), defaults=family_named(family).builtin_video,
                      patch_size=vision.patch_size, merge_size=vision.merge_size,
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
        defaults = family_named(family).builtin_video
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
    from preprocess.families.qwen3_vl import qwen3_video_smart_resize

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


def test_a_stream_whose_frames_share_one_timestamp_is_read_as_hfs_decoder_reads_it(tmp_path):
    """Packets that all carry timestamp 0 (as some muxers write them) cannot be told apart by
    seeking: the stream is decoded from the start, frame i the decoder's i-th, as HF's reader does."""
    import av

    path = tmp_path / "zero.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
        frames = synthetic_video_frames(np.random.default_rng(3), 7, 48, 32)
        for i, rgb in enumerate([*frames, None]):
            if rgb is not None:
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts = i
            for packet in stream.encode(frame if rgb is not None else None):
                packet.pts = packet.dts = 0
                container.mux(packet)
    reference, meta = reference_frames(path)
    with VideoReader(path) as reader:
        assert reader.info.total_frames == meta.total_num_frames == len(reference) == 7
        got = list(reader.frames([0, 2, 2, 6]))
    assert [i for i, _ in got] == [0, 2, 2, 6]
    assert all(np.array_equal(frame, reference[i]) for i, frame in got)


def _hf_videos(family, path, processor, **call_kwargs):
    frames, meta = reference_frames(path)
    out = processor(videos=[frames], video_metadata=[meta], return_metadata=True, return_tensors="pt", **call_kwargs)
    return out


def _ours(family, path, request=VideoRequest(), **options):
    vision, video = BUILTIN_VISION[family], family_named(family).builtin_video
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


def _rotated_pair(tmp_path, nprng, degrees, container="mp4"):
    """The same frames written twice, without and with a display matrix of `degrees`."""
    frames = list(synthetic_video_frames(nprng, 12, 70, 40))  # landscape, so a quarter turn shows
    plain = write_video(tmp_path / f"plain{degrees}.{container}", frames, 10.0, codec=VIDEO_CODECS[container])
    turned = write_video(tmp_path / f"rot{degrees}.{container}", frames, 10.0, codec=VIDEO_CODECS[container],
                         rotate=degrees)
    return plain, turned


@pytest.mark.parametrize("degrees", [90, -90, 180])
def test_rotated_videos_come_out_upright_and_are_sized_upright(degrees, tmp_path):
    """A display matrix of +90 (counter-clockwise) turns each stored frame a quarter turn
    counter-clockwise, as players show it; the grid is sized from the upright frame and the
    pixels equal HF's processor on the upright frames, both families."""
    plain, turned = _rotated_pair(tmp_path, np.random.default_rng(degrees % 360), degrees)
    frames, meta = reference_frames(plain)
    upright = np.stack([np.rot90(f, degrees // 90) for f in frames])
    with VideoReader(turned) as reader:
        assert reader.info.rotation == (degrees // 90) % 4
        assert (reader.info.height, reader.info.width) == upright.shape[1:3]
        got = np.stack([f for _, f in reader.frames(range(len(frames)))])
    assert np.array_equal(got, upright)
    if degrees % 180:
        assert got.shape[1:3] == frames.shape[2:0:-1]  # portrait from a landscape stream
    meta.height, meta.width = upright.shape[1:3]
    for family in FAMILIES:
        want = hf_processor(family)(videos=[upright], video_metadata=[meta], return_metadata=True,
                                    return_tensors="pt", cap_pixels_per_frame=False)
        _, _, grid, values = _ours(family, turned)
        assert list(grid) == want["video_grid_thw"][0].tolist()
        assert np.array_equal(values, want["pixel_values_videos"].numpy())


def _torchcodec_usable() -> bool:
    from transformers.utils.import_utils import is_torchcodec_usable
    try:
        return bool(is_torchcodec_usable(decode="video"))
    except TypeError:
        return bool(is_torchcodec_usable())


@pytest.mark.skipif(not _torchcodec_usable(), reason="torchcodec needs the system FFmpeg libraries")
@pytest.mark.parametrize("degrees", [90, -90, 180])
def test_rotated_frames_equal_torchcodec_hfs_default_decoder(degrees, tmp_path):
    """Where torchcodec runs, it is the oracle for the orientation: HF's default video loader."""
    _, turned = _rotated_pair(tmp_path, np.random.default_rng(1), degrees)
    frames, meta = load_video(str(turned), backend="torchcodec",
                              sample_indices_fn=lambda metadata, **kw: np.arange(metadata.total_num_frames))
    frames = np.asarray(frames).transpose(0, 2, 3, 1)  # torchcodec gives [T, C, H, W]
    with VideoReader(turned) as reader:
        assert (reader.info.height, reader.info.width) == (meta.height, meta.width)
        got = np.stack([f for _, f in reader.frames(range(len(frames)))])
    assert np.array_equal(got, frames)


# ---------------------------------------------------------------------------------------------
# whole rows: tokens, masks, positions and pixels of conversations with videos and images
# against HF's processor (official template, HF video processor) and get_rope_index


@pytest.fixture(scope="module")
def hf_row_processors(builtin_profiles, tmp_path_factory):
    """Per family: (processor, tiny model). The processor is HF's own class over the profile's
    tokenizer, the official template, the PIL image processor (what vlmpack's images match) and
    the family's video processor with its published settings."""
    import json

    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.conftest import FIXTURES_DIR
    from tests.helpers.models import tiny_qwen2_5_vl, tiny_qwen3_vl

    out = {}
    for family, profile in builtin_profiles.items():
        directory = tmp_path_factory.mktemp(family)
        (directory / "tokenizer.json").write_text(profile.tokenizer_json, encoding="utf-8")
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        v = profile.vision
        images = Qwen2VLImageProcessorPil(patch_size=v.patch_size, merge_size=v.merge_size,
                                          temporal_patch_size=v.temporal_patch_size, image_mean=list(v.image_mean),
                                          image_std=list(v.image_std), min_pixels=v.min_pixels, max_pixels=v.max_pixels)
        name = "qwen3_vl" if family == "qwen3-vl" else "qwen2_5_vl"
        template = (FIXTURES_DIR / f"{name}_instruct.chat_template.jinja").read_text(encoding="utf-8")
        cls = Qwen3VLProcessor if family == "qwen3-vl" else Qwen2_5_VLProcessor
        processor = cls(image_processor=images, tokenizer=tokenizer, video_processor=hf_processor(family),
                        chat_template=template)
        out[family] = (processor, tiny_qwen3_vl() if family == "qwen3-vl" else tiny_qwen2_5_vl())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_with_videos_equal_hf_processing(family, builtin_profiles, hf_row_processors, tmp_path):
    from preprocess.pipeline import SampleOptions, process_row
    from shards_schema.pixels import pixel_values_from_patches
    from tests.helpers.render import expected_mask_from_ids, hf_template_messages

    profile = builtin_profiles[family]
    processor, model = hf_row_processors[family]
    rng, nprng = random.Random(f"rows-{family}"), np.random.default_rng(7)
    media = tmp_path / "media"
    media.mkdir()
    options = SampleOptions(media_root=str(media), max_seq_len=1 << 20)
    video = family_named(family).builtin_video
    for n in range(6):
        row, messages, hf_videos, hf_meta, hf_images = random_video_row(rng, nprng, media, family)
        text = processor.apply_chat_template(hf_template_messages(messages), tokenize=False)
        hf = processor(text=[text], images=hf_images or None, videos=hf_videos, video_metadata=hf_meta,
                       return_tensors="pt", cap_pixels_per_frame=False)
        sample = process_row(row, sample_uid=f"r{n}", source="x", profile=profile, options=options)
        ids = hf["input_ids"][0].numpy()
        assert sample.input_ids.tolist() == ids.tolist(), n
        trained = [True] * sum(m["role"] == "assistant" for m in messages)
        assert np.array_equal(sample.loss_mask, expected_mask_from_ids(ids.tolist(), trained, processor.tokenizer))
        assert sample.video_grid_thw.tolist() == hf["video_grid_thw"].tolist()
        values = video_pixel_values_from_patches(sample.video_patches, video.image_mean, video.image_std)
        assert np.array_equal(values, hf["pixel_values_videos"].numpy()), n
        if hf_images:
            assert sample.image_grid_thw.tolist() == hf["image_grid_thw"].tolist()
            v = profile.vision
            image_values = pixel_values_from_patches(sample.pixel_patches, v.image_mean, v.image_std, v.patch_size,
                                                     v.temporal_patch_size)
            assert np.array_equal(image_values, np.asarray(hf["pixel_values"]))
        kwargs = dict(input_ids=hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"],
                      image_grid_thw=hf.get("image_grid_thw"), video_grid_thw=hf["video_grid_thw"])
        if family == "qwen2.5-vl":
            kwargs["second_per_grid_ts"] = hf["second_per_grid_ts"]
            assert np.array_equal(sample.second_per_grid_ts, hf["second_per_grid_ts"].numpy().astype(np.float32))
        with torch.no_grad():
            positions, _ = model.model.get_rope_index(**kwargs)
        assert np.array_equal(sample.position_ids, positions[:, 0].numpy()), n


# ---------------------------------------------------------------------------------------------
# bad videos in a real job: each row rejected with its code, the others written


def _faststart_mp4(path, frames, fps):
    """An MP4 with its index first (as streaming sites write them): truncating it keeps an
    openable container whose later frames are missing."""
    import av

    frames = list(frames)
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=int(fps))
        stream.width, stream.height, stream.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def test_job_over_good_and_bad_videos(tmp_path):
    import json
    import subprocess
    import sys

    import av

    from shards_schema import open_shards

    media = tmp_path / "media"
    media.mkdir()
    nprng = np.random.default_rng(3)
    write_video(media / "good.mp4", synthetic_video_frames(nprng, 12, 64, 48), 6.0)
    write_video(media / "good.webm", synthetic_video_frames(nprng, 9, 48, 64), 3.0, codec="libvpx-vp9")
    whole = _faststart_mp4(media / "whole.mp4", synthetic_video_frames(nprng, 40, 64, 48), 10).read_bytes()
    (media / "truncated.mp4").write_bytes(whole[: len(whole) // 2])
    (media / "empty.mp4").write_bytes(b"")
    (media / "text.mp4").write_text("not a video " * 40)
    with av.open(str(media / "audio.mkv"), "w") as container:  # a container with no video stream
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    write_video(media / "long.mp4", synthetic_video_frames(nprng, 90, 384, 384), 30.0)
    frame_dir = media / "frames"
    frame_dir.mkdir()
    from PIL import Image

    for k, frame in enumerate(synthetic_video_frames(nprng, 5, 40, 30)):
        Image.fromarray(frame).save(frame_dir / f"{k}.png")
    Image.fromarray(np.zeros((31, 40, 3), np.uint8)).save(frame_dir / "odd.png")

    def chat(video, **options):
        return json.dumps({"messages": [{"role": "user", "content": [{"type": "video", "video": video, **options},
                                                                      {"type": "text", "text": "What happens?"}]},
                                        {"role": "assistant", "content": "Colours drift."}]})

    lines = [
        (chat("good.mp4"), None),
        (chat("truncated.mp4"), "bad_video"),
        (chat("empty.mp4"), "not_a_video"),
        (chat("text.mp4"), "not_a_video"),
        (chat("audio.mkv"), "no_video_stream"),
        (chat("missing.mp4"), "missing_file"),
        (chat("../outside.mp4"), "path_outside_media_root"),
        (chat("https://example.com/v.mp4"), "remote_url"),
        (chat("long.mp4", fps=30, max_pixels=384 * 384 * 90), "video_too_long"),
        (chat("good.mp4", fps=-2), "bad_video_option"),
        (chat("good.mp4", video_start=5.0, video_end=4.0), "video_sampling"),
        (chat([f"frames/{k}.png" for k in range(5)]), None),
        (chat(["frames/0.png", "frames/odd.png"]), "bad_video"),
        (chat("good.webm", nframes=4), None),
        (chat("big.mp4"), "media_too_large"),
    ]
    with open(media / "big.mp4", "wb") as fh:  # sparse: 5 GiB of nothing, over the default --max-video-bytes
        fh.truncate(5 * 2**30)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(line + "\n" for line, _ in lines), encoding="utf-8")
    out = tmp_path / "shards"
    command = [sys.executable, "-m", "shards_schema.cli", "preprocess", str(data), "--out", str(out), "--media-root",
               str(media), "--max-seq-len", "4096", "--workers", "2",
               "--rows-per-shard", "4", "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    rejects = {r["row"]: r for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}
    assert {row: r["code"] for row, r in rejects.items()} == {k: code for k, (_, code) in enumerate(lines) if code}
    assert all(r["reason"].startswith("video 0: ") or r["code"] == "bad_video_option" for r in rejects.values())
    good = [k for k, (_, code) in enumerate(lines) if code is None]
    assert manifest["accounting"]["rows_written"] == len(good) and manifest["totals"]["videos"] == len(good)
    shards = open_shards(out)
    assert [int(shards[i]["video_grid_thw"].shape[0]) for i in range(len(shards))] == [1] * len(good)
    verify = subprocess.run([sys.executable, "-m", "shards_schema.cli", "verify", str(out)], capture_output=True,
                            text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr


# ---------------------------------------------------------------------------------------------
# the qwen-vl-utils sampling mode against qwen-vl-utils itself


def _qvu_reference(vp, ele: dict, total: int, fps: float, height: int, width: int, patch_size: int):
    """What qwen_vl_utils.fetch_video computes for a video of this metadata: its window, frame
    count and linspace indices (`_read_video_*`), then its per-frame pixel budget and size."""
    start, end, window = vp.calculate_video_frame_range(ele, total, fps)
    nframes = vp.smart_nframes(ele, total_frames=window, video_fps=fps)
    indices = torch.linspace(start, end, nframes).round().long().tolist()
    factor = patch_size * vp.SPATIAL_MERGE_SIZE
    min_pixels = ele.get("min_pixels", vp.VIDEO_MIN_TOKEN_NUM * factor * factor)
    total_pixels = ele.get("total_pixels", vp.MODEL_SEQ_LEN * factor * factor * 0.9)
    max_pixels = max(min(vp.VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / nframes * vp.FRAME_FACTOR),
                     int(min_pixels * 1.05))
    max_pixels = min(ele.get("max_pixels", max_pixels), max_pixels)
    size = vp.smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return indices, size


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen_vl_utils_mode_equals_qwen_vl_utils(family):
    import qwen_vl_utils.vision_process as vp
    rng = random.Random(f"qvu-{family}")
    vision = BUILTIN_VISION[family]
    checked = 0
    for _ in range(500):
        total, fps, height, width = _random_meta(rng)
        ele = {}
        if rng.random() < 0.4:
            ele.update(rng.choice([{"fps": rng.choice([0.5, 1.0, 4.0])}, {"nframes": rng.choice([2, 5, 8, 16])}]))
        if rng.random() < 0.3:
            ele.update(min_frames=rng.choice([2, 4]), max_frames=rng.choice([8, 64]))
        if rng.random() < 0.3:
            ele.update(max_pixels=rng.choice([64 * 28 * 28, 256 * 28 * 28]), min_pixels=rng.choice([16 * 28 * 28, 4096]))
        if rng.random() < 0.2:
            ele["total_pixels"] = rng.choice([20480 * 28 * 28, 2048 * 28 * 28])
        if rng.random() < 0.3:
            duration = total / fps
            ele.update(video_start=round(rng.uniform(0, duration / 2), 2), video_end=round(rng.uniform(duration / 2, duration * 1.2), 2))
        request = VideoRequest(**ele)
        try:
            want_indices, want_size = _qvu_reference(vp, ele, total, fps, height, width, vision.patch_size)
        except (ValueError, AssertionError):  # qwen-vl-utils refuses this video: so must we
            with pytest.raises(Exception):
                plan(family, total, fps, height, width, request, sampling="qwen-vl-utils")
            continue
        if min(want_size) == 0:  # qwen-vl-utils floors a thin frame to no pixels, which no processor takes
            with pytest.raises(RejectError, match="video_sampling"):
                plan(family, total, fps, height, width, request, sampling="qwen-vl-utils")
            continue
        got = plan(family, total, fps, height, width, request, sampling="qwen-vl-utils")
        assert got.indices.tolist() == want_indices, (total, fps, ele)
        assert (got.height, got.width) == tuple(want_size), (height, width, ele)
        checked += 1
    assert checked > 250


def test_video_patches_to_frames_inverts_frames_to_patches():
    from preprocess.video.patches import resize_frame
    from shards_schema.inspect import video_patches_to_frames

    nprng = np.random.default_rng(9)
    for family in FAMILIES:
        vision = BUILTIN_VISION[family]
        factor = vision.patch_size * vision.merge_size
        for n in (2, 5):
            frames = list(synthetic_video_frames(nprng, n, 97, 61))
            height, width = 2 * factor, 3 * factor
            rows, grid = frames_to_patches(iter(frames), n, height, width, patch_size=vision.patch_size,
                                           merge_size=vision.merge_size, temporal_patch_size=vision.temporal_patch_size)
            back = video_patches_to_frames(rows, grid, vision.patch_size, vision.merge_size, vision.temporal_patch_size)
            resized = [resize_frame(f, height, width).transpose(1, 2, 0) for f in frames]
            resized += [resized[-1]] * (len(back) - n)  # the last temporal patch repeats its last frame
            assert back.shape == (len(resized), height, width, 3)
            assert all(np.array_equal(a, b) for a, b in zip(back, resized))


@pytest.mark.parametrize("family", FAMILIES)
def test_video_fit_samples_fewer_frames_until_the_video_fits(family, builtin_profiles, tmp_path):
    """Without --video-fit a video too long for --max-seq-len alone is `video_too_long`; with it,
    the row is written with fewer frames (the plan HF's processor makes for that `nframes`)."""
    from preprocess.errors import RejectError
    from preprocess.pipeline import SampleOptions, process_row

    media = tmp_path / "media"
    media.mkdir()
    write_video(media / "long.mp4", synthetic_video_frames(np.random.default_rng(4), 120, 320, 240), 30.0)
    row = {"messages": [{"role": "user", "content": [{"type": "video", "video": "long.mp4", "fps": 30},
                                                     {"type": "text", "text": "What happens?"}]},
                        {"role": "assistant", "content": "A bar sweeps."}]}
    profile = builtin_profiles[family]
    options = SampleOptions(media_root=str(media), max_seq_len=2048)
    with pytest.raises(RejectError, match="video_too_long"):
        process_row(row, sample_uid="a", source="x", profile=profile, options=options)
    sample = process_row(row, sample_uid="a", source="x", profile=profile,
                         options=dataclasses.replace(options, video_fit=True))
    assert sample.num_tokens <= 2048
    frames = 2 * int(sample.video_grid_thw[0, 0])
    assert 2 <= frames < 120
    # the fitted video equals what HF computes for that many frames
    with VideoReader(media / "long.mp4") as reader:
        info = reader.info
    want = plan(family, info.total_frames, info.fps, info.height, info.width, VideoRequest(nframes=frames))
    assert sample.video_grid_thw[0].tolist() == list(want.grid)


# ---------------------------------------------------------------------------------------------
# the container's header and the part's options, checked before any frame is decoded


def _forged_index_mp4(path, tmp_path, claimed: int):
    """A 6-frame MP4 whose sample tables claim `claimed` one-byte frames in a single chunk: the
    file holds a fraction of them, and FFmpeg's seeking on such an index takes minutes."""
    import struct

    clip = write_video(tmp_path / "six.mp4", synthetic_video_frames(np.random.default_rng(2), 6, 64, 48), 4.0)
    data = bytearray(clip.read_bytes())

    def box(tag):
        return data.find(tag) - 4

    struct.pack_into(">I", data, box(b"stts") + 16, claimed)  # one run of `claimed` frame durations
    struct.pack_into(">II", data, box(b"stsz") + 12, 1, claimed)  # `claimed` frames of one byte each
    struct.pack_into(">I", data, box(b"stsc") + 20, claimed)  # all in the first chunk
    path.write_bytes(bytes(data))
    return path


def test_the_header_is_checked_before_any_frame_is_decoded(tmp_path):
    """Frames over --max-image-pixels (`frame_too_large`), a still image given as a video (a
    PNG, a GIF of one frame: `not_a_video`), a frame rate under 0.001 fps and an index promising frames the file lacks
    (`bad_video`) are refused from the header: nothing is decoded, nothing seeks."""
    import fractions
    import time

    import av

    clip = write_video(tmp_path / "clip.mp4", synthetic_video_frames(np.random.default_rng(1), 4, 64, 48), 4.0)
    png = tmp_path / "still.png"
    from PIL import Image

    Image.fromarray(np.zeros((48, 64, 3), np.uint8)).save(png)
    still_gif, animated_gif = tmp_path / "still.gif", tmp_path / "animated.gif"
    Image.open(png).save(still_gif)
    frames = [Image.fromarray(frame) for frame in synthetic_video_frames(np.random.default_rng(2), 3, 64, 48)]
    frames[0].save(animated_gif, save_all=True, append_images=frames[1:], duration=100)
    slow = tmp_path / "slow.mkv"
    with av.open(str(slow), "w") as container:
        stream = container.add_stream("mpeg4", rate=fractions.Fraction(1, 5000))  # a frame every 5000 s
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for packet in [*stream.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")),
                       *stream.encode()]:
            container.mux(packet)
    forged = _forged_index_mp4(tmp_path / "forged.mp4", tmp_path, 10**6)
    cases = [(clip, {"max_frame_pixels": 64 * 48 - 1}, "frame_too_large", "64x48 = 3072 pixels"),
             (png, {}, "not_a_video", "still image (png_pipe)"),
             (png.read_bytes(), {}, "not_a_video", "still image"),
             (still_gif, {}, "not_a_video", "still image (gif of one frame)"),
             (still_gif.read_bytes(), {}, "not_a_video", "still image (gif of one frame)"),
             (slow, {}, "bad_video", "0.0002 fps is below 0.001"),
             (forged, {}, "bad_video", "promises 1000000 frames but it holds")]
    with mock.patch.object(VideoReader, "_decoded", side_effect=AssertionError("a frame was decoded")), \
            mock.patch.object(av.container.InputContainer, "seek", side_effect=AssertionError("the reader seeked")):
        for source, kwargs, code, needle in cases:
            started = time.perf_counter()
            with pytest.raises(RejectError) as err:
                VideoReader(source, **kwargs)
            assert err.value.code == code and needle in err.value.message, (source, err.value)
            assert time.perf_counter() - started < 5
    with VideoReader(clip, max_frame_pixels=64 * 48) as reader:  # at the limit: read as usual
        assert reader.info.total_frames == 4
    with VideoReader(animated_gif) as reader:  # an animation is a video
        assert reader.info.total_frames == 3 and len(list(reader.frames([0, 1, 2]))) == 3


def _mpegts_bytes(frames, fps: int = 10) -> bytes:
    import io

    import av

    frames = np.stack(list(frames))
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mpegts") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def test_lists_of_other_files_are_refused_unopened_and_every_frame_size_is_checked(tmp_path):
    """An HLS playlist, a DASH manifest, an FFmpeg concat list and an SDP description name other
    files or streams, which FFmpeg opens while it opens the list (from outside --media-root, or
    a pipe that never ends): each is refused by its first bytes, FFmpeg never called, as is an
    empty file. A stream whose frames grow mid-stream past --max-image-pixels is
    `frame_too_large` at the first such frame, before it is converted; within the limit its
    frames are read at their own sizes (the plan resizes each)."""
    import av

    rng = np.random.default_rng(2)
    (tmp_path / "outside.ts").write_bytes(_mpegts_bytes(synthetic_video_frames(rng, 10, 64, 48)))
    lists = {"clip.m3u8": (b"\xef\xbb\xbf#EXTM3U\n#EXTINF:1.0,\noutside.ts\n#EXT-X-ENDLIST\n", "an HLS playlist"),
             "clip.mpd": (b'<?xml version="1.0"?>\n<MPD xmlns="urn:mpeg:dash:schema:mpd:2011"></MPD>', "a DASH manifest"),
             "clip.txt": (b"ffconcat version 1.0\nfile outside.ts\n", "an FFmpeg concat list"),
             "clip.sdp": (b"v=0\no=- 0 0 IN IP4 127.0.0.1\nm=video 5004 RTP/AVP 96\n", "an SDP session description")}
    with mock.patch.object(av, "open", side_effect=AssertionError("FFmpeg opened it")):
        for name, (data, kind) in lists.items():
            (tmp_path / name).write_bytes(data)
            for source in (tmp_path / name, data):
                with pytest.raises(RejectError) as err:
                    VideoReader(source)
                assert err.value.code == "not_a_video" and f"is {kind}" in err.value.message and \
                    err.value.message.endswith("not a video: give the video file itself"), err.value
    (tmp_path / "empty.mp4").write_bytes(b"")
    for source in (tmp_path / "empty.mp4", b""):
        with pytest.raises(RejectError, match=r"is empty \(0 bytes\)") as err:
            VideoReader(source)
        assert err.value.code == "not_a_video"
    grows = _mpegts_bytes(synthetic_video_frames(rng, 6, 64, 48)) + \
        _mpegts_bytes(synthetic_video_frames(rng, 6, 128, 96))
    with VideoReader(grows, max_frame_pixels=64 * 48) as reader:  # the header and first frame are within it
        assert (reader.info.width, reader.info.height) == (64, 48)
        with pytest.raises(RejectError) as err:
            list(reader.frames(range(reader.info.total_frames)))
    assert err.value.code == "frame_too_large" and "frames of 128x96 = 12288 pixels, over --max-image-pixels 3072" \
        in err.value.message, err.value
    with VideoReader(grows, max_frame_pixels=128 * 96) as reader:  # within it: read, each frame as it decodes
        sizes = [frame.shape[:2] for _, frame in reader.frames(range(reader.info.total_frames))]
    assert sizes[0] == (48, 64) and sizes[-1] == (96, 128), sizes


@pytest.mark.parametrize("family", FAMILIES)
def test_contradicting_bounds_and_the_wrong_kind_of_media_are_named_rejects(family, builtin_profiles, tmp_path):
    """A part's min_pixels over its max_pixels (or over the maximum in force), min_frames over
    max_frames, a video data URI that says image/png, an image data URI that says video/mp4 and
    a PNG file given as a video are each rejected with a reason naming what is wrong."""
    import base64

    from PIL import Image

    from preprocess.pipeline import SampleOptions, process_row

    media = tmp_path / "media"
    media.mkdir()
    clip = write_video(media / "clip.mp4", synthetic_video_frames(np.random.default_rng(3), 6, 64, 48), 4.0)
    Image.fromarray(np.full((48, 64, 3), 90, np.uint8)).save(media / "still.png")
    png_uri = "data:image/png;base64," + base64.b64encode((media / "still.png").read_bytes()).decode()
    video_uri = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()

    def chat(part):
        return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]},
                             {"role": "assistant", "content": "Grey."}]}

    default_max = family_named(family).builtin_video.max_pixels
    cases = [
        ({"type": "video", "video": "clip.mp4", "min_pixels": 9000, "max_pixels": 8000}, "bad_video_option",
         "`min_pixels` 9000 is more than `max_pixels` 8000"),
        ({"type": "video", "video": "clip.mp4", "min_pixels": default_max + 1}, "bad_video_option",
         f"`min_pixels` {default_max + 1} is more than `max_pixels` {default_max}"),
        ({"type": "video", "video": "clip.mp4", "min_frames": 9, "max_frames": 8}, "bad_video_option",
         "`min_frames` 9 is more than `max_frames` 8"),
        ({"type": "video", "video": "clip.mp4", "min_frames": 800}, "bad_video_option",
         "`min_frames` 800 is more than `max_frames` 768"),
        ({"type": "image_url", "image_url": {"url": png_uri}, "min_pixels": 5000, "max_pixels": 4000},
         "bad_image_option", "`min_pixels` 5000 is more than `max_pixels` 4000"),
        ({"type": "image", "image": png_uri, "min_pixels": 10**9}, "bad_image_option",
         f"`min_pixels` 1000000000 is more than `max_pixels` {builtin_profiles[family].vision.max_pixels}"),
        ({"type": "video_url", "video_url": {"url": png_uri}}, "mime_mismatch", "says 'image/png', an image"),
        ({"type": "image_url", "image_url": {"url": video_uri}}, "mime_mismatch", "says 'video/mp4', a video"),
        ({"type": "video", "video": "still.png"}, "not_a_video", "still image"),
    ]
    for part, code, needle in cases:
        with pytest.raises(RejectError) as err:
            process_row(chat(part), sample_uid="u", source="s", profile=builtin_profiles[family],
                        options=SampleOptions(media_root=str(media)))
        assert err.value.code == code and needle in err.value.message, (part, err.value)
    # a maximum under the profile's minimum is no contradiction: the maximum wins, as in HF
    sample = process_row(chat({"type": "video", "video": "clip.mp4", "max_pixels": 1000}), sample_uid="u", source="s",
                         profile=builtin_profiles[family], options=SampleOptions(media_root=str(media)))
    assert sample.video_grid_thw.shape == (1, 3)


def test_an_image_parts_own_pixel_bounds_size_it_as_the_job_wide_bounds_would(family, builtin_profiles, tmp_path):
    """An image part's min_pixels / max_pixels give the sample a job with those --min-pixels /
    --max-pixels gives (HF's image processor called with them)."""
    import base64
    import io

    from PIL import Image

    from preprocess.pipeline import SampleOptions, process_row

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(buf, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    profile = builtin_profiles[family]
    factor = profile.vision.resize_factor

    def chat(**bounds):
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}, **bounds},
                                                          {"type": "text", "text": "What?"}]},
                             {"role": "assistant", "content": "Noise."}]}

    default = process_row(chat(), sample_uid="u", source="s", profile=profile, options=SampleOptions())
    for bounds in ({"max_pixels": 80_000}, {"min_pixels": 400 * factor * factor},
                   {"min_pixels": factor * factor, "max_pixels": 8 * factor * factor}):
        got = process_row(chat(**bounds), sample_uid="u", source="s", profile=profile, options=SampleOptions())
        want = process_row(chat(), sample_uid="u", source="s", options=SampleOptions(),
                           profile=profile.with_pixel_bounds(bounds.get("min_pixels"), bounds.get("max_pixels")))
        assert got.image_grid_thw.tolist() == want.image_grid_thw.tolist() != default.image_grid_thw.tolist()
        assert np.array_equal(got.pixel_patches, want.pixel_patches)
        assert np.array_equal(got.input_ids, want.input_ids) and np.array_equal(got.position_ids, want.position_ids)


def test_a_cut_off_video_file_is_a_damaged_video_naming_the_file(tmp_path, builtin_profiles):
    """An MP4 with its index at the end (as PyAV and FFmpeg write it by default) cut in half or
    cut inside that index, and a Matroska file cut inside its header, are `bad_video` naming the
    file and where it is cut, not `not_a_video` / `no_video_stream`; whole files without a video
    stream (audio-only MP4 and Matroska) stay `no_video_stream`, and text stays `not_a_video`."""
    import av

    from preprocess.pipeline import SampleOptions, process_row

    nprng = np.random.default_rng(4)
    whole = write_video(tmp_path / "whole.mp4", synthetic_video_frames(nprng, 8, 64, 48), 4.0).read_bytes()
    moov = whole.find(b"moov") - 4
    assert whole[:len(whole) // 2].find(b"moov") < 0  # the index is in the half cut off
    mkv = write_video(tmp_path / "whole.mkv", synthetic_video_frames(nprng, 4, 32, 32), 4.0, codec="mpeg4")
    (tmp_path / "half.mp4").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "in_index.mp4").write_bytes(whole[: moov + 40])
    (tmp_path / "head.mkv").write_bytes(mkv.read_bytes()[:16])
    (tmp_path / "text.mp4").write_text("not a video " * 40)
    for name, kind, rate in (("audio.m4a", "aac", 8000), ("audio.mkv", "pcm_s16le", 8000)):
        with av.open(str(tmp_path / name), "w", format="mp4" if name.endswith("m4a") else None) as container:
            stream = container.add_stream(kind, rate=rate)
            samples = np.zeros((1, 1024), np.float32 if kind == "aac" else np.int16)
            frame = av.AudioFrame.from_ndarray(samples, format="fltp" if kind == "aac" else "s16", layout="mono")
            frame.sample_rate = rate
            for packet in [*stream.encode(frame), *stream.encode()]:
                container.mux(packet)
    cases = [
        (tmp_path / "half.mp4", "bad_video", "is a truncated or damaged MP4 / QuickTime file: its `mdat` box at byte"),
        (tmp_path / "in_index.mp4", "bad_video", f"its `moov` box at byte {moov:,} is"),
        (whole[: len(whole) // 2], "bad_video", "video is a truncated or damaged MP4 / QuickTime file"),
        (tmp_path / "head.mkv", "bad_video", "is a truncated or damaged Matroska / WebM file"),
        (tmp_path / "audio.m4a", "no_video_stream", "holds no video stream (streams: audio)"),
        (tmp_path / "audio.mkv", "no_video_stream", "holds no video stream (streams: audio)"),
        (tmp_path / "text.mp4", "not_a_video", "cannot be opened as a video container"),
    ]
    for source, code, needle in cases:
        with pytest.raises(RejectError) as err:
            VideoReader(source)
        assert err.value.code == code and needle in err.value.message, (source, err.value)
        if not isinstance(source, bytes):
            assert f"video file {str(source)!r}" in err.value.message
    row = {"messages": [{"role": "user", "content": [{"type": "video", "video": "half.mp4"}]},
                        {"role": "assistant", "content": "A cut-off clip."}]}
    with pytest.raises(RejectError) as err:
        process_row(row, sample_uid="x", source="x", profile=builtin_profiles["qwen3-vl"],
                    options=SampleOptions(media_root=str(tmp_path)))
    assert err.value.code == "bad_video"
    assert err.value.message.startswith(f"video 0: video file {str((tmp_path / 'half.mp4').resolve())!r} is a truncated")
    assert err.value.message.endswith("download or encode it again")
