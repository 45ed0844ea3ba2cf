"""Converting between a shard directory and an export directory (`export_webdataset`, `import_webdataset`)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ..atomic import TMP_SUFFIX, atomic_open, fsync_dir, write_json_atomic, write_jsonl_atomic
from ..manifest import MANIFEST_NAME, REJECTS_NAME, ShardFormatError, build_manifest
from ..reader import open_shards
from ..schema import Sample
from ..writer import ShardWriter
from .format import (
    BLOCK,
    DEFAULT_MAX_TAR_BYTES,
    INDEX_NAME,
    TAR_PREFIX,
    WebDatasetFormatError,
    build_index,
    encode_sample,
    encoded_size,
    member_header,
    tar_file_size,
    tar_name,
)
from .reader import WebDatasetShards


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
            self._write(member_header(name, size))
            for part in parts:
                if len(part):
                    self._write(part)
            if size % BLOCK:
                self._write(bytes(BLOCK - size % BLOCK))

    def close(self) -> dict:
        end_offset = self.pos
        self._write(bytes(tar_file_size(end_offset) - end_offset))  # end-of-archive blocks + record padding
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
                members = encode_sample(index, shard.row(j))
                if writer is not None and (
                    (samples_per_tar is not None and len(writer.sample_offsets) >= samples_per_tar)
                    or tar_file_size(writer.pos + encoded_size(members)) > max_tar_bytes
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
    result = build_index(manifest, tars, rejects, samples_per_tar=samples_per_tar, max_tar_bytes=max_tar_bytes)
    write_json_atomic(out / INDEX_NAME, result)
    return result


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
