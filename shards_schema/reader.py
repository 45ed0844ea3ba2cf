"""Zero-copy reads of a shard directory.

Each shard is memory-mapped; a row is a set of numpy views into the mapped offsets/values
buffers (no `to_pylist`, no per-element Python). Reading sample i touches only its bytes.
Objects pickle by path and reopen their maps lazily, so they work in DataLoader workers.

Opening a shard checks everything that reading it relies on, and `vlmpack verify` runs the
same checks (`file_fault`, `read_batches`): the file is a regular file of the manifest's
size, its Arrow footer and record batch metadata are intact (every buffer inside the file,
every offset in range: `RecordBatch.validate(full=True)`, which reads offsets, never token or
pixel values), its schema is exactly the shard schema of the manifest's version and patch row
width, and it holds the manifest's row count. A row's columns are checked against each other
when it is read (lengths, grids against patch rows). A damaged shard raises `ShardFault`: one
line naming the file, verify's fault kind and the fix. Bytes that only change values (a
flipped pixel or token) are caught by sha256 (`vlmpack verify`, `export`, `fetch`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pyarrow as pa

from .atomic import refuse_leftover_tmp
from .manifest import MANIFEST_NAME, ShardFormatError, load_manifest
from .schema import (COLUMN_DTYPES, FORMAT_NAME, READABLE_SCHEMA_VERSIONS, VIDEO_COLUMNS, array_columns,
                     shard_schema)

ARROW_ERRORS = (pa.ArrowException, OSError, ValueError)  # what pyarrow raises on a damaged file


class ShardFault(ShardFormatError):
    """A damaged shard file, named as `vlmpack verify` names it: `kind` is verify's fault kind,
    `detail` what is wrong, `row` the row within the shard (None: the file as a whole)."""

    def __init__(self, path: str | Path, kind: str, detail: str, row: int | None = None):
        self.path, self.kind, self.detail, self.row = Path(path), kind, detail, row
        where = str(self.path) if row is None else f"{self.path} row {row}"
        fix = "" if detail.endswith(DETAILS_WITH_THEIR_OWN_FIX) else \
            "; restore the file (fetch it again, or re-run `vlmpack preprocess`)"
        super().__init__(f"{where}: [{kind}] {detail}{fix} and check the directory with `vlmpack verify "
                         f"{self.path.parent}`")


UNREADABLE_BY_THIS_USER = "this user may not read it (permission denied): fix its permissions"
RESTORE_THE_MANIFEST = f"(or restore {MANIFEST_NAME})"  # ends the detail of a manifest whose schema_version changed
# details that end in their own fix: restoring the shard would not help
DETAILS_WITH_THEIR_OWN_FIX = (UNREADABLE_BY_THIS_USER, RESTORE_THE_MANIFEST)


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def file_fault(path: Path, expected_bytes: int | None) -> tuple[str, str] | None:
    """(kind, detail) of what a stat shows wrong with the shard at `path`, or None (nothing is
    opened, so a FIFO cannot block): missing_shard, not_a_file, unreadable_shard (this user may
    not read it), or size_mismatch against `expected_bytes`."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return "missing_shard", f"listed in {MANIFEST_NAME} but missing from the directory"
    except OSError as exc:
        return "unreadable_shard", f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(found.st_mode):
        return "not_a_file", f"a {_file_type(found.st_mode)} stands where {MANIFEST_NAME} lists a shard file"
    if not os.access(path, os.R_OK):
        return "unreadable_shard", UNREADABLE_BY_THIS_USER
    if expected_bytes is not None and found.st_size != expected_bytes:
        return "size_mismatch", (f"{found.st_size:,} bytes on disk, the manifest says {expected_bytes:,} (truncated, "
                                 "replaced or still being copied)")
    return None


def schema_problem(schema: pa.Schema, patch_row_width: int | None = None, version: int | None = None) -> str | None:
    """What makes `schema` other than the shard schema of `version` and `patch_row_width` (None:
    the ones the schema's own metadata records), or None when it is exactly that schema."""
    meta = schema.metadata or {}
    fmt = meta.get(b"vlmpack.format", b"").decode(errors="replace")
    found_version = meta.get(b"vlmpack.schema_version", b"").decode(errors="replace")
    found_width = meta.get(b"vlmpack.patch_row_width", b"").decode(errors="replace")
    problems, whole_shard_of = [], None
    if fmt != FORMAT_NAME:
        problems.append(f"format {fmt!r} (expected {FORMAT_NAME!r})")
    if version is None:
        version = int(found_version) if found_version in tuple(map(str, READABLE_SCHEMA_VERSIONS)) else None
        if version is None:
            problems.append(f"schema_version {found_version!r} (this vlmpack reads "
                            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))})")
    elif found_version != str(version):
        problems.append(f"schema_version {found_version!r} (manifest: {version})")
        if found_version in tuple(map(str, READABLE_SCHEMA_VERSIONS)) and found_width.isdigit() and \
                schema.equals(shard_schema(int(found_width), int(found_version)), check_metadata=True):
            whole_shard_of = found_version
    if patch_row_width is None:
        patch_row_width = int(found_width) if found_width.isdigit() and found_width.isascii() and int(found_width) > 0 else None
        if patch_row_width is None:
            problems.append(f"patch_row_width {found_width!r} (expected a positive integer)")
    elif found_width != str(patch_row_width):
        problems.append(f"patch_row_width {found_width!r} (manifest: {patch_row_width})")
    if whole_shard_of is not None and len(problems) == 1:
        # an intact shard of a version this vlmpack reads, and nothing else amiss: the manifest's
        # number is what is wrong, and restoring the shard would change nothing
        return (f"schema metadata: schema_version {found_version!r} (manifest: {version}): the file is a whole "
                f"version-{whole_shard_of} shard, so {MANIFEST_NAME}'s schema_version {version} was changed: set it "
                f"back to {whole_shard_of} {RESTORE_THE_MANIFEST}")
    if problems:
        return "schema metadata: " + "; ".join(problems)
    expected = shard_schema(patch_row_width, version)
    if schema.equals(expected, check_metadata=True):
        return None
    head = f"Arrow schema differs from shard_schema({patch_row_width}, version {version})"
    try:
        diff = [f"{f.name}: {f.type}" for f in schema if f.name not in expected.names or expected.field(f.name) != f]
        missing = [n for n in expected.names if n not in schema.names]
    except UnicodeDecodeError:  # a damaged field name or type
        return f"{head}: a field's name or type holds bytes that are not UTF-8"
    other = [k.decode(errors="replace") for k in meta if meta[k] != expected.metadata.get(k)]
    return f"{head}: differing {diff}, missing {missing}" + (f", other metadata {other}" if other else "")


def read_batches(path: Path, patch_row_width: int | None = None,
                 version: int | None = None) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """The memory-mapped record batches of the shard at `path`, every structure a reader relies on
    checked (see the module docstring); ShardFault (unreadable_shard, schema_mismatch) when one
    fails. Call `file_fault` first: it keeps a FIFO from being opened."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        schema = reader.schema
    except ARROW_ERRORS as exc:
        raise ShardFault(path, "unreadable_shard", f"not a readable Arrow IPC file (a damaged or missing footer: "
                                                   f"truncated, or still being written?): {exc}") from None
    problem = schema_problem(schema, patch_row_width, version)
    if problem:
        raise ShardFault(path, "schema_mismatch", problem)
    batches = []
    for b in range(reader.num_record_batches):
        try:
            batch = reader.get_batch(b)
            batch.validate(full=True)  # offsets monotone and inside their buffers, UTF-8: reads no values
        except ARROW_ERRORS as exc:
            raise ShardFault(path, "unreadable_shard", f"record batch {b} is damaged (its metadata or offsets): "
                                                       f"{exc}") from None
        batches.append(batch)
    return schema, batches


def buffer_view(buffer: pa.Buffer | None, dtype, start: int, stop: int) -> np.ndarray:
    """Elements [start, stop) of an Arrow buffer, zero-copy. Only those are viewed: a buffer may be
    longer (and of any byte length). A validated array's elements are inside its buffers; an empty
    array may have none, and its single offset is 0."""
    dtype = np.dtype(dtype)
    if buffer is None or buffer.size < stop * dtype.itemsize:
        return np.zeros(max(stop - start, 0), dtype)
    return np.frombuffer(buffer, dtype=dtype, count=stop)[start:]


def offsets_view(column: pa.Array) -> np.ndarray:
    """The offsets of a list or string column (int32, or int64 for large lists), zero-copy."""
    dtype = np.int64 if pa.types.is_large_list(column.type) else np.int32
    return buffer_view(column.buffers()[1], dtype, column.offset, column.offset + len(column) + 1)


def list_views(column: pa.Array, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) numpy views of a list column, zero-copy."""
    values = column.values
    return offsets_view(column), buffer_view(values.buffers()[1], dtype, values.offset, values.offset + len(values))


def _grid_rows(grid: np.ndarray) -> float:
    """Patch rows a flat [t, h, w, ...] grid needs (float64: damaged values cannot wrap around)."""
    return float(grid.reshape(-1, 3).astype(np.float64).prod(axis=1).sum())


def row_fault(row: dict, patch_row_width: int, video_patch_row_width: int) -> tuple[str, str] | None:
    """(verify's fault kind, detail) when the flat columns of one row do not fit together (lengths,
    grids against patch bytes), else None. A few comparisons of lengths: cheap enough for every
    read."""
    n = len(row["input_ids"])
    if len(row["loss_mask"]) != n:
        return "loss_mask_length", f"loss_mask has {len(row['loss_mask'])} values for {n} tokens"
    if len(row["position_ids"]) != 3 * n:
        return "position_ids_length", f"position_ids has {len(row['position_ids'])} values, expected 3 x {n} tokens"
    for kind, grid_name, patches_name, width in (("image", "image_grid_thw", "pixel_patches", patch_row_width),
                                                 ("video", "video_grid_thw", "video_patches", video_patch_row_width)):
        grid, patches = row[grid_name], row[patches_name]
        if len(grid) % 3 or (grid < 1).any():
            return f"{kind}_grid", f"{grid_name} {grid.tolist()[:12]} is not [t, h, w] triples of positive sizes"
        if len(patches) != _grid_rows(grid) * width:
            return (f"{patches_name}_length", f"{patches_name} has {len(patches):,} bytes, the grids "
                    f"{grid.reshape(-1, 3).tolist()[:2]} need {_grid_rows(grid):,.0f} patches x {width}")
    if len(row["second_per_grid_ts"]) != len(row["video_grid_thw"]) // 3:
        return "video_grid", (f"{len(row['second_per_grid_ts'])} second_per_grid_ts for "
                              f"{len(row['video_grid_thw']) // 3} videos")
    return None


class ShardFile:
    """One memory-mapped Arrow IPC file, checked when opened (`read_batches`). `patch_row_width`
    and `version`: what the manifest says the shard holds (None: what its own schema records)."""

    def __init__(self, path: str | Path, patch_row_width: int | None = None, version: int | None = None):
        self.path = Path(path)
        self._expected = (patch_row_width, version)
        self._open()

    def _open(self) -> None:
        fault = file_fault(self.path, None)
        if fault is not None:
            raise ShardFault(self.path, *fault)
        self.schema, self._batches = read_batches(self.path, *self._expected)
        meta = self.schema.metadata
        self.version = int(meta[b"vlmpack.schema_version"])
        self.columns = array_columns(self.version)
        self.patch_row_width = int(meta[b"vlmpack.patch_row_width"])
        self.video_patch_row_width = int(meta.get(b"vlmpack.video_patch_row_width", 2 * self.patch_row_width))
        self.batch_starts = np.cumsum([0] + [b.num_rows for b in self._batches])
        self._views: dict[int, dict] = {}

    def __getstate__(self):
        return {"path": self.path, "expected": self._expected}

    def __setstate__(self, state):
        self.path, self._expected = state["path"], state.get("expected", (None, None))
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
        fault = row_fault(out, self.patch_row_width, self.video_patch_row_width)
        if fault is not None:
            raise ShardFault(self.path, *fault, row=j)
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
            parts.append(buffer_view(col.buffers()[1], np.int32, col.offset, col.offset + len(col)))
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


class ShardSet:
    """All shards of a directory as one indexable dataset (`open_shards(DIR)`)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.manifest = load_manifest(self.directory)
        refuse_leftover_tmp(self.directory, "shards")
        self.shard_files = [s["file"] for s in self.manifest["shards"]]
        self.row_starts = np.cumsum([0] + [s["rows"] for s in self.manifest["shards"]], dtype=np.int64)
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
            entry = self.manifest["shards"][k]
            path = self.directory / entry["file"]
            fault = file_fault(path, entry["bytes"])  # a stat: catches truncated and replaced files before Arrow reads them
            if fault is not None:
                raise ShardFault(path, *fault)
            shard = ShardFile(path, self.patch_row_width, self.manifest["schema_version"])
            if len(shard) != entry["rows"]:
                raise ShardFault(path, "row_count", f"{len(shard)} rows in the file, the manifest says {entry['rows']}")
            self._shards[k] = shard
        return shard

    def open_all(self) -> "ShardSet":
        """Open (and so check) every shard now rather than at its first read: reads footers and offsets."""
        for k in range(len(self.shard_files)):
            self.shard(k)
        return self

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
