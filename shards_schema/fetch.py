"""`vlmpack fetch SRC DST`: bring a shard directory down from an object store (or any path)
to local disk, every shard checked against the manifest's size and sha256.

Training memory-maps its shards, so they must be on a local or shared file system; this is
how a directory written to s3:// / gs:// / hf:// gets there. Each shard is streamed into
`DST/<file>.tmp` while hashed and renamed into place only when it matches the manifest; the
manifest is written last, so DST holds a manifest only once everything it lists is there and
checked. A shard that does not match its manifest, or is missing, stops the fetch (exit 1) and
is not kept.

A re-run checks what DST already holds, a finished copy included: each shard's size (a stat),
then its sha256 (one streaming read, several shards at a time). Shards that match are kept;
any other (damaged, truncated, replaced by a directory) is fetched again, the manifest of a
finished copy removed first, so that DST never claims a shard it has not checked. A shard
fetched now is hashed while it streams in, never read a second time.
"""

from __future__ import annotations

import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .atomic import TMP_SUFFIX, write_json_atomic
from .errors import EXIT_FAULT, EXIT_INTERRUPTED, UserError, first_few
from .flags import refuse_bad_location
from .manifest import MANIFEST_NAME, REJECTS_NAME, ShardFormatError, check_manifest, parse_manifest
from .outdir import exclusive_output_dir, refuse_input_as_output, user_entries
from .reader import file_fault
from .storage import NotARegularFile, StorageError, is_url, join, open_binary, redact
from .writer import file_sha256

CHUNK = 8 << 20
MAX_MANIFEST_BYTES = 1 << 30  # a manifest holds ~300 bytes per shard: this is millions of shards
CHECK_THREADS = min(8, os.cpu_count() or 1)  # hashlib and file reads release the GIL


class FetchMismatch(UserError):
    """The source's bytes are not what its manifest says: a damaged source (exit 1)."""

    exit_code = EXIT_FAULT


class FetchInterrupted(UserError):
    """Ctrl-C during a fetch: exit 130, what a shell reports for a command SIGINT ended."""

    exit_code = EXIT_INTERRUPTED


def _read_manifest(src: str) -> dict:
    """The source's manifest, every field a reader relies on checked (as `load_manifest` does)."""
    where = f"{redact(src).rstrip('/')}/{MANIFEST_NAME}"
    try:
        with open_binary(join(src, MANIFEST_NAME)) as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
    except StorageError as exc:
        raise UserError(f"{redact(src)}: no readable {MANIFEST_NAME} ({exc}): is it a finished shard directory?") from None
    except FileNotFoundError:
        raise UserError(f"{src}: no {MANIFEST_NAME}: is it a finished shard directory?") from None
    except IsADirectoryError:
        raise UserError(f"{src}: {MANIFEST_NAME} is a directory: is it a finished shard directory?") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise UserError(f"{where} is over {MAX_MANIFEST_BYTES:,} bytes: not a vlmpack manifest")
    return check_manifest(parse_manifest(data, where), where, redact(src))


def _copy(src_file: str, dst: Path, expect_bytes: int | None, expect_sha256: str | None, bar) -> None:
    """Stream src_file to dst (via dst.tmp), hashing; rename only when it matches."""
    tmp = dst.with_name(dst.name + TMP_SUFFIX)
    digest, size = hashlib.sha256(), 0
    try:
        with open_binary(src_file) as fh, open(tmp, "wb") as out:
            while chunk := fh.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
                bar.update(len(chunk))
        if (expect_bytes is not None and size != expect_bytes) or (expect_sha256 and digest.hexdigest() != expect_sha256):
            raise FetchMismatch(f"{redact(src_file)} does not match the manifest: {size:,} bytes, sha256 "
                                f"{digest.hexdigest()[:16]}..., the manifest says {expect_bytes:,} bytes, sha256 "
                                f"{(expect_sha256 or '')[:16]}...: the source is damaged; nothing of it was kept")
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _matches(path: Path, shard: dict) -> bool:
    """`path` is a regular file of the shard's size (a stat) and sha256 (one streaming read)."""
    return file_fault(path, shard["bytes"]) is None and file_sha256(path) == shard["sha256"]


def _held_manifest(path: Path) -> dict | None:
    """The manifest of an earlier fetch into DST; None when it is damaged (the copy is then
    treated as unfinished: every shard in it is checked)."""
    try:
        return parse_manifest(path.read_bytes(), path)
    except ShardFormatError:
        return None


def fetch(src: str, dst: str | Path, *, progress: bool = True) -> dict:
    """Copy the shard directory `src` (URL or path) to `dst`; returns what was done: shards,
    fetched, kept, bytes, up_to_date (DST already held all of it, checked), refetched (names of
    shards of a finished copy that failed the check and were fetched again)."""
    from tqdm import tqdm

    refuse_bad_location("the source", src, "give the shard directory to copy")
    refuse_bad_location("the destination", str(dst), "give a local directory to copy it into")
    if is_url(str(dst)):  # Path() would fold it into a local directory `s3:/...`
        raise UserError(f"{redact(str(dst))}: fetch copies a shard directory to local disk; give a local directory "
                        "as DST (to copy between stores, use the store's own tools, e.g. `aws s3 sync`)")
    if not is_url(src):
        try:
            is_dir = stat.S_ISDIR(os.stat(src).st_mode)  # another OSError (a link loop) is the dispatcher's line
        except FileNotFoundError:
            raise UserError(f"{src}: no such directory: give the shard directory to copy") from None
        if not is_dir:
            raise UserError(f"{src}: not a directory: give the shard directory to copy")
        refuse_input_as_output(dst, src, what="the destination")
    manifest = _read_manifest(src)
    shards = manifest["shards"]  # plain, unique file names with counts and a sha256 (check_manifest)
    wanted = {s["file"] for s in shards} | {REJECTS_NAME, MANIFEST_NAME}

    def held_manifest(out: Path) -> dict | None:
        """The manifest of a finished earlier fetch of `src` into `out` (None: unfinished or
        fresh); UserError where `out` holds anything else, checked before the directory is
        claimed so that a refused one is left as it was."""
        existing = out / MANIFEST_NAME
        held = _held_manifest(existing) if existing.is_file() else None
        if held is not None and held != manifest:
            raise UserError(f"{out} holds another dataset (its {MANIFEST_NAME} differs from {redact(src)}'s): "
                            "fetch into a new or empty directory")
        foreign = [n for n in user_entries(out) if n not in wanted and not n.endswith(TMP_SUFFIX)]
        if foreign:
            raise UserError(f"{out} is not empty ({first_few(foreign)}) and holds no fetch of {redact(src)}: "
                            "fetch into a new or empty directory")
        return held

    with exclusive_output_dir(dst, "fetch", what="the destination", check=held_manifest) as out:
        existing = out / MANIFEST_NAME
        finished = held_manifest(out) is not None
        for stale in out.glob("*" + TMP_SUFFIX):
            stale.unlink()
        with tqdm(total=sum(s["bytes"] for s in shards), unit="B", unit_scale=True, desc="check",
                  disable=not progress or not any((out / s["file"]).exists() for s in shards)) as bar:
            def check(shard: dict) -> bool:
                ok = _matches(out / shard["file"], shard)
                bar.update(shard["bytes"])
                return ok

            with ThreadPoolExecutor(CHECK_THREADS) as pool:
                todo = [s for s, ok in zip(shards, pool.map(check, shards)) if not ok]
        in_the_way = [out / s["file"] for s in todo if (out / s["file"]).is_dir()]
        if in_the_way:
            raise UserError(f"{in_the_way[0]} is a directory where {MANIFEST_NAME} lists a shard file: move it away "
                            "and re-run the fetch")
        if not todo and finished:
            return {"shards": len(shards), "fetched": 0, "kept": len(shards), "bytes": 0, "up_to_date": True,
                    "refetched": []}
        if existing.exists() or existing.is_symlink():
            existing.unlink()  # its presence means "every shard here and checked": not while one is fetched again
        total = sum(s["bytes"] for s in todo)
        with tqdm(total=total, unit="B", unit_scale=True, desc="fetch", disable=not progress) as bar:
            for shard in todo:
                src_file = join(src, shard["file"])
                try:
                    _copy(src_file, out / shard["file"], shard["bytes"], shard["sha256"], bar)
                except NotARegularFile as exc:
                    raise FetchMismatch(f"{exc}; the source is damaged") from None
                except (FileNotFoundError, StorageError) as exc:
                    if isinstance(exc, StorageError) and exc.kind != "not_found":
                        raise
                    raise FetchMismatch(f"{redact(src_file)} is missing, and the source's {MANIFEST_NAME} lists it: the "
                                        "source is damaged or incomplete; restore the shard there (or re-run the job "
                                        "that wrote it), then fetch again") from None
        try:
            _copy(join(src, REJECTS_NAME), out / REJECTS_NAME, None, None, tqdm(disable=True))
        except (FileNotFoundError, StorageError) as exc:
            if isinstance(exc, StorageError) and exc.kind != "not_found":
                raise
            raise FetchMismatch(f"{redact(src).rstrip('/')}/{REJECTS_NAME} is missing, which every shard directory "
                                "holds beside its manifest: the source is incomplete; restore it there (or re-run the "
                                "job that wrote it), then fetch again") from None
        write_json_atomic(existing, manifest)  # last: its presence means every shard is here and checked
    return {"shards": len(shards), "fetched": len(todo), "kept": len(shards) - len(todo), "bytes": total,
            "up_to_date": False, "refetched": [s["file"] for s in todo] if finished else []}


class Fetch:
    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("src", help="shard directory to copy: s3://, gs://, hf://, https:// URL (credentials from "
                                        "the store's environment) or a path")
        parser.add_argument("dst", help="local directory to copy it into: new or empty, or an earlier fetch of the same "
                                        "source (a re-run checks every shard there and fetches what is missing or fails "
                                        "the check)")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")

    @staticmethod
    def run(args) -> int:
        try:
            done = fetch(args.src, args.dst, progress=not args.no_progress)
        except KeyboardInterrupt:  # the shard being copied is removed as it unwinds (`_copy`); the others stay
            raise FetchInterrupted("stopped by SIGINT (Ctrl-C); the shards fetched so far are kept: re-run the same "
                                   "command to fetch the rest") from None
        print(f"{describe(done)} -> {args.dst}")
        return 0


def describe(done: dict) -> str:
    """What a fetch did, in one line (`vlmpack fetch`, `vlmpack train --data s3://...`)."""
    if done["up_to_date"]:
        return f"already there, every shard checked against the manifest's sha256 ({done['shards']} shards)"
    damaged = ""
    if done["refetched"]:
        damaged = f" ({first_few(done['refetched'])} failed the check and came down again)"
    return (f"fetched {done['fetched']} shards ({done['bytes'] / 2**20:,.1f} MiB){damaged}, kept {done['kept']} already "
            "there; every shard checked against the manifest's sha256")
