"""WebDataset interop: a shard directory <-> tar shards that stream from object stores.

Layout of an export directory (`vlmpack export DIR --format webdataset --out TARDIR`):

    TARDIR/vlmpack-000000.tar, vlmpack-000001.tar, ...   one sample per key, in global order
    TARDIR/rejects.jsonl                                 copied from the source directory
    TARDIR/index.json                                    written last: its presence means complete

A sample is the group of tar members `<key>.<member>` with key `s` + the global sample index
zero-padded to 9 digits (`s000000012`; no dots, so WebDataset's "key = name up to the first
dot" rule splits it exactly), members in sorted name order:

    image_grid_thw.npy  int32 [K, 3]      loss_mask.npy      uint8 [L]
    input_ids.npy       int32 [L]         pixel_patches.npy  uint8 [N, W]  (W = C*P*P)
    meta.json           {index, sample_uid, source, num_tokens, num_target_tokens, num_images, num_patches}
    position_ids.npy    int32 [3, L]

`.npy` members are NPY 1.0 (exact little-endian dtype and shape, C order), so `webdataset`'s
standard `.decode()` and plain `numpy.load` read them. Tar members carry fixed metadata
(mtime 0, uid/gid 0, empty user/group names, mode 0o644, USTAR headers), so an export is
byte-reproducible: the same directory always gives the same tars and the same index.json.

`index.json` holds the source manifest (profile fingerprint, settings, accounting, shard
layout), and per tar its sample count, first global index, bytes, sha256 and the byte offset
of every sample's first member header: random access is one `pread` per sample.

`vlmpack import TARDIR --out DIR` rebuilds a shard directory with the source's shard layout
(same file names, same rows per shard), so a round trip reproduces the Arrow shards and the
manifest byte for byte.

This module imports only the standard library, numpy and the contract: not `preprocess`, and
not the `webdataset` package (which imports torch); the tars it writes need no special reader.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.lib.format as npy_format

from .atomic import TMP_SUFFIX, atomic_open, fsync_dir, write_json_atomic, write_jsonl_atomic
from .manifest import MANIFEST_NAME, REJECTS_NAME, ShardFormatError, build_manifest
from .reader import open_shards
from .schema import FORMAT_NAME as SHARDS_FORMAT_NAME
from .schema import SCHEMA_VERSION, Sample
from .writer import ShardWriter, file_sha256

FORMAT_NAME = "vlmpack-webdataset"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
TAR_PREFIX = "vlmpack-"
DEFAULT_MAX_TAR_BYTES = 1 << 30  # ~1 GB, like the Arrow shards: big sequential reads, enough tars to split over workers

KEY_PREFIX = "s"
KEY_DIGITS = 9
META_MEMBER = "meta.json"
# member -> (sample field, dtype on disk, shape in words). Little-endian explicitly: the bytes
# of an export must not depend on the machine that wrote it.
ARRAY_MEMBERS = {
    "image_grid_thw.npy": ("image_grid_thw", np.dtype("<i4"), "[K, 3]"),
    "input_ids.npy": ("input_ids", np.dtype("<i4"), "[L]"),
    "loss_mask.npy": ("loss_mask", np.dtype("|u1"), "[L]"),
    "pixel_patches.npy": ("pixel_patches", np.dtype("|u1"), "[N, W]"),
    "position_ids.npy": ("position_ids", np.dtype("<i4"), "[3, L]"),
}
MEMBER_NAMES = tuple(sorted([*ARRAY_MEMBERS, META_MEMBER]))

_BLOCK = tarfile.BLOCKSIZE  # 512
_RECORD = tarfile.RECORDSIZE  # 10240: tar files are padded to whole records, as tarfile and GNU tar do
_NPY_HEADER_PROBE = 16384  # an NPY 1.0 header is < 64 KiB; ours are ~128 bytes, numpy refuses > 10000


class WebDatasetFormatError(ShardFormatError):
    """An export directory (index.json or a tar) that is missing, incomplete, corrupted or foreign."""


def sample_key(index: int) -> str:
    """WebDataset key of global sample `index` (`s000000012`)."""
    return f"{KEY_PREFIX}{index:0{KEY_DIGITS}d}"


def tar_name(k: int) -> str:
    return f"{TAR_PREFIX}{k:06d}.tar"


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _tar_file_size(member_bytes: int) -> int:
    """Size on disk of a tar whose members take `member_bytes`: plus 2 end blocks, padded to a record."""
    return -(-(member_bytes + 2 * _BLOCK) // _RECORD) * _RECORD


# ---------------------------------------------------------------------------- writing


def _member_header(name: str, size: int) -> bytes:
    """One USTAR header with every field fixed, so the bytes depend only on name and size.

    USTAR (not PAX/GNU): no extended records carrying times, and every tar reader knows it;
    our names are short ASCII, well inside its 100-character limit.
    """
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


def _npy_parts(array: np.ndarray, dtype: np.dtype) -> list:
    """NPY 1.0 bytes of `array` as [header, data], the data a view (no copy of the pixels).

    Same bytes as `numpy.save` / `numpy.lib.format.write_array` (a test checks it).
    """
    array = np.ascontiguousarray(array, dtype=dtype)
    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, npy_format.header_data_from_array_1_0(array))
    return [header.getvalue(), array.reshape(-1).view(np.uint8)]


def _meta_bytes(index: int, row: dict) -> bytes:
    meta = {
        "index": index,
        "sample_uid": row["sample_uid"],
        "source": row["source"],
        "num_tokens": int(row["input_ids"].shape[0]),
        "num_target_tokens": int(np.count_nonzero(row["loss_mask"])),
        "num_images": int(row["image_grid_thw"].shape[0]),
        "num_patches": int(row["pixel_patches"].shape[0]),
    }
    return json.dumps(meta, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _encode_sample(index: int, row: dict) -> list[tuple[str, list]]:
    """(member name, byte parts) for one reader row, in sorted member order."""
    members = {name: _npy_parts(row[field], dtype) for name, (field, dtype, _) in ARRAY_MEMBERS.items()}
    members[META_MEMBER] = [_meta_bytes(index, row)]
    key = sample_key(index)
    return [(f"{key}.{name}", members[name]) for name in MEMBER_NAMES]


def _encoded_size(members: list[tuple[str, list]]) -> int:
    return sum(_BLOCK + _padded(sum(len(p) for p in parts)) for _, parts in members)


class _TarShardWriter:
    """Writes one tar to `<name>.tmp`, hashing as it goes; `close()` fsyncs and renames it.

    The tar framing is written here rather than through `tarfile.TarFile.addfile` or
    `webdataset.TarWriter`: both copy each payload through a file object, and TarWriter streams
    (`w|`), so neither tells where a member starts. Writing headers (`TarInfo.tobuf`) and
    payloads ourselves gives each sample's offset for random access, hashes the bytes once
    while writing, and writes pixel arrays straight from the memory-mapped shard.
    """

    def __init__(self, path: Path, first_index: int):
        self.path = path
        self.tmp_path = path.with_name(path.name + TMP_SUFFIX)
        self.first_index = first_index
        self.sample_offsets: list[int] = []
        self.pos = 0
        self._hash = hashlib.sha256()
        self._fh = open(self.tmp_path, "wb")

    def _write(self, data) -> None:
        self._fh.write(data)
        self._hash.update(data)
        self.pos += len(data)

    def add(self, members: list[tuple[str, list]]) -> None:
        self.sample_offsets.append(self.pos)
        for name, parts in members:
            size = sum(len(p) for p in parts)
            self._write(_member_header(name, size))
            for part in parts:
                if len(part):
                    self._write(part)
            if size % _BLOCK:
                self._write(bytes(_BLOCK - size % _BLOCK))

    def close(self) -> dict:
        end_offset = self.pos
        self._write(bytes(_tar_file_size(end_offset) - end_offset))  # end-of-archive blocks + record padding
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self.tmp_path, self.path)
        fsync_dir(self.path.parent)
        return {
            "file": self.path.name,
            "samples": len(self.sample_offsets),
            "first_index": self.first_index,
            "bytes": self.pos,
            "sha256": self._hash.hexdigest(),
            "sample_offsets": self.sample_offsets,
            "end_offset": end_offset,
        }

    def abort(self) -> None:
        self._fh.close()
        self.tmp_path.unlink(missing_ok=True)


def _prepare_out_dir(out: Path, source: Path, *, overwrite: bool, completion_file: str, owned: re.Pattern) -> None:
    """Create `out`, or, with `overwrite`, clear the files a previous run of ours left there.

    The completion file (index.json / manifest.json) goes first, so a run killed midway never
    leaves a directory that looks complete. Files we did not write are never deleted.
    """
    if out.resolve() == source.resolve():
        raise ValueError(f"--out {out} is the input directory; choose another directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(p for p in out.iterdir())
    if not existing:
        return
    if not overwrite:
        raise ValueError(f"--out {out} is not empty ({len(existing)} entries); choose a new directory or pass --overwrite")
    (out / completion_file).unlink(missing_ok=True)
    for path in existing:
        if path.is_file() and owned.fullmatch(path.name):
            path.unlink()
    fsync_dir(out)


_EXPORT_OWNED = re.compile(rf"({re.escape(TAR_PREFIX)}\d+\.tar|{re.escape(REJECTS_NAME)}|{re.escape(INDEX_NAME)})(\{TMP_SUFFIX})?")
_IMPORT_OWNED = re.compile(rf"([\w.-]+\.arrow|{re.escape(REJECTS_NAME)}|{re.escape(MANIFEST_NAME)})(\{TMP_SUFFIX})?")


def export_webdataset(
    directory: str | Path,
    out: str | Path,
    *,
    samples_per_tar: int | None = None,
    max_tar_bytes: int = DEFAULT_MAX_TAR_BYTES,
    overwrite: bool = False,
) -> dict:
    """Write the shard directory `directory` as WebDataset tars under `out`; returns index.json.

    A new tar starts when the current one holds `samples_per_tar` samples (no limit if None)
    or the next sample would take it past `max_tar_bytes` (a single larger sample gets a tar
    of its own).
    """
    directory, out = Path(directory), Path(out)
    if samples_per_tar is not None and samples_per_tar < 1:
        raise ValueError(f"--samples-per-tar must be at least 1, got {samples_per_tar}")
    if max_tar_bytes < 1:
        raise ValueError(f"--max-tar-bytes must be positive, got {max_tar_bytes}")
    shards = open_shards(directory)
    manifest = shards.manifest
    rejects_path = directory / REJECTS_NAME
    if not rejects_path.is_file():
        raise ShardFormatError(f"{directory}: no {REJECTS_NAME} beside {MANIFEST_NAME} (an incomplete directory?)")
    _prepare_out_dir(out, directory, overwrite=overwrite, completion_file=INDEX_NAME, owned=_EXPORT_OWNED)

    tars: list[dict] = []
    writer: _TarShardWriter | None = None
    index = 0
    try:
        for k in range(len(shards.shard_files)):
            shard = shards.shard(k)
            for j in range(len(shard)):
                members = _encode_sample(index, shard.row(j))
                if writer is not None and (
                    (samples_per_tar is not None and len(writer.sample_offsets) >= samples_per_tar)
                    or _tar_file_size(writer.pos + _encoded_size(members)) > max_tar_bytes
                ):
                    tars.append(writer.close())
                    writer = None
                if writer is None:
                    writer = _TarShardWriter(out / tar_name(len(tars)), first_index=index)
                writer.add(members)
                index += 1
        if writer is not None:
            tars.append(writer.close())
            writer = None
    finally:
        if writer is not None:
            writer.abort()

    rejects = rejects_path.read_bytes()
    with atomic_open(out / REJECTS_NAME, "wb") as fh:
        fh.write(rejects)
    result = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "key_format": f"{KEY_PREFIX}{{index:0{KEY_DIGITS}d}}",
        "members": {name: f"{dtype.name} {shape}" for name, (_, dtype, shape) in ARRAY_MEMBERS.items()}
        | {META_MEMBER: "{index, sample_uid, source, num_tokens, num_target_tokens, num_images, num_patches}"},
        "url_pattern": f"{TAR_PREFIX}{{000000..{len(tars) - 1:06d}}}.tar" if tars else None,
        "samples": index,
        "tar_bytes": sum(t["bytes"] for t in tars),
        "export": {"samples_per_tar": samples_per_tar, "max_tar_bytes": max_tar_bytes},
        "manifest": manifest,
        "rejects": {
            "file": REJECTS_NAME,
            "bytes": len(rejects),
            "lines": rejects.count(b"\n"),
            "sha256": hashlib.sha256(rejects).hexdigest(),
        },
        "tars": tars,
    }
    write_json_atomic(out / INDEX_NAME, result)
    return result


# ---------------------------------------------------------------------------- reading


def _load_npy(data, where: str, dtype: np.dtype) -> np.ndarray:
    """A read-only view of NPY `data` with exactly `dtype` (C order), or a clear error."""
    probe = io.BytesIO(bytes(data[:_NPY_HEADER_PROBE]))
    try:
        version = npy_format.read_magic(probe)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"NPY version {version[0]}.{version[1]}, expected 1.0 or 2.0")
        read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        shape, fortran_order, found = read_header(probe)
    except (ValueError, EOFError) as exc:
        raise WebDatasetFormatError(f"{where}: not a valid .npy array ({exc})") from exc
    if found != dtype:
        raise WebDatasetFormatError(f"{where}: dtype {found.str} ({found.name}), the contract says {dtype.str} ({dtype.name})")
    if fortran_order and len(shape) > 1:
        raise WebDatasetFormatError(f"{where}: Fortran-ordered array; re-export it in C order")
    count = int(np.prod(shape, dtype=np.int64))
    offset = probe.tell()
    if len(data) - offset != count * dtype.itemsize:
        raise WebDatasetFormatError(
            f"{where}: {len(data) - offset} data bytes for shape {tuple(shape)} ({count * dtype.itemsize} expected; truncated?)"
        )
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def _decode_sample(members: dict, where: str, patch_row_width: int) -> dict:
    """Members (name -> bytes) of one sample -> the dict `open_shards(DIR)[i]` gives, validated."""
    missing = [name for name in MEMBER_NAMES if name not in members]
    if missing:
        raise WebDatasetFormatError(f"{where}: missing member(s) {', '.join(missing)} (has {', '.join(sorted(members))})")
    row = {field: _load_npy(members[name], f"{where}.{name}", dtype) for name, (field, dtype, _) in ARRAY_MEMBERS.items()}
    try:
        meta = json.loads(bytes(members[META_MEMBER]).decode("utf-8"))
        row["sample_uid"], row["source"] = str(meta["sample_uid"]), str(meta["source"])
        num_target_tokens = int(meta["num_target_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise WebDatasetFormatError(f"{where}.{META_MEMBER}: not a vlmpack meta record ({type(exc).__name__}: {exc})") from exc

    ids, mask, pos, grid, pixels = (row[f] for f in ("input_ids", "loss_mask", "position_ids", "image_grid_thw", "pixel_patches"))
    expected = {
        "input_ids.npy": (ids.ndim == 1, "[L]"),
        "loss_mask.npy": (mask.shape == ids.shape, f"[{ids.shape[0] if ids.ndim == 1 else 'L'}] like input_ids"),
        "position_ids.npy": (ids.ndim == 1 and pos.shape == (3, ids.shape[0]), f"[3, {ids.shape[0] if ids.ndim == 1 else 'L'}]"),
        "image_grid_thw.npy": (grid.ndim == 2 and grid.shape[1] == 3, "[K, 3]"),
        "pixel_patches.npy": (pixels.ndim == 2 and pixels.shape[1] == patch_row_width, f"[N, {patch_row_width}]"),
    }
    for name, (ok, shape) in expected.items():
        if not ok:
            raise WebDatasetFormatError(f"{where}.{name}: shape {list(row[ARRAY_MEMBERS[name][0]].shape)}, the contract says {shape}")
    patches_from_grid = int(np.prod(grid, axis=1, dtype=np.int64).sum())
    if patches_from_grid != pixels.shape[0]:
        raise WebDatasetFormatError(f"{where}.pixel_patches.npy: {pixels.shape[0]} patches, image_grid_thw says {patches_from_grid}")
    if num_target_tokens != int(np.count_nonzero(mask)):
        raise WebDatasetFormatError(
            f"{where}.{META_MEMBER}: num_target_tokens {num_target_tokens}, loss_mask has {np.count_nonzero(mask)} targets"
        )
    return row


def _split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: key = path up to the first dot of the file name, member = the rest."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    return (name, "") if dot < 0 else (name[:dot], name[dot + 1 :])


def load_index(tardir: str | Path) -> dict:
    """index.json of an export directory, checked for format, version and a consistent tar list."""
    tardir = Path(tardir)
    path = tardir / INDEX_NAME
    if not path.is_file():
        hint = " (an export that has not finished, or not a `vlmpack export` directory?)" if tardir.is_dir() else ""
        raise WebDatasetFormatError(f"{tardir}: no {INDEX_NAME}{hint}")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WebDatasetFormatError(f"{path}: not valid JSON ({exc})") from exc
    found = index.get("format") if isinstance(index, dict) else None
    if found != FORMAT_NAME:
        raise WebDatasetFormatError(f"{path}: not a vlmpack WebDataset index (format {found!r})")
    if index.get("format_version") != FORMAT_VERSION:
        raise WebDatasetFormatError(
            f"{path}: format version {index.get('format_version')}, this vlmpack reads {FORMAT_VERSION}; re-export with this version"
        )
    manifest = index.get("manifest") or {}
    if manifest.get("format") != SHARDS_FORMAT_NAME or manifest.get("schema_version") != SCHEMA_VERSION:
        raise WebDatasetFormatError(
            f"{path}: exported from shard schema {manifest.get('format')!r} v{manifest.get('schema_version')}, "
            f"this vlmpack reads {SHARDS_FORMAT_NAME!r} v{SCHEMA_VERSION}"
        )
    expected_first = 0
    for k, entry in enumerate(index.get("tars", [])):
        try:
            name = entry["file"]
            consistent = entry["first_index"] == expected_first and len(entry["sample_offsets"]) == entry["samples"]
            expected_first += int(entry["samples"])
            _ = entry["bytes"], entry["sha256"], entry["end_offset"]
        except (KeyError, TypeError, ValueError) as exc:
            raise WebDatasetFormatError(f"{path}: tar entry {k} is malformed ({type(exc).__name__}: {exc})") from exc
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".tar"):
            raise WebDatasetFormatError(f"{path}: tar entry {name!r} is not a plain .tar file name")
        if not consistent:
            raise WebDatasetFormatError(f"{path}: entry for {name} is inconsistent (first_index, samples, sample_offsets)")
    if expected_first != index.get("samples"):
        raise WebDatasetFormatError(f"{path}: tars hold {expected_first} samples, index says {index.get('samples')}")
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
        self.manifest: dict = self.index["manifest"]
        self.tars: list[dict] = self.index["tars"]
        self.patch_row_width = int(self.manifest["patch_row_width"])
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

    def verify(self) -> None:
        """Every tar present with the recorded size and sha256, and rejects.jsonl intact."""
        for k, entry in enumerate(self.tars):
            path = self._tar_path(k)
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise WebDatasetFormatError(f"{path}: {size} bytes, {INDEX_NAME} says {entry['bytes']} (truncated or replaced?)")
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
                    member_key, member = _split_name(info.name)
                    if member_key != key:
                        if key is not None:
                            yield _decode_sample(members, f"{path}: sample {key}", self.patch_row_width)
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
            yield _decode_sample(members, f"{path}: sample {key}", self.patch_row_width)
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
                info = tarfile.TarInfo.frombuf(bytes(span[pos : pos + _BLOCK]), "utf-8", "surrogateescape")
            except tarfile.HeaderError as exc:
                raise WebDatasetFormatError(
                    f"{where}: no tar header at byte {start + pos} ({exc}); offsets in {INDEX_NAME} do not match the tar"
                ) from exc
            member_key, member = _split_name(info.name)
            if member_key != key:
                raise WebDatasetFormatError(
                    f"{where}: found member {info.name} at byte {start + pos}; offsets in {INDEX_NAME} do not match the tar"
                )
            members[member] = span[pos + _BLOCK : pos + _BLOCK + info.size]
            pos += _BLOCK + _padded(info.size)
        return _decode_sample(members, where, self.patch_row_width)


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
            cached = {n: np.concatenate([p[n] for p in parts]) if parts else np.zeros(0, np.int64) for n in STATS_NAMES}
            _STATS_CACHE[key] = cached
        return {n: v.copy() for n, v in cached.items()}

    def _tar_stats(self, k: int) -> dict[str, np.ndarray]:
        path, entry = self._tar_path(k), self.tars[k]
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise WebDatasetFormatError(f"{path}: {size} bytes, {INDEX_NAME} says {entry['bytes']} (truncated or replaced?)")
        n = int(entry["samples"])
        if n == 0:
            return {name: np.zeros(0, np.int64) for name in STATS_NAMES}
        starts = np.asarray(entry["sample_offsets"], dtype=np.int64)
        ends = np.append(starts[1:], int(entry["end_offset"]))
        tar = np.memmap(path, dtype=np.uint8, mode="r")
        out = []
        for lo in range(0, n, _STATS_CHUNK):
            hi = min(n, lo + _STATS_CHUNK)
            out.append(_walk_sample_headers(tar, starts[lo:hi], ends[lo:hi], int(entry["first_index"]) + lo, path, self.patch_row_width))
        del tar
        return {name: np.concatenate([o[name] for o in out]) for name in STATS_NAMES}


STATS_NAMES = ("num_tokens", "num_patches", "num_images")
_STATS_CACHE: dict[tuple, dict[str, np.ndarray]] = {}  # (tardir, index.json mtime_ns, size) -> sizes
_STATS_CHUNK = 1 << 16  # samples per vectorised step (bounds the gather temporaries to a few MB)
_OCTAL_WEIGHTS = 8 ** np.arange(10, -1, -1, dtype=np.int64)  # USTAR size field: 11 octal digits + NUL
_DECIMAL_WEIGHTS = 10 ** np.arange(KEY_DIGITS - 1, -1, -1, dtype=np.int64)
_NPY_MAGIC = np.frombuffer(b"\x93NUMPY", dtype=np.uint8)


def _walk_sample_headers(
    tar: np.ndarray, starts: np.ndarray, ends: np.ndarray, first_index: int, path: Path, width: int
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
        for member in MEMBER_NAMES:
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
            data = pos + _BLOCK
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
            pos = data + -(-size // _BLOCK) * _BLOCK
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


def iter_webdataset_samples(tardir: str | Path, verify: bool = False) -> Iterator[dict]:
    """Samples of an export directory in global order, as `open_shards(DIR)[i]` gives them."""
    return WebDatasetShards(tardir).iter_samples(verify=verify)


# ---------------------------------------------------------------------------- import


def import_webdataset(tardir: str | Path, out: str | Path, *, overwrite: bool = False) -> dict:
    """Rebuild a shard directory from an export; returns its manifest.

    Every tar's sha256 is checked before anything is written. The shards keep the source's
    file names and rows per shard, so the Arrow files (and the manifest) come out identical.
    """
    tardir, out = Path(tardir), Path(out)
    dataset = WebDatasetShards(tardir)
    dataset.verify()
    rejects = dataset.read_rejects()
    manifest = dataset.manifest
    layout = manifest["shards"]
    index_path = tardir / INDEX_NAME
    for entry in layout:
        if Path(entry["file"]).name != entry["file"] or not entry["file"].endswith(".arrow"):
            raise WebDatasetFormatError(f"{index_path}: shard name {entry['file']!r} is not a plain .arrow file name")
    rows = sum(int(s["rows"]) for s in layout)
    if rows != len(dataset):
        raise WebDatasetFormatError(f"{index_path}: the manifest's shards hold {rows} rows, the tars {len(dataset)}")
    rejected = manifest["accounting"]["rows_rejected"]
    if len(rejects) != rejected:
        raise WebDatasetFormatError(f"{tardir / REJECTS_NAME}: {len(rejects)} rejects, the manifest accounts for {rejected}")
    _prepare_out_dir(out, tardir, overwrite=overwrite, completion_file=MANIFEST_NAME, owned=_IMPORT_OWNED)

    samples = dataset.iter_samples()
    width = dataset.patch_row_width
    shard_infos = []
    for entry in layout:
        writer = ShardWriter(out / entry["file"], width)
        try:
            for _ in range(int(entry["rows"])):
                row = next(samples)
                writer.add(
                    Sample(
                        sample_uid=row["sample_uid"],
                        source=row["source"],
                        input_ids=row["input_ids"],
                        loss_mask=row["loss_mask"],
                        position_ids=row["position_ids"],
                        pixel_patches=row["pixel_patches"],
                        image_grid_thw=row["image_grid_thw"],
                    )
                )
            info = writer.close().to_json()
        except BaseException:
            writer.abort()
            raise
        for stat in ("rows", "tokens", "target_tokens", "images", "patches"):
            if info[stat] != entry[stat]:
                raise WebDatasetFormatError(f"{out / entry['file']}: {stat} {info[stat]}, the source manifest says {entry[stat]}")
        shard_infos.append(info)
    write_jsonl_atomic(out / REJECTS_NAME, rejects)
    result = build_manifest(
        profile=manifest["profile"],
        settings=manifest["settings"],
        shards=shard_infos,
        accounting=manifest["accounting"],
        patch_row_width=width,
    )
    write_json_atomic(out / MANIFEST_NAME, result)
    return result


# ---------------------------------------------------------------------------- CLI


def _parse_bytes(text: str) -> int:
    """`1073741824`, `512M`, `1G`, `1.5GB` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1073741824, 512M, 1G)")
    scale = 1 << (10 * " KMGT".index(match.group(2).upper() or " "))
    return int(float(match.group(1)) * scale)


def _fail(command: str, exc: Exception) -> int:
    print(f"vlmpack {command}: error: {exc}", file=sys.stderr)
    return 2


class Export:
    """`vlmpack export DIR --format webdataset --out TARDIR`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("directory", help="shard directory (with manifest.json)")
        parser.add_argument("--format", choices=["webdataset"], default="webdataset", help="output format (default: webdataset)")
        parser.add_argument("--out", required=True, help="directory for the tars, index.json and rejects.jsonl")
        parser.add_argument("--samples-per-tar", type=int, default=None, help="at most this many samples per tar (default: no limit)")
        parser.add_argument(
            "--max-tar-bytes",
            type=_parse_bytes,
            default=DEFAULT_MAX_TAR_BYTES,
            help="start a new tar before this size (default: 1G; K/M/G/T suffixes)",
        )
        parser.add_argument("--overwrite", action="store_true", help="replace a previous export in --out")

    @staticmethod
    def run(args) -> int:
        try:
            index = export_webdataset(
                args.directory,
                args.out,
                samples_per_tar=args.samples_per_tar,
                max_tar_bytes=args.max_tar_bytes,
                overwrite=args.overwrite,
            )
        except (ShardFormatError, ValueError) as exc:
            return _fail("export", exc)
        print(f"exported {index['samples']} samples into {len(index['tars'])} tars ({index['tar_bytes'] / 1e6:.1f} MB) -> {args.out}")
        if index["url_pattern"]:
            print(f"WebDataset urls: {Path(args.out) / index['url_pattern']}")
        return 0


class Import:
    """`vlmpack import TARDIR --out DIR`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("tardir", help="directory written by `vlmpack export --format webdataset` (with index.json)")
        parser.add_argument("--out", required=True, help="shard directory to create")
        parser.add_argument("--overwrite", action="store_true", help="replace a previous import in --out")

    @staticmethod
    def run(args) -> int:
        try:
            manifest = import_webdataset(args.tardir, args.out, overwrite=args.overwrite)
        except (ShardFormatError, ValueError) as exc:
            return _fail("import", exc)
        totals = manifest["totals"]
        print(f"imported {totals['rows']} samples into {totals['shards']} shards ({totals['bytes'] / 1e6:.1f} MB) -> {args.out}")
        return 0
