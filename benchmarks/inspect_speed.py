"""How fast `vlmpack inspect` (and `show --uid`) is on a million-sample shard directory.

The directory is synthesized cheaply, with the real writer: tiny `shards_schema.schema.Sample`s
(8-256 tokens, 0-3 images of a 2x2..6x6 patch grid, a tail of target tokens) written by
`ShardWriter` into a few large shards, plus a manifest from `build_manifest`. Token values and
pixels are zeros (inspect never reads them) and the profile is the built-in qwen3-vl one with
patch_size 2 (12-byte patch rows), so a million samples take well under a GiB and about a
minute to build. Built once under --dir and reused while its manifest exists.

Timed (page cache warm: the directory was just written or read):
  inspect_shards(DIR)                  in-process library call (first call, then best of 3)
    of which open + sample_stats        manifest, memory maps, list offsets, num_target_tokens
  format_report                         the terminal text with histograms
  vlmpack inspect DIR --json / text     whole CLI in a fresh process (Python start + imports)
  vlmpack inspect DIR --plots OUT       + matplotlib charts and report.html
  vlmpack show DIR --uid <last uid>     uid scan over every row + tokenizer load + decode

    python benchmarks/inspect_speed.py --samples 1000000 --shards 4 \
        --json-out benchmarks/results/inspect_speed_<device>_<yyyymmdd>.json
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
from common import machine_info, parser, write_json

from preprocess.profiles import builtin_profile
from shards_schema import open_shards
from shards_schema.atomic import write_json_atomic
from shards_schema.inspect import format_report, inspect_shards
from shards_schema.manifest import MANIFEST_NAME, REJECTS_NAME, build_manifest
from shards_schema.schema import Sample
from shards_schema.writer import ShardWriter

PATCH_SIZE, MERGE = 2, 2
MAX_TOKENS = 256


def synthetic_profile() -> dict:
    fp = json.loads(json.dumps(builtin_profile("qwen3-vl").fingerprint))
    fp["vision"]["patch_size"] = PATCH_SIZE
    fp["id"] = "synthetic-" + fp["id"][:6]
    return fp


def build(directory: Path, samples: int, shards: int, seed: int = 0) -> float:
    """Write `samples` tiny samples into `shards` shard files + manifest.json; returns seconds."""
    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    width = 3 * PATCH_SIZE * PATCH_SIZE
    rng = np.random.default_rng(seed)
    # per-sample sizes, vectorised; every array below is a view into one of these buffers
    lengths = np.clip(rng.lognormal(np.log(48), 0.6, samples).astype(np.int64), 8, MAX_TOKENS)
    targets = np.maximum(1, (lengths * rng.uniform(0.05, 0.6, samples)).astype(np.int64))
    n_images = rng.choice(4, size=samples, p=[0.3, 0.5, 0.15, 0.05])
    sides = rng.integers(1, 4, size=(samples, 3, 2)) * MERGE  # per image: h, w in patches
    ids = np.zeros(MAX_TOKENS, np.int32)
    positions = np.zeros((3, MAX_TOKENS), np.int32)
    mask_tail = np.concatenate([np.zeros(MAX_TOKENS, np.uint8), np.ones(MAX_TOKENS, np.uint8)])
    pixels = np.zeros((3 * 36, width), np.uint8)
    bounds = np.linspace(0, samples, shards + 1).astype(np.int64)
    infos = []
    for k in range(shards):
        writer = ShardWriter(directory / f"shard-{k:06d}.arrow", width)
        for i in range(int(bounds[k]), int(bounds[k + 1])):
            L, T, K = int(lengths[i]), int(targets[i]), int(n_images[i])
            grid = np.ones((K, 3), np.int32)
            grid[:, 1:] = sides[i, :K]
            writer.add(Sample(
                sample_uid=f"synthetic-{i:08d}",
                source=f"synthetic.jsonl:{i}",
                input_ids=ids[:L],
                loss_mask=mask_tail[MAX_TOKENS - (L - T) : MAX_TOKENS + T],
                position_ids=positions[:, :L],
                pixel_patches=pixels[: int(grid.prod(axis=1).sum())],
                image_grid_thw=grid,
            ))
        infos.append(writer.close().to_json())
    rejected = samples // 1000  # pretend accounting: 0.1% rejected, two reasons
    by_reason = {"bad_base64": rejected - rejected // 3, "too_long": rejected // 3}
    with open(directory / REJECTS_NAME, "w", encoding="utf-8") as fh:
        for j, (code, count) in enumerate(by_reason.items()):
            for r in range(count):
                fh.write(json.dumps({"source": "synthetic.jsonl", "row": samples + 2 * r + j, "code": code,
                                     "reason": f"synthetic {code} reject"}) + "\n")
    manifest = build_manifest(
        profile=synthetic_profile(),
        settings={"synthetic": True, "samples": samples},
        shards=infos,
        accounting={"rows_read": samples + rejected, "rows_written": samples, "rows_rejected": rejected,
                    "rejects_by_reason": by_reason,
                    "inputs": [{"path": "synthetic.jsonl", "format": "jsonl", "rows": samples + rejected}]},
        patch_row_width=width,
    )
    write_json_atomic(directory / MANIFEST_NAME, manifest)
    return time.perf_counter() - started


def timed(fn, repeat: int = 1) -> tuple[float, float]:
    """(first call seconds, best of `repeat` further calls, or the first if repeat == 0)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    best = first
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return first, best


def cli_seconds(*argv: str) -> float:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "shards_schema.cli", *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"vlmpack {' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = parser(__doc__, json_out="the timings, totals and machine as JSON")
    ap.add_argument("--samples", type=int, default=1_000_000, help="synthetic samples to build")
    ap.add_argument("--shards", type=int, default=4, help="shard files they are written to")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "vlmpack-inspect-1m"),
                    help="where the synthetic directory is built (reused; default: under the temp dir)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild even if the directory exists")
    args = ap.parse_args()
    directory = Path(args.dir)

    existing = directory / MANIFEST_NAME
    if args.rebuild or not existing.is_file() or json.loads(existing.read_text())["totals"]["rows"] != args.samples:
        shutil.rmtree(directory, ignore_errors=True)
        print(f"building {args.samples:,} samples in {args.shards} shards under {directory} ...", flush=True)
        print(f"  built in {build(directory, args.samples, args.shards):.1f} s", flush=True)
    size = sum(p.stat().st_size for p in directory.glob("*.arrow"))
    shards = open_shards(directory)
    batches = sum(pa.ipc.open_file(pa.memory_map(str(directory / f))).num_record_batches for f in shards.shard_files)
    print(f"directory: {len(shards):,} samples, {args.shards} shards, {batches} record batches, {size / 2**20:,.0f} MiB\n")

    rows = []
    first, best = timed(lambda: inspect_shards(directory), repeat=3)
    rows.append(("inspect_shards(DIR)  [library]", first, best))
    first, best = timed(lambda: open_shards(directory).sample_stats(), repeat=3)
    rows.append(("  of which open_shards + sample_stats", first, best))
    report = inspect_shards(directory)
    first, best = timed(lambda: format_report(report), repeat=3)
    rows.append(("format_report  [terminal text]", first, best))
    rows.append(("vlmpack inspect DIR --json  [CLI, new process]", cli_seconds("inspect", str(directory), "--json"), None))
    rows.append(("vlmpack inspect DIR  [CLI text]", cli_seconds("inspect", str(directory)), None))
    plots = directory.parent / (directory.name + "-plots")
    rows.append(("vlmpack inspect DIR --plots OUT  [+ PNGs, HTML]", cli_seconds("inspect", str(directory), "--plots", str(plots)), None))
    last_uid = f"synthetic-{args.samples - 1:08d}"
    rows.append((f"vlmpack show DIR --uid {last_uid}", cli_seconds("show", str(directory), "--uid", last_uid), None))
    rows.append(("vlmpack show DIR --index -1  [no uid scan]", cli_seconds("show", str(directory), "--index", "-1"), None))
    import_s = cli_seconds("inspect", "--help")
    rows.append(("  (python start + imports: vlmpack inspect --help)", import_s, None))

    print(f"{'what':<56} {'first s':>9} {'best s':>9}")
    for name, first, best in rows:
        print(f"{name:<56} {first:>9.3f} {'' if best is None else f'{best:>9.3f}'}")
    t = report["totals"]
    print(f"\nper sample (library, best): {rows[0][2] / len(shards) * 1e9:.0f} ns; "
          f"rows {t['rows']:,}, tokens {t['tokens']:,}, images {t['images']:,}, visual tokens {t['visual_tokens']:,}")
    machine = machine_info("cpu")
    print(f"{machine['device']}, {machine['cpu_count']} cpus, python {machine['python']}, numpy {machine['numpy']}")
    if args.json_out:
        write_json(args.json_out, {"machine": machine, "args": vars(args), "bytes": size,
                                   "seconds": [{"what": name, "first": first, "best": best} for name, first, best in rows],
                                   "totals": t})


if __name__ == "__main__":
    main()
