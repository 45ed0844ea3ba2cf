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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

from shards_schema import storage

from .errors import ConfigError, RejectError
from .formats import ROW_FORMATS, detect_row_format

_SUFFIX_FORMAT = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


@dataclass(frozen=True)
class InputFile:
    path: str  # as given by the user; recorded in sample sources
    format: str
    num_rows: int
    size: int  # bytes (sum of data files for a datasets dir), part of the job identity
    line_offsets: tuple[int, ...] = ()  # JSONL: byte offset of every unit's first line
    blank_lines: tuple[int, ...] = ()  # JSONL: blank lines in every unit (not rows)
    row_format: str = "openai"  # the rows' layout (preprocess.formats)

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
        raise ConfigError(f"{path}: a directory but not a `datasets` save_to_disk directory (no dataset_info.json)")
    fmt = _SUFFIX_FORMAT.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{path}: unknown input format {path.suffix!r}; use .jsonl, .json, .parquet or a datasets directory")
    return fmt


_WHITESPACE = frozenset(bytes([c]) for c in b" \t\r\n\v\f") | {b""}


def _is_blank(line: bytes) -> bool:
    # the first byte decides for almost every line, without copying a long line
    return line[:1] in _WHITESPACE and not line.strip()


def _scan_jsonl(path: str, rows_per_unit: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Count lines, remember where every unit starts and how many of its lines are blank,
    reading the file once in binary."""
    offsets, blanks, position, rows = [], [], 0, 0
    with storage.open_binary(path) as fh:
        for line in fh:
            if rows % rows_per_unit == 0:
                offsets.append(position)
                blanks.append(0)
            if _is_blank(line):
                blanks[-1] += 1
            position += len(line)
            rows += 1
    return rows, tuple(offsets), tuple(blanks)


def _load_dataset(path: Path):
    import datasets

    return datasets.load_from_disk(str(path))


def describe_input(path_str: str, rows_per_unit: int, input_format: str = "auto") -> InputFile:
    """The input's size, rows and units; its row layout is `input_format`, or with "auto" the
    layout of its first row (table inputs: of its column names)."""
    path = Path(path_str)
    remote = storage.is_url(path_str) and not is_hub_dataset(path_str)
    if is_hub_dataset(path_str):
        fmt = "hf_hub"
    elif remote:
        fmt = _SUFFIX_FORMAT.get(Path(urlsplit(path_str).path).suffix.lower())
        if fmt is None:
            raise ConfigError(f"{storage.redact(path_str)}: unknown input format; a URL input is a .jsonl, .json or "
                              ".parquet file")
        storage.info(path_str)  # there and readable, or a StorageError naming why not
    elif not path.exists():
        raise ConfigError(f"input {path_str} does not exist")
    else:
        fmt = detect_format(path)
    offsets: tuple[int, ...] = ()
    blanks: tuple[int, ...] = ()
    if fmt in ("jsonl", "json", "parquet"):
        size = storage.info(path_str)["size"] if remote else path.stat().st_size
    if fmt == "jsonl":
        rows, offsets, blanks = _scan_jsonl(path_str, rows_per_unit)
    elif fmt == "json":
        rows = len(_load_json_array(path_str))
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        with storage.open_binary(path_str) as fh:
            rows = pq.ParquetFile(fh).metadata.num_rows
    elif fmt == "hf_hub":
        rows = len(load_hub_dataset(path_str))
        size = sum(p.stat().st_size for p in hub_dataset_files(path_str))
    else:
        rows = len(_load_dataset(path))
        size = sum(p.stat().st_size for p in path.glob("*.arrow"))
    if input_format == "auto":
        row_format = detect_row_format(_first_row(path_str, fmt))
    elif input_format in ROW_FORMATS:
        row_format = input_format
    else:
        raise ConfigError(f"--input-format {input_format!r}: choose auto or one of {', '.join(ROW_FORMATS)}")
    return InputFile(path=path_str, format=fmt, num_rows=rows, size=size, line_offsets=offsets, blank_lines=blanks,
                     row_format=row_format)


def _first_row(path_str: str, fmt: str):
    """The first row (JSONL, JSON) or the column names (Parquet, datasets) that name an input's
    layout; None when there is none to look at (an empty input, a first line that is not JSON)."""
    if fmt == "hf_hub":
        return load_hub_dataset(path_str).column_names
    if fmt == "jsonl":
        with storage.open_binary(path_str) as fh:
            for line in fh:
                if not _is_blank(line):
                    try:
                        return json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        return None
        return None
    if fmt == "json":
        rows = _load_json_array(path_str)
        return rows[0] if rows else None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with storage.open_binary(path_str) as fh:
            return pq.ParquetFile(fh).schema_arrow.names
    return _load_dataset(Path(path_str)).column_names


def plan_units(inputs: list[InputFile], rows_per_unit: int) -> list[WorkUnit]:
    units = []
    for inp in inputs:
        for k, start in enumerate(range(0, inp.num_rows, rows_per_unit)):
            blank = inp.blank_lines[k] if inp.blank_lines else 0
            units.append(WorkUnit(len(units), inp, start, min(start + rows_per_unit, inp.num_rows), blank))
    return units


@lru_cache(maxsize=2)
def _load_json_array(path: str) -> list:
    try:
        with storage.open_binary(path) as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); for one conversation per line use .jsonl") from exc
    if not isinstance(data, list):
        raise ConfigError(f"{path}: a JSON input must be an array of rows, got {type(data).__name__}")
    return data


def read_rows(unit: WorkUnit, rows_per_unit: int) -> Iterator[tuple[int, object]]:
    """Yield (row index, parsed row or RejectError) for every row of the unit, in order."""
    inp = unit.input
    if inp.format == "jsonl":
        with storage.open_binary(inp.path) as fh:
            fh.seek(inp.line_offsets[unit.start // rows_per_unit])
            for row in range(unit.start, unit.stop):
                line = fh.readline()
                if _is_blank(line):
                    continue
                try:
                    yield row, json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    yield row, RejectError("bad_json", f"line is not valid JSON: {exc}")
        return
    if inp.format == "json":
        rows = _load_json_array(inp.path)[unit.start : unit.stop]
    elif inp.format == "parquet":
        rows = _parquet_rows(inp.path, unit.start, unit.stop)
    elif inp.format == "hf_hub":
        rows = load_hub_dataset(inp.path).with_format("arrow")[unit.start : unit.stop].to_pylist()
    else:
        table = _load_dataset(Path(inp.path)).with_format("arrow")[unit.start : unit.stop]
        rows = table.to_pylist()
    yield from enumerate(rows, start=unit.start)


def _parquet_rows(path: str, start: int, stop: int) -> list:
    import pyarrow.parquet as pq

    with storage.open_binary(path) as fh:
        return _parquet_slice(pq.ParquetFile(fh), start, stop)


def _parquet_slice(pf, start: int, stop: int) -> list:
    groups, first_row, row = [], None, 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row + n > start and row < stop:
            groups.append(g)
            first_row = row if first_row is None else first_row
        row += n
    if not groups:
        return []
    table = pf.read_row_groups(groups)
    return table.slice(start - first_row, stop - start).to_pylist()
