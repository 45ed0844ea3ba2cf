"""What the planner reads of a source: per-sample token and visual-token counts.

A source is a shard directory (manifest.json) or a WebDataset export of one (index.json,
`vlmpack export --format webdataset`). An export keeps its source's manifest in index.json,
so both have the same fingerprint: plans, plan caches and loader states carry over between
a directory and its export (same data, same packs, bit for bit). The counts come from Arrow
list offsets or tar headers; never a token or pixel value is read.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from shards_schema import MANIFEST_NAME, ShardFormatError, ShardSet, load_manifest, open_shards
from shards_schema.webdataset import (
    ARRAY_MEMBERS,
    INDEX_NAME,
    KEY_DIGITS,
    KEY_PREFIX,
    MEMBER_NAMES,
    WebDatasetFormatError,
    WebDatasetShards,
    load_index,
)


@dataclass
class SourceStats:
    """What the planner knows about one source: per-sample sizes and an identity."""

    name: str  # the shard directory (or a label for synthetic stats)
    num_tokens: np.ndarray  # int64 [n]
    visual_tokens: np.ndarray  # int64 [n] (patches / merge_size^2)
    fingerprint: dict  # identity of the data (manifest profile id + shard checksums)
    describe: Callable[[int], str] | None = None  # sample index -> "uid ..." for error messages

    def __len__(self) -> int:
        return len(self.num_tokens)


def source_fingerprint(manifest: dict) -> dict:
    """The parts of a manifest that identify the data (cheap: no shard is read)."""
    return {
        "profile_id": manifest["profile"]["id"],
        "schema_version": manifest["schema_version"],
        "patch_row_width": manifest["patch_row_width"],
        "shards_sha256": [s["sha256"] for s in manifest["shards"]],
    }


def is_webdataset_export(directory: str | Path) -> bool:
    directory = Path(directory)
    return not (directory / MANIFEST_NAME).is_file() and (directory / INDEX_NAME).is_file()


def source_manifest(directory: str | Path) -> dict:
    """The shard manifest of a source (for an export: the one recorded in its index.json)."""
    directory = Path(directory)
    if is_webdataset_export(directory):
        return load_index(directory)["manifest"]
    if directory.is_dir() and not (directory / MANIFEST_NAME).exists():
        raise ShardFormatError(
            f"{directory}: neither {MANIFEST_NAME} nor {INDEX_NAME}; a training source is a shard directory written by "
            "`vlmpack preprocess` (one whose job has not finished, or whose partitions are not merged yet, has no "
            f"{MANIFEST_NAME}) or its WebDataset export (`vlmpack export --format webdataset`)"
        )
    return load_manifest(directory)


def open_source(directory: str | Path) -> "ShardSet | WebDatasetSource":
    """A source as an indexable dataset: `len`, `[i]` (the reader's sample dict), `.manifest`,
    `.directory`, `.sample_stats()`; both kinds pickle by path (DataLoader workers)."""
    return WebDatasetSource(directory) if is_webdataset_export(directory) else open_shards(directory)


_WDS_STATS_CACHE: dict[tuple, dict[str, np.ndarray]] = {}  # (tardir, index.json mtime_ns, size) -> sizes
_STATS_CHUNK = 1 << 16  # samples per vectorised step (bounds the gather temporaries to a few MB)


class WebDatasetSource(WebDatasetShards):
    """`WebDatasetShards` with what the planner needs: `directory` and `sample_stats()`.

    Per-sample sizes are not in index.json, and reading every sample's meta.json would be a
    tar walk in Python per sample. Instead they come from the tar headers themselves: index.json
    gives each sample's first header offset, members follow in the documented sorted order, each
    USTAR header holds the member's size, each `.npy` payload starts with its header length.
    So one numpy gather per member over all samples of a tar (memory-mapped) yields every
    size, touching only header pages, never a pixel. Each walk is checked: names must be
    `<key>.<member>` for the expected key and the walk must land exactly on the next sample.
    The result is cached per process, keyed by index.json's identity (ranks plan every epoch).
    """

    def __init__(self, tardir: str | Path):
        super().__init__(tardir)
        self.directory = self.tardir

    def sample_stats(self) -> dict[str, np.ndarray]:
        """num_tokens, num_patches, num_images (int64 [n]); like `ShardSet.sample_stats` minus
        num_target_tokens (which lives only in meta.json)."""
        index_stat = (self.tardir / INDEX_NAME).stat()
        key = (str(self.tardir.resolve()), index_stat.st_mtime_ns, index_stat.st_size)
        cached = _WDS_STATS_CACHE.get(key)
        if cached is None:
            parts = [self._tar_stats(k) for k in range(len(self.tars))]
            names = ("num_tokens", "num_patches", "num_images")
            cached = {n: np.concatenate([p[n] for p in parts]) if parts else np.zeros(0, np.int64) for n in names}
            _WDS_STATS_CACHE[key] = cached
        return {n: v.copy() for n, v in cached.items()}

    def _tar_stats(self, k: int) -> dict[str, np.ndarray]:
        path, entry = self._tar_path(k), self.tars[k]
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise WebDatasetFormatError(f"{path}: {size} bytes, {INDEX_NAME} says {entry['bytes']} (truncated or replaced?)")
        n = int(entry["samples"])
        if n == 0:
            return {"num_tokens": np.zeros(0, np.int64), "num_patches": np.zeros(0, np.int64), "num_images": np.zeros(0, np.int64)}
        starts = np.asarray(entry["sample_offsets"], dtype=np.int64)
        ends = np.append(starts[1:], int(entry["end_offset"]))
        tar = np.memmap(path, dtype=np.uint8, mode="r")
        out = []
        for lo in range(0, n, _STATS_CHUNK):
            hi = min(n, lo + _STATS_CHUNK)
            out.append(_walk_sample_headers(tar, starts[lo:hi], ends[lo:hi], int(entry["first_index"]) + lo,
                                            path, self.patch_row_width))
        del tar
        return {name: np.concatenate([o[name] for o in out]) for name in out[0]}


_TAR_BLOCK = tarfile.BLOCKSIZE  # 512: one header; payloads are padded to whole blocks
_OCTAL_WEIGHTS = 8 ** np.arange(10, -1, -1, dtype=np.int64)  # USTAR size field: 11 octal digits + NUL
_DECIMAL_WEIGHTS = 10 ** np.arange(KEY_DIGITS - 1, -1, -1, dtype=np.int64)
_NPY_MAGIC = np.frombuffer(b"\x93NUMPY", dtype=np.uint8)


def _walk_sample_headers(tar: np.ndarray, starts: np.ndarray, ends: np.ndarray, first_index: int, path: Path,
                         width: int) -> dict[str, np.ndarray]:
    """Payload sizes of every member of samples starting at `starts` (see `WebDatasetSource`)."""
    n = len(starts)
    pos = starts.copy()
    payload: dict[str, np.ndarray] = {}

    def fail(rows: np.ndarray, what: str):
        j = int(np.flatnonzero(rows)[0])
        key = f"{KEY_PREFIX}{first_index + j:0{KEY_DIGITS}d}"
        raise WebDatasetFormatError(
            f"{path}: sample {key} (byte {int(starts[j])}): {what}; the tar does not match {INDEX_NAME} "
            "(re-export it, or check it with WebDatasetShards(...).verify())"
        )

    digits = ((first_index + np.arange(n, dtype=np.int64))[:, None] // _DECIMAL_WEIGHTS) % 10 + ord("0")
    try:
        for member in MEMBER_NAMES:
            expected_name = np.concatenate([
                np.full((n, 1), ord(KEY_PREFIX), np.int64), digits,
                np.broadcast_to(np.frombuffer(f".{member}\0".encode(), np.uint8).astype(np.int64), (n, len(member) + 2)),
            ], axis=1)
            name = tar[pos[:, None] + np.arange(expected_name.shape[1])]
            bad = (name != expected_name).any(axis=1)
            if bad.any():
                fail(bad, f"expected member {member} here")
            field = tar[pos[:, None] + 124 + np.arange(11)].astype(np.int64) - ord("0")
            bad = ((field < 0) | (field > 7)).any(axis=1)
            if bad.any():
                fail(bad, f"member {member} has an unreadable size field")
            size = field @ _OCTAL_WEIGHTS
            data = pos + _TAR_BLOCK
            if member.endswith(".npy"):
                head = tar[data[:, None] + np.arange(12)].astype(np.int64)
                version = head[:, 6]
                bad = (head[:, :6] != _NPY_MAGIC).any(axis=1) | ((version != 1) & (version != 2))
                if bad.any():
                    fail(bad, f"member {member} is not an NPY 1.0/2.0 array")
                header_len = np.where(version == 1, 10 + head[:, 8] + (head[:, 9] << 8),
                                      12 + head[:, 8] + (head[:, 9] << 8) + (head[:, 10] << 16) + (head[:, 11] << 24))
                payload[member] = size - header_len
            pos = data + -(-size // _TAR_BLOCK) * _TAR_BLOCK
    except IndexError:
        fail(np.ones(n, bool), "a member header lies beyond the end of the tar")
    bad = pos != ends
    if bad.any():
        fail(bad, "its members do not end where the next sample starts")

    tokens = payload["loss_mask.npy"]  # uint8 [L]: the byte count is the token count
    checks = {
        "input_ids.npy": payload["input_ids.npy"] != tokens * ARRAY_MEMBERS["input_ids.npy"][1].itemsize,
        "position_ids.npy": payload["position_ids.npy"] != 3 * tokens * ARRAY_MEMBERS["position_ids.npy"][1].itemsize,
        "image_grid_thw.npy": payload["image_grid_thw.npy"] % (3 * ARRAY_MEMBERS["image_grid_thw.npy"][1].itemsize) != 0,
        "pixel_patches.npy": payload["pixel_patches.npy"] % width != 0,
    }
    for member, bad in checks.items():
        if bad.any():
            fail(bad, f"member {member} has a size that does not fit its shape")
    return {
        "num_tokens": tokens,
        "num_patches": payload["pixel_patches.npy"] // width,
        "num_images": payload["image_grid_thw.npy"] // (3 * ARRAY_MEMBERS["image_grid_thw.npy"][1].itemsize),
    }


def load_source_stats(directory: str | Path) -> SourceStats:
    """Per-sample token and visual-token counts of a source, from Arrow offsets or tar headers."""
    shards = open_source(directory)
    stats = shards.sample_stats()
    merge = int(shards.manifest["profile"]["vision"]["merge_size"])

    def describe(i: int) -> str:
        return f"uid {shards[i]['sample_uid']!r}"

    return SourceStats(
        name=str(Path(directory).resolve()),
        num_tokens=stats["num_tokens"].astype(np.int64),
        visual_tokens=stats["num_patches"].astype(np.int64) // (merge * merge),
        fingerprint=source_fingerprint(shards.manifest),
        describe=describe,
    )


def parse_source(spec) -> tuple[str, float | None]:
    """'DIR', 'DIR:0.7', Path or (DIR, weight) -> (DIR, weight or None).

    A ':' suffix is a weight only when it parses as a number and DIR itself does not exist
    (so directories whose names contain ':' still work)."""
    if isinstance(spec, (tuple, list)):
        directory, weight = spec
        return str(directory), None if weight is None else float(weight)
    text = str(spec)
    if ":" in text and not Path(text).exists():
        head, tail = text.rsplit(":", 1)
        try:
            return head, float(tail)
        except ValueError:
            pass
    return text, None


def normalize_sources(sources) -> list[tuple[str, float | None]]:
    """One source spec or a list of them -> [(DIR, weight or None), ...]."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    return [parse_source(s) for s in sources]
