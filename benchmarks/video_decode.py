"""Reading the sampled frames of a video: PyAV full decode (what `transformers.video_utils.load_video(
backend="pyav")` does), vlmpack's `VideoReader` (demux once, seek to the keyframe before each
sampled frame) and torchcodec's `VideoDecoder.get_frames_at` (exact seek mode), on the same
generated video in one process, interleaved rounds. Reports ms per video, the ratios and
whether each reader's frames equal PyAV's rgb24 frames, which are the reference's pixels.

    python benchmarks/video_decode.py --seconds 60 --fps 30 --width 1280 --height 720 --gop 60 \\
        --json-out benchmarks/results/video_decode_cpu2_<yyyymmdd>.json
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import add_video_arguments, log, machine_info, parser, write_json

from preprocess.examples import synthetic_video_frames, write_video
from preprocess.video.decode import VideoReader
from preprocess.families.qwen3_vl import hf_qwen3_indices


def read_full_decode(path: Path, indices: list[int]) -> list[np.ndarray]:
    """transformers' pyav reader: decode from the start, keep the sampled frames."""
    import av

    wanted, frames = set(indices), {}
    with av.open(str(path)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i > indices[-1]:
                break
            if i in wanted:
                frames[i] = frame.to_ndarray(format="rgb24")
    return [frames[i] for i in indices]


def read_vlmpack(path: Path, indices: list[int]) -> list[np.ndarray]:
    with VideoReader(path) as reader:
        return [frame for _, frame in reader.frames(indices)]


def read_torchcodec(path: Path, indices: list[int]) -> list[np.ndarray]:
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(str(path), seek_mode="exact", num_ffmpeg_threads=1)
    frames = decoder.get_frames_at(indices=indices).data  # [N, C, H, W] uint8
    return [f.permute(1, 2, 0).numpy() for f in frames]


READERS = {"pyav_full_decode": read_full_decode, "vlmpack": read_vlmpack, "torchcodec": read_torchcodec}


def main() -> None:
    p = parser(__doc__)
    add_video_arguments(p, seconds=20.0)
    p.add_argument("--gop", type=int, default=60, help="keyframe interval in frames")
    p.add_argument("--sample-fps", type=float, default=2.0, help="frames sampled per second (Qwen3-VL's default)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        frames_total = int(args.seconds * args.fps)
        t0 = time.perf_counter()
        path = write_video(Path(tmp) / "clip.mp4", synthetic_video_frames(np.random.default_rng(0), frames_total,
                                                                          args.width, args.height),
                           args.fps, gop=args.gop)
        log(f"video: {frames_total} frames {args.width}x{args.height} @ {args.fps:g} fps, gop {args.gop}, "
            f"{path.stat().st_size / 2**20:.1f} MiB (encoded in {time.perf_counter() - t0:.1f} s)")
        indices = hf_qwen3_indices(frames_total, args.fps, args.sample_fps, None, 4, 768).tolist()
        reference = read_full_decode(path, indices)
        results = {}
        for name, read in READERS.items():
            try:
                frames = read(path, indices)
            except Exception as exc:  # e.g. torchcodec without FFmpeg libraries
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                log(f"{name}: unavailable ({results[name]['error']})")
                continue
            diff = max(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) for a, b in zip(frames, reference))
            results[name] = {"frames_equal_reference": diff == 0, "max_abs_diff": diff, "seconds": []}
        for _ in range(args.rounds):
            for name, read in READERS.items():
                if "seconds" in results[name]:
                    t0 = time.perf_counter()
                    read(path, indices)
                    results[name]["seconds"].append(time.perf_counter() - t0)
        for name in READERS:
            r = results[name]
            if "seconds" in r:
                r["ms_median"] = 1000 * statistics.median(r["seconds"])
                log(f"{name}: {r['ms_median']:.0f} ms, frames equal the reference: {r['frames_equal_reference']} "
                    f"(max |diff| {r['max_abs_diff']})")
        base = results["pyav_full_decode"]["ms_median"]
        for name in READERS:
            if "ms_median" in results[name]:
                results[name]["speedup_vs_full_decode"] = base / results[name]["ms_median"]
        out = {"benchmark": "video_decode", "machine": machine_info(), "settings": vars(args) | {"sampled": len(indices)},
               "results": results}
        log(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "seconds"} for k, v in results.items()}))
        if args.json_out:
            write_json(args.json_out, out)


if __name__ == "__main__":
    main()
