"""Video preprocessing per core: the HF path, vlmpack's, and the floor, on the same videos in
one process, interleaved rounds.

* HF: what users run today: `transformers.video_utils.load_video(path, backend="pyav")` (the
  whole stream decoded, every frame kept) and the family's HF video processor (sampling,
  torchvision resize, normalise, patchify) -> float32 `pixel_values_videos`;
* vlmpack: open + plan (`open_video_source`, `plan_video`), decode the sampled frames
  (`VideoReader`), resize and cut into uint8 rows (`frames_to_patches`): what a shard stores;
* floor: decode the sampled frames + the bicubic resize alone, which bit-exact output needs.

    python benchmarks/video_preprocess.py --videos 4 --seconds 10 --json-out benchmarks/results/video_preprocess_cpu2_<yyyymmdd>.json
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import add_video_arguments, log, machine_info, parser, write_json

from preprocess.examples import synthetic_video_frames, write_video
from preprocess.families import family_named
from preprocess.video import VideoOptions, VideoRequest, plan_video
from preprocess.video.decode import VideoReader
from preprocess.video.patches import frames_to_patches, resize_frame
from shards_schema.builtin import BUILTIN_VISION

FAMILY = "qwen3-vl"


def hf_processor():
    from transformers import Qwen3VLVideoProcessor

    vision, video = BUILTIN_VISION[FAMILY], family_named(FAMILY).builtin_video
    return Qwen3VLVideoProcessor(size={"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels},
                                 patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                 merge_size=vision.merge_size, image_mean=list(video.image_mean),
                                 image_std=list(video.image_std), fps=video.fps, do_sample_frames=True)


def run_hf(path: Path, processor) -> int:
    from transformers.video_utils import load_video

    frames, meta = load_video(str(path), backend="pyav",
                              sample_indices_fn=lambda metadata, **kw: np.arange(metadata.total_num_frames))
    out = processor(videos=[frames], video_metadata=[meta], return_tensors="pt", cap_pixels_per_frame=False)
    return int(out["pixel_values_videos"].shape[0])


def _plan(reader: VideoReader):
    vision, info = BUILTIN_VISION[FAMILY], reader.info
    return plan_video(info.total_frames, info.fps, info.height, info.width, request=VideoRequest(),
                      options=VideoOptions(), family=family_named(FAMILY), defaults=family_named(FAMILY).builtin_video,
                      patch_size=vision.patch_size, merge_size=vision.merge_size,
                      temporal_patch_size=vision.temporal_patch_size)


def run_vlmpack(path: Path) -> int:
    vision = BUILTIN_VISION[FAMILY]
    with VideoReader(path) as reader:
        plan = _plan(reader)
        rows, _ = frames_to_patches((f for _, f in reader.frames(plan.indices)), len(plan.indices), plan.height,
                                    plan.width, patch_size=vision.patch_size, merge_size=vision.merge_size,
                                    temporal_patch_size=vision.temporal_patch_size)
    return rows.shape[0]


def run_floor(path: Path) -> int:
    with VideoReader(path) as reader:
        plan = _plan(reader)
        return sum(resize_frame(f, plan.height, plan.width).shape[0] for _, f in reader.frames(plan.indices))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--videos", type=int, default=4, help="generated videos")
    add_video_arguments(p, seconds=10.0)
    args = p.parse_args()
    torch.set_num_threads(1)  # per core, like one preprocessing worker

    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        paths = [write_video(Path(tmp) / f"v{k}.mp4", synthetic_video_frames(rng, int(args.seconds * args.fps),
                                                                             args.width, args.height), args.fps, gop=60)
                 for k in range(args.videos)]
        log(f"{args.videos} videos of {args.seconds:g} s, {args.width}x{args.height} @ {args.fps:g} fps")
        processor = hf_processor()
        paths_run = {"hf": lambda path: run_hf(path, processor), "vlmpack": run_vlmpack, "floor": run_floor}
        seconds = {name: [] for name in paths_run}
        patches = {name: fn(paths[0]) for name, fn in paths_run.items()}  # warm-up (imports, kernels)
        for _ in range(args.rounds):
            for name, fn in paths_run.items():
                t0 = time.perf_counter()
                for path in paths:
                    fn(path)
                seconds[name].append((time.perf_counter() - t0) / len(paths))
        ms = {name: 1000 * statistics.median(v) for name, v in seconds.items()}
        result = {"ms_per_video": ms, "hf_over_vlmpack": ms["hf"] / ms["vlmpack"],
                  "vlmpack_over_floor": ms["vlmpack"] / ms["floor"], "patches_per_video": patches["vlmpack"],
                  "hf_patches_per_video": patches["hf"]}
        log(f"ms per video: HF {ms['hf']:.0f}, vlmpack {ms['vlmpack']:.0f}, floor {ms['floor']:.0f}; "
            f"vlmpack {result['hf_over_vlmpack']:.2f}x faster than HF, {result['vlmpack_over_floor']:.2f}x the floor")
        if args.json_out:
            write_json(args.json_out, {"benchmark": "video_preprocess", "machine": machine_info(),
                                       "settings": vars(args), "result": result, "seconds": seconds})


if __name__ == "__main__":
    main()
