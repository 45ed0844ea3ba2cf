"""Local paths and object-store URLs (s3://, gs://, hf://, https://, ...) behind one small
interface, through fsspec; a local path takes the plain file system.

Credentials and endpoints come from each store's own environment and config files (for S3:
`AWS_PROFILE`, `AWS_ACCESS_KEY_ID`, `~/.aws/credentials`, `AWS_ENDPOINT_URL` or
`FSSPEC_S3_ENDPOINT_URL`; for GCS: `GOOGLE_APPLICATION_CREDENTIALS`; ...); vlmpack never takes
them as arguments. A URL is only ever recorded (manifest, logs, rejects) through `redact`,
which drops user info and credential-like query parameters (pre-signed URLs).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

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


# a store's scheme written without its `//` (`s3:/bucket`, `gs:bucket`), which a path would take
# as a local directory named `s3:`
_SCHEME_WITHOUT_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(?!//)/*(.*)$")
STORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "hf", "http", "https", "az", "abfs", "abfss")


def refuse_malformed_url(flag: str, spec) -> None:
    """UserError for `spec` written as a store's URL without the `//` after its scheme, unless
    a local path of that name exists; a `file://` URL, which names a local path."""
    if not isinstance(spec, str) or is_url(spec):
        return
    if spec[:7].lower() == "file://":  # as a path it would be a directory named `file:`
        raise UserError(f"{flag} {spec!r}: give a local path as itself ({unquote(spec[7:]) or '/'}), without file://")
    match = _SCHEME_WITHOUT_SLASHES.match(spec)
    if match and match.group(1).lower() in STORE_SCHEMES and not Path(spec).exists():
        scheme, rest = match.groups()
        raise UserError(f"{flag} {spec!r} is not a URL (as a path it lies under a local directory '{scheme}:'): "
                        f"write {scheme}://{rest}, with two slashes after '{scheme}:', or ./{spec} for a local path")


def redact(url: str) -> str:
    """`url` without user info and credential-like query parameters (safe to record)."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if not _SECRET_QUERY.search(k)])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# Schemes that reach the same store: a URL in either spelling names the same object
_SAME_STORE = {"s3a": "s3", "gcs": "gs", "abfss": "abfs"}


def object_identity(url: str) -> str:
    """`url` redacted, its scheme in one spelling per store (s3a:// as s3://, gcs:// as gs://):
    two spellings of one object compare equal."""
    parts = urlsplit(redact(url))
    return urlunsplit((_SAME_STORE.get(parts.scheme, parts.scheme), *parts[1:]))


# The most retries a fetch may be given, and the longest pause between two attempts: a row
# whose store does not answer costs a bounded time.
MAX_FETCH_RETRIES = 10
MAX_FETCH_PAUSE = 30.0


@dataclass(frozen=True)
class FetchPolicy:
    """How long one fetch may wait, and how often it is tried again, before its store counts as
    unreachable. `timeout` (seconds) bounds connecting and each wait for data (http(s):// through
    aiohttp, s3:// through botocore; other stores keep their client's own timeouts). An attempt
    that times out, is refused or gets a server error is retried up to `retries` times, after
    `backoff` seconds and twice as long before each further one (at most MAX_FETCH_PAUSE)."""

    timeout: float = 30.0
    retries: int = 2
    backoff: float = 1.0

    def pause(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt` (1 = the first retry)."""
        return min(self.backoff * 2 ** (attempt - 1), MAX_FETCH_PAUSE)


def _timeout_options(url: str, policy: FetchPolicy | None) -> dict:
    """fsspec storage options that make the store's client give up after `policy.timeout`
    seconds without a connection or without data, and leave retrying to `read_bytes`."""
    if policy is None:
        return {}
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("http", "https"):
        import aiohttp

        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(
            total=None, connect=policy.timeout, sock_connect=policy.timeout, sock_read=policy.timeout)}}
    if scheme in ("s3", "s3a"):
        return {"config_kwargs": {"connect_timeout": policy.timeout, "read_timeout": policy.timeout,
                                  "retries": {"total_max_attempts": 1, "mode": "standard"}}}
    return {}


def _filesystem(url: str, policy: FetchPolicy | None = None):
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **_timeout_options(url, policy))
        if policy is not None and url.split("://", 1)[0].lower() in ("s3", "s3a"):
            # s3fs retries timed-out calls itself (5 times by default) inside each attempt; this
            # instance is only used with this policy's options, so read_bytes's loop is the only retry
            fs.retries = 1
        return fs, path
    except (ImportError, ValueError) as exc:
        scheme = url.split("://", 1)[0]
        raise StorageError("unreachable", f"{redact(url)}: no file system for {scheme}:// ({exc}); install its "
                           "fsspec package (s3fs for s3://, gcsfs for gs://)") from None
    except OSError as exc:  # a file system that connects when it is made (ftp://, sftp://)
        raise classify(exc, url) from None


def _causes(exc: BaseException):
    """`exc` and the exceptions it was raised from, outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _transport_failure(exc: BaseException) -> str | None:
    """The kind a wrapped HTTP status or network failure means, None when there is none.

    fsspec's HTTP file system raises FileNotFoundError for any failed request, from the real
    cause: a 403, a refused connection or a timeout is no missing file."""
    for cause in _causes(exc):
        status = getattr(cause, "status", None)
        if isinstance(status, int) and 400 <= status < 600:
            return "not_found" if status in (404, 410) else "denied" if status in (401, 403) else "unreachable"
        if isinstance(cause, (TimeoutError, ConnectionError)) or (
                isinstance(cause, OSError) and not isinstance(cause, (FileNotFoundError, PermissionError))
                and cause is not exc):
            return "unreachable"
    return None


# the clients' own "found no credentials" errors (botocore, google-auth): the store was never
# asked, so neither the network nor the endpoint is to blame
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}


def classify(exc: BaseException, url: str) -> StorageError:
    """A store's exception -> StorageError naming what went wrong and what to check."""
    where = redact(url)
    text = redact_text(f"{type(exc).__name__}: {exc}")[:300]
    if isinstance(exc, StorageError):
        return exc
    if any(type(cause).__name__ in _NO_CREDENTIALS for cause in _causes(exc)):
        return StorageError("denied", f"{where}: no credentials for the store ({_reason(exc)}); give them (e.g. "
                            "AWS_PROFILE, AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS)")
    kind = _transport_failure(exc)
    if kind == "not_found":
        return StorageError("not_found", f"{where} does not exist ({_reason(exc)})")
    if kind == "denied":
        return StorageError("denied", f"{where}: access denied ({_reason(exc)}); check the store's credentials "
                            "(e.g. AWS_PROFILE, AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS)")
    if kind == "unreachable":
        return StorageError("unreachable", f"{where}: cannot reach the store ({_reason(exc)}); check the network and "
                            "the endpoint (e.g. AWS_ENDPOINT_URL)")
    if isinstance(exc, FileNotFoundError):
        return StorageError("not_found", f"{where} does not exist ({text})")
    # a whole-word 403: the digits of an endpoint's port (":40312") are no status code
    if isinstance(exc, PermissionError) or re.search(
            r"AccessDenied|Forbidden|\b403\b|InvalidAccessKeyId|SignatureDoesNotMatch", text):
        return StorageError("denied", f"{where}: access denied ({text}); check the store's credentials "
                            "(e.g. AWS_PROFILE, AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS)")
    return StorageError("unreachable", f"{where}: cannot reach the store ({text}); check the network and the "
                        "endpoint (e.g. AWS_ENDPOINT_URL)")


def _reason(exc: BaseException) -> str:
    """The innermost cause's type and text (what the server or the network said)."""
    inner = list(_causes(exc))[-1]
    text = str(inner) or ("timed out" if isinstance(inner, TimeoutError) else "")
    return f"{type(inner).__name__}: {redact_text(text)}"[:300]


def redact_text(text: str) -> str:
    """`text` with every URL in it redacted."""
    return re.sub(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+", lambda m: redact(m.group(0)), text)


class NotARegularFile(UserError):
    """A path to read that is a FIFO, a socket or a device: never opened for reading."""


def file_kind(mode: int) -> str:
    """What a file of stat mode `mode` is, for a message."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def open_local(path: str | Path, buffering: int = -1):
    """open(path, "rb") of a regular file only. A FIFO's open would wait for a writer, for ever:
    the file is opened non-blocking and its kind checked on the descriptor before any read
    (IsADirectoryError for a directory, NotARegularFile for the other kinds)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise NotARegularFile(f"{path} is {file_kind(mode)}, not a regular file: replace it with the file it "
                                  "stands for")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def open_binary(spec: str | Path, policy: FetchPolicy | None = None):
    """A readable, seekable binary file of a local path (a regular file: `open_local`) or a URL."""
    if not is_url(str(spec)):
        return open_local(spec, buffering=1 << 20)  # JSONL rows with base64 media run to megabytes
    fs, path = _filesystem(str(spec), policy)
    try:
        return fs.open(path, "rb")
    except Exception as exc:  # noqa: BLE001 - every store raises its own kinds
        raise classify(exc, str(spec)) from None


def info(spec: str, policy: FetchPolicy | None = None) -> dict:
    """`{"size": bytes, "mtime_ns": int}` of a URL (StorageError when it is not there)."""
    fs, path = _filesystem(spec, policy)
    try:
        found = fs.info(path)
    except Exception as exc:  # noqa: BLE001
        raise classify(exc, spec) from None
    if found.get("type") == "directory":
        raise StorageError("not_found", f"{redact(spec)} is a directory (a prefix of other objects), not a file: "
                           "give the URL of a file in it")
    modified = found.get("LastModified") or found.get("mtime") or found.get("updated")
    if hasattr(modified, "timestamp"):
        modified = modified.timestamp()
    try:
        mtime_ns = int(float(modified) * 1e9)
    except (TypeError, ValueError):
        mtime_ns = 0
    return {"size": int(found.get("size") or 0), "mtime_ns": mtime_ns}


def read_bytes(spec: str, max_bytes: int, policy: FetchPolicy | None = None) -> bytes:
    """The whole object, refused (StorageError "too_large") before reading when over `max_bytes`.
    With a `policy`, each attempt is bounded by its timeout and an unreachable store is tried
    again up to `policy.retries` times with growing pauses (a missing object, refused
    credentials or an object over the cap are final at once)."""
    _filesystem(spec, policy)  # no file system for the scheme: final, not worth a retry
    attempts = 1 + (policy.retries if policy is not None else 0)
    for attempt in range(attempts):
        if attempt:
            time.sleep(policy.pause(attempt))
        try:
            return _read_once(spec, max_bytes, policy)
        except StorageError as exc:
            if exc.kind != "unreachable":
                raise
            failure = exc
    raise StorageError("unreachable", f"{failure} (tried {attempts} times)" if attempts > 1 else str(failure))


def _read_once(spec: str, max_bytes: int, policy: FetchPolicy | None) -> bytes:
    size = info(spec, policy)["size"]
    if size > max_bytes:
        raise StorageError("too_large", f"{redact(spec)} has {size:,} bytes, over the cap of {max_bytes:,}")
    with open_binary(spec, policy) as fh:
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


def require_prefix(url: str, what: str = "--out") -> None:
    """Refuse, before any work, an output prefix that cannot be written: one naming no bucket,
    one in a bucket that does not exist, or one that is an object (a file) itself."""
    fs, path = _filesystem(url)
    scheme = url.split("://", 1)[0]
    where = redact(url) if redact(url).startswith(f"{scheme}://") else url  # `s3://` redacted is `s3:`
    bucket = path.strip("/").split("/", 1)[0]
    if not bucket:
        raise StorageError("not_found", f"{what} {where} names no bucket: give {scheme}://BUCKET/PREFIX")
    try:
        fs.info(bucket)
    except FileNotFoundError:
        raise StorageError("not_found", f"{what} {where}: the bucket {bucket} does not exist: create it, or give a "
                           "prefix in a bucket that does") from None
    except Exception as exc:  # noqa: BLE001
        raise classify(exc, f"{scheme}://{bucket}") from None
    if path.strip("/") != bucket and remote_size(url) is not None:
        raise StorageError("not_found", f"{what} {where} is an object, not a prefix: give a prefix (a directory) "
                           "for the shards")


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


def list_names(url: str) -> list[str]:
    """The names directly under the prefix `url`, objects and sub-prefixes alike, sorted ([]
    when there is none): one listing, however much lies deeper."""
    fs, root = _filesystem(url)
    root = root.rstrip("/")
    try:
        entries = fs.ls(root, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    except Exception as exc:  # noqa: BLE001
        raise classify(exc, url) from None
    return sorted({entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries} - {""})


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
