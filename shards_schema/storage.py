"""Local paths and object-store URLs (s3://, gs://, hf://, https://, ...) behind one small
interface, through fsspec; a local path takes the plain file system.

Credentials and endpoints come from each store's own environment and config files (for S3:
`AWS_PROFILE`, `AWS_ACCESS_KEY_ID`, `~/.aws/credentials`, `AWS_ENDPOINT_URL` or
`FSSPEC_S3_ENDPOINT_URL`; for GCS: `GOOGLE_APPLICATION_CREDENTIALS`; ...); vlmpack never takes
them as arguments. A URL is only ever recorded (manifest, logs, rejects) through `redact`,
which drops user info and credential-like query parameters (pre-signed URLs).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .errors import UserError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_SECRET_QUERY = re.compile(r"(sig|signature|credential|token|key|secret|security|auth|password)", re.IGNORECASE)


class StorageError(UserError):
    """A store refused or could not be reached. `kind`: not_found, denied, unreachable or too_large."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def is_url(spec) -> bool:
    """A `scheme://` reference other than `file://` (which is a local path)."""
    return isinstance(spec, str) and bool(_URL.match(spec)) and not spec.lower().startswith("file://")


def redact(url: str) -> str:
    """`url` without user info and credential-like query parameters (safe to record)."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if not _SECRET_QUERY.search(k)])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _filesystem(url: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        scheme = url.split("://", 1)[0]
        raise StorageError("unreachable", f"{redact(url)}: no file system for {scheme}:// ({exc}); install its "
                           "fsspec package (s3fs for s3://, gcsfs for gs://)") from None


def classify(exc: BaseException, url: str) -> StorageError:
    """A store's exception -> StorageError naming what went wrong and what to check."""
    where = redact(url)
    text = f"{type(exc).__name__}: {exc}"[:300]
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return StorageError("not_found", f"{where} does not exist ({text})")
    # a whole-word 403: the digits of an endpoint's port (":40312") are no status code
    if isinstance(exc, PermissionError) or re.search(
            r"AccessDenied|Forbidden|\b403\b|InvalidAccessKeyId|SignatureDoesNotMatch", text):
        return StorageError("denied", f"{where}: access denied ({text}); check the store's credentials "
                            "(e.g. AWS_PROFILE, AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS)")
    return StorageError("unreachable", f"{where}: cannot reach the store ({text}); check the network and the "
                        "endpoint (e.g. AWS_ENDPOINT_URL)")


def open_binary(spec: str | Path):
    """A readable, seekable binary file of a local path or a URL."""
    if not is_url(str(spec)):
        return open(spec, "rb", buffering=1 << 20)  # JSONL rows with base64 media run to megabytes
    fs, path = _filesystem(str(spec))
    try:
        return fs.open(path, "rb")
    except Exception as exc:  # noqa: BLE001 - every store raises its own kinds
        raise classify(exc, str(spec)) from None


def info(spec: str) -> dict:
    """`{"size": bytes, "mtime_ns": int}` of a URL (StorageError when it is not there)."""
    fs, path = _filesystem(spec)
    try:
        found = fs.info(path)
    except Exception as exc:  # noqa: BLE001
        raise classify(exc, spec) from None
    if found.get("type") == "directory":
        raise StorageError("not_found", f"{redact(spec)} is a directory, not a file")
    modified = found.get("LastModified") or found.get("mtime") or found.get("updated")
    if hasattr(modified, "timestamp"):
        modified = modified.timestamp()
    try:
        mtime_ns = int(float(modified) * 1e9)
    except (TypeError, ValueError):
        mtime_ns = 0
    return {"size": int(found.get("size") or 0), "mtime_ns": mtime_ns}


def read_bytes(spec: str, max_bytes: int) -> bytes:
    """The whole object, refused (StorageError "too_large") before reading when over `max_bytes`."""
    size = info(spec)["size"]
    if size > max_bytes:
        raise StorageError("too_large", f"{redact(spec)} has {size:,} bytes, over the cap of {max_bytes:,}")
    with open_binary(spec) as fh:
        try:
            data = fh.read(max_bytes + 1)
        except Exception as exc:  # noqa: BLE001
            raise classify(exc, spec) from None
    if len(data) > max_bytes:
        raise StorageError("too_large", f"{redact(spec)} grew past the cap of {max_bytes:,} bytes while read")
    return data


def join(base: str, name: str) -> str:
    """`name` inside the directory `base` (a URL prefix or a path)."""
    return f"{base.rstrip('/')}/{name}" if is_url(base) else str(Path(base) / name)


def remote_size(url: str) -> int | None:
    """Bytes of the object at `url`, None when there is none."""
    try:
        return info(url)["size"]
    except StorageError as exc:
        if exc.kind == "not_found":
            return None
        raise


def upload_file(local: Path, url: str) -> None:
    """Put one file: the object appears whole or not at all (S3 and GCS commit an upload only
    when it is complete), so a killed upload leaves no partial object behind."""
    fs, path = _filesystem(url)
    try:
        fs.put_file(str(local), path)
    except Exception as exc:  # noqa: BLE001
        raise classify(exc, url) from None


def list_tree(url: str) -> dict[str, int]:
    """{relative path: size} of every object under the prefix `url` ({} when there is none)."""
    fs, root = _filesystem(url)
    root = root.rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    except Exception as exc:  # noqa: BLE001
        raise classify(exc, url) from None
    return {name[len(root) + 1:]: int(meta.get("size") or 0) for name, meta in found.items()
            if meta.get("type") != "directory" and name.startswith(root + "/")}


def download_tree(url: str, local: Path) -> int:
    """Copy every object under `url` into `local` (same relative paths), skipping files already
    there at the same size; each lands under a temporary name and is renamed when whole."""
    fs, _ = _filesystem(url)
    copied = 0
    for name, size in sorted(list_tree(url).items()):
        target = local / name
        if target.is_file() and target.stat().st_size == size:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        try:
            fs.get_file(_filesystem(join(url, name))[1], str(tmp))
        except Exception as exc:  # noqa: BLE001
            tmp.unlink(missing_ok=True)
            raise classify(exc, join(url, name)) from None
        tmp.replace(target)
        copied += 1
    return copied
