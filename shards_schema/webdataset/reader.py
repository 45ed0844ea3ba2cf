"""Reading an export directory: index.json, sequential and random access, per-sample sizes."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..atomic import refuse_leftover_tmp
from ..json_object import NotAJSONObject, parse_json_object
from ..manifest import REJECTS_NAME, check_manifest, is_count, require_directory
from ..schema import FORMAT_NAME as SHARDS_FORMAT_NAME
from ..schema import READABLE_SCHEMA_VERSIONS
from ..storage import NotARegularFile, open_local
from ..writer import file_sha256
from .format import (
    ARRAY_MEMBERS,
    BLOCK,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    KEY_DIGITS,
    KEY_PREFIX,
    WebDatasetFormatError,
    decode_sample,
    member_names,
    padded,
    sample_key,
    split_name,
)


# the counts every `tars` entry of index.json carries
_TAR_COUNTS = ("first_index", "samples", "bytes", "end_offset")
_DAMAGED_INDEX = "index.json is damaged or was edited by hand; export the shard directory again"


def load_index(tardir: str | Path) -> dict:
    """index.json of an export directory, checked for format, version and a consistent tar list."""
    tardir = Path(tardir)
    require_directory(tardir, "directory written by `vlmpack export` (the one holding index.json)")
    path = tardir / INDEX_NAME
    try:
        with open_local(path) as f:  # a FIFO is refused, not waited on
            index = parse_json_object(f.read(), path)
    except FileNotFoundError:
        hint = " (an export that has not finished, or not a `vlmpack export` directory?)" if tardir.is_dir() else ""
        raise WebDatasetFormatError(f"{tardir}: no {INDEX_NAME}{hint}") from None
    except IsADirectoryError:
        raise WebDatasetFormatError(f"{path} is a directory, not the index file: {_DAMAGED_INDEX}") from None
    except (NotAJSONObject, NotARegularFile) as exc:
        raise WebDatasetFormatError(str(exc)) from None
    except OSError as exc:
        raise WebDatasetFormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    found = index.get("format")
    if found != FORMAT_NAME:
        raise WebDatasetFormatError(f"{path}: not a vlmpack WebDataset index (format {found!r})")
    version = index.get("format_version")
    if not is_count(version):
        raise WebDatasetFormatError(f"{path}: format_version {version!r} is not an integer: {_DAMAGED_INDEX}")
    if version != FORMAT_VERSION:
        raise WebDatasetFormatError(
            f"{path}: format version {version}, this vlmpack reads {FORMAT_VERSION}; re-export with this version"
        )
    for key, kind in (("manifest", dict), ("tars", list), ("rejects", dict)):
        if not isinstance(index.get(key), kind):
            found = "and it is missing" if key not in index else f"got {type(index[key]).__name__}"
            raise WebDatasetFormatError(f"{path}: `{key}` must be {'an object' if kind is dict else 'a list'}, "
                                        f"{found}: {_DAMAGED_INDEX}")
    if not isinstance(index["rejects"].get("sha256"), str):
        raise WebDatasetFormatError(f"{path}: rejects.sha256 {index['rejects'].get('sha256')!r} is not a string: "
                                    f"{_DAMAGED_INDEX}")
    manifest = index["manifest"]
    if manifest.get("format") != SHARDS_FORMAT_NAME or manifest.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise WebDatasetFormatError(
            f"{path}: exported from shard schema {manifest.get('format')!r} v{manifest.get('schema_version')}, "
            f"this vlmpack reads {SHARDS_FORMAT_NAME!r} v{', v'.join(map(str, READABLE_SCHEMA_VERSIONS))}"
        )
    check_manifest(manifest, f"{path} (the manifest of the exported directory)", str(tardir))
    expected_first = 0
    for k, entry in enumerate(index["tars"]):
        if not isinstance(entry, dict):
            raise WebDatasetFormatError(f"{path}: tar entry {k} is not an object: {_DAMAGED_INDEX}")
        name = entry.get("file")
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".tar"):
            raise WebDatasetFormatError(f"{path}: tar entry {name!r} is not a plain .tar file name")
        bad = [f"{key} {entry.get(key)!r}" for key in _TAR_COUNTS if not is_count(entry.get(key))]
        offsets = entry.get("sample_offsets")
        if not isinstance(offsets, list) or not all(is_count(o) for o in offsets):
            bad.append("sample_offsets (not a list of integers)")
        if not isinstance(entry.get("sha256"), str):
            bad.append(f"sha256 {entry.get('sha256')!r}")
        if bad:
            raise WebDatasetFormatError(f"{path}: tar entry {k} ({name}) has missing or invalid {', '.join(bad)} "
                                        f"(counts are integers 0..2^53, sha256 a string): {_DAMAGED_INDEX}")
        if entry["first_index"] != expected_first or len(offsets) != entry["samples"]:
            raise WebDatasetFormatError(f"{path}: entry for {name} is inconsistent (first_index, samples, sample_offsets)")
        # random access reads each sample from its offset to the next one's (the last: to
        # end_offset), so they must be blocks in order inside the tar, the first at its start
        bounds = np.asarray([*offsets, entry["end_offset"]], dtype=np.int64)
        if ((offsets and offsets[0] != 0) or (bounds % BLOCK).any() or (np.diff(bounds) <= 0).any()
                or entry["end_offset"] > entry["bytes"]):
            raise WebDatasetFormatError(
                f"{path}: entry for {name}: sample_offsets and end_offset are not increasing {BLOCK}-byte block "
                f"boundaries from 0 within its {entry['bytes']} bytes: {_DAMAGED_INDEX}")
        expected_first += entry["samples"]
    samples = index.get("samples")
    if not is_count(samples):
        raise WebDatasetFormatError(f"{path}: `samples` {samples!r} is not an integer: {_DAMAGED_INDEX}")
    if expected_first != samples:
        raise WebDatasetFormatError(f"{path}: its tars hold {expected_first} samples, `samples` says {samples}: "
                                    f"{_DAMAGED_INDEX}")
    return index


class WebDatasetShards:
    """An export directory as a dataset: `len`, `[i]` (random access via member offsets), iteration.

    Items are the dicts `open_shards(DIR)[i]` gives (read-only numpy arrays with the contract
    dtypes and shapes, plus sample_uid and source). Pickles by path (DataLoader workers).
    """

    def __init__(self, tardir: str | Path):
        self.tardir = Path(tardir)
        self.directory = self.tardir  # named like `ShardSet.directory`: both kinds of source read alike
        self.index = load_index(self.tardir)
        refuse_leftover_tmp(self.tardir, "tars")
        self.manifest: dict = self.index["manifest"]
        self.tars: list[dict] = self.index["tars"]
        self.patch_row_width = int(self.manifest["patch_row_width"])
        self.schema_version = int(self.manifest["schema_version"])
        self.first_indices = np.array([t["first_index"] for t in self.tars] + [self.index["samples"]], dtype=np.int64)
        self._files: dict[int, object] = {}

    def __getstate__(self):
        return {"tardir": self.tardir}

    def __setstate__(self, state):
        self.__init__(state["tardir"])

    def __len__(self) -> int:
        return int(self.index["samples"])

    def close(self) -> None:
        """Close the tar files random access opened (they reopen on the next access)."""
        for fh in self._files.values():
            fh.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def tar_paths(self) -> list[str]:
        """Tar paths in order: what `webdataset.WebDataset(...)` takes."""
        return [str(self.tardir / t["file"]) for t in self.tars]

    def _tar_path(self, k: int) -> Path:
        path = self.tardir / self.tars[k]["file"]
        if not path.is_file():
            raise WebDatasetFormatError(f"{path}: listed in {INDEX_NAME} but missing")
        return path

    def check_files(self) -> None:
        """Every tar present as a regular file of the recorded size: a stat each, nothing opened
        (so a FIFO cannot block)."""
        for entry in self.tars:
            path = self.tardir / entry["file"]
            try:
                found = os.stat(path)
            except OSError:
                raise WebDatasetFormatError(f"{path}: listed in {INDEX_NAME} but missing; export the shard directory "
                                            "again") from None
            if not stat.S_ISREG(found.st_mode):
                raise WebDatasetFormatError(f"{path}: not a regular file, where {INDEX_NAME} lists a tar; export the "
                                            "shard directory again")
            if found.st_size != entry["bytes"]:
                raise WebDatasetFormatError(f"{path}: {found.st_size} bytes, {INDEX_NAME} says {entry['bytes']} "
                                            "(truncated or replaced?); export the shard directory again")

    def verify(self) -> None:
        """Every tar present with the recorded size and sha256, and rejects.jsonl intact."""
        self.check_files()
        for entry in self.tars:
            path = self.tardir / entry["file"]
            digest = file_sha256(path)
            if digest != entry["sha256"]:
                raise WebDatasetFormatError(
                    f"{path}: sha256 {digest} does not match {INDEX_NAME} ({entry['sha256']}); the tar is corrupted"
                )
        self.read_rejects()

    def read_rejects(self) -> list[dict]:
        path = self.tardir / REJECTS_NAME
        if not path.is_file():
            raise WebDatasetFormatError(f"{path}: missing (listed in {INDEX_NAME})")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.index["rejects"]["sha256"]:
            raise WebDatasetFormatError(f"{path}: sha256 does not match {INDEX_NAME}; the file was modified")
        return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]

    def iter_tar(self, k: int) -> Iterator[dict]:
        """Samples of tar `k` in order, read sequentially with the standard `tarfile` reader."""
        path, entry = self._tar_path(k), self.tars[k]
        expected = entry["first_index"]
        key, members = None, {}
        try:
            with tarfile.open(path, "r|") as archive:
                for info in archive:
                    if not info.isfile():
                        continue
                    member_key, member = split_name(info.name)
                    if member_key != key:
                        if key is not None:
                            yield decode_sample(members, f"{path}: sample {key}", self.patch_row_width, expected, self.schema_version)
                            expected += 1
                        if member_key != sample_key(expected):
                            raise WebDatasetFormatError(
                                f"{path}: member {info.name}: expected sample {sample_key(expected)} here (samples out of order or split?)"
                            )
                        key, members = member_key, {}
                    if member in members:
                        raise WebDatasetFormatError(f"{path}: sample {key}: member {member} appears twice")
                    members[member] = archive.extractfile(info).read()
        except (tarfile.TarError, EOFError) as exc:
            raise WebDatasetFormatError(f"{path}: not a readable tar ({exc}); truncated or corrupted? re-export it") from exc
        if key is not None:
            yield decode_sample(members, f"{path}: sample {key}", self.patch_row_width, expected, self.schema_version)
            expected += 1
        if expected - entry["first_index"] != entry["samples"]:
            raise WebDatasetFormatError(f"{path}: {expected - entry['first_index']} samples, {INDEX_NAME} says {entry['samples']}")

    def iter_samples(self, verify: bool = False) -> Iterator[dict]:
        """All samples in global order (`verify`: check every tar's sha256 first)."""
        if verify:
            self.verify()
        for k in range(len(self.tars)):
            yield from self.iter_tar(k)

    __iter__ = iter_samples

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples in {self.tardir}")
        i %= n
        k = int(np.searchsorted(self.first_indices, i, side="right")) - 1
        entry = self.tars[k]
        j = i - entry["first_index"]
        start = entry["sample_offsets"][j]
        end = entry["sample_offsets"][j + 1] if j + 1 < entry["samples"] else entry["end_offset"]
        fh = self._files.get(k)
        if fh is None:
            fh = self._files[k] = open(self._tar_path(k), "rb")
        span = memoryview(os.pread(fh.fileno(), end - start, start))
        path, key = self.tardir / entry["file"], sample_key(i)
        where = f"{path}: sample {key}"
        if len(span) != end - start:
            size = os.fstat(fh.fileno()).st_size
            raise WebDatasetFormatError(
                f"{where}: the tar has {size} bytes, the sample spans bytes {start}..{end}; truncated? re-export it"
            )
        members, pos = {}, 0
        while pos < len(span):
            try:
                info = tarfile.TarInfo.frombuf(bytes(span[pos : pos + BLOCK]), "utf-8", "surrogateescape")
            except tarfile.HeaderError as exc:
                raise WebDatasetFormatError(
                    f"{where}: no tar header at byte {start + pos} ({exc}); offsets in {INDEX_NAME} do not match the tar"
                ) from exc
            member_key, member = split_name(info.name)
            if member_key != key:
                raise WebDatasetFormatError(
                    f"{where}: found member {info.name} at byte {start + pos}; offsets in {INDEX_NAME} do not match the tar"
                )
            members[member] = span[pos + BLOCK : pos + BLOCK + info.size]
            pos += BLOCK + padded(info.size)
        return decode_sample(members, where, self.patch_row_width, i, self.schema_version)


    def sample_stats(self) -> dict[str, np.ndarray]:
        """num_tokens, num_patches, num_images (int64 [n], global order), from the tar headers alone.

        Like `ShardSet.sample_stats` minus num_target_tokens (which lives only in meta.json).
        Per-sample sizes are not in index.json, and reading every sample's meta.json would be a
        tar walk in Python per sample. Instead they come from the tar headers: index.json gives
        each sample's first header offset, members follow in the documented sorted order, each
        USTAR header holds the member's size, each `.npy` payload starts with its header length.
        So one numpy gather per member over all samples of a tar (memory-mapped) yields every
        size, touching only header pages, never a pixel. Each walk is checked: names must be
        `<key>.<member>` for the expected key and the walk must land exactly on the next sample.
        The result is cached per process, keyed by index.json's identity (training ranks plan
        every epoch); callers get copies.
        """
        index_stat = (self.tardir / INDEX_NAME).stat()
        key = (str(self.tardir.resolve()), index_stat.st_mtime_ns, index_stat.st_size)
        cached = _STATS_CACHE.get(key)
        if cached is None:
            parts = [self._tar_stats(k) for k in range(len(self.tars))]
            names = stats_names(self.schema_version)
            cached = {n: np.concatenate([p[n] for p in parts]) if parts else np.zeros(0, np.int64) for n in names}
            _STATS_CACHE[key] = cached
        return {n: v.copy() for n, v in cached.items()}

    def _tar_stats(self, k: int) -> dict[str, np.ndarray]:
        path, entry = self._tar_path(k), self.tars[k]
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise WebDatasetFormatError(f"{path}: {size} bytes, {INDEX_NAME} says {entry['bytes']} (truncated or replaced?)")
        n = int(entry["samples"])
        if n == 0:
            return {name: np.zeros(0, np.int64) for name in stats_names(self.schema_version)}
        starts = np.asarray(entry["sample_offsets"], dtype=np.int64)
        ends = np.append(starts[1:], int(entry["end_offset"]))
        tar = np.memmap(path, dtype=np.uint8, mode="r")
        out = []
        for lo in range(0, n, _STATS_CHUNK):
            hi = min(n, lo + _STATS_CHUNK)
            out.append(_walk_sample_headers(tar, starts[lo:hi], ends[lo:hi], int(entry["first_index"]) + lo, path,
                                            self.patch_row_width, self.schema_version))
        del tar
        return {name: np.concatenate([o[name] for o in out]) for name in stats_names(self.schema_version)}


STATS_NAMES = ("num_tokens", "num_patches", "num_images", "num_video_patches", "num_videos")


def stats_names(schema_version: int) -> tuple[str, ...]:
    return STATS_NAMES if schema_version >= 2 else STATS_NAMES[:3]

_STATS_CACHE: dict[tuple, dict[str, np.ndarray]] = {}  # (tardir, index.json mtime_ns, size) -> sizes
_STATS_CHUNK = 1 << 16  # samples per vectorised step (bounds the gather temporaries to a few MB)
_OCTAL_WEIGHTS = 8 ** np.arange(10, -1, -1, dtype=np.int64)  # USTAR size field: 11 octal digits + NUL
_DECIMAL_WEIGHTS = 10 ** np.arange(KEY_DIGITS - 1, -1, -1, dtype=np.int64)
_NPY_MAGIC = np.frombuffer(b"\x93NUMPY", dtype=np.uint8)


def _walk_sample_headers(
    tar: np.ndarray, starts: np.ndarray, ends: np.ndarray, first_index: int, path: Path, width: int, schema_version: int
) -> dict[str, np.ndarray]:
    """Payload sizes of every member of samples starting at `starts` (see `WebDatasetShards.sample_stats`)."""
    n = len(starts)
    pos = starts.copy()
    payload: dict[str, np.ndarray] = {}

    def fail(rows: np.ndarray, what: str):
        j = int(np.flatnonzero(rows)[0])
        raise WebDatasetFormatError(
            f"{path}: sample {sample_key(first_index + j)} (byte {int(starts[j])}): {what}; the tar does not match {INDEX_NAME} "
            "(re-export it, or check it with WebDatasetShards(...).verify())"
        )

    digits = ((first_index + np.arange(n, dtype=np.int64))[:, None] // _DECIMAL_WEIGHTS) % 10 + ord("0")
    try:
        for member in member_names(schema_version):
            expected_name = np.concatenate(
                [
                    np.full((n, 1), ord(KEY_PREFIX), np.int64),
                    digits,
                    np.broadcast_to(np.frombuffer(f".{member}\0".encode(), np.uint8).astype(np.int64), (n, len(member) + 2)),
                ],
                axis=1,
            )
            name = tar[pos[:, None] + np.arange(expected_name.shape[1])]
            bad = (name != expected_name).any(axis=1)
            if bad.any():
                fail(bad, f"expected member {member} here")
            field = tar[pos[:, None] + 124 + np.arange(11)].astype(np.int64) - ord("0")
            bad = ((field < 0) | (field > 7)).any(axis=1)
            if bad.any():
                fail(bad, f"member {member} has an unreadable size field")
            size = field @ _OCTAL_WEIGHTS
            data = pos + BLOCK
            if member.endswith(".npy"):
                head = tar[data[:, None] + np.arange(12)].astype(np.int64)
                version = head[:, 6]
                bad = (head[:, :6] != _NPY_MAGIC).any(axis=1) | ((version != 1) & (version != 2))
                if bad.any():
                    fail(bad, f"member {member} is not an NPY 1.0/2.0 array")
                header_len = np.where(
                    version == 1,
                    10 + head[:, 8] + (head[:, 9] << 8),
                    12 + head[:, 8] + (head[:, 9] << 8) + (head[:, 10] << 16) + (head[:, 11] << 24),
                )
                payload[member] = size - header_len
            pos = data + -(-size // BLOCK) * BLOCK
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
    if schema_version >= 2:
        checks |= {
            "video_grid_thw.npy": payload["video_grid_thw.npy"] % (3 * ARRAY_MEMBERS["video_grid_thw.npy"][1].itemsize) != 0,
            "video_patches.npy": payload["video_patches.npy"] % (2 * width) != 0,
        }
    for member, bad in checks.items():
        if bad.any():
            fail(bad, f"member {member} has a size that does not fit its shape")
    stats = {
        "num_tokens": tokens,
        "num_patches": payload["pixel_patches.npy"] // width,
        "num_images": payload["image_grid_thw.npy"] // (3 * ARRAY_MEMBERS["image_grid_thw.npy"][1].itemsize),
    }
    if schema_version >= 2:
        stats["num_video_patches"] = payload["video_patches.npy"] // (2 * width)
        stats["num_videos"] = payload["video_grid_thw.npy"] // (3 * ARRAY_MEMBERS["video_grid_thw.npy"][1].itemsize)
    return stats


def iter_webdataset_samples(tardir: str | Path, verify: bool = False) -> Iterator[dict]:
    """Samples of an export directory in global order, as `open_shards(DIR)[i]` gives them."""
    return WebDatasetShards(tardir).iter_samples(verify=verify)
