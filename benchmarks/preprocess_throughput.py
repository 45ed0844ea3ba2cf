"""Preprocessing throughput and storage, side by side with the Hugging Face path, same inputs, one run.

Per core (one process, interleaved rounds so machine noise hits all paths alike):
  hf     : json row -> apply_chat_template (official template) -> load_image (base64 decode,
           EXIF, RGB) -> Qwen2VLImageProcessorPil -> expand image pads -> tokenize
  vlmpack: json row -> preprocess.pipeline.process_row (render, decode, resize, patchify,
           tokenize, masks, M-RoPE positions)
  floor  : base64 decode + PIL decode + bicubic resize to the same size, nothing else
Storage: shard bytes per visual token vs HF's float32 pixel_values per visual token.
Scaling: the full `vlmpack preprocess` job with 1 worker vs all cores.

    python benchmarks/preprocess_throughput.py --rows 300 --size 500 \
        --json-out benchmarks/results/preprocess_throughput_<device>_<yyyymmdd>.json
"""

from __future__ import annotations

import base64
import io
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, machine_info, parser, write_json
from PIL import Image

from preprocess.examples import encode_data_uri, synthetic_image, write_jsonl
from preprocess.images import smart_resize
from preprocess.job import PreprocessConfig, run_preprocess
from preprocess.pipeline import SampleOptions, process_row
from preprocess.profiles import builtin_profile

FIXTURES = REPO / "tests" / "fixtures"
TEMPLATE_FILE = {"qwen3-vl": "qwen3_vl_instruct.chat_template.jinja", "qwen2.5-vl": "qwen2_5_vl_instruct.chat_template.jinja"}


def make_rows(n: int, size: int, seed: int, min_size: int | None = None) -> list[dict]:
    """Single-image photo-sized conversations (JPEG, ~size px on the long side, or each side
    uniform in [min_size, size]), like captioning/VQA data."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        if min_size:
            w, h = (int(rng.uniform(min_size, size)) for _ in range(2))
        else:
            w = int(size * rng.uniform(0.75, 1.0))
            h = int(size * rng.uniform(0.6, 1.0))
        uri = encode_data_uri(synthetic_image(rng, w, h), "JPEG")
        rows.append({"id": f"r{i}", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "Describe the image in detail."}]},
            {"role": "assistant", "content": "The image shows a gradient background with several coloured shapes. " * 3},
        ]})
    return rows


def hf_path(profile, template: str):
    from transformers import AutoTokenizer
    from transformers.image_utils import load_image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tmp = Path(tempfile.mkdtemp())
    (tmp / "tokenizer.json").write_text(profile.tokenizer_json, encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp))
    v = profile.vision
    processor = Qwen2VLImageProcessorPil(patch_size=v.patch_size, merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size,
                                         image_mean=list(v.image_mean), image_std=list(v.image_std),
                                         min_pixels=v.min_pixels, max_pixels=v.max_pixels)

    def run(line: str):
        row = json.loads(line)
        text = tokenizer.apply_chat_template(row["messages"], chat_template=template, tokenize=False)
        urls = [p["image_url"]["url"] for m in row["messages"] if isinstance(m["content"], list) for p in m["content"] if "image_url" in p]
        features = processor(images=[load_image(u) for u in urls], return_tensors="np")
        for g in features["image_grid_thw"]:
            text = text.replace("<|image_pad|>", "<|placeholder|>" * int(g.prod() // v.merge_size**2), 1)
        ids = tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"), add_special_tokens=False)["input_ids"]
        return ids, features["pixel_values"]

    return run


def vlmpack_path(profile):
    options = SampleOptions()

    def run(line: str):
        return process_row(json.loads(line), sample_uid="x", source="x", profile=profile, options=options)

    return run


def floor_path(profile):
    v = profile.vision

    def run(line: str):
        row = json.loads(line)
        for m in row["messages"]:
            for p in m["content"] if isinstance(m["content"], list) else []:
                if "image_url" in p:
                    img = Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
                    img.load()
                    h, w = smart_resize(img.height, img.width, v.resize_factor, v.min_pixels, v.max_pixels)
                    img.convert("RGB").resize((w, h), Image.Resampling.BICUBIC)

    return run


_FLOOR = {}


def _floor_init(profile_name: str, lines_path: str) -> None:
    _FLOOR["run"] = floor_path(builtin_profile(profile_name))
    _FLOOR["lines"] = Path(lines_path).read_text(encoding="utf-8").splitlines()


def _floor_one(index: int) -> None:
    _FLOOR["run"](_FLOOR["lines"][index])


def parallel_floor_rows_per_s(profile_name: str, lines_path: Path, distinct: int, total: int, workers: int) -> float:
    """The machine's own parallel ceiling: decode+resize alone in `workers` warm processes. Each
    worker reads the distinct rows from `lines_path` and gets row indices only, so the parent's
    pipe carries no image bytes (as in the job, whose workers read their own rows)."""
    order = [i % distinct for i in range(total)]
    with mp.get_context("spawn").Pool(workers, initializer=_floor_init, initargs=(profile_name, str(lines_path))) as pool:
        pool.map(_floor_one, order[: 2 * workers], chunksize=1)
        t0 = time.perf_counter()
        pool.map(_floor_one, order, chunksize=4)
        return total / (time.perf_counter() - t0)


def per_sample_ms(fn, lines: list[str], rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for line in lines:
            fn(line)
        times.append((time.perf_counter() - t0) / len(lines) * 1e3)
    return times


def main() -> int:
    ap = parser(__doc__, json_out="the report and the machine as JSON")
    ap.add_argument("--profile", default="qwen3-vl", choices=sorted(TEMPLATE_FILE), help="built-in profile")
    ap.add_argument("--rows", type=int, default=300, help="conversations timed per path")
    ap.add_argument("--size", type=int, default=500, help="long side of the images in pixels")
    ap.add_argument("--min-size", type=int, default=None,
                    help="draw each side uniformly from [--min-size, --size] instead (e.g. 300 with --size 900)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the rows")
    ap.add_argument("--workers", default=f"1,{os.cpu_count()}", help="worker counts for the scaling run, comma separated")
    ap.add_argument("--job-rows", type=int, default=2000, help="rows of the scaling job")
    ap.add_argument("--work-dir", default=None, help="scratch directory (e.g. /dev/shm)")
    ap.add_argument("--template", default=None, help="official chat template file (default: tests/fixtures)")
    args = ap.parse_args()

    profile = builtin_profile(args.profile)
    template = Path(args.template or FIXTURES / TEMPLATE_FILE[args.profile]).read_text(encoding="utf-8")
    rows = make_rows(args.rows, args.size, seed=0, min_size=args.min_size)
    lines = [json.dumps(r) for r in rows]
    paths = {"hf": hf_path(profile, template), "vlmpack": vlmpack_path(profile), "floor": floor_path(profile)}
    for fn in paths.values():  # warm up (imports, caches)
        for line in lines[:5]:
            fn(line)
    timings = {name: [] for name in paths}
    for _ in range(args.rounds):  # interleave the paths round by round
        for name, fn in paths.items():
            timings[name] += per_sample_ms(fn, lines, 1)
    ms = {name: statistics.median(t) for name, t in timings.items()}

    # Storage and scaling: the real job on the same rows (repeated to --job-rows so every worker
    # has many units). Outputs are deleted after each run; shard checksums are compared.
    work = Path(tempfile.mkdtemp(dir=args.work_dir))
    worker_counts = sorted({1, *(int(w) for w in args.workers.split(","))})
    job_rows = [rows[i % len(rows)] for i in range(max(args.job_rows, len(rows)))]
    data = write_jsonl(work / "rows.jsonl", job_rows)
    # 8 units per worker of the largest pool, rounded up: a ninth round of one left-over unit would
    # time the job's tail, not its throughput
    rows_per_shard = -(-len(job_rows) // (8 * worker_counts[-1]))
    jobs = {}
    for workers in worker_counts:
        out = work / f"out{workers}"
        cfg = PreprocessConfig(inputs=[str(data)], out=str(out), profile=args.profile,
                               workers=workers, rows_per_shard=rows_per_shard, progress=False)
        t0 = time.perf_counter()
        manifest = run_preprocess(cfg)
        jobs[workers] = (time.perf_counter() - t0, manifest)
        shutil.rmtree(out)
    distinct = write_jsonl(work / "distinct.jsonl", rows)
    floor_rate = {w: parallel_floor_rows_per_s(args.profile, distinct, len(rows), len(job_rows), w) for w in worker_counts}
    totals = jobs[1][1]["totals"]
    v = profile.vision
    visual_tokens = totals["patches"] // v.merge_size**2
    ours_bytes = totals["bytes"] / visual_tokens
    pixel_bytes = v.patch_row_width * v.merge_size**2
    hf_bytes = 4 * v.pixel_values_row_width * v.merge_size**2
    same = all(m["shards"] == jobs[1][1]["shards"] for _, m in jobs.values())
    t1 = jobs[1][0]
    # One worker as a user runs it: `vlmpack preprocess --workers 1` with the default shard size
    # (in-process, so no interpreter start-up): setup (profile, input scan), the units phase per
    # row and the tail (records, manifest), against the floor per row measured above.
    out = work / "out_default"
    cfg = PreprocessConfig(inputs=[str(data)], out=str(out), profile=args.profile, workers=1, progress=False)
    t0, cpu0 = time.perf_counter(), time.process_time()
    run1 = run_preprocess(cfg)["_run"]
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    shutil.rmtree(work)
    per_row_ms = run1["seconds"] / len(job_rows) * 1e3
    one_worker = {
        "setup_seconds": run1["setup_seconds"], "units_seconds": run1["seconds"],
        "tail_seconds": total - run1["setup_seconds"] - run1["seconds"], "total_seconds": total,
        "units_ms_per_row": per_row_ms, "floor_ms_per_row": ms["floor"], "ratio_to_floor": per_row_ms / ms["floor"],
        "cpu_ms_per_row": (cpu - run1["setup_seconds"]) / len(job_rows) * 1e3,  # the writer thread's included
    }

    report = {
        "machine": machine_info("cpu"),
        "profile": args.profile, "rows": args.rows, "image_long_side": args.size, "cpu_count": os.cpu_count(),
        "ms_per_sample": ms,
        "speedup_vs_hf": ms["hf"] / ms["vlmpack"],
        "ratio_to_floor": ms["vlmpack"] / ms["floor"],
        "shard_bytes_per_visual_token": ours_bytes,
        "hf_float32_bytes_per_visual_token": hf_bytes,
        "bytes_reduction": hf_bytes / ours_bytes,
        "pixel_bytes_per_visual_token": pixel_bytes,
        "job_rows": len(job_rows),
        "one_worker_job": one_worker,
        "job_rows_per_s": {w: len(job_rows) / t for w, (t, _) in jobs.items()},
        "scaling_efficiency": {w: (t1 / t) / w for w, (t, _) in jobs.items()},
        "floor_rows_per_s": floor_rate,
        "floor_scaling_efficiency": {w: floor_rate[w] / floor_rate[1] / w for w in worker_counts},
        "job_vs_parallel_floor": {w: report_rate / floor_rate[w] for w, report_rate in ((w, len(job_rows) / t) for w, (t, _) in jobs.items())},
        # where the wall time of each job went: setup (serial), units phase, and the summed
        # in-worker unit time (if unit_seconds / workers << units phase, the gap is pool start/tail)
        "job_phases": {w: {k: m["_run"][k] for k in ("setup_seconds", "seconds", "unit_seconds")} for w, (_, m) in jobs.items()},
        "byte_identical_across_worker_counts": same,
    }
    print(f"{'path':<10}{'ms/sample':>12}")
    for name in paths:
        print(f"{name:<10}{ms[name]:>12.2f}")
    print(f"vlmpack is {report['speedup_vs_hf']:.2f}x the HF path per core, {report['ratio_to_floor']:.2f}x the decode+resize floor")
    print(f"bytes per visual token: {ours_bytes:,.0f} (whole shard: pixels, ids, masks, positions) / {pixel_bytes:,} "
          f"(pixels alone) vs {hf_bytes:,} (HF float32 pixel_values): {report['bytes_reduction']:.2f}x / "
          f"{hf_bytes / pixel_bytes:.2f}x fewer")
    print(f"job with 1 worker, default shard size, {len(job_rows)} rows: setup {one_worker['setup_seconds']:.2f} s | units "
          f"{one_worker['units_seconds']:.2f} s = {per_row_ms:.2f} ms/row = {one_worker['ratio_to_floor']:.2f}x the "
          f"floor's {ms['floor']:.2f} ms/row (CPU {one_worker['cpu_ms_per_row']:.2f} ms/row) | tail "
          f"{one_worker['tail_seconds']:.2f} s")
    for w, rate in report["job_rows_per_s"].items():
        print(f"job with {w:>2} worker(s): {rate:8.1f} rows/s, speed-up {rate / report['job_rows_per_s'][1]:5.2f}x, "
              f"efficiency {report['scaling_efficiency'][w]:.0%} | decode+resize alone: {floor_rate[w]:8.1f} rows/s, "
              f"efficiency {report['floor_scaling_efficiency'][w]:.0%} | job/floor {report['job_vs_parallel_floor'][w]:.2f}")
    for w, ph in report["job_phases"].items():
        print(f"  {w:>2} worker(s): setup {ph['setup_seconds']:.1f} s, units phase {ph['seconds']:.1f} s, "
              f"in-worker unit time {ph['unit_seconds']:.1f} s ({ph['unit_seconds'] / w:.1f} s per worker)")
    print(f"shards byte-identical across worker counts: {same}")
    if args.json_out:
        write_json(args.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
