"""Building shard directories for tests: `vlmpack preprocess` over example rows, and
rewriting a shard in place with the manifest made to agree."""

from __future__ import annotations

import json
from pathlib import Path

from preprocess.examples import example_rows, write_jsonl
from shards_schema import ShardFile
from shards_schema.cli import main as vlmpack
from shards_schema.manifest import total_keys
from shards_schema.schema import Sample
from shards_schema.writer import ShardWriter
from tests.helpers.train import SEQ_LEN


def preprocess(tmp: Path, name: str, profile: str = "qwen3-vl", rows: int = 24, seed: int = 5,
               seq_len: int = SEQ_LEN, size_range: tuple[int, int] = (32, 96), video_rows: float = 0.0) -> Path:
    data = write_jsonl(tmp / f"{name}.jsonl", example_rows(rows, seed=seed, family=profile, size_range=size_range,
                                                           video_rows=video_rows))
    out = tmp / name
    assert vlmpack(["preprocess", str(data), "--out", str(out), "--profile", profile, "--workers", "1",
                    "--max-seq-len", str(seq_len), "--no-progress"]) == 0
    return out


def manifest_of(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def write_manifest(d: Path, manifest: dict) -> None:
    (d / "manifest.json").write_text(json.dumps(manifest, indent=2))


def read_samples(path: Path) -> list[Sample]:
    shard = ShardFile(path)
    out = []
    for j in range(len(shard)):
        r = shard.row(j)
        out.append(Sample(r["sample_uid"], r["source"], r["input_ids"].copy(), r["loss_mask"].copy(),
                          r["position_ids"].copy(), r["pixel_patches"].copy(), r["image_grid_thw"].copy(),
                          r["video_patches"].copy(), r["video_grid_thw"].copy(), r["second_per_grid_ts"].copy()))
    return out


def rewrite_shard(d: Path, k: int, mutate) -> str:
    """Rewrite shard k with `mutate(samples)` applied, then make the manifest agree with the new bytes."""
    manifest = manifest_of(d)
    entry = manifest["shards"][k]
    samples = read_samples(d / entry["file"])
    mutate(samples)
    writer = ShardWriter(d / entry["file"], manifest["patch_row_width"], manifest["schema_version"])
    for s in samples:
        writer.add(s)
    manifest["shards"][k] = writer.close().to_json()
    for key in total_keys(manifest):
        manifest["totals"][key] = sum(s[key] for s in manifest["shards"])
    write_manifest(d, manifest)
    return entry["file"]

