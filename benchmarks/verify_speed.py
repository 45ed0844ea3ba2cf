"""How fast `vlmpack verify` is, per sample, in --quick and full mode.

Builds a shard directory with many samples cheaply, or takes one with --dir, then times
`verify_shards(DIR, quick=True)` and `verify_shards(DIR)` (best of --repeat), and sha256 of
all shard files alone (the floor under the full check).

The synthetic directory: a few template rows tokenized with the real Qwen3 tokenizer (a chat
turn `user: ... / assistant: ...` with the real loss mask; every `--image-every`-th row also
holds one image of grid (1, H, W) with random pixel bytes and positions from
`mrope_position_ids`), tiled to `--rows` rows with unique sample uids, written as Arrow
record batches of 4096 rows like ShardWriter does, with a manifest that the verifier accepts
(real sha256, sizes, stats, accounting). Every row is therefore checked in full, and the
full check must report no fault (the script fails otherwise). Files are hot in the page cache
after building; the figures are CPU-bound, a cold read adds the disk's time.

    python benchmarks/verify_speed.py --rows 1000000 --image-every 20 \
        --json-out benchmarks/results/verify_speed_<device>_<yyyymmdd>.json
    python benchmarks/verify_speed.py --dir /data/shards --repeat 1
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from common import machine_info, parser, write_json

from shards_schema.manifest import MANIFEST_NAME, REJECTS_NAME, build_manifest
from shards_schema.positions import mrope_position_ids, text_position_ids
from shards_schema.schema import shard_schema
from shards_schema.verify import verify_shards
from shards_schema.writer import BATCH_ROWS, file_sha256


def _template_rows(profile, image_grid: tuple[int, int, int]) -> dict:
    """{'text': row, 'image': row}; a row is (input_ids, loss_mask, position_ids [3, L], grid [K, 3], patches)."""
    sp, tok = profile.special, profile.tokenizer
    W, m = profile.vision.patch_row_width, profile.vision.merge_size
    enc = lambda s: np.asarray(tok.encode(s, add_special_tokens=False).ids, dtype=np.int32)  # noqa: E731
    user = np.concatenate([[sp.im_start], enc("user\nWhat is two plus two? Answer briefly."), [sp.im_end], enc("\n")])
    header = np.concatenate([[sp.im_start], enc("assistant\n")])
    content = enc("Two plus two is four.")
    tail = np.concatenate([content, [sp.im_end]])
    rows = {}
    for kind in ("text", "image"):
        grids = np.asarray([image_grid] if kind == "image" else [], dtype=np.int32).reshape(-1, 3)
        n_pad = int(grids.prod(axis=1).sum()) // (m * m)
        vision = np.concatenate([[sp.vision_start], np.full(n_pad, sp.image_pad), [sp.vision_end]]) if n_pad else []
        ids = np.concatenate([user[:3], vision, user[3:], header, tail, enc("\n")]).astype(np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        start = len(ids) - 1 - len(tail)
        mask[start : start + len(tail)] = 1
        pos = mrope_position_ids(ids, grids, image_pad_id=sp.image_pad, merge_size=m) if n_pad else text_position_ids(len(ids))
        patches = np.random.default_rng(0).integers(0, 256, (int(grids.prod(axis=1).sum()), W), dtype=np.uint8)
        rows[kind] = (ids, mask, pos, grids, patches)
    return rows


def _list(lengths: np.ndarray, values: np.ndarray, value_type, large: bool = False) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(lengths, out=offsets[1:])
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def _shard_table(first: int, count: int, templates: dict, image_every: int, schema: pa.Schema) -> pa.Table:
    """Rows first..first+count-1; row i holds an image iff image_every and i % image_every == 0 (vectorised tiling)."""
    is_image = (np.arange(first, first + count) % image_every == 0) if image_every else np.zeros(count, dtype=bool)
    kinds = np.where(is_image, 1, 0)
    parts = [templates["text"], templates["image"]]

    def column(field: int, flatten) -> tuple[np.ndarray, np.ndarray]:
        per_kind = [np.ascontiguousarray(flatten(p[field])) for p in parts]
        lengths = np.asarray([len(v) for v in per_kind])[kinds]
        # gather: each row's values are its template's; built by index arithmetic, no row loop
        starts = np.concatenate(([0], np.cumsum([len(v) for v in per_kind])))[kinds]
        flat_index = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths) + np.arange(lengths.sum())
        return lengths, np.concatenate(per_kind)[flat_index]

    uids = pa.array([f"bench-{i:09d}" for i in range(first, first + count)], pa.string())
    ids_len, ids = column(0, lambda a: a)
    mask_len, mask = column(1, lambda a: a)
    pos_len, pos = column(2, lambda a: a.reshape(-1))
    grid_len, grid = column(3, lambda a: a.reshape(-1))
    pix_len, pix = column(4, lambda a: a.reshape(-1))
    targets = np.asarray([int(p[1].sum()) for p in parts], dtype=np.int32)[kinds]
    columns = [
        uids,
        uids,
        _list(ids_len, ids, pa.int32()),
        _list(mask_len, mask, pa.uint8()),
        _list(pos_len, pos, pa.int32()),
        _list(grid_len, grid, pa.int32()),
        _list(pix_len, pix, pa.uint8(), large=True),
        pa.array(targets, pa.int32()),
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def build_directory(out: Path, rows: int, rows_per_shard: int, image_every: int, image_grid) -> None:
    from preprocess.profiles import builtin_profile

    profile = builtin_profile("qwen3-vl")
    W = profile.vision.patch_row_width
    schema = shard_schema(W)
    templates = _template_rows(profile, image_grid)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for k, first in enumerate(range(0, rows, rows_per_shard)):
        table = _shard_table(first, min(rows_per_shard, rows - first), templates, image_every, schema)
        path = out / f"shard-{k:06d}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            writer.write_table(table, max_chunksize=BATCH_ROWS)
        lengths = {name: np.diff(table.column(name).combine_chunks().offsets.to_numpy()) for name in ("input_ids", "image_grid_thw", "pixel_patches")}
        shards.append({
            "file": path.name, "rows": table.num_rows, "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "tokens": int(lengths["input_ids"].sum()), "target_tokens": int(table.column("num_target_tokens").to_numpy().sum()),
            "images": int(lengths["image_grid_thw"].sum()) // 3, "patches": int(lengths["pixel_patches"].sum()) // W,
        })
    accounting = {"rows_read": rows, "rows_written": rows, "rows_rejected": 0, "rejects_by_reason": {}, "inputs": []}
    manifest = build_manifest(profile=profile.fingerprint, settings={"benchmark": "verify_speed"}, shards=shards,
                              accounting=accounting, patch_row_width=W)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    (out / REJECTS_NAME).write_text("")


def _best(fn, repeat: int):
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return min(times), result


def main(argv=None) -> int:
    ap = parser(__doc__, json_out="the timings, totals and machine as JSON")
    ap.add_argument("--dir", help="time this existing shard directory instead of building one")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the built directory")
    ap.add_argument("--rows-per-shard", type=int, default=100_000, help="rows per shard file of the built directory")
    ap.add_argument("--image-every", type=int, default=20, help="every N-th row holds one image (0: text only)")
    ap.add_argument("--image-grid", type=int, nargs=3, default=(1, 4, 4), metavar=("T", "H", "W"),
                    help="grid of that image")
    ap.add_argument("--repeat", type=int, default=2, help="time each mode this many times, report the best")
    ap.add_argument("--workers", type=int, default=1, help="verify's worker processes")
    ap.add_argument("--keep", action="store_true", help="keep the built directory (printed)")
    args = ap.parse_args(argv)

    tmp = None
    if args.dir:
        directory = Path(args.dir)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="verify_speed_"))
        directory = tmp / "shards"
        t = time.perf_counter()
        build_directory(directory, args.rows, args.rows_per_shard, args.image_every, tuple(args.image_grid))
        print(f"built {directory} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
        totals = manifest["totals"]
        n, nbytes = totals["rows"], totals["bytes"]
        print(f"directory: {directory}: {totals['shards']} shards, {n:,} rows, {totals['tokens']:,} tokens, "
              f"{totals['images']:,} images, {nbytes / 2**30:.2f} GiB; repeat {args.repeat} (best), workers {args.workers}")
        results = []
        t_quick, quick = _best(lambda: verify_shards(directory, quick=True, workers=args.workers), args.repeat)
        results.append(("verify --quick", t_quick, quick.ok))
        t_hash, _ = _best(lambda: [file_sha256(directory / s["file"]) for s in manifest["shards"]], args.repeat)
        results.append(("sha256 of all shards (floor)", t_hash, None))
        t_full, full = _best(lambda: verify_shards(directory, workers=args.workers), args.repeat)
        results.append(("verify (full)", t_full, full.ok))
        print(f"\n| {'check':<30} | {'seconds':>8} | {'us/sample':>9} | {'samples/s':>11} | {'GiB/s':>6} | ok |")
        print(f"|{'-' * 32}|{'-' * 10}|{'-' * 11}|{'-' * 13}|{'-' * 8}|----|")
        for name, secs, ok in results:
            print(f"| {name:<30} | {secs:8.3f} | {secs / n * 1e6:9.3f} | {n / secs:11,.0f} | {nbytes / 2**30 / secs:6.2f} | "
                  f"{'' if ok is None else ('yes' if ok else 'NO')} |")
        if args.json_out:
            write_json(args.json_out, {"machine": machine_info("cpu"), "args": vars(args), "totals": totals,
                                       "seconds": [{"check": name, "seconds": secs, "ok": ok} for name, secs, ok in results]})
        if not (quick.ok and full.ok):
            print(full.format_text(), file=sys.stderr)
            return 1
        return 0
    finally:
        if tmp is not None:
            if args.keep:
                print(f"kept {directory}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
