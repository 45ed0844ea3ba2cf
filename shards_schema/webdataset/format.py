"""The vlmpack WebDataset format: member names, tar headers, `.npy` bytes and index.json.

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

and, exported from schema version 2 shards, the video arrays and counts:

    second_per_grid_ts.npy  float32 [V]   video_grid_thw.npy  int32 [V, 3]
    video_patches.npy       uint8 [M, W2]  (W2 = C*T*P*P)      meta.json  + num_videos, num_video_patches

`.npy` members are NPY 1.0 (exact little-endian dtype and shape, C order), so `webdataset`'s
standard `.decode()` and plain `numpy.load` read them. Tar members carry fixed metadata
(mtime 0, uid/gid 0, empty user/group names, mode 0o644, USTAR headers), so an export is
byte-reproducible: the same directory always gives the same tars and the same index.json.

`index.json` holds the source manifest (profile fingerprint, settings, accounting, shard
layout), and per tar its sample count, first global index, bytes, sha256 and the byte offset
of every sample's first member header: random access is one `pread` per sample.

Encoding and decoding here are pure (bytes in, bytes or arrays out): `reader` and `convert`
do the file work.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import numpy as np
import numpy.lib.format as npy_format

from ..manifest import REJECTS_NAME, ShardFormatError

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
    "second_per_grid_ts.npy": ("second_per_grid_ts", np.dtype("<f4"), "[V]"),
    "video_grid_thw.npy": ("video_grid_thw", np.dtype("<i4"), "[V, 3]"),
    "video_patches.npy": ("video_patches", np.dtype("|u1"), "[M, W2]"),
}
VIDEO_MEMBERS = ("second_per_grid_ts.npy", "video_grid_thw.npy", "video_patches.npy")
MEMBER_NAMES = tuple(sorted([*ARRAY_MEMBERS, META_MEMBER]))
META_COUNTS = ("index", "num_tokens", "num_target_tokens", "num_images", "num_patches", "num_videos", "num_video_patches")


def array_members(schema_version: int) -> dict:
    """The array members of samples exported from shards of `schema_version`."""
    return {k: v for k, v in ARRAY_MEMBERS.items() if schema_version >= 2 or k not in VIDEO_MEMBERS}


def member_names(schema_version: int) -> tuple[str, ...]:
    return tuple(sorted([*array_members(schema_version), META_MEMBER]))


def meta_counts(schema_version: int) -> tuple[str, ...]:
    return META_COUNTS if schema_version >= 2 else META_COUNTS[:5]

BLOCK = tarfile.BLOCKSIZE  # 512
_RECORD = tarfile.RECORDSIZE  # 10240: tar files are padded to whole records, as tarfile and GNU tar do
_NPY_HEADER_PROBE = 16384  # an NPY 1.0 header is < 64 KiB; ours are ~128 bytes, numpy refuses > 10000


class WebDatasetFormatError(ShardFormatError):
    """An export directory (index.json or a tar) that is missing, incomplete, corrupted or foreign."""


def sample_key(index: int) -> str:
    """WebDataset key of global sample `index` (`s000000012`)."""
    return f"{KEY_PREFIX}{index:0{KEY_DIGITS}d}"


def tar_name(k: int) -> str:
    return f"{TAR_PREFIX}{k:06d}.tar"


def padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def tar_file_size(member_bytes: int) -> int:
    """Size on disk of a tar whose members take `member_bytes`: plus 2 end blocks, padded to a record."""
    return -(-(member_bytes + 2 * BLOCK) // _RECORD) * _RECORD


# ---------------------------------------------------------------------------- encoding


def member_header(name: str, size: int) -> bytes:
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


def _meta_bytes(index: int, row: dict, schema_version: int) -> bytes:
    meta = {
        "index": index,
        "sample_uid": row["sample_uid"],
        "source": row["source"],
        "num_tokens": int(row["input_ids"].shape[0]),
        "num_target_tokens": int(np.count_nonzero(row["loss_mask"])),
        "num_images": int(row["image_grid_thw"].shape[0]),
        "num_patches": int(row["pixel_patches"].shape[0]),
    }
    if schema_version >= 2:
        meta["num_videos"] = int(row["video_grid_thw"].shape[0])
        meta["num_video_patches"] = int(row["video_patches"].shape[0])
    return json.dumps(meta, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def encode_sample(index: int, row: dict, schema_version: int) -> list[tuple[str, list]]:
    """(member name, byte parts) for one reader row, in sorted member order."""
    members = {name: _npy_parts(row[field], dtype) for name, (field, dtype, _) in array_members(schema_version).items()}
    members[META_MEMBER] = [_meta_bytes(index, row, schema_version)]
    key = sample_key(index)
    return [(f"{key}.{name}", members[name]) for name in member_names(schema_version)]


def encoded_size(members: list[tuple[str, list]]) -> int:
    return sum(BLOCK + padded(sum(len(p) for p in parts)) for _, parts in members)


# ---------------------------------------------------------------------------- decoding


def load_npy(data, where: str, dtype: np.dtype) -> np.ndarray:
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


def decode_sample(members: dict, where: str, patch_row_width: int, index: int, schema_version: int) -> dict:
    """Members (name -> bytes) of global sample `index` -> the dict `open_shards(DIR)[i]` gives.

    Checked on the way, cheaply (no pass over the tokens beyond a count): every member present,
    exact dtypes and shapes, grids >= 1 with patches matching them, a 0/1 loss mask, and
    meta.json agreeing with the arrays and the sample's place.
    """
    missing = [name for name in member_names(schema_version) if name not in members]
    if missing:
        raise WebDatasetFormatError(f"{where}: missing member(s) {', '.join(missing)} (has {', '.join(sorted(members))})")
    arrays = array_members(schema_version)
    row = {field: load_npy(members[name], f"{where}.{name}", dtype) for name, (field, dtype, _) in arrays.items()}
    try:
        meta = json.loads(bytes(members[META_MEMBER]).decode("utf-8"))
        row["sample_uid"], row["source"] = str(meta["sample_uid"]), str(meta["source"])
        counts = {key: int(meta[key]) for key in meta_counts(schema_version)}
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
    if schema_version >= 2:
        vgrid, seconds, vpatches = row["video_grid_thw"], row["second_per_grid_ts"], row["video_patches"]
        expected |= {
            "video_grid_thw.npy": (vgrid.ndim == 2 and vgrid.shape[1] == 3, "[V, 3]"),
            "second_per_grid_ts.npy": (seconds.ndim == 1 and seconds.shape[0] == (vgrid.shape[0] if vgrid.ndim == 2 else -1),
                                       "[V] like video_grid_thw"),
            "video_patches.npy": (vpatches.ndim == 2 and vpatches.shape[1] == 2 * patch_row_width,
                                  f"[M, {2 * patch_row_width}]"),
        }
    for name, (ok, shape) in expected.items():
        if not ok:
            raise WebDatasetFormatError(f"{where}.{name}: shape {list(row[ARRAY_MEMBERS[name][0]].shape)}, the contract says {shape}")
    if grid.size and int(grid.min()) < 1:
        raise WebDatasetFormatError(f"{where}.image_grid_thw.npy: grid {grid.tolist()} has a value below 1")
    patches_from_grid = int(np.prod(grid, axis=1, dtype=np.int64).sum())
    if patches_from_grid != pixels.shape[0]:
        raise WebDatasetFormatError(f"{where}.pixel_patches.npy: {pixels.shape[0]} patches, image_grid_thw says {patches_from_grid}")
    if schema_version >= 2:
        if vgrid.size and int(vgrid.min()) < 1:
            raise WebDatasetFormatError(f"{where}.video_grid_thw.npy: grid {vgrid.tolist()} has a value below 1")
        video_from_grid = int(np.prod(vgrid, axis=1, dtype=np.int64).sum())
        if video_from_grid != vpatches.shape[0]:
            raise WebDatasetFormatError(f"{where}.video_patches.npy: {vpatches.shape[0]} patches, video_grid_thw says {video_from_grid}")
    if mask.size and int(mask.max()) > 1:
        raise WebDatasetFormatError(f"{where}.loss_mask.npy: value {int(mask.max())}, the contract allows 0 and 1")
    found = {
        "index": index,
        "num_tokens": ids.shape[0],
        "num_target_tokens": int(np.count_nonzero(mask)),
        "num_images": grid.shape[0],
        "num_patches": pixels.shape[0],
    }
    if schema_version >= 2:
        found |= {"num_videos": vgrid.shape[0], "num_video_patches": vpatches.shape[0]}
    for key, value in found.items():
        if counts[key] != value:
            raise WebDatasetFormatError(f"{where}.{META_MEMBER}: {key} {counts[key]}, the sample's arrays and place say {value}")
    if schema_version < 2:  # rows read alike whatever version they come from: no video
        row |= {"video_grid_thw": np.zeros((0, 3), np.int32), "second_per_grid_ts": np.zeros(0, np.float32),
                "video_patches": np.zeros((0, 2 * patch_row_width), np.uint8)}
    return row


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: key = path up to the first dot of the file name, member = the rest."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    return (name, "") if dot < 0 else (name[:dot], name[dot + 1 :])




# ---------------------------------------------------------------------------- index.json


def build_index(manifest: dict, tars: list[dict], rejects: bytes, *, samples_per_tar: int | None, max_tar_bytes: int) -> dict:
    """index.json of an export: the format, the source manifest, rejects.jsonl's digest and the tar list.

    Each tar entry (what the tar writer returns) holds file, samples, first_index, bytes,
    sha256, sample_offsets (header offset of each sample's first member) and end_offset.
    """
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "key_format": f"{KEY_PREFIX}{{index:0{KEY_DIGITS}d}}",
        "members": {name: f"{dtype.name} {shape}" for name, (_, dtype, shape) in
                    array_members(manifest["schema_version"]).items()}
        | {META_MEMBER: "{" + ", ".join(["index", "sample_uid", "source", *meta_counts(manifest["schema_version"])[1:]]) + "}"},
        "url_pattern": f"{TAR_PREFIX}{{000000..{len(tars) - 1:06d}}}.tar" if tars else None,
        "samples": sum(t["samples"] for t in tars),
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
