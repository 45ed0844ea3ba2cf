"""Write samples into one Arrow IPC file shard, atomically, with the stats the manifest needs."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from .atomic import TMP_SUFFIX, fsync_dir
from .schema import SCHEMA_VERSION, Sample, shard_schema

# Record batches stay far below 2^31 child values (int32 list offsets) and small enough that
# reading one row maps only a little of the file, and that the background thread writes most of
# a shard while its rows are still being decoded (only the last batch is written at close).
BATCH_PIXEL_BYTES = 16 << 20
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


def _list_array(arrays: list[np.ndarray], value_type: pa.DataType, large: bool = False,
                scratch: np.ndarray | None = None) -> pa.Array:
    """One list column from per-row arrays; its values are gathered into `scratch` when it is
    big enough (the writer reuses one buffer for the pixel columns instead of a fresh one per
    batch, whose pages the kernel would have to fault in again every time)."""
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(lengths, out=offsets[1:])
    dtype = np.dtype(value_type.to_pandas_dtype())
    flat = [a.reshape(-1) for a in arrays]
    if scratch is not None and flat and scratch.dtype == dtype and scratch.size >= offsets[-1]:
        values = np.concatenate(flat, out=scratch[: int(offsets[-1])])
    else:
        values = np.concatenate(flat).astype(dtype, copy=False) if flat else np.zeros(0, dtype=dtype)
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def samples_to_record_batch(samples: list[Sample], schema: pa.Schema, scratch: dict[str, np.ndarray] | None = None
                            ) -> pa.RecordBatch:
    scratch = scratch or {}
    video = schema.get_field_index("video_patches") >= 0
    columns = [
        pa.array([s.sample_uid for s in samples], pa.string()),
        pa.array([s.source for s in samples], pa.string()),
        _list_array([s.input_ids for s in samples], pa.int32()),
        _list_array([s.loss_mask for s in samples], pa.uint8()),
        _list_array([s.position_ids for s in samples], pa.int32()),
        _list_array([s.image_grid_thw for s in samples], pa.int32()),
        _list_array([s.pixel_patches for s in samples], pa.uint8(), large=True, scratch=scratch.get("pixel_patches")),
        pa.array([s.num_target_tokens for s in samples], pa.int32()),
    ]
    if video:
        columns += [
            _list_array([s.video_grid_thw for s in samples], pa.int32()),
            _list_array([s.second_per_grid_ts for s in samples], pa.float32()),
            _list_array([s.video_patches for s in samples], pa.uint8(), large=True, scratch=scratch.get("video_patches")),
        ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


class _HashingFile:
    """The shard's file: each byte is hashed on its way to disk, so no one reads the file back
    for its sha256."""

    def __init__(self, path: Path):
        self._fh = open(path, "wb")
        self.sha256 = hashlib.sha256()

    @property
    def closed(self) -> bool:
        return self._fh.closed

    def write(self, data) -> int:
        self.sha256.update(data)  # hashlib and the write both release the GIL on large buffers
        return self._fh.write(data)

    def tell(self) -> int:
        return self._fh.tell()

    def flush(self) -> None:
        self._fh.flush()

    def fileno(self) -> int:
        return self._fh.fileno()

    def close(self) -> None:
        self._fh.close()


class ShardWriter:
    """Append samples; `close()` publishes the file under its final name and returns its stats.

    Writes go to `<name>.tmp`, which is fsynced and renamed on close, so a killed job never
    leaves a shard that looks complete. Full batches are written (gathered, written, hashed) on
    a background thread while the caller decodes the next rows; at most one batch is in
    flight, and its error (a full disk) is raised by the next `add` or by `close`.
    """

    def __init__(self, path: Path, patch_row_width: int, schema_version: int = SCHEMA_VERSION):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + TMP_SUFFIX)
        self.patch_row_width = patch_row_width
        self.video_patch_row_width = 2 * patch_row_width  # C*T*P*P, T = 2 in both families
        self.schema_version = schema_version
        self.schema = shard_schema(patch_row_width, schema_version)
        self._file = _HashingFile(self.tmp_path)
        self._sink = pa.PythonFile(self._file, mode="w")
        self._writer = pa.ipc.new_file(self._sink, self.schema)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shard-writer")
        self._in_flight: Future | None = None
        self._scratch: dict[str, np.ndarray] = {}
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
        self._wait()
        if self._pending:
            batch, self._pending, self._pending_bytes = self._pending, [], 0
            self._in_flight = self._thread.submit(self._write_batch, batch)

    def _wait(self) -> None:
        if self._in_flight is not None:
            done, self._in_flight = self._in_flight, None
            done.result()

    def _write_batch(self, samples: list[Sample]) -> None:
        for column in ("pixel_patches", "video_patches"):
            need = sum(getattr(s, column).size for s in samples)
            if need > self._scratch.get(column, np.zeros(0, dtype=np.uint8)).size:
                self._scratch[column] = np.empty(max(need, BATCH_PIXEL_BYTES), dtype=np.uint8)
        self._writer.write_batch(samples_to_record_batch(samples, self.schema, self._scratch))

    def close(self) -> ShardInfo:
        try:
            self._flush()
            self._wait()
            self._writer.close()
            self._sink.close()
        finally:
            self._thread.shutdown()
        with open(self.tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(self.tmp_path, self.path)
        fsync_dir(self.path.parent)
        return ShardInfo(
            file=self.path.name,
            bytes=self.path.stat().st_size,
            sha256=self._file.sha256.hexdigest(),
            **self._stats,
        )

    def abort(self) -> None:
        try:
            self._thread.shutdown()  # the batch in flight ends first; its error, if any, is moot now
            self._writer.close()
            self._sink.close()
        finally:
            self._file.close()
            self.tmp_path.unlink(missing_ok=True)
