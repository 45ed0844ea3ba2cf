"""Shard directories of schema version 1 (no video columns), written before videos, still open,
verify, export, import and train; their rows read as holding no video."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from shards_schema import ShardFile, open_shards
from shards_schema.atomic import write_json_atomic
from shards_schema.manifest import TOTAL_KEYS_V1, build_manifest
from shards_schema.schema import Sample
from shards_schema.verify import verify_shards
from shards_schema.webdataset import export_webdataset, import_webdataset
from shards_schema.writer import ShardWriter

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def v1_dir(tmp_path_factory) -> Path:
    """A version 2 directory of image and text rows, rewritten as version 1 (same samples)."""
    tmp = tmp_path_factory.mktemp("v1")
    data = write_jsonl(tmp / "chats.jsonl", example_rows(12, seed=3, size_range=(32, 96)))
    v2 = tmp / "v2"
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(v2), workers=1, rows_per_shard=5, progress=False))
    manifest = json.loads((v2 / "manifest.json").read_text())
    out = tmp / "v1"
    out.mkdir()
    entries = []
    for entry in manifest["shards"]:
        shard = ShardFile(v2 / entry["file"])
        writer = ShardWriter(out / entry["file"], manifest["patch_row_width"], schema_version=1)
        for j in range(len(shard)):
            r = shard.row(j)
            writer.add(Sample(r["sample_uid"], r["source"], r["input_ids"], r["loss_mask"], r["position_ids"],
                              r["pixel_patches"], r["image_grid_thw"]))
        entries.append(writer.close().to_json())
    v1 = build_manifest(profile=manifest["profile"], settings=manifest["settings"], shards=entries,
                        accounting=manifest["accounting"], patch_row_width=manifest["patch_row_width"], schema_version=1)
    write_json_atomic(out / "manifest.json", v1)
    (out / "rejects.jsonl").write_bytes((v2 / "rejects.jsonl").read_bytes())
    return out


def test_a_version_1_directory_has_no_video_columns_and_reads_as_without_video(v1_dir):
    manifest = json.loads((v1_dir / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and set(manifest["totals"]) == {*TOTAL_KEYS_V1, "shards"}
    shard = ShardFile(v1_dir / manifest["shards"][0]["file"])
    assert shard.version == 1 and "video_patches" not in shard.schema.names
    shards = open_shards(v1_dir)
    for i in range(len(shards)):
        row = shards[i]
        assert row["video_grid_thw"].shape == (0, 3) and row["second_per_grid_ts"].shape == (0,)
        assert row["video_patches"].shape[0] == 0
    stats = shards.sample_stats()
    assert not stats["num_videos"].any() and not stats["num_video_patches"].any()


def test_verify_passes_and_names_the_version(v1_dir):
    report = verify_shards(v1_dir)
    assert report.ok, report.format_text()
    assert report.schema_version == 1 and "schema version 1" in report.format_text()


def test_export_and_import_keep_version_1_byte_for_byte(v1_dir, tmp_path):
    export_webdataset(v1_dir, tmp_path / "tars", samples_per_tar=4)
    import_webdataset(tmp_path / "tars", tmp_path / "back")
    for path in sorted(v1_dir.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            assert (tmp_path / "back" / path.name).read_bytes() == path.read_bytes(), path.name


def test_train_runs_on_a_version_1_directory(v1_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "shards_schema.cli", "train", "--arch", "tiny", "--data", str(v1_dir), "--out",
         str(tmp_path / "run"), "--seq-len", "1024", "--train-steps", "1", "--global-batch-packs", "1",
         "--num-workers", "0", "--tensorboard", "false", "--save-final", "false"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and np.isfinite(metrics[0]["loss"])
