"""Input discovery and row reading: JSONL, JSON arrays, Parquet, `datasets` directories and
Hugging Face Hub datasets (`hf://datasets/ORG/NAME?split=train&config=NAME&revision=REV`,
loaded through `datasets.load_dataset` into its cache).

The job splits every input into work units of at most `rows_per_shard` consecutive rows.
A unit is the grain of everything downstream: one worker task, one shard file, one resume
checkpoint, one partition member. Units depend only on the inputs and `rows_per_shard`,
never on the worker count, which is why output bytes do not depend on it either.

A row is identified by its input path (as given on the command line) and its 0-based index
in that input (for JSONL, the line number). Blank (whitespace-only) JSONL lines are not rows:
they are skipped, keep their line numbers (so later rows keep theirs), and count nowhere.

Memory stays bounded whatever an input holds. JSONL and JSON inputs are read in blocks, never
whole: a JSON input is split into its top-level array's elements by a streaming splitter, and a
row (a line, an element, or an Arrow row of Parquet and `datasets` inputs) holding more than
`max_row_bytes` is rejected as `row_too_large` without being held (the rest of a long line or
element is read past). A row that cannot be parsed (not JSON, nested deeper than the parser
allows, an integer too long to convert) or read (a damaged Parquet row group or Arrow buffer)
is rejected with its code; the other rows are read as usual. Inputs that cannot be read at all
(missing, unreadable, a FIFO or device, a damaged Parquet footer or `datasets` directory), and
an input named twice, stop the job before it starts with one line naming them.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import stat
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

from shards_schema import storage

from .errors import ConfigError, RejectError, loads_or_reject
from .formats import ROW_FORMATS, detect_row_format

DEFAULT_MAX_ROW_BYTES = 256 << 20  # a --max-media-bytes image (128 MiB) base64-encoded is 171 MiB, plus its row
READ_BLOCK_BYTES = 1 << 20  # JSONL and JSON inputs are read in blocks of this size, never whole
ARROW_BATCH_ROWS = 64  # Arrow rows are checked and converted to Python objects this many at a time
_SUFFIX_FORMAT = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


@dataclass(frozen=True)
class InputFile:
    path: str  # as given by the user; recorded in sample sources
    format: str
    num_rows: int
    size: int  # bytes (sum of data files for a datasets dir), part of the job identity
    unit_offsets: tuple[int, ...] = ()  # JSONL / JSON: byte offset of every unit's first line / array element
    blank_lines: tuple[int, ...] = ()  # JSONL: blank lines in every unit (not rows)
    row_format: str = "openai"  # the rows' layout (preprocess.formats)
    row_format_detected: bool = False  # taken from its first row by --input-format auto (what a reject's fix says)

    def identity(self) -> dict:
        identity = {"path": self.path, "format": self.format, "rows": self.num_rows, "bytes": self.size}
        if self.row_format != "openai":
            identity["row_format"] = self.row_format
        if any(self.blank_lines):
            identity["blank_lines"] = sum(self.blank_lines)
        return identity


@dataclass(frozen=True)
class WorkUnit:
    index: int  # global, stable across partitions and re-runs: names the shard
    input: InputFile
    start: int  # first row (inclusive)
    stop: int  # last row (exclusive)

    blank_lines: int = 0  # JSONL lines in [start, stop) that are blank: skipped, not rows

    @property
    def num_rows(self) -> int:
        """Rows the unit yields."""
        return self.stop - self.start - self.blank_lines


HUB_PREFIX = "hf://datasets/"


def is_hub_dataset(spec: str) -> bool:
    return spec.startswith(HUB_PREFIX)


def parse_hub_spec(spec: str) -> dict:
    """`hf://datasets/ORG/NAME?split=S&config=C&revision=R` -> load_dataset's arguments (split
    defaults to train)."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(spec)
    repo = (parts.netloc + parts.path).removeprefix("datasets/").strip("/")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=False).items()}
    unknown = sorted(set(query) - {"split", "config", "revision"})
    if not repo or repo.count("/") > 1 or unknown:
        raise ConfigError(f"input {spec!r}: write a Hub dataset as hf://datasets/ORG/NAME?split=train&config=NAME"
                          f"&revision=REV{f' (unknown parameters: {unknown})' if unknown else ''}")
    return {"path": repo, "name": query.get("config"), "split": query.get("split", "train"),
            "revision": query.get("revision")}


@lru_cache(maxsize=4)
def load_hub_dataset(spec: str):
    """The split of a Hub dataset, prepared in the `datasets` cache (downloaded once)."""
    import datasets
    import huggingface_hub

    args = parse_hub_spec(spec)
    huggingface_hub.utils.logging.set_verbosity_error()  # its retry warnings: the error below says it once
    try:
        dataset = datasets.load_dataset(**args)
    except FileNotFoundError as exc:
        raise ConfigError(f"input {spec}: dataset not found ({exc}); check the name, or log in (hf auth login) "
                          "for a private or gated one") from None
    except ValueError as exc:  # an unknown split or config
        raise ConfigError(f"input {spec}: {exc}") from None
    except (ConnectionError, OSError) as exc:
        raise ConfigError(f"input {spec}: cannot reach the Hugging Face Hub ({exc}); check the network, "
                          "or HF_ENDPOINT / proxy settings") from None
    if not isinstance(dataset, datasets.Dataset):
        raise ConfigError(f"input {spec}: name one split (?split=...), got {type(dataset).__name__}")
    return dataset


def hub_dataset_files(spec: str) -> list[Path]:
    """The prepared Arrow files of a Hub dataset split (what its content fingerprint hashes)."""
    return sorted(Path(f["filename"]) for f in load_hub_dataset(spec).cache_files)


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return "hf_dataset"
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise ConfigError(f"{path} is a DatasetDict with splits {splits}: pass one split directory, e.g. {path / splits[0]}" if splits else f"{path}: empty DatasetDict")
        raise ConfigError(f"{path}: a directory but not a `datasets` save_to_disk directory (no dataset_info.json); "
                          "give such a directory, or the .jsonl, .json or .parquet files in it")
    fmt = _SUFFIX_FORMAT.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(_compressed_name(str(path)) or f"{path}: unknown input format {path.suffix!r}; use .jsonl, "
                          ".json, .parquet or a datasets directory")
    return fmt


# Compressed files by suffix and by their first bytes: the tool that unpacks each
_COMPRESSION_SUFFIXES = {".gz": "gunzip -k", ".bz2": "bunzip2 -k", ".xz": "unxz -k", ".zst": "unzstd",
                         ".zip": "unzip", ".tgz": "tar -xzf"}
_COMPRESSION_MAGIC = ((b"\x1f\x8b", "gzip", "gunzip -c"), (b"\x28\xb5\x2f\xfd", "zstd", "unzstd -c"),
                      (b"BZh", "bzip2", "bunzip2 -c"), (b"\xfd7zXZ\x00", "xz", "unxz -c"),
                      (b"PK\x03\x04", "zip", "unzip -p"))


def _compressed_name(name: str) -> str | None:
    """The message for an input named as a compressed file, or None."""
    path = Path(urlsplit(name).path)
    suffix = path.suffix.lower()
    if suffix not in _COMPRESSION_SUFFIXES:
        return None
    unpack = "tar -xzf" if path.stem.lower().endswith(".tar") else _COMPRESSION_SUFFIXES[suffix]
    how = "download and unpack it" if storage.is_url(name) else f"unpack it first (`{unpack} {name}`)"
    return (f"{storage.redact(name)} is a compressed file ({suffix}), but inputs are read uncompressed: {how} and "
            "give the .jsonl, .json or .parquet file")


# ---------------------------------------------------------------- inputs checked before the job starts

_SPECIAL_FILES = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                  (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _special_file(path: str, mode: int, what: str) -> ConfigError:
    kind = next((name for is_kind, name in _SPECIAL_FILES if is_kind(mode)), "not a regular file")
    link = f" (a symbolic link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    return ConfigError(f"{what} {path}{link} is {kind}: only regular files and `datasets` directories are read "
                       "(never opened, it could block or never end); write the data to a .jsonl, .json or .parquet "
                       "file and give that")


def _stat(path: str, what: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise ConfigError(f"{what} {path} is a broken symbolic link (to {os.readlink(path)}): fix the link or "
                              "give the file itself") from None
        if glob.has_magic(path):
            raise ConfigError(f"{what} {path} matches no file: the pattern reached vlmpack unexpanded, so nothing "
                              "matches it; check the directory and the pattern") from None
        raise ConfigError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror or exc}): check the path and its "
                          "permissions") from None


def _check_readable(path: str, what: str) -> None:
    try:
        with open(path, "rb"):  # a regular file: opening it cannot block
            pass
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror or exc}): check its permissions "
                          "(e.g. chmod a+r)") from None


def check_local_input(path_str: str) -> os.stat_result:
    """The stat of a local input that is a readable regular file, or a `datasets` directory whose
    files are; otherwise a ConfigError naming it and the fix. Nothing that could block is opened:
    a FIFO, a device (also through a symbolic link) or a socket is refused from its stat alone."""
    st = _stat(path_str, "input")
    if stat.S_ISREG(st.st_mode):
        _check_readable(path_str, "input")
    elif stat.S_ISDIR(st.st_mode):
        detect_format(Path(path_str))  # a `datasets` directory, or an error saying what it is
        try:
            entries = sorted(os.listdir(path_str))
        except OSError as exc:
            raise ConfigError(f"input {path_str} cannot be listed ({exc.strerror or exc}): check its "
                              "permissions") from None
        for entry in entries:
            file = os.path.join(path_str, entry)
            mode = _stat(file, f"input {path_str}: file").st_mode
            if stat.S_ISREG(mode):
                _check_readable(file, f"input {path_str}: file")
            elif not stat.S_ISDIR(mode):
                raise _special_file(file, mode, f"input {path_str}: file")
    else:
        raise _special_file(path_str, st.st_mode, "input")
    return st


def check_inputs(specs: list[str]) -> None:
    """Every local input checked (`check_local_input`), and each input named once: the same file,
    `datasets` directory or Hub split named twice, however spelled (another relative path, a
    symbolic or hard link, a URL with other credentials or s3a:// for s3://), is refused naming both spellings, as
    its rows would otherwise be trained on twice."""
    named: dict[tuple, str] = {}
    for spec in specs:
        if is_hub_dataset(spec):
            key = ("hub", *sorted((k, v or "") for k, v in parse_hub_spec(spec).items()))
        elif storage.is_url(spec):
            key = ("url", storage.object_identity(spec))
        else:
            st = check_local_input(spec)
            key = ("local", st.st_dev, st.st_ino)
        if key in named:
            first = named[key]
            if spec == first:
                raise ConfigError(f"input {storage.redact(spec)} is named twice: its rows would be read twice; name "
                                  "each input once")
            if key[0] != "local":
                how = ""
            elif os.path.realpath(spec) == os.path.realpath(first):
                how = f" (both are {os.path.realpath(spec)})"
            else:
                how = " (a hard link to it)"
            raise ConfigError(f"input {storage.redact(spec)} is the same input as {storage.redact(first)}{how}: its "
                              "rows would be read twice; name each input once")
        named[key] = spec


# ---------------------------------------------------------------- JSONL: lines, read in blocks

_NOT_WHITESPACE = re.compile(rb"[^ \t\r\n\v\f]")


def _lines(fh, max_bytes: int) -> Iterator[tuple[bytes | None, int, int, bool]]:
    """Each line of binary file `fh` from where it stands, split at b"\\n" as iterating the file
    does: (the line's bytes, or None when it holds more than `max_bytes` without its newline;
    its length with the newline; without it; whether it is blank). The file is read in blocks;
    a line over `max_bytes` is read past, never held."""
    pieces: list[bytes] = []
    size, blank = 0, True
    while block := fh.read(READ_BLOCK_BYTES):
        at = 0
        while at < len(block):
            end = block.find(b"\n", at)
            stop = len(block) if end < 0 else end + 1
            if blank and _NOT_WHITESPACE.search(block, at, stop):
                blank = False
            size += stop - at
            if size <= max_bytes + 1:  # + its newline
                pieces.append(block[at:stop])
            elif pieces:
                pieces = []
            if end >= 0:
                line = b"".join(pieces) if size - 1 <= max_bytes else None
                pieces = []  # not held twice while the line is parsed
                yield line, size, size - 1, blank
                size, blank = 0, True
            at = stop
    if size:  # a last line without a newline
        line = b"".join(pieces) if size <= max_bytes else None
        pieces = []
        yield line, size, size, blank


# Byte order marks of the Unicode encodings other than UTF-8 (UTF-32's first: it begins with UTF-16's)
_OTHER_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
               (b"\xfe\xff", "UTF-16"))


def _refuse_non_utf8_text(fh, path: str) -> None:
    """A JSON or JSONL input is UTF-8 text: one that starts with a UTF-16 or UTF-32 byte order
    mark, or is compressed (gzip, zstd, bzip2, xz, zip) under a text name, is refused before it
    is split into rows (its bytes would be read as rows of garbage, or its rows cut apart),
    naming the encoding and the fix. `fh` is left at the start."""
    head = fh.read(6)
    fh.seek(0)
    for magic, compression, unpack in _COMPRESSION_MAGIC:
        if head.startswith(magic):
            name = storage.redact(path)
            raise ConfigError(f"input {name} is {compression}-compressed, but JSON and JSONL inputs are read as "
                              f"plain UTF-8 text: unpack it first, e.g. `{unpack} {name} > rows"
                              f"{Path(urlsplit(name).path).suffix}`")
    for bom, encoding in _OTHER_BOMS:
        if head.startswith(bom):
            name = storage.redact(path)
            raise ConfigError(f"input {name} is {encoding} text (it starts with a {encoding} byte order mark), but JSON "
                              f"and JSONL inputs are read as UTF-8: convert it, e.g. `iconv -f {encoding} -t UTF-8 "
                              f"{name} > rows-utf8{Path(urlsplit(name).path).suffix}`")


# A CR between two rows: the end of one object, the start of the next
_CR_BETWEEN_ROWS = re.compile(rb"\}[ \t]*\r[ \t\r]*\{")


def _refuse_cr_line_breaks(fh, path: str, probe: int = 16 << 20) -> None:
    """A JSONL input is split at LF: one whose first line (up to its LF, at most `probe` bytes
    read) holds rows separated by CR alone (line breaks of classic Mac OS) is refused before it
    is read as a single row. Windows' CRLF is split at its LF; a raw CR inside one row's string
    makes that row bad JSON, not the input. `fh` is left at the start."""
    head = b""
    while len(head) < probe and (block := fh.read(READ_BLOCK_BYTES)):
        lf = block.find(b"\n")
        head += block if lf < 0 else block[:lf]
        if lf >= 0:
            break
    fh.seek(0)
    if _CR_BETWEEN_ROWS.search(head):
        name = storage.redact(path)
        raise ConfigError(f"input {name} ends its lines in CR alone (classic Mac OS line breaks), but JSONL rows are "
                          f"split at LF: convert it, e.g. `tr '\\r' '\\n' < {name} > rows-lf.jsonl`")


def _scan_jsonl(path: str, rows_per_unit: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Count lines, remember where every unit starts and how many of its lines are blank,
    reading the file once in blocks (no line is held)."""
    offsets, blanks, position, rows = [], [], 0, 0
    with storage.open_binary(path) as fh:
        _refuse_non_utf8_text(fh, path)
        _refuse_cr_line_breaks(fh, path)
        first_line = _first_nonblank_line_start(fh)
        for _, size, _, blank in _lines(fh, max_bytes=0):
            if rows % rows_per_unit == 0:
                offsets.append(position)
                blanks.append(0)
            if blank:
                blanks[-1] += 1
            position += size
            rows += 1
    # a JSON array (pretty-printed, its first line `[` alone or its first element's start; or on one
    # line): rows of garbage. A first line that is a whole array is one bad row, rejected alone.
    if first_line.startswith(b"[") and (rows - sum(blanks) == 1 or not _whole_json(first_line)):
        raise ConfigError(f"input {storage.redact(path)} holds one JSON array (it starts with `[`), not JSON lines "
                          "(one row object per line): name it .json, or write one row per line")
    return rows, tuple(offsets), tuple(blanks)


def _first_nonblank_line_start(fh, probe: int = 1 << 16) -> bytes:
    """The file's first line that is not blank, stripped, where it ends within the first `probe`
    bytes (a UTF-8 byte order mark skipped); else its start, cut at `probe`. `fh` is left at the
    start."""
    head = fh.read(probe)
    fh.seek(0)
    head = head[len(_UTF8_BOM):] if head.startswith(_UTF8_BOM) else head
    for line in head.split(b"\n"):
        if line.strip():
            return line.strip()
    return b""


def _whole_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return False
    return True


# ---------------------------------------------------------------- JSON: a top-level array, split as it streams

# Everything up to the next byte that matters, whole strings within the block skipped: at the
# array's top level a bracket, brace, quote or comma, deeper only a bracket, brace or quote
# (commas there split nothing). A quote stops it only when its string goes on past the block;
# inside such a string only its end or an escape matters. The quantifiers are possessive: a
# match never backtracks (and runs at about the speed of json.loads).
_JSON_SKIP_TOP = re.compile(rb'(?:[^"{}\[\],]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.DOTALL)
_JSON_SKIP_NESTED = re.compile(rb'(?:[^"{}\[\]]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.DOTALL)
_JSON_IN_STRING = re.compile(rb'["\\]')
_QUOTE, _OPENING, _CLOSING = ord('"'), (ord("{"), ord("[")), (ord("}"), ord("]"))
_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass
class _Element:
    data: bytes | None  # None when the element holds more than the byte limit (read past, not held)
    size: int  # its bytes, whitespace around it included
    closed: bool  # False: the file ended inside it, before the array's `]` (truncated)
    offset: int  # byte offset of its first byte


class _ArraySplitter:
    """The elements of a top-level JSON array, split at its top-level commas while the file is
    read in blocks: strings, nesting and escapes are tracked, nothing is parsed. `fh` stands at
    an element's first byte (just after `[` or a top-level `,`); after the array's `]`, `end`
    is the byte offset just past it.

    Nesting is tracked by bracket kind, so an element that leaves a bracket open inside it
    (`[{...}}`) ends at the closer of its outer one: that element is bad JSON, and the rows
    after it are still found. Valid JSON never closes a bracket of another kind."""

    def __init__(self, fh, offset: int, max_bytes: int, first: bool):
        self.fh, self.offset, self.max_bytes = fh, offset, max_bytes
        self.first = first  # the array's first element: blank and closed by `]`, it is an empty array
        self.end: int | None = None
        self.tail = b""  # what followed `]` in its block

    def __iter__(self) -> Iterator[_Element]:
        open_brackets: list[int] = []  # the opening byte of each bracket the element has open
        open_count = {opener: 0 for opener in _OPENING}  # of each kind, so a closer's match is found in O(1)
        in_string, skip = False, 0
        pieces: list[bytes] = []
        size, nonblank, start = 0, False, self.offset
        base = self.offset

        def add(block: bytes, lo: int, hi: int) -> None:
            nonlocal size, nonblank, pieces
            if hi <= lo:
                return
            if not nonblank and _NOT_WHITESPACE.search(block, lo, hi):
                nonblank = True
            size += hi - lo
            if size <= self.max_bytes:
                pieces.append(block[lo:hi])
            elif pieces:
                pieces = []

        def element(closed: bool) -> _Element:
            nonlocal pieces
            data, pieces = (b"".join(pieces) if size <= self.max_bytes else None), []  # held once
            return _Element(data, size, closed, start)

        while block := self.fh.read(READ_BLOCK_BYTES):
            n, at, cut = len(block), skip, 0  # `cut`: where the current element's bytes in this block begin
            skip = 0
            while at < n:
                if in_string:
                    found = _JSON_IN_STRING.search(block, at)
                    if found is None:
                        at = n
                    elif found.group() == b'"':
                        in_string, at = False, found.end()
                    else:  # an escape: the byte after it is the string's, whatever it is
                        at = found.end() + 1
                        skip = max(0, at - n)
                    continue
                at = (_JSON_SKIP_NESTED if open_brackets else _JSON_SKIP_TOP).match(block, at).end()
                if at == n:
                    break
                byte = block[at]
                at += 1
                if byte == _QUOTE:
                    in_string = True
                elif byte in _OPENING:
                    open_brackets.append(byte)
                    open_count[byte] += 1
                elif byte in _CLOSING:
                    if open_brackets:
                        opener = _OPENING[_CLOSING.index(byte)]
                        if open_count[opener]:  # brackets left open inside it close with it
                            while (inner := open_brackets.pop()) != opener:
                                open_count[inner] -= 1
                            open_count[opener] -= 1
                    elif byte == _CLOSING[1]:  # the array ends
                        add(block, cut, at - 1)
                        if nonblank or not self.first:
                            yield element(closed=True)
                        self.end, self.tail = base + at, block[at:]
                        return
                else:  # a top-level comma ends the element
                    add(block, cut, at - 1)
                    done = element(closed=True)
                    self.first = False
                    size, nonblank, start, cut = 0, False, base + at, at
                    yield done
                    del done
            add(block, cut, n)
            base += n
        if nonblank or not self.first:  # the file ends inside the array
            yield element(closed=False)


def _open_json_array(fh, path: str) -> int:
    """Skip a UTF-8 byte order mark and whitespace up to the array's `[`; its offset + 1."""
    head = fh.read(READ_BLOCK_BYTES)
    at = len(_UTF8_BOM) if head.startswith(_UTF8_BOM) else 0
    while (found := _NOT_WHITESPACE.search(head, at)) is None:
        more = fh.read(READ_BLOCK_BYTES)
        if not more:
            raise ConfigError(f"{storage.redact(path)}: empty, not a JSON array of rows; write the rows as a JSON "
                              "array, or one per line as .jsonl")
        at, head = len(head), head + more
    if found.group() != b"[":
        start = head[found.start() : found.start() + 20].decode("utf-8", "backslashreplace")
        raise ConfigError(f"{storage.redact(path)}: a JSON input must be an array of rows, but it starts with "
                          f"{start!r}; write the rows as an array, or one per line as .jsonl")
    return found.end()


def _scan_json(path: str, rows_per_unit: int) -> tuple[int, tuple[int, ...]]:
    """Count the array's elements and remember where every unit's first element starts, reading
    the file once in blocks (no element is held). Anything but whitespace after the array's
    `]` (a second array, a truncated copy) stops the job: its rows would be lost unseen."""
    offsets, rows = [], 0
    with storage.open_binary(path) as fh:
        _refuse_non_utf8_text(fh, path)
        first = _open_json_array(fh, path)
        fh.seek(first)
        splitter = _ArraySplitter(fh, first, max_bytes=0, first=True)
        element = None
        for element in splitter:
            if rows % rows_per_unit == 0:
                offsets.append(element.offset)
            rows += 1
        if element is not None and not element.closed and _last_nonblank_byte(fh) == b"]":
            raise ConfigError(f"{storage.redact(path)}: the array element at byte {element.offset} (element "
                              f"{rows - 1}) leaves a string or a bracket open, so the file ends inside it though "
                              "it ends in the array's `]`: the rows after it cannot be told apart. Fix that "
                              "element (a missing `\"`, `}` or `]`), or fetch the file again if it was cut short")
        if splitter.end is not None:
            at, block = splitter.end, splitter.tail
            while True:
                found = _NOT_WHITESPACE.search(block)
                if found is not None:
                    raise ConfigError(f"{storage.redact(path)}: more data after the JSON array ends (at byte "
                                      f"{at + found.start()}); "
                                      "an input holds one array: split the file, or convert it to .jsonl")
                at += len(block)
                block = fh.read(READ_BLOCK_BYTES)
                if not block:
                    break
    return rows, tuple(offsets)


def _last_nonblank_byte(fh) -> bytes:
    """The file's last byte that is not whitespace (b"" when there is none)."""
    end = fh.seek(0, os.SEEK_END)
    while end > 0:
        start = max(0, end - READ_BLOCK_BYTES)
        fh.seek(start)
        block = fh.read(end - start).rstrip()
        if block:
            return block[-1:]
        end = start
    return b""


def _json_elements(path: str, offset: int, max_bytes: int, first: bool) -> Iterator[_Element]:
    with storage.open_binary(path) as fh:
        fh.seek(offset)
        yield from _ArraySplitter(fh, offset, max_bytes, first)


# ---------------------------------------------------------------- rows from bytes

def _brief(exc: BaseException) -> str:
    """An exception as one short line (pyarrow's messages run over several)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _too_large(size: int, max_bytes: int, what: str) -> RejectError:
    return RejectError("row_too_large", f"{what} holds {size:,} bytes, more than --max-row-bytes {max_bytes:,}, "
                       "and was skipped; raise --max-row-bytes, or keep large images and videos in files under "
                       "--media-root")


def parse_json_row(data: bytes, what: str = "row"):
    """One JSON row's value, or the RejectError (`bad_json`) saying why it cannot be parsed."""
    try:
        return loads_or_reject(data, "bad_json", what)
    except RejectError as exc:
        return exc


def _json_row(element: _Element, max_bytes: int):
    if element.data is None:
        return _too_large(element.size, max_bytes, "the array element")
    if not element.closed:
        return RejectError("bad_json", "the file ends inside this element, before the array's closing `]`: the file "
                           "is truncated")
    if not _NOT_WHITESPACE.search(element.data):
        return RejectError("bad_json", "an empty array element (two commas in a row, or a comma before `]`)")
    return parse_json_row(element.data, "the array element")


def _load_dataset(path: Path):
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets and pyarrow raise many kinds for a damaged directory
        fault = _damaged_json_file(path) or _brief(exc)
        raise ConfigError(f"input {path}: a `datasets` directory that cannot be loaded ({fault}); its files are "
                          "missing or damaged: save it again with Dataset.save_to_disk") from None


def _damaged_json_file(path: Path) -> str | None:
    """Which of a `datasets` directory's JSON files is not JSON, if one is."""
    for name in ("state.json", "dataset_info.json"):
        try:
            json.loads((path / name).read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            return f"{name} is damaged: {_brief(exc)}"
    return None


def _parquet_file(path: str, fh):
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(fh, buffer_size=READ_BLOCK_BYTES)
        counted = sum(pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for a damaged footer
        raise ConfigError(f"input {storage.redact(path)}: not a readable Parquet file ({_brief(exc)}); the file "
                          "is truncated or damaged: write it again, or convert it to .jsonl") from None
    if counted != pf.metadata.num_rows:
        raise ConfigError(f"input {storage.redact(path)}: a damaged Parquet footer (its row groups hold {counted} "
                          f"rows, the file says {pf.metadata.num_rows}); write the file again")
    return pf


def describe_input(path_str: str, rows_per_unit: int, input_format: str = "auto",
                   max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> InputFile:
    """The input's size, rows and units; its row layout is `input_format`, or with "auto" the
    layout of its first row (table inputs: of its column names)."""
    path = Path(path_str)
    remote = storage.is_url(path_str) and not is_hub_dataset(path_str)
    if is_hub_dataset(path_str):
        fmt = "hf_hub"
    elif remote:
        fmt = _SUFFIX_FORMAT.get(Path(urlsplit(path_str).path).suffix.lower())
        if fmt is None:
            raise ConfigError(_compressed_name(path_str) or f"{storage.redact(path_str)}: unknown input format; a URL "
                              "input is a .jsonl, .json or .parquet file")
        storage.info(path_str)  # there and readable, or a StorageError naming why not
    else:
        check_local_input(path_str)
        fmt = detect_format(path)
    offsets: tuple[int, ...] = ()
    blanks: tuple[int, ...] = ()
    if fmt in ("jsonl", "json", "parquet"):
        size = storage.info(path_str)["size"] if remote else path.stat().st_size
    if fmt == "jsonl":
        rows, offsets, blanks = _scan_jsonl(path_str, rows_per_unit)
    elif fmt == "json":
        rows, offsets = _scan_json(path_str, rows_per_unit)
    elif fmt == "parquet":
        with storage.open_binary(path_str) as fh:
            rows = _parquet_file(path_str, fh).metadata.num_rows
    elif fmt == "hf_hub":
        rows = len(load_hub_dataset(path_str))
        size = sum(p.stat().st_size for p in hub_dataset_files(path_str))
    else:
        rows = len(_load_dataset(path))
        size = sum(p.stat().st_size for p in path.glob("*.arrow"))
    table = fmt not in ("jsonl", "json")  # its first "row" is its column names
    first = _first_row(path_str, fmt, offsets, max_row_bytes) if input_format == "auto" or table and rows else None
    if table and rows:
        _refuse_a_table_without_turns(path_str, first)
    if input_format == "auto":
        row_format = detect_row_format(first)
    elif input_format in ROW_FORMATS:
        row_format = input_format
    else:
        raise ConfigError(f"--input-format {input_format!r}: choose auto or one of {', '.join(ROW_FORMATS)}")
    return InputFile(path=path_str, format=fmt, num_rows=rows, size=size, unit_offsets=offsets, blank_lines=blanks,
                     row_format=row_format, row_format_detected=input_format == "auto")


# rows read for an input's layout: its first row that holds turns among these many
LAYOUT_ROWS_LOOKED_AT = 1000
TURNS_KEYS = ("conversations", "messages")  # where the ShareGPT and the OpenAI / ms-swift layouts hold a chat


def _first_row(path_str: str, fmt: str, offsets: tuple[int, ...], max_row_bytes: int):
    """The first row that is a JSON object holding turns (JSONL, JSON: rows that are not are
    rejected one by one where they are read, and must not decide the layout of the others), else
    its first JSON object, or the column names (Parquet, datasets) that name an input's layout;
    None when there is none to look at in its first LAYOUT_ROWS_LOOKED_AT rows (an empty input,
    rows that are not JSON objects or are over `max_row_bytes`)."""
    if fmt == "hf_hub":
        return load_hub_dataset(path_str).column_names
    if fmt == "jsonl":
        with storage.open_binary(path_str) as fh:
            rows = (parse_json_row(data) if data is not None else None
                    for data, _, _, blank in _lines(fh, max_row_bytes) if not blank)
            return _first_object(rows)
    if fmt == "json":
        elements = _json_elements(path_str, offsets[0], max_row_bytes, first=True) if offsets else ()
        return _first_object(_json_row(element, max_row_bytes) for element in elements)
    if fmt == "parquet":
        with storage.open_binary(path_str) as fh:
            return _parquet_file(path_str, fh).schema_arrow.names
    return _load_dataset(Path(path_str)).column_names


def _refuse_a_table_without_turns(path_str: str, columns: list[str]) -> None:
    """A table's rows share its columns: with no column of turns every row would be rejected,
    so the input is refused once, naming its columns."""
    if not any(key in columns for key in TURNS_KEYS):
        shown = ", ".join(columns[:12]) + (f", ... ({len(columns)} in all)" if len(columns) > 12 else "")
        raise ConfigError(f"input {storage.redact(path_str)}: no `messages` or `conversations` column (its columns: "
                          f"{shown or 'none'}); vlmpack reads each row's chat from one of them: rename the column "
                          "that holds the turns")


def _first_object(rows: Iterator) -> dict | None:
    first = None
    for row in itertools.islice(rows, LAYOUT_ROWS_LOOKED_AT):
        if isinstance(row, dict):
            if any(isinstance(row.get(key), (list, str)) and row[key] for key in TURNS_KEYS):
                return row
            first = first if first is not None else row
    return first


def plan_units(inputs: list[InputFile], rows_per_unit: int) -> list[WorkUnit]:
    units = []
    for inp in inputs:
        for k, start in enumerate(range(0, inp.num_rows, rows_per_unit)):
            blank = inp.blank_lines[k] if inp.blank_lines else 0
            units.append(WorkUnit(len(units), inp, start, min(start + rows_per_unit, inp.num_rows), blank))
    return units


# ---------------------------------------------------------------- the rows of a unit

def read_rows(unit: WorkUnit, rows_per_unit: int,
              max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[tuple[int, object]]:
    """Yield (row index, parsed row or RejectError) for every row of the unit, in order; a row
    over `max_row_bytes` is a `row_too_large` RejectError, never held whole."""
    inp = unit.input
    if inp.format == "jsonl":
        with storage.open_binary(inp.path) as fh:
            fh.seek(inp.unit_offsets[unit.start // rows_per_unit])
            lines = _lines(fh, max_row_bytes)
            for row in range(unit.start, unit.stop):  # not zip(): it would keep the last line's bytes
                data, _, length, blank = next(lines, (None, 0, 0, None))
                if blank is None:
                    return  # the file is shorter than scanned: the unit's count check names it
                if blank:
                    continue
                if data is None:
                    parsed = _too_large(length, max_row_bytes, "the line")
                else:
                    parsed = parse_json_row(data, "the line")
                del data  # not held beside the parsed row
                yield row, parsed
        return
    if inp.format == "json":
        k = unit.start // rows_per_unit
        elements = _json_elements(inp.path, inp.unit_offsets[k], max_row_bytes, first=k == 0)
        for row in range(unit.start, unit.stop):
            element = next(elements, None)
            if element is None:
                return
            parsed = _json_row(element, max_row_bytes)
            del element
            yield row, parsed
        return
    if inp.format == "parquet":
        yield from _parquet_rows(inp.path, unit.start, unit.stop, max_row_bytes)
        return
    if inp.format == "hf_hub":
        table = load_hub_dataset(inp.path).with_format("arrow")[unit.start : unit.stop]
    else:
        table = _load_dataset(Path(inp.path)).with_format("arrow")[unit.start : unit.stop]
    yield from _arrow_rows(table, unit.start, max_row_bytes)


def _arrow_rows(table, first: int, max_row_bytes: int) -> Iterator[tuple[int, object]]:
    """The rows of an Arrow table or record batch as Python objects, `ARROW_BATCH_ROWS` at a
    time. Damaged data is a rejected row (`unreadable_row`), never a read out of bounds: a batch
    is converted once its buffers validate (offsets in bounds, strings UTF-8); otherwise its
    rows are converted one at a time once its offsets validate, so a bad string rejects its own
    row only. A row over `max_row_bytes` (its Arrow bytes) is `row_too_large`, never converted."""
    for at in range(0, table.num_rows, ARROW_BATCH_ROWS):
        batch = table.slice(at, ARROW_BATCH_ROWS)
        if batch.nbytes <= max_row_bytes:
            try:
                batch.validate(full=True)
                rows = batch.to_pylist()
            except Exception:  # noqa: BLE001 - find the rows at fault below, one at a time
                pass
            else:
                yield from enumerate(rows, start=first + at)
                continue
        damage = _damaged_offsets(batch)
        for k in range(batch.num_rows):
            if damage:
                yield first + at + k, RejectError(
                    "unreadable_row", f"rows {first + at}-{first + at + batch.num_rows - 1} cannot be read (their "
                    f"Arrow offsets are damaged: {damage}); the input is damaged: write it again")
            else:
                yield first + at + k, _arrow_row(batch.slice(k, 1), max_row_bytes)


def _arrow_row(one_row, max_row_bytes: int):
    size = one_row.nbytes  # the bytes the row refers to, not its batch's
    if size > max_row_bytes:
        return _too_large(size, max_row_bytes, "the row")
    try:
        return one_row.to_pylist()[0]
    except Exception as exc:  # noqa: BLE001 - UnicodeDecodeError, ValueError (a date out of range), ...
        return RejectError("unreadable_row", f"the row cannot be read ({_brief(exc)}); its input is damaged: write "
                           "it again")


def _as_bytes(arrow_type):
    """`arrow_type` with every string type as the binary type of its width: validating that
    checks offsets only, not UTF-8."""
    import pyarrow as pa

    if pa.types.is_string(arrow_type):
        return pa.binary()
    if pa.types.is_large_string(arrow_type):
        return pa.large_binary()
    if pa.types.is_struct(arrow_type):
        return pa.struct([field.with_type(_as_bytes(field.type)) for field in arrow_type])
    if pa.types.is_map(arrow_type):
        return pa.map_(_as_bytes(arrow_type.key_type), _as_bytes(arrow_type.item_type))
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        field = arrow_type.value_field.with_type(_as_bytes(arrow_type.value_type))
        if pa.types.is_fixed_size_list(arrow_type):
            return pa.list_(field, arrow_type.list_size)
        return pa.large_list(field) if pa.types.is_large_list(arrow_type) else pa.list_(field)
    return arrow_type


def _damaged_offsets(batch) -> str | None:
    """Why the batch's offsets and lengths do not validate, or None when they do (its strings
    may still not be UTF-8: converting a row then raises, for that row alone)."""
    import pyarrow as pa

    try:
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        table.cast(pa.schema([field.with_type(_as_bytes(field.type)) for field in table.schema])).validate(full=True)
    except Exception as exc:  # noqa: BLE001
        return _brief(exc)
    return None


def _parquet_rows(path: str, start: int, stop: int, max_row_bytes: int) -> Iterator[tuple[int, object]]:
    """Rows [start, stop) of a Parquet file, one row group at a time, streamed in batches. A row
    group that cannot be read (a damaged page) makes its rows `unreadable_row` rejects naming
    the group and its row range; the other row groups are read as usual."""
    with storage.open_binary(path) as fh:
        pf = _parquet_file(path, fh)
        group_start = 0
        for g in range(pf.metadata.num_row_groups):
            group_stop = group_start + pf.metadata.row_group(g).num_rows
            if group_stop > start and group_start < stop:
                yield from _parquet_group_rows(pf, g, group_start, group_stop, start, stop, max_row_bytes)
            group_start = group_stop
            if group_start >= stop:
                break


def _parquet_group_rows(pf, group: int, group_start: int, group_stop: int, start: int, stop: int,
                        max_row_bytes: int) -> Iterator[tuple[int, object]]:
    lo, hi = max(start, group_start), min(stop, group_stop)  # the unit's rows in this group
    batch_start, wanted = group_start, lo  # the next batch's first row; the next row to yield
    try:
        for batch in pf.iter_batches(batch_size=ARROW_BATCH_ROWS, row_groups=[group], use_threads=False):
            batch_stop = batch_start + batch.num_rows
            first, last = max(batch_start, wanted), min(batch_stop, hi)
            if first < last:
                for index, value in _arrow_rows(batch.slice(first - batch_start, last - first), first, max_row_bytes):
                    yield index, value
                    wanted = index + 1
            batch_start = batch_stop
            if batch_start >= hi:
                break
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many kinds for a damaged page
        reason = _brief(exc)
    else:
        if wanted >= hi:
            return
        reason = f"the row group gives {batch_start - group_start} rows, its footer says {group_stop - group_start}"
    for index in range(wanted, hi):
        yield index, RejectError("unreadable_row", f"Parquet row group {group} (rows {group_start}-{group_stop - 1}) "
                                 f"cannot be read from row {wanted} on ({reason}); the file is damaged: write it again")
