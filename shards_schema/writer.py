"""Write samples into one Arrow IPC file shard, atomically, with the stats the manifest needs."""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from .atomic import TMP_SUFFIX, fsync_dir
from .schema import SCHEMA_VERSION, Sample, shard_schema

# Record batches stay far below 2^31 child values (int32 list offsets) and small enough that
# reading one row maps only a little of the file.
BATCH_PIXEL_BYTES = 64 << 20
BATCH_ROWS = 4096


@dataclass
class ShardInfo:
    """One shard's entry in the manifest."""

    file: str
    rows: int
    tokens: int
    target_tokens: int
    images: int
    patches: int
    bytes: int
    sha256: str
    videos: int | None = None  # schema version 2 on
    video_patches: int | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _list_array(arrays: list[np.ndarray], value_type: pa.DataType, large: bool = False) -> pa.Array:
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    values = pa.array(values.astype(value_type.to_pandas_dtype(), copy=False), type=value_type)
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(pa.array(offsets), values)


def samples_to_record_batch(samples: list[Sample], schema: pa.Schema) -> pa.RecordBatch:
    video = schema.get_field_index("video_patches") >= 0
    columns = [
        pa.array([s.sample_uid for s in samples], pa.string()),
        pa.array([s.source for s in samples], pa.string()),
        _list_array([s.input_ids for s in samples], pa.int32()),
        _list_array([s.loss_mask for s in samples], pa.uint8()),
        _list_array([s.position_ids for s in samples], pa.int32()),
        _list_array([s.image_grid_thw for s in samples], pa.int32()),
        _list_array([s.pixel_patches for s in samples], pa.uint8(), large=True),
        pa.array([s.num_target_tokens for s in samples], pa.int32()),
    ]
    if video:
        columns += [
            _list_array([s.video_grid_thw for s in samples], pa.int32()),
            _list_array([s.second_per_grid_ts for s in samples], pa.float32()),
            _list_array([s.video_patches for s in samples], pa.uint8(), large=True),
        ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


class ShardWriter:
    """Append samples; `close()` publishes the file under its final name and returns its stats.

    Writes go to `<name>.tmp`, which is fsynced and renamed on close, so a killed job never
    leaves a shard that looks complete.
    """

    def __init__(self, path: Path, patch_row_width: int, schema_version: int = SCHEMA_VERSION):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + TMP_SUFFIX)
        self.patch_row_width = patch_row_width
        self.video_patch_row_width = 2 * patch_row_width  # C*T*P*P, T = 2 in both families
        self.schema_version = schema_version
        self.schema = shard_schema(patch_row_width, schema_version)
        self._sink = pa.OSFile(str(self.tmp_path), "wb")
        self._writer = pa.ipc.new_file(self._sink, self.schema)
        self._pending: list[Sample] = []
        self._pending_bytes = 0
        self._stats = dict(rows=0, tokens=0, target_tokens=0, images=0, patches=0)
        if schema_version >= 2:
            self._stats.update(videos=0, video_patches=0)

    def add(self, sample: Sample) -> None:
        if sample.pixel_patches.ndim != 2 or (sample.num_patches and sample.pixel_patches.shape[1] != self.patch_row_width):
            raise ValueError(
                f"{sample.sample_uid}: pixel_patches shape {sample.pixel_patches.shape} does not match "
                f"row width {self.patch_row_width}"
            )
        if sample.num_videos or sample.num_video_patches:
            if self.schema_version < 2:
                raise ValueError(f"{sample.sample_uid}: schema version {self.schema_version} shards hold no video")
            if sample.video_patches.ndim != 2 or sample.video_patches.shape[1] != self.video_patch_row_width:
                raise ValueError(f"{sample.sample_uid}: video_patches shape {sample.video_patches.shape} does not match "
                                 f"row width {self.video_patch_row_width}")
        self._pending.append(sample)
        self._pending_bytes += sample.pixel_patches.nbytes + sample.video_patches.nbytes
        self._stats["rows"] += 1
        self._stats["tokens"] += sample.num_tokens
        self._stats["target_tokens"] += sample.num_target_tokens
        self._stats["images"] += sample.num_images
        self._stats["patches"] += sample.num_patches
        if self.schema_version >= 2:
            self._stats["videos"] += sample.num_videos
            self._stats["video_patches"] += sample.num_video_patches
        if self._pending_bytes >= BATCH_PIXEL_BYTES or len(self._pending) >= BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_batch(samples_to_record_batch(self._pending, self.schema))
            self._pending, self._pending_bytes = [], 0

    def close(self) -> ShardInfo:
        self._flush()
        self._writer.close()
        self._sink.close()
        with open(self.tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(self.tmp_path, self.path)
        fsync_dir(self.path.parent)
        return ShardInfo(
            file=self.path.name,
            bytes=self.path.stat().st_size,
            sha256=file_sha256(self.path),
            **self._stats,
        )

    def abort(self) -> None:
        try:
            self._writer.close()
            self._sink.close()
        finally:
            self.tmp_path.unlink(missing_ok=True)
