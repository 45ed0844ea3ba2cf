"""Converting between a shard directory and an export directory (`export_webdataset`, `import_webdataset`)."""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from ..atomic import TMP_SUFFIX, atomic_open, fsync_dir, write_json_atomic, write_jsonl_atomic
from ..errors import UserError, first_few
from ..manifest import MANIFEST_NAME, REJECTS_NAME, ShardFormatError, build_manifest
from ..outdir import exclusive_output_dir, recorded_command, refuse_input_as_output, user_entries
from ..reader import ShardFault, open_shards
from ..schema import VIDEO_COLUMNS, Sample
from ..writer import ShardWriter, file_sha256
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


def _claim_out_dir(out: Path, *, overwrite: bool, completion_file: str, owned: re.Pattern, command: str,
                   last_writer: str | None) -> None:
    """Make the locked `out` ready to write: empty, or holding only a previous run's output of
    ours, which `overwrite` replaces (`_check_out_dir`). The completion file goes first, so a
    run killed midway never leaves a directory that looks complete.
    """
    _check_out_dir(out, overwrite=overwrite, completion_file=completion_file, owned=owned, command=command,
                   last_writer=last_writer)
    entries = user_entries(out)
    if not entries:
        return
    (out / completion_file).unlink(missing_ok=True)
    for name in entries:
        (out / name).unlink(missing_ok=True)
    fsync_dir(out)


def _check_out_dir(out: Path, *, overwrite: bool, completion_file: str, owned: re.Pattern, command: str,
                   last_writer: str | None) -> None:
    """UserError unless `out` may be written, reading only: empty, or holding only a previous
    run's output of `command` (its lock file's record, `last_writer`, read before this job took
    the lock) and `overwrite` given. Anything else is refused whatever the flags: our output
    never mixes with other files, and a delete never reaches files we did not write, even
    where their names are those we write (a user's shard directory under `import`)."""
    what = f"vlmpack {command}"
    entries = user_entries(out)
    foreign = [name for name in entries if not (owned.fullmatch(name) and (out / name).is_file())]
    if foreign:
        raise UserError(f"--out {out} holds files that `{what}` did not write ({first_few(foreign)}): choose an empty or "
                        "new directory")
    if entries and last_writer != command:
        raise UserError(f"--out {out} is not empty ({first_few(entries)}) and is not the output of `{what}`: choose "
                        "an empty or new directory")
    if entries and not overwrite:
        state = "a finished" if completion_file in entries else f"an unfinished (no {completion_file})"
        raise UserError(f"--out {out} holds the output of {state} `{what}`: pass --overwrite to replace it, or choose a new directory")


def _remove_on_failure(paths: list[Path]) -> None:
    """What a failed run published goes, completion file first, so nothing partial stays behind."""
    for path in paths:
        path.unlink(missing_ok=True)


_EXPORT_OWNED = re.compile(rf"({re.escape(TAR_PREFIX)}\d+\.tar|{re.escape(REJECTS_NAME)}|{re.escape(INDEX_NAME)})(\{TMP_SUFFIX})?")
_IMPORT_OWNED = re.compile(rf"([\w.-]+\.arrow|{re.escape(REJECTS_NAME)}|{re.escape(MANIFEST_NAME)})(\{TMP_SUFFIX})?")


def _check_sha256(path: Path, entry: dict) -> None:
    """The shard at `path` has the sha256 its manifest entry records."""
    digest = file_sha256(path)
    if digest != entry["sha256"]:
        raise ShardFault(path, "sha256_mismatch", f"sha256 {digest} does not match {MANIFEST_NAME} ({entry['sha256']}): "
                                                  "its bytes changed since the job wrote them")


def export_webdataset(
    directory: str | Path,
    out: str | Path,
    *,
    samples_per_tar: int | None = None,
    max_tar_bytes: int = DEFAULT_MAX_TAR_BYTES,
    overwrite: bool = False,
    progress: bool = False,
) -> dict:
    """Write the shard directory `directory` as WebDataset tars under `out`; returns index.json.

    A new tar starts when the current one holds `samples_per_tar` samples (no limit if None)
    or the next sample would take it past `max_tar_bytes` (a single larger sample gets a tar
    of its own). Each shard's size and sha256 are checked against the manifest before its
    samples are written (one more sequential read of the shard, usually from the page cache
    by the time its rows are encoded), so a corrupted shard stops the export and nothing of
    the export is left. `progress`: a bar of the samples written.
    """
    from tqdm import tqdm

    directory, out = Path(directory), Path(out)
    if samples_per_tar is not None and samples_per_tar < 1:
        raise UserError(f"--samples-per-tar must be at least 1, got {samples_per_tar}")
    if max_tar_bytes < 1:
        raise UserError(f"--max-tar-bytes must be positive, got {max_tar_bytes}")
    shards = open_shards(directory)
    manifest = shards.manifest
    version = int(manifest["schema_version"])
    rejects_path = directory / REJECTS_NAME
    if not rejects_path.is_file():
        raise ShardFormatError(f"{directory}: no {REJECTS_NAME} beside {MANIFEST_NAME} (an incomplete directory?)")
    refuse_input_as_output(out, directory)
    claim = {"overwrite": overwrite, "completion_file": INDEX_NAME, "owned": _EXPORT_OWNED, "command": "export",
             "last_writer": recorded_command(out)}
    with exclusive_output_dir(out, "export", check=lambda d: _check_out_dir(d, **claim)) as out:
        _claim_out_dir(out, **claim)
        tars: list[dict] = []
        writer: _TarShardWriter | None = None
        index = 0
        bar = tqdm(total=len(shards), unit="sample", desc="export", disable=not progress)
        try:
            for k, entry in enumerate(manifest["shards"]):
                shard = shards.shard(k)  # present, of the manifest's size, a readable shard
                _check_sha256(directory / entry["file"], entry)
                for j in range(len(shard)):
                    members = encode_sample(index, shard.row(j), version)
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
                    bar.update()
            if writer is not None:
                tars.append(writer.close())
                writer = None
            rejects = rejects_path.read_bytes()
            with atomic_open(out / REJECTS_NAME, "wb") as fh:
                fh.write(rejects)
            result = build_index(manifest, tars, rejects, samples_per_tar=samples_per_tar, max_tar_bytes=max_tar_bytes)
            write_json_atomic(out / INDEX_NAME, result)
        except BaseException:
            if writer is not None:
                writer.abort()
            _remove_on_failure([out / INDEX_NAME, *(out / t["file"] for t in tars), out / REJECTS_NAME])
            raise
        finally:
            bar.close()
    return result


def import_webdataset(tardir: str | Path, out: str | Path, *, overwrite: bool = False, progress: bool = False) -> dict:
    """Rebuild a shard directory from an export; returns its manifest.

    Every tar's size and sha256 are checked before anything is written, every sample is decoded
    and checked (dtypes, shapes, patches against grids, meta.json against the arrays), and each
    rebuilt shard must have the exported shard's sha256: the shards keep the source's file names
    and rows per shard, so the Arrow files (and the manifest) come out identical. On any
    mismatch the shards written so far are removed: nothing partial is left. `progress`: a bar
    of the samples written.
    """
    from tqdm import tqdm

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
    refuse_input_as_output(out, tardir)
    listed = {entry["file"] for entry in dataset.tars}
    stray = sorted(p.name for p in tardir.glob("*.tar") if p.name not in listed)
    if stray:  # samples the index does not list are not imported: say so rather than drop them unseen
        print(f"vlmpack import: warning: {tardir} holds {len(stray)} tar file(s) that {INDEX_NAME} does not list, not imported: "
              f"{', '.join(stray[:5])}{' ...' if len(stray) > 5 else ''}", file=sys.stderr)
    claim = {"overwrite": overwrite, "completion_file": MANIFEST_NAME, "owned": _IMPORT_OWNED, "command": "import",
             "last_writer": recorded_command(out)}
    with exclusive_output_dir(out, "import", check=lambda d: _check_out_dir(d, **claim)) as out:
        _claim_out_dir(out, **claim)
        samples = dataset.iter_samples()
        bar = tqdm(total=len(dataset), unit="sample", desc="import", disable=not progress)
        width = dataset.patch_row_width
        shard_infos: list[dict] = []
        try:
            for entry in layout:
                shard_infos.append(_import_shard(out / entry["file"], entry, samples, width, index_path,
                                                 dataset.schema_version, bar))
            write_jsonl_atomic(out / REJECTS_NAME, rejects)
            result = build_manifest(
                profile=manifest["profile"],
                settings=manifest["settings"],
                shards=shard_infos,
                accounting=manifest["accounting"],
                patch_row_width=width,
                schema_version=dataset.schema_version,
            )
            write_json_atomic(out / MANIFEST_NAME, result)
        except BaseException:
            _remove_on_failure([out / MANIFEST_NAME, *(out / info["file"] for info in shard_infos), out / REJECTS_NAME])
            raise
        finally:
            bar.close()
    return result


def _import_shard(path: Path, entry: dict, samples, width: int, index_path: Path, schema_version: int, bar) -> dict:
    """Write the next `entry["rows"]` samples as shard `path` (a tick of `bar` each); it must
    equal the exported shard."""
    writer = ShardWriter(path, width, schema_version)
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
                    **({name: row[name] for name in VIDEO_COLUMNS} if schema_version >= 2 else {}),
                )
            )
            bar.update()
        info = writer.close().to_json()
    except BaseException:
        writer.abort()
        raise
    try:
        for stat in ("rows", "tokens", "target_tokens", "images", "patches", "bytes", "sha256",
                     *(("videos", "video_patches") if schema_version >= 2 else ())):
            if info[stat] != entry[stat]:
                raise WebDatasetFormatError(
                    f"{path}: {stat} {info[stat]}, the exported shard's entry in {index_path} says {entry[stat]}: "
                    "the samples changed after the export; re-export from the shard directory"
                )
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return info
