"""A media reference in a chat part (an image or a video) -> its bytes, or a checked local file.

Which kind a reference string is, decided from the string alone (no file-system probing):

* `scheme://...` -> a URL: `file://` is read as a local path; anything else (s3, gs, hf,
  https, ...) is rejected (`remote_url`) unless the job opts in with `--allow-remote-media`,
  then fetched through fsspec (`shards_schema.storage`) under the same byte cap, with the
  job's timeout and retries (`--remote-timeout`, `--remote-retries`);
* `data:...;base64,...` -> a data URI;
* only base64 characters (A-Z a-z 0-9 + / = - _ and whitespace) AND either longer than 256
  characters or starting like an encoded PNG/JPEG/GIF/WebP -> raw base64 (a path of
  257+ characters with no dot in it would be misread: file names have extensions, so this
  does not happen in practice);
* anything else -> a file path, resolved under `media_root`; it must stay inside `media_root`
  after resolving `..` and symlinks, and be a regular file (a FIFO is never opened, so a job
  never blocks on one).

Besides strings, a reference may be the encoded bytes themselves, or a Hugging Face `Image` /
`Video` feature as Parquet and `datasets` store it, `{"bytes": ..., "path": ...}`: its bytes
when present (text there, as a JSON export writes them, is base64), else its path (a
reference string as above).

Every reference is held to a byte cap before it is read or decoded (`media_too_large`).
Images are read whole; videos stay files that the decoder streams.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import math
import os
import re
import stat
from pathlib import Path
from urllib.parse import unquote

from shards_schema.storage import FetchPolicy, StorageError, file_kind, read_bytes, redact

from .errors import RejectError

# Bytes of one image file (or of a data URI's / base64 string's decoded data): checked before
# reading, so a huge file never reaches memory. 128 MiB holds an uncompressed 8-bit RGB TIFF of
# 44 megapixels and any compressed image up to the default pixel limit seen in practice.
DEFAULT_MAX_MEDIA_BYTES = 128 * 2**20

_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# standard and URL-safe alphabets, padding, whitespace (MIME line breaks)
_BASE64_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \t\n\r\v\f"
# base64 of the first bytes of PNG, JPEG, GIF and WebP (RIFF) files (any video is longer than
# _LONG_BASE64 characters).
_BASE64_MEDIA_PREFIXES = ("iVBORw0KGgo", "/9j/", "R0lGOD", "UklGR")
_LONG_BASE64 = 256
_FLAG = {"image": "--max-media-bytes", "video": "--max-video-bytes"}


def resolve_media(source: str, media_root: Path | None, max_bytes: int, *, kind: str,
                  remote: FetchPolicy | None = None) -> bytes | Path:
    """The bytes of an inline reference (data URI, base64, embedded bytes), or the checked path
    of a local file (not read). `kind` ("image" or "video") names the reference in messages.
    `remote`: how URLs are fetched; None rejects them (`remote_url`)."""
    if isinstance(source, dict) and ("bytes" in source or "path" in source):
        if isinstance(source.get("bytes"), str):  # bytes written out as text (a JSON export): base64, never a path
            try:
                return _b64decode(source["bytes"].strip(), max_bytes, f"the `bytes` of the {kind} feature", kind)
            except RejectError as exc:
                raise RejectError(exc.code, f"the `bytes` of the {kind} feature are text, read as base64: "
                                  f"{exc.message}; give the encoded bytes, or their base64") from None
        source = source["bytes"] if source.get("bytes") is not None else source.get("path")
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) > max_bytes:
            raise RejectError("media_too_large", f"embedded {kind} of {len(source):,} bytes exceeds {_FLAG[kind]} "
                              f"{max_bytes:,}")
        if not len(source):
            raise RejectError("empty_source", f"embedded {kind} holds no bytes")
        return bytes(source)
    if not isinstance(source, str) or not source.strip():
        raise RejectError("empty_source", f"{kind} reference must be a non-empty string, got {source!r:.80}")
    source = source.strip()
    if _URL_SCHEME.match(source):
        if source[:7].lower() == "file://":
            return media_file(unquote(source[7:]), media_root, max_bytes, kind)
        if remote is not None:
            return _fetch(source, max_bytes, kind, remote)
        raise RejectError(
            "remote_url",
            f"{redact(source)[:80]!r} is a URL: fetching is off; pass --allow-remote-media, or download the {kind}s "
            "and pass --media-root",
        )
    if source[:5].lower() == "data:":
        comma = source.find(",")
        header = source[:comma] if comma >= 0 else source[:80]
        if comma < 0 or not header.lower().endswith(";base64"):
            raise RejectError("bad_data_uri", f"data URI must be 'data:{kind}/...;base64,<data>', got {header[:80]!r}")
        check_declared_kind(declared_type(source), kind)
        return _b64decode(source[comma + 1 :], max_bytes, "data URI", kind)
    if _looks_like_base64(source):
        return _b64decode(source, max_bytes, f"base64 {kind}", kind)
    return media_file(source, media_root, max_bytes, kind)


_FETCH_CODES = {"not_found": "remote_not_found", "denied": "remote_denied", "unreachable": "remote_unreachable",
                "too_large": "media_too_large"}


def _fetch(url: str, max_bytes: int, kind: str, policy: FetchPolicy) -> bytes:
    try:
        return read_bytes(url, max_bytes, policy)
    except StorageError as exc:
        flag = f" ({_FLAG[kind]})" if exc.kind == "too_large" else ""
        raise RejectError(_FETCH_CODES[exc.kind], f"{kind} {exc}{flag}") from None


def declared_type(source: str) -> str | None:
    """The media type a data URI declares (lower case, '' when empty), None for other sources."""
    source = source.strip() if isinstance(source, str) else ""
    if source[:5].lower() != "data:":
        return None
    header = source[5 : source.find(",")]
    return header.split(";", 1)[0].strip().lower()


_OTHER_KIND = {"image": "video", "video": "image"}
_PART_SPELLING = {"image": "an image part (image / image_url)", "video": "a video part (video / video_url)"}


def check_declared_kind(declared: str | None, kind: str) -> None:
    """A data URI must not declare the other kind of media: an image part's `video/mp4` or a
    video part's `image/png` is refused before its bytes are decoded (`mime_mismatch`)."""
    other = _OTHER_KIND[kind]
    if declared is not None and declared.partition("/")[0] == other:
        article = "an" if other == "image" else "a"
        raise RejectError("mime_mismatch", f"the {kind} part's data URI says {declared[:60]!r}, {article} {other}: "
                          f"give it as {_PART_SPELLING[other]}, or fix the data URI's type")


def _looks_like_base64(text: str) -> bool:
    if len(text) <= _LONG_BASE64 and not text.startswith(_BASE64_MEDIA_PREFIXES):
        return False
    return _in_base64_alphabet(text)


def _in_base64_alphabet(text: str) -> bool:
    # bytes.translate deleting the alphabet: ~4x faster than a regex on megabyte strings
    return text.isascii() and not text.encode("ascii").translate(None, _BASE64_BYTES)


def _b64decode(text: str, max_bytes: int, what: str, kind: str) -> bytes:
    """Standard or URL-safe base64, whitespace ignored, missing '=' padding restored; refused
    from its length alone when the decoded data would exceed `max_bytes`."""
    if len(text) // 4 * 3 > max_bytes:  # cheap bound first; whitespace and padding only make it larger
        encoded = len(text) - sum(text.count(c) for c in " \t\n\r\v\f=")
        if encoded * 3 // 4 > max_bytes:
            raise RejectError(
                "media_too_large",
                f"{what} holds {encoded * 3 // 4} bytes ({encoded} base64 characters), over "
                f"{_FLAG[kind]} {max_bytes}; shrink the {kind} or raise {_FLAG[kind]}",
            )
    data = None
    if len(text) % 4 == 0:  # the usual case, padded without whitespace: no copy to strip it first
        with contextlib.suppress(binascii.Error, ValueError):
            data = base64.b64decode(text, validate=True)
    if data is None:
        compact = "".join(text.split())
        compact += "=" * (-len(compact) % 4)
        altchars = b"-_" if ("-" in compact or "_" in compact) else None
        try:
            data = base64.b64decode(compact, altchars=altchars, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RejectError("bad_base64", f"{kind} base64 does not decode ({exc})") from None
    if not data:
        raise RejectError("bad_base64", f"{kind} base64 decodes to zero bytes")
    return data


def _check_regular(st: os.stat_result, resolved: Path, max_bytes: int, kind: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise RejectError(
            "not_a_regular_file",
            f"{kind} path {str(resolved)[:160]!r} is {file_kind(st.st_mode)}: only regular files are read",
        )
    if st.st_size > max_bytes:
        raise _file_too_large(resolved, st.st_size, max_bytes, kind)


def _file_too_large(resolved: Path, size: int, max_bytes: int, kind: str) -> RejectError:
    return RejectError(
        "media_too_large",
        f"{kind} file {str(resolved)[:160]!r} has {size} bytes, over {_FLAG[kind]} {max_bytes}; "
        f"shrink the {kind} or raise {_FLAG[kind]}",
    )


def read_media_file(resolved: Path, max_bytes: int, kind: str) -> bytes:
    """At most `max_bytes` of a regular file. stat before open: a FIFO is never opened, a huge
    file never read. The file is opened non-blocking (opening a FIFO swapped in meanwhile
    returns at once) and checked again on the open descriptor."""
    try:
        _check_regular(os.stat(resolved), resolved, max_bytes, kind)
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as fh:
            st = os.fstat(fd)
            _check_regular(st, resolved, max_bytes, kind)
            data = fh.read(st.st_size + 1)
            if len(data) > st.st_size:  # grew since the stat: read on, up to the cap
                data += fh.read(max_bytes + 1 - len(data))
    except FileNotFoundError:
        raise RejectError("missing_file", f"{kind} file {str(resolved)[:160]!r} does not exist") from None
    except OSError as exc:
        raise RejectError("unreadable_file", f"{kind} file {str(resolved)[:160]!r} cannot be read ({exc})") from None
    if len(data) > max_bytes:
        raise _file_too_large(resolved, len(data), max_bytes, kind)
    return data


def media_file(path_text: str, media_root: Path | None, max_bytes: int, kind: str) -> Path:
    """The resolved path of a file reference, inside `media_root`, a regular file within the cap."""
    if media_root is None:
        raise RejectError(
            "no_media_root",
            f"{kind} {path_text[:120]!r} is a file path: pass --media-root DIR (the folder {kind} paths are relative "
            f"to){_base64_hint(path_text, kind)}",
        )
    try:
        root = Path(media_root).resolve()
        path = Path(path_text)
        resolved = (path if path.is_absolute() else root / path).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # embedded NUL, symlink loop (RuntimeError before 3.13)
        raise RejectError("bad_path", f"{kind} path {path_text[:120]!r} cannot be resolved ({exc})") from None
    if not resolved.is_relative_to(root):
        raise RejectError(
            "path_outside_media_root",
            f"{kind} path {path_text[:120]!r} resolves to {str(resolved)[:120]!r}, outside --media-root {str(root)!r}",
        )
    try:
        _check_regular(os.stat(resolved), resolved, max_bytes, kind)
    except FileNotFoundError:
        raise RejectError("missing_file", f"{kind} file {str(resolved)[:160]!r} does not exist"
                          f"{_base64_hint(path_text, kind)}") from None
    except OSError as exc:
        raise RejectError("unreadable_file", f"{kind} file {str(resolved)[:160]!r} cannot be read ({exc})") from None
    return resolved


def _base64_hint(path_text: str, kind: str) -> str:
    """For a reference read as a path that may be meant as base64 (of the base64 alphabet, no
    file extension, at least 16 characters): how to give it as base64."""
    if len(path_text) < 16 or "." in path_text or not _in_base64_alphabet(path_text):
        return ""
    return (f"; if it is base64, give it as a data URI (data:{kind}/...;base64,...): bare base64 is taken as such from "
            f"{_LONG_BASE64 + 1} characters, or where it starts as a PNG, JPEG, GIF or WebP file does")


# ---------------------------------------------------------------------------------------------
# numeric options of an image or video part

# The largest count or pixel number a part may give: the reference arithmetic (HF's processors,
# qwen-vl-utils) runs in floats, which hold every integer up to 2**53 exactly.
MAX_OPTION_INTEGER = 2**53
# The lowest frame rate a part or a container may have: frames at most 1000 s apart, so that
# timestamps and temporal positions stay in range.
MIN_FPS = 1e-3
# Options of qwen-vl-utils that vlmpack does not apply: a part giving them is refused rather
# than sized otherwise than it asks.
UNSUPPORTED_SIZE_OPTIONS = ("resized_height", "resized_width")


def count_flag(text: str) -> int:
    """argparse type of a flag giving what a video part's counts and pixel numbers may be."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_OPTION_INTEGER:
        raise argparse.ArgumentTypeError(f"must be a positive integer, at most 2**53, got {text}")
    return value


def frames_flag(text: str) -> int:
    """argparse type of a flag giving the most frames a video part may sample: frames are cut in
    pairs (temporal patches of 2), so fewer than 2 would reject every video."""
    value = count_flag(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (a video's frames are cut in pairs), got {text}")
    return value


def fps_flag(text: str) -> float:
    """argparse type of a flag giving what a video part's fps may be."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not MIN_FPS <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least {MIN_FPS:g}, got {text}")
    return value


def part_number(part: dict, name: str, *, integer: bool, code: str, where: str, minimum: float = 0.0):
    """A media part's numeric option: None when absent, else an int (`integer`: a whole number
    from 1 to MAX_OPTION_INTEGER, 8.0 taken as 8) or a finite float of at least `minimum`.
    Anything else (a bool, a string, NaN, an infinity, out of range) is refused with `code`,
    naming the option, its valid range and the value given."""
    value = part.get(name)
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and isinstance(value, float):
        number = math.isfinite(value) and (value.is_integer() or not integer)
    if number and (1 if integer else minimum) <= value <= (MAX_OPTION_INTEGER if integer else math.inf):
        return int(value) if integer else float(value)
    if integer:
        valid = f"a positive integer, at most 2**53 ({MAX_OPTION_INTEGER})"
    else:
        valid = f"a positive number, at least {minimum:g} and finite" if minimum > 0 else "a number >= 0, finite"
    given = f"{value!r:.40}" + (" (a string: give a JSON number)" if isinstance(value, str) else "")
    raise RejectError(code, f"{where}: `{name}` must be {valid}, got {given}")


def check_unsupported_size_options(part: dict, code: str, where: str) -> None:
    given = [name for name in UNSUPPORTED_SIZE_OPTIONS if part.get(name) is not None]
    if given:
        raise RejectError(code, f"{where}: {' and '.join(f'`{n}`' for n in given)} (qwen-vl-utils' fixed size) "
                          "is not supported: remove it and bound the size with `min_pixels` / `max_pixels`")


def check_bounds(low_name: str, low, high_name: str, high, code: str, where: str) -> None:
    """A lower bound over its upper bound contradicts itself: refused, naming both."""
    if low is not None and high is not None and low > high:
        raise RejectError(code, f"{where}: `{low_name}` {low} is more than `{high_name}` {high}: "
                          f"give {low_name} <= {high_name}")
