"""Peak memory of one worker on a long video, vlmpack against the HF path, and the bytes each
visual token costs on disk against HF's float32 `pixel_values_videos`.

A long H.264 video is generated (default 10 minutes of 1080p at 30 fps: a drifting gradient
and a sweeping bar, CRF 28, keyframe every 250 frames). Each path runs in a fresh Python
process on it, with the Qwen3-VL defaults (2 fps, at most 768 frames, the whole clip's pixel
budget), and the process's peak resident memory (`ru_maxrss`) is reported next to the same
interpreter with the same imports and no video (the import floor):

* vlmpack: `vlmpack preprocess` of one row holding the video (`--workers 1`, the row is
  processed in that process): demux once, seek to each sampled frame, one decoded frame held,
  each frame resized and cut into uint8 rows as it arrives; writes the shard directory.
* HF (pyav): the family's HF video processor handed the path, decoding through
  `transformers.video_utils.load_video(backend="pyav")` with the processor's own frame
  sampling: every frame is decoded up to the last sampled one, the sampled ones are kept at
  full resolution, stacked, then resized and normalised to float32 `pixel_values_videos`.
* HF (torchcodec, HF's default decoder), where torchcodec runs (it needs system FFmpeg).

Bytes per visual token: the shard directory's bytes and its video_patches bytes per merged
video token, against `pixel_values_videos.nbytes` per token.

    python benchmarks/video_memory.py --json-out benchmarks/results/video_memory_cpu2_<yyyymmdd>.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
from common import REPO, log, machine_info, parser, write_json

FAMILY = "qwen3-vl"

IMPORTS = "import numpy, torch, av, transformers, preprocess.pipeline, preprocess.video.decode\n"

# Each child prints one JSON line: its own peak RSS (KiB, Linux ru_maxrss) and what it made.
CHILD_HEADER = textwrap.dedent("""
    import json, resource, sys, time
    sys.path.insert(0, {repo!r})
    """)

FLOOR = IMPORTS + "print(json.dumps({'peak_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))\n"

HF_PATH = IMPORTS + textwrap.dedent("""
    from transformers.video_utils import load_video
    from shards_schema.builtin import BUILTIN_VISION, QWEN3_VL_VIDEO
    from transformers import Qwen3VLVideoProcessor
    vision, video = BUILTIN_VISION["qwen3-vl"], QWEN3_VL_VIDEO
    processor = Qwen3VLVideoProcessor(size={{"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels}},
                                      patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                      merge_size=vision.merge_size, image_mean=list(video.image_mean),
                                      image_std=list(video.image_std), fps=video.fps, do_sample_frames=True)
    backend = {backend!r}
    # HF's own flow for a video path (fetch_videos with the processor's sampling), on the named backend
    processor.fetch_videos = lambda url, sample_indices_fn=None: (lambda v, m: ([v], [m]))(
        *load_video(url[0] if isinstance(url, list) else url, backend=backend, sample_indices_fn=sample_indices_fn))
    t0 = time.perf_counter()
    out = processor(videos=[{path!r}], return_tensors="pt", cap_pixels_per_frame=False)
    seconds = time.perf_counter() - t0
    values, grid = out["pixel_values_videos"], out["video_grid_thw"]
    print(json.dumps({{"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "seconds": seconds,
                      "grid": grid[0].tolist(), "pixel_values_videos_bytes": values.numel() * values.element_size(),
                      "tokens": int(grid.prod()) // vision.merge_size ** 2}}))
    """)

VLMPACK_PATH = IMPORTS + textwrap.dedent("""
    from preprocess.job import PreprocessConfig, run_preprocess
    from preprocess.pipeline import SampleOptions
    t0 = time.perf_counter()
    manifest = run_preprocess(PreprocessConfig(inputs=[{rows!r}], out={out!r}, workers=1, progress=False,
                                               sample=SampleOptions(media_root={media!r}, max_seq_len=262144)))
    seconds = time.perf_counter() - t0
    print(json.dumps({{"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "seconds": seconds,
                      "written": manifest["accounting"]["rows_written"],
                      "rejects": manifest["accounting"]["rejects_by_reason"]}}))
    """)


def make_video(path: Path, seconds: float, width: int, height: int, fps: float, gop: int) -> dict:
    """A drifting gradient and a sweeping bar, encoded as it is made (one frame in memory)."""
    import fractions

    import av

    yy, xx = np.mgrid[0:height, 0:2 * width]
    canvas = np.stack([127 + 120 * np.sin(xx / 97.0), 127 + 120 * np.sin(yy / 53.0 + xx / 300.0),
                       127 + 120 * np.sin((xx + yy) / 151.0)], axis=-1).astype(np.uint8)
    frames = int(round(seconds * fps))
    started = time.perf_counter()
    with av.open(str(path), mode="w", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=fractions.Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "28"}
        stream.codec_context.gop_size = gop
        for k in range(frames):
            offset = (k * 7) % width
            frame = np.ascontiguousarray(canvas[:, offset:offset + width])
            bar = (k * 13) % width
            frame[:, bar:bar + 8] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return {"frames": frames, "bytes": path.stat().st_size, "encode_s": time.perf_counter() - started}


def run_child(body: str) -> dict:
    code = CHILD_HEADER.format(repo=str(REPO)) + body
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def torchcodec_usable() -> bool:
    try:
        from transformers.utils.import_utils import is_torchcodec_usable
        return bool(is_torchcodec_usable(decode="video"))
    except Exception:  # noqa: BLE001 - any failure to load it means it does not run here
        return False


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--minutes", type=float, default=10.0, help="video length (default %(default)s)")
    ap.add_argument("--width", type=int, default=1920, help="video width (default %(default)s)")
    ap.add_argument("--height", type=int, default=1080, help="video height (default %(default)s)")
    ap.add_argument("--fps", type=float, default=30.0, help="video frame rate (default %(default)s)")
    ap.add_argument("--gop", type=int, default=250, help="keyframe interval in frames (default %(default)s)")
    ap.add_argument("--work-dir", default=None, help="where the video and the shards go (default: a temp dir)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        media = work / "media"
        media.mkdir(parents=True, exist_ok=True)
        video_path = media / "long.mp4"
        log(f"encoding {args.minutes:g} min of {args.width}x{args.height} at {args.fps:g} fps ...")
        video = make_video(video_path, args.minutes * 60, args.width, args.height, args.fps, args.gop)
        log(f"video: {video['frames']} frames, {video['bytes'] / 2**20:.1f} MiB, encoded in {video['encode_s']:.0f} s")
        rows = work / "rows.jsonl"
        rows.write_text(json.dumps({"id": "long", "messages": [
            {"role": "user", "content": [{"type": "video", "video": "long.mp4"}, {"type": "text", "text": "Describe."}]},
            {"role": "assistant", "content": "A gradient drifts while a bar sweeps."}]}) + "\n")

        results = {"floor": run_child(FLOOR)}
        log(f"import floor: {results['floor']['peak_kib'] / 2**20:.2f} GiB")
        shards = work / "shards"
        results["vlmpack"] = run_child(VLMPACK_PATH.format(rows=str(rows), out=str(shards), media=str(media)))
        log(f"vlmpack: peak {results['vlmpack']['peak_kib'] / 2**20:.2f} GiB in {results['vlmpack']['seconds']:.1f} s")
        backends = ["pyav"] + (["torchcodec"] if torchcodec_usable() else [])
        for backend in backends:
            results[f"hf_{backend}"] = run_child(HF_PATH.format(path=str(video_path), backend=backend))
            r = results[f"hf_{backend}"]
            log(f"HF ({backend}): peak {r['peak_kib'] / 2**20:.2f} GiB in {r['seconds']:.1f} s, grid {r['grid']}")

        from shards_schema import open_shards

        opened = open_shards(shards)
        sample = opened[0]
        merge = opened.manifest["profile"]["vision"]["merge_size"]
        grid = sample["video_grid_thw"][0].tolist()
        tokens = int(np.prod(grid)) // merge ** 2
        shard_bytes = sum(p.stat().st_size for p in shards.glob("*.arrow"))
        hf = results["hf_pyav"]
        disk = {"video_tokens": tokens, "grid": grid, "grid_equals_hf": grid == hf["grid"],
                "video_patches_bytes_per_token": sample["video_patches"].nbytes / tokens,
                "shard_bytes_per_token": shard_bytes / tokens,
                "hf_pixel_values_videos_bytes_per_token": hf["pixel_values_videos_bytes"] / hf["tokens"]}
        disk["hf_over_shard"] = disk["hf_pixel_values_videos_bytes_per_token"] / disk["shard_bytes_per_token"]

    floor = results["floor"]["peak_kib"]
    # (each child's "seconds" times different spans: the whole job for vlmpack, the processor call for HF;
    # speed is benchmarks/video_preprocess.py's business)
    summary = {name: {"peak_gib": r["peak_kib"] / 2**20, "above_floor_gib": (r["peak_kib"] - floor) / 2**20}
               for name, r in results.items()}
    for name in summary:
        if name.startswith("hf_"):
            summary[name]["above_floor_over_vlmpack"] = (summary[name]["above_floor_gib"]
                                                         / summary["vlmpack"]["above_floor_gib"])
    print(f"\n{args.minutes:g} min {args.width}x{args.height} @ {args.fps:g} fps, {video['frames']} frames, grid {grid} "
          f"({tokens} video tokens)")
    print(f"{'path':16s} {'peak GiB':>9s} {'above imports':>14s}")
    for name, s in summary.items():
        print(f"{name:16s} {s['peak_gib']:9.2f} {s['above_floor_gib']:14.2f}")
    print(f"bytes/video token: shard {disk['shard_bytes_per_token']:,.0f} (video_patches "
          f"{disk['video_patches_bytes_per_token']:,.0f}), HF float32 {disk['hf_pixel_values_videos_bytes_per_token']:,.0f}"
          f" -> {disk['hf_over_shard']:.2f}x smaller")
    if args.json_out:
        write_json(args.json_out, {"machine": machine_info("cpu"), "video": {**video, "minutes": args.minutes,
                   "width": args.width, "height": args.height, "fps": args.fps, "gop": args.gop},
                   "results": results, "summary": summary, "disk": disk})
        log(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
