"""`vlmpack fetch SRC DST`: bring a shard directory down from an object store (or any path)
to local disk, every shard checked against the manifest's size and sha256.

Training memory-maps its shards, so they must be on a local or shared file system; this is
how a directory written to s3:// / gs:// / hf:// gets there. Each shard is streamed into
`DST/<file>.tmp` while hashed and renamed into place only when it matches the manifest; the
manifest is written last, so DST holds a manifest only once everything it lists is there and
checked. A re-run resumes: shards already in DST with the right size and sha256 are kept. A
shard that does not match its manifest stops the fetch (exit 1) and is not kept.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .atomic import TMP_SUFFIX, write_json_atomic
from .errors import UserError
from .manifest import MANIFEST_NAME, REJECTS_NAME
from .outdir import exclusive_output_dir, user_entries
from .storage import StorageError, join, open_binary, redact
from .writer import file_sha256

CHUNK = 8 << 20


class FetchMismatch(UserError):
    """The source's bytes are not what its manifest says: a damaged source (exit 1)."""

    exit_code = 1


def _read_manifest(src: str) -> dict:
    try:
        with open_binary(join(src, MANIFEST_NAME)) as fh:
            manifest = json.loads(fh.read().decode("utf-8"))
    except StorageError as exc:
        raise UserError(f"{redact(src)}: no readable {MANIFEST_NAME} ({exc}): is it a finished shard directory?") from None
    except FileNotFoundError:
        raise UserError(f"{src}: no {MANIFEST_NAME}: is it a finished shard directory?") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{redact(src)}/{MANIFEST_NAME} is not valid JSON ({exc})") from None
    if not isinstance(manifest.get("shards"), list):
        raise UserError(f"{redact(src)}/{MANIFEST_NAME} lists no shards: not a vlmpack shard directory")
    return manifest


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


def fetch(src: str, dst: str | Path, *, progress: bool = True) -> dict:
    """Copy the shard directory `src` (URL or path) to `dst`; returns what was done."""
    from tqdm import tqdm

    manifest = _read_manifest(src)
    shards = [s for s in manifest["shards"] if isinstance(s, dict) and isinstance(s.get("file"), str)]
    if any("/" in s["file"] or s["file"].startswith(".") for s in shards):
        raise UserError(f"{redact(src)}/{MANIFEST_NAME} names a shard outside the directory: refusing it")
    wanted = {s["file"] for s in shards} | {REJECTS_NAME}

    def up_to_date(out: Path) -> bool:
        """True where `out` holds this fetch, finished; UserError where it holds anything else."""
        existing = out / MANIFEST_NAME
        if existing.exists():
            if json.loads(existing.read_text(encoding="utf-8")) == manifest:
                return True
            raise UserError(f"{out} holds another dataset (its {MANIFEST_NAME} differs from {redact(src)}'s): "
                            "fetch into a new or empty directory")
        foreign = [n for n in user_entries(out) if n not in wanted and not n.endswith(TMP_SUFFIX)]
        if foreign:
            raise UserError(f"{out} is not empty ({', '.join(foreign[:3])}...) and holds no fetch of {redact(src)}: "
                            "fetch into a new or empty directory")
        return False

    with exclusive_output_dir(dst, "fetch", check=up_to_date) as out:
        existing = out / MANIFEST_NAME
        if up_to_date(out):
            return {"shards": len(shards), "fetched": 0, "kept": len(shards), "bytes": 0, "up_to_date": True}
        for stale in out.glob("*" + TMP_SUFFIX):
            stale.unlink()
        todo, kept = [], 0
        for shard in shards:
            path = out / shard["file"]
            if path.exists() and path.stat().st_size == shard.get("bytes") and file_sha256(path) == shard.get("sha256"):
                kept += 1
            else:
                todo.append(shard)
        total = sum(int(s.get("bytes") or 0) for s in todo)
        with tqdm(total=total, unit="B", unit_scale=True, desc="fetch", disable=not progress) as bar:
            for shard in todo:
                _copy(join(src, shard["file"]), out / shard["file"], shard.get("bytes"), shard.get("sha256"), bar)
        try:
            _copy(join(src, REJECTS_NAME), out / REJECTS_NAME, None, None, tqdm(disable=True))
        except StorageError as exc:
            if exc.kind != "not_found":
                raise
        except FileNotFoundError:
            pass
        write_json_atomic(existing, manifest)  # last: its presence means every shard is here and checked
    return {"shards": len(shards), "fetched": len(todo), "kept": kept, "bytes": total, "up_to_date": False}


class Fetch:
    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("src", help="shard directory to copy: s3://, gs://, hf://, https:// URL (credentials from "
                                        "the store's environment) or a path")
        parser.add_argument("dst", help="local directory to copy it into: new or empty, or an unfinished fetch of the "
                                        "same source (re-running resumes)")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")

    @staticmethod
    def run(args) -> int:
        done = fetch(args.src, args.dst, progress=not args.no_progress)
        if done["up_to_date"]:
            print(f"{args.dst}: already holds {redact(args.src)} ({done['shards']} shards checked)")
        else:
            print(f"fetched {done['fetched']} shards ({done['bytes'] / 2**20:,.1f} MiB), kept {done['kept']} already "
                  f"there, every one checked against the manifest's sha256 -> {args.dst}")
        return 0
