"""Zero-copy reads of a shard directory.

Each shard is memory-mapped; a row is a set of numpy views into the mapped offsets/values
buffers (no `to_pylist`, no per-element Python). Reading sample i touches only its bytes.
Objects pickle by path and reopen their maps lazily, so they work in DataLoader workers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from .atomic import refuse_leftover_tmp
from .manifest import ShardFormatError, load_manifest
from .schema import COLUMN_DTYPES, FORMAT_NAME, READABLE_SCHEMA_VERSIONS, VIDEO_COLUMNS, array_columns


def list_views(column: pa.Array, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) numpy views of a list column, zero-copy."""
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int64 if pa.types.is_large_list(column.type) else np.int32)
    offsets = offsets[column.offset : column.offset + len(column) + 1]
    values = column.values
    values = np.frombuffer(values.buffers()[1], dtype=dtype)[values.offset : values.offset + len(values)]
    return offsets, values


class ShardFile:
    """One memory-mapped Arrow IPC file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._open()

    def _open(self) -> None:
        try:
            self._reader = pa.ipc.open_file(pa.memory_map(str(self.path), "r"))
        except (pa.ArrowInvalid, OSError) as exc:
            raise ShardFormatError(f"{self.path}: not a readable Arrow IPC file ({exc})") from exc
        meta = self._reader.schema.metadata or {}
        if meta.get(b"vlmpack.format") != FORMAT_NAME.encode():
            raise ShardFormatError(f"{self.path}: not a vlmpack shard")
        self.version = int(meta.get(b"vlmpack.schema_version", b"0"))
        if self.version not in READABLE_SCHEMA_VERSIONS:
            raise ShardFormatError(f"{self.path}: schema version {meta.get(b'vlmpack.schema_version')}, "
                                   f"this vlmpack reads versions {', '.join(map(str, READABLE_SCHEMA_VERSIONS))}")
        self.columns = array_columns(self.version)
        self.patch_row_width = int(meta[b"vlmpack.patch_row_width"])
        self.video_patch_row_width = int(meta.get(b"vlmpack.video_patch_row_width", 2 * self.patch_row_width))
        self._batches = [self._reader.get_batch(b) for b in range(self._reader.num_record_batches)]
        self.batch_starts = np.cumsum([0] + [b.num_rows for b in self._batches])
        self._views: dict[int, dict] = {}

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.path = state["path"]
        self._open()

    def __len__(self) -> int:
        return int(self.batch_starts[-1])

    def _batch_views(self, b: int) -> dict:
        views = self._views.get(b)
        if views is None:
            batch = self._batches[b]
            views = {name: list_views(batch.column(name), COLUMN_DTYPES[name]) for name in self.columns}
            views["sample_uid"] = batch.column("sample_uid")
            views["source"] = batch.column("source")
            self._views[b] = views
        return views

    def row(self, j: int) -> dict:
        b = int(np.searchsorted(self.batch_starts, j, side="right")) - 1
        r = j - int(self.batch_starts[b])
        views = self._batch_views(b)
        out = {}
        for name in self.columns:
            offsets, values = views[name]
            out[name] = values[offsets[r] : offsets[r + 1]]
        if self.version < 2:  # a version 1 shard holds no video
            for name in VIDEO_COLUMNS:
                out[name] = np.zeros(0, COLUMN_DTYPES[name])
        out["position_ids"] = out["position_ids"].reshape(3, -1)
        out["image_grid_thw"] = out["image_grid_thw"].reshape(-1, 3)
        out["pixel_patches"] = out["pixel_patches"].reshape(-1, self.patch_row_width)
        out["video_grid_thw"] = out["video_grid_thw"].reshape(-1, 3)
        out["video_patches"] = out["video_patches"].reshape(-1, self.video_patch_row_width)
        out["sample_uid"] = views["sample_uid"][r].as_py()
        out["source"] = views["source"][r].as_py()
        return out

    def list_lengths(self, name: str) -> np.ndarray:
        """Per-row lengths of a list column, from its offsets alone (values are never touched); a
        video column of a version 1 shard has length 0 in every row."""
        if name not in self.columns:
            return np.zeros(len(self), np.int64)
        parts = [np.diff(list_views(batch.column(name), COLUMN_DTYPES[name])[0]) for batch in self._batches]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def list_values(self, name: str) -> np.ndarray:
        """Every row's values of a list column end to end (a video column of a version 1 shard:
        none). For the small columns (grids, second_per_grid_ts): it reads their values."""
        if name not in self.columns:
            return np.zeros(0, COLUMN_DTYPES[name])
        parts = []
        for batch in self._batches:
            offsets, values = list_views(batch.column(name), COLUMN_DTYPES[name])
            parts.append(values[offsets[0] : offsets[-1]])
        return np.concatenate(parts) if parts else np.zeros(0, COLUMN_DTYPES[name])

    def string_column(self, name: str) -> pa.ChunkedArray:
        """A string column (sample_uid, source), zero-copy from the mapped file, one chunk per batch."""
        return pa.chunked_array([batch.column(name) for batch in self._batches], pa.string())

    def int_column(self, name: str) -> np.ndarray:
        """A non-null int32 column, zero-copy from its buffer (`to_numpy` would import pandas)."""
        parts = []
        for batch in self._batches:
            col = batch.column(name)
            parts.append(np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset : col.offset + len(col)])
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


class ShardSet:
    """All shards of a directory as one indexable dataset (`open_shards(DIR)`)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.manifest = load_manifest(self.directory)
        refuse_leftover_tmp(self.directory, "shards")
        self.shard_files = [s["file"] for s in self.manifest["shards"]]
        self.row_starts = np.cumsum([0] + [int(s["rows"]) for s in self.manifest["shards"]])
        self.patch_row_width = int(self.manifest["patch_row_width"])
        self._shards: list[ShardFile | None] = [None] * len(self.shard_files)

    def __getstate__(self):
        return {"directory": self.directory}

    def __setstate__(self, state):
        self.__init__(state["directory"])

    def __len__(self) -> int:
        return int(self.row_starts[-1])

    def shard(self, k: int) -> ShardFile:
        shard = self._shards[k]
        if shard is None:
            path = self.directory / self.shard_files[k]
            if not path.is_file():
                raise ShardFormatError(f"{path}: listed in the manifest but missing")
            size, expected_size = path.stat().st_size, int(self.manifest["shards"][k]["bytes"])
            if size != expected_size:  # a stat: catches truncated and replaced files before Arrow reads them
                raise ShardFormatError(
                    f"{path}: {size} bytes, the manifest says {expected_size} (truncated, replaced or still being "
                    f"copied): restore it, and check the directory with `vlmpack verify {self.directory}`"
                )
            shard = ShardFile(path)
            expected = int(self.manifest["shards"][k]["rows"])
            if len(shard) != expected:
                raise ShardFormatError(f"{path}: {len(shard)} rows, manifest says {expected}")
            self._shards[k] = shard
        return shard

    def locate(self, i: int) -> tuple[int, int]:
        """Global row index -> (shard index, row within shard)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples in {self.directory}")
        i %= n
        k = int(np.searchsorted(self.row_starts, i, side="right")) - 1
        return k, i - int(self.row_starts[k])

    def __getitem__(self, i: int) -> dict:
        k, j = self.locate(int(i))
        return self.shard(k).row(j)

    def sample_stats(self) -> dict[str, np.ndarray]:
        """Per-sample sizes for planning and inspection, read from offsets and one small column."""
        stats = {"num_tokens": [], "num_patches": [], "num_images": [], "num_target_tokens": [],
                 "num_video_patches": [], "num_videos": []}
        for k in range(len(self.shard_files)):
            shard = self.shard(k)
            stats["num_tokens"].append(shard.list_lengths("input_ids"))
            stats["num_patches"].append(shard.list_lengths("pixel_patches") // self.patch_row_width)
            stats["num_images"].append(shard.list_lengths("image_grid_thw") // 3)
            stats["num_video_patches"].append(shard.list_lengths("video_patches") // shard.video_patch_row_width)
            stats["num_videos"].append(shard.list_lengths("video_grid_thw") // 3)
            stats["num_target_tokens"].append(shard.int_column("num_target_tokens"))
        return {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in stats.items()}


    def string_column(self, name: str) -> pa.ChunkedArray:
        """A string column of every row in order, zero-copy (`ShardFile.string_column` of each shard)."""
        chunks = [chunk for k in range(len(self.shard_files)) for chunk in self.shard(k).string_column(name).chunks]
        return pa.chunked_array(chunks, pa.string())


def open_shards(directory: str | Path) -> ShardSet:
    return ShardSet(directory)
