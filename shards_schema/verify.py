"""`vlmpack verify DIR`: check a shard directory end to end before a training job trusts it.

Two depths:

* `--quick` (seconds on terabytes): the manifest against the directory (files present, sizes,
  stray or leftover files, totals, row accounting, `rejects.jsonl`), each shard opened as every
  reader opens it (`reader.file_fault`, `reader.read_batches`: a regular file, Arrow footer,
  schema and record batch metadata intact, offsets in range), row count and per-shard sums
  read from list *offsets* (tokens, images, patches) plus the small `num_target_tokens`
  column. Never hashes, never reads token or pixel values, so a flipped byte inside pixel data
  passes `--quick`.
* full (default): all of the above plus the sha256 of every shard and every row's invariants
  (lengths, grids, image pads and vision markers, M-RoPE positions recomputed with
  `mrope_position_ids`, loss mask only on assistant turns, each `source` (input:row) once). Row checks
  are vectorised over slices of each record batch (~1M tokens); positions are recomputed by
  one `mrope_position_ids` call per slice (the rows concatenated, see `_check_positions`).

`--workers N` checks shards in N processes (full mode: hashing and row checks are per shard).

A `sample_uid` is the input's own `id` (input:row when it has none), and real data repeats
ids: a repeated sample_uid is a warning (counted and shown, exit 0), while a repeated `source`
is a fault (two rows claiming the same input row).

`verify_shards()` returns a `VerifyReport`; it raises `ShardFormatError` when DIR is not a
shard directory at all (no manifest, unreadable manifest, other format or schema version),
which the CLI turns into exit code 2 (1 = faults found, 0 = clean).

Memory stays bounded however broken the data: the report keeps the first `keep_per_kind`
faults of each kind and counts all of them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import stat
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from .atomic import TMP_SUFFIX
from .errors import EXIT_FAULT, EXIT_OK, EXIT_USER_ERROR, UserError, print_error
from .families import find_rules, reading_rules
from .flags import refuse_bad_location
from .manifest import (MANIFEST_NAME, PARTS_DIR, REJECTS_NAME, SHARD_STAT_KEYS, VIDEO_STAT_KEYS, ShardFormatError,
                       is_count, layout_problems, read_manifest, shard_entries, total_keys)
from .positions import mrope_position_ids
from .reader import ShardFault, file_fault, list_views, offsets_view, read_batches
from .storage import file_kind, is_url, redact
from .writer import file_sha256

SHARD_SUFFIX = ".arrow"
SPECIAL_TOKEN_KEYS = ("im_start", "im_end", "assistant", "vision_start", "vision_end", "image_pad")
DEFAULT_KEEP_PER_KIND = 100  # faults of one kind kept in a report (all are counted)
DEFAULT_SHOW_PER_KIND = 20  # faults of one kind printed by the CLI
DUPLICATE_EXAMPLES = 5
UNIQUE_COLUMNS = ("sample_uid", "source")  # string columns compared across shards (full mode)
ROWS_SLICE_TOKENS = 1 << 20  # row checks run on record-batch slices of about this many tokens

__all__ = ["Fault", "VerifyReport", "verify_shards", "Verify"]


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One thing wrong (or, as a report's warning, worth knowing). `shard` is the file in DIR it concerns (None: the manifest / directory as a
    whole, or rejects.jsonl); `row` is the row within that shard (None: not about one row)."""

    kind: str
    message: str
    shard: str | None = None
    row: int | None = None

    def where(self) -> str:
        if self.shard is None:
            return "(directory)"
        return self.shard if self.row is None else f"{self.shard} row {self.row}"

    def __str__(self) -> str:
        return f"{self.where()}: [{self.kind}] {self.message}"


class _FaultLog:
    """Faults kept up to `keep` per kind, every fault counted (exit codes use the counts)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.faults: list[Fault] = []
        self.counts: Counter = Counter()  # all faults
        self.kept: Counter = Counter()  # faults in self.faults

    def _keep(self, fault: Fault) -> None:
        if self.kept[fault.kind] < self.keep:
            self.kept[fault.kind] += 1
            self.faults.append(fault)

    def add(self, kind: str, message: str, shard: str | None = None, row: int | None = None, count: int = 1) -> None:
        self.counts[kind] += count
        self._keep(Fault(kind, message, shard, None if row is None else int(row)))

    def add_rows(self, kind: str, shard: str, row0: int, rows: np.ndarray, describe) -> None:
        """One fault per row in `rows` (batch-local indices, ascending); only the kept ones are described."""
        rows = np.asarray(rows)
        if rows.size == 0:
            return
        self.counts[kind] += int(rows.size)
        for r in rows[: max(0, self.keep - self.kept[kind])].tolist():
            self._keep(Fault(kind, describe(r), shard, row0 + r))

    def add_count(self, kind: str, count: int) -> None:
        """Faults counted but not described (beyond the examples kept)."""
        self.counts[kind] += count

    def wants_examples(self, kind: str) -> bool:
        return self.kept[kind] < self.keep

    def merge(self, other: "_FaultLog") -> None:
        for fault in other.faults:
            self._keep(fault)
        self.counts.update(other.counts)


@dataclass
class VerifyReport:
    directory: str
    mode: str  # "quick" or "full"
    faults: list[Fault] = field(default_factory=list)  # the first `keep_per_kind` of each kind
    fault_counts: dict[str, int] = field(default_factory=dict)  # every fault, by kind
    warnings: list[Fault] = field(default_factory=list)  # not faults: the exit code ignores them
    warning_counts: dict[str, int] = field(default_factory=dict)
    shards: int = 0
    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0
    schema_version: int | None = None

    @property
    def ok(self) -> bool:
        return not self.fault_counts

    @property
    def num_faults(self) -> int:
        return sum(self.fault_counts.values())

    def to_json(self) -> dict:
        return {
            "directory": self.directory,
            "mode": self.mode,
            "ok": self.ok,
            "num_faults": self.num_faults,
            "fault_counts": dict(self.fault_counts),
            "faults": [asdict(f) for f in self.faults],
            "faults_listed_complete": len(self.faults) == self.num_faults,
            "warning_counts": dict(self.warning_counts),
            "warnings": [asdict(w) for w in self.warnings],
            "schema_version": self.schema_version,
            "shards": self.shards,
            "rows": self.rows,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
        }

    def format_text(self, show_per_kind: int = DEFAULT_SHOW_PER_KIND) -> str:
        lines = _listed("WARNING", self.warnings, self.warning_counts, show_per_kind)
        lines += _listed("FAULT", self.faults, self.fault_counts, show_per_kind)
        checked = (f"schema version {self.schema_version}, {self.shards} shards, {self.rows:,} rows, "
                   f"{_mib(self.bytes)} checked ({self.mode}) in {self.seconds:.2f} s")
        warned = ""
        if self.warning_counts:
            warned = "; warnings: " + ", ".join(f"{k} {v}" for k, v in sorted(self.warning_counts.items()))
        if self.ok:
            lines.append(f"verify {self.directory}: OK: {checked}{warned}")
        else:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.fault_counts.items()))
            lines.append(f"verify {self.directory}: FAILED: {self.num_faults} faults ({kinds}); {checked}{warned}")
        return "\n".join(lines)


def _listed(label: str, entries: list[Fault], counts: dict[str, int], show_per_kind: int) -> list[str]:
    """`label` lines for up to `show_per_kind` entries of each kind, then a count of the rest."""
    lines, shown = [], Counter()
    for f in entries:
        shown[f.kind] += 1
        if shown[f.kind] <= show_per_kind:
            lines.append(f"{label} {f}")
    for kind, count in counts.items():
        listed = min(count, show_per_kind, shown[kind])
        if count > listed:
            lines.append(f"... [{kind}] {count - listed} more (of {count}; `--max-faults N` shows more, `--json` lists up to {DEFAULT_KEEP_PER_KIND})")
    return lines


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


# ---------------------------------------------------------------------------------------------
# Manifest, directory, rejects
# ---------------------------------------------------------------------------------------------


def _check_manifest_fields(manifest: dict, log: _FaultLog) -> list[dict]:
    """The well-formed shard entries; each other entry, and each field readers need that is
    missing or out of range, reported (`manifest.shard_entries`, `manifest.layout_problems`: the
    checks every reader makes before it trusts a manifest)."""
    entries, problems = shard_entries(manifest)
    for message, name in problems:
        log.add("manifest_field", f"{MANIFEST_NAME}: {message}", name)
    for message in layout_problems(manifest):
        log.add("manifest_field", f"{MANIFEST_NAME}: {message}")
    return entries


def _check_totals(manifest: dict, entries: list[dict], log: _FaultLog) -> None:
    totals = manifest.get("totals")
    all_entries = manifest.get("shards") if isinstance(manifest.get("shards"), list) else []
    if not isinstance(totals, dict):
        log.add("totals_mismatch", f"{MANIFEST_NAME}: no `totals` object")
        return
    if len(entries) != len(all_entries):
        return  # broken entries already reported; sums over them would only add noise
    for key in total_keys(manifest):
        expected = sum(int(e[key]) for e in entries)
        if totals.get(key) != expected:
            log.add("totals_mismatch", f"{MANIFEST_NAME}: totals.{key} = {totals.get(key)!r} but the shard entries sum to {expected}")
    if totals.get("shards") != len(entries):
        log.add("totals_mismatch", f"{MANIFEST_NAME}: totals.shards = {totals.get('shards')!r} but {len(entries)} shards are listed")


def _check_accounting(manifest: dict, log: _FaultLog) -> dict | None:
    acc = manifest.get("accounting")
    if not isinstance(acc, dict) or not all(is_count(acc.get(k)) for k in ("rows_read", "rows_written", "rows_rejected")):
        log.add("accounting_mismatch", f"{MANIFEST_NAME}: `accounting` needs integer rows_read, rows_written, rows_rejected")
        return None
    read, written, rejected = acc["rows_read"], acc["rows_written"], acc["rows_rejected"]
    if read != written + rejected:
        log.add("accounting_mismatch", f"{MANIFEST_NAME}: rows_read {read} != rows_written {written} + rows_rejected {rejected}")
    totals = manifest.get("totals") if isinstance(manifest.get("totals"), dict) else {}
    if written != totals.get("rows"):
        log.add("accounting_mismatch", f"{MANIFEST_NAME}: rows_written {written} != totals.rows {totals.get('rows')!r}")
    by_reason = acc.get("rejects_by_reason")  # absent from some earlier manifests
    if "rejects_by_reason" in acc and not (isinstance(by_reason, dict) and all(map(is_count, by_reason.values()))):
        log.add("accounting_mismatch", f"{MANIFEST_NAME}: accounting.rejects_by_reason {by_reason!r:.80} is not an object "
                                       "of counts (reject code -> rows)")
        by_reason = None
    reason_sum = sum(by_reason.values()) if by_reason is not None else None
    if reason_sum is not None and reason_sum != rejected:
        log.add("accounting_mismatch", f"{MANIFEST_NAME}: rejects_by_reason sums to {reason_sum}, rows_rejected is {rejected}")
    return acc


def _check_rejects(directory: Path, acc: dict | None, log: _FaultLog) -> None:
    path = directory / REJECTS_NAME
    expected = acc["rows_rejected"] if acc else None
    if not path.exists() and not path.is_symlink():
        if expected:
            log.add("rejects_mismatch", f"{REJECTS_NAME} is missing but the manifest counts {expected} rejected rows")
        return
    codes: Counter = Counter()
    n = 0
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):  # a FIFO's open would wait for a writer: named from its mode instead
            log.add("unreadable_rejects", f"{REJECTS_NAME} is {file_kind(mode)}, not a regular file: its rejected "
                    "rows cannot be checked; replace it with the rejects.jsonl the job wrote, or re-run the job")
            return
        fh = open(path, encoding="utf-8", errors="replace")
    except OSError as exc:  # nothing is known of its contents: no mismatch to report
        fix = ("fix its permissions" if isinstance(exc, PermissionError)
               else "restore it, or re-run the job that wrote it")
        log.add("unreadable_rejects", f"{REJECTS_NAME} cannot be read ({exc.strerror or exc}): its rejected rows "
                f"cannot be checked; {fix}")
        return
    with fh:
        for n, line in enumerate(fh, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                log.add("rejects_mismatch", f"{REJECTS_NAME} line {n} does not parse as JSON ({exc})")
                continue
            if not isinstance(record, dict) or "code" not in record:
                log.add("rejects_mismatch", f"{REJECTS_NAME} line {n} is not a reject record (an object with source, row, code, reason)")
                continue
            codes[str(record["code"])] += 1
    if expected is not None and n != expected:
        log.add("rejects_mismatch", f"{REJECTS_NAME} has {n} lines but the manifest counts rows_rejected = {expected}")
    by_reason = acc.get("rejects_by_reason") if acc else None
    if isinstance(by_reason, dict) and n == expected and dict(codes) != {k: v for k, v in by_reason.items() if v}:
        log.add("rejects_mismatch", f"{REJECTS_NAME} codes {dict(sorted(codes.items()))} differ from accounting.rejects_by_reason {by_reason}")


def _check_directory_listing(directory: Path, listed: set[str], log: _FaultLog) -> None:
    for path in sorted(directory.iterdir()):
        name = path.name
        if name == PARTS_DIR:
            continue
        if name.endswith(TMP_SUFFIX):
            log.add("leftover_tmp", f"{name}: torn write of an interrupted job; delete it (or re-run the job to finish)", name)
        elif name.endswith(SHARD_SUFFIX) and name not in listed:
            log.add("unlisted_shard", f"{name} is not in {MANIFEST_NAME}: a stray or foreign shard (training would ignore it)", name)


# ---------------------------------------------------------------------------------------------
# One shard
# ---------------------------------------------------------------------------------------------


@dataclass
class _Context:
    """What the shard checks need from the manifest (plain data: it is pickled to workers)."""

    directory: str
    patch_row_width: int
    quick: bool
    keep: int
    special: dict | None  # token name -> id, None when the manifest lacks them
    merge_size: int | None
    version: int = 1  # the manifest's schema version
    family: str | None = None
    tokens_per_second: int = 2
    decode_timestamps: bool = False  # the manifest's tokenizer is the bundled one: timestamps are read


@dataclass
class _ShardResult:
    log: _FaultLog
    rows: int = 0
    columns: dict[str, pa.Array] | None = None  # sample_uid and source, for the checks across shards


def _check_shard(entry: dict, ctx: _Context, on_rows=None) -> _ShardResult:
    name = entry["file"]
    log = _FaultLog(ctx.keep)
    result = _ShardResult(log)
    path = Path(ctx.directory) / name
    fault = file_fault(path, entry["bytes"])  # the readers' own checks (`reader.file_fault`, `read_batches`)
    if fault is not None:
        log.add(*fault, name)
        if fault[0] != "size_mismatch":
            return result
    size_ok = fault is None  # a file of another size is still read: what else is wrong with it is worth knowing
    try:
        _, batches = read_batches(path, ctx.patch_row_width, ctx.version)
    except ShardFault as fault:
        log.add(fault.kind, fault.detail, name)
        return result
    rows = sum(b.num_rows for b in batches)
    result.rows = rows
    if rows != entry["rows"]:
        log.add("row_count", f"{rows} rows in the file, manifest says {entry['rows']}", name)
    try:
        _check_offset_stats(batches, entry, ctx, name, log)
        if not ctx.quick:
            if size_ok:
                digest = file_sha256(path)
                if digest != entry["sha256"]:
                    log.add("sha256_mismatch", f"sha256 {digest[:16]}… != manifest {entry['sha256'][:16]}… (bytes changed since the job wrote them)", name)
            result.columns = _check_rows(batches, entry, ctx, name, log, on_rows)
    except Exception as exc:  # corrupt data must give a fault, never a crash of the verifier
        log.add("check_error", f"checking stopped on this shard: {type(exc).__name__}: {exc}", name)
    return result


def _offsets(batch: pa.RecordBatch, column: str) -> np.ndarray:
    return offsets_view(batch.column(column)).astype(np.int64)


def _check_offset_stats(batches, entry: dict, ctx: _Context, name: str, log: _FaultLog) -> None:
    """Per-shard sums from list offsets and the num_target_tokens column (no token or pixel values)."""
    keys = SHARD_STAT_KEYS + (VIDEO_STAT_KEYS if ctx.version >= 2 else ())
    sums = dict.fromkeys(keys, 0)
    for batch in batches:
        sums["tokens"] += int(np.diff(_offsets(batch, "input_ids")).sum())
        sums["images"] += int(np.diff(_offsets(batch, "image_grid_thw")).sum()) // 3
        sums["patches"] += int(np.diff(_offsets(batch, "pixel_patches")).sum()) // ctx.patch_row_width
        sums["target_tokens"] += int(batch.column("num_target_tokens").to_numpy().astype(np.int64).sum())
        if ctx.version >= 2:
            sums["videos"] += int(np.diff(_offsets(batch, "video_grid_thw")).sum()) // 3
            sums["video_patches"] += int(np.diff(_offsets(batch, "video_patches")).sum()) // (2 * ctx.patch_row_width)
    for key in keys:
        if sums[key] != entry[key]:
            log.add("shard_stats", f"{key}: the rows hold {sums[key]:,}, manifest says {entry[key]:,}", name)


def _seg_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-row sums of a flat array cut by offsets (offsets[0] == 0), vectorised."""
    small = values.dtype.itemsize == 1 and len(values) < 2**23  # sums of bytes fit int32: half the traffic
    c = np.zeros(len(values) + 1, dtype=np.int32 if small else np.int64)
    np.cumsum(values, out=c[1:])
    return c[offsets[1:]] - c[offsets[:-1]]


def _first_per_row(flat_idx: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For flat indices of offending elements: (rows, first offending index within row, count per row)."""
    rows = np.searchsorted(offsets, flat_idx, side="right") - 1
    uniq, first, counts = np.unique(rows, return_index=True, return_counts=True)
    return uniq, flat_idx[first] - offsets[uniq], counts


def _check_rows(batches, entry: dict, ctx: _Context, name: str, log: _FaultLog, on_rows) -> dict[str, pa.Array]:
    """Every row's invariants, one slice of a record batch at a time; returns the UNIQUE_COLUMNS
    (sample_uid and source) of the rows checked.

    (The per-shard sums were compared from offsets already; here each row's loss_mask is tied to
    its num_target_tokens, so those sums hold for the mask too.)
    """
    columns: dict[str, list] = {name: [] for name in UNIQUE_COLUMNS}
    row0 = 0
    for batch in batches:  # validated in full when the shard was opened (`read_batches`)
        # slices of bounded token count keep the flat temporaries small whatever the batch holds
        offsets = _offsets(batch, "input_ids")
        for r0, r1 in _row_slices(offsets - offsets[0], ROWS_SLICE_TOKENS):
            _check_batch(_RowSlice.of(batch.slice(r0, r1 - r0), row0 + r0, ctx, name, log))
        for column in UNIQUE_COLUMNS:
            columns[column].append(batch.column(column))
        row0 += batch.num_rows
        if on_rows:
            on_rows(batch.num_rows)
    return {column: pa.concat_arrays(arrays) if arrays else pa.array([], pa.string()) for column, arrays in columns.items()}


def _row_slices(offsets: np.ndarray, max_tokens: int):
    """(start, stop) row ranges of at most `max_tokens` tokens each (at least one row each)."""
    n, start = len(offsets) - 1, 0
    while start < n:
        stop = int(np.searchsorted(offsets, offsets[start] + max_tokens, side="right")) - 1
        stop = min(max(stop, start + 1), n)
        yield start, stop
        start = stop


@dataclass
class _RowSlice:
    """One slice of a record batch as flat numpy views: each list column is `values` cut by
    per-row `offsets` (rebased to start at 0), plus where the slice is and where faults go."""

    shard: str  # file name in DIR
    row0: int  # shard row of the slice's first row
    log: _FaultLog
    special: dict | None  # token name -> id, None when the manifest lacks them
    merge_size: int | None
    patch_row_width: int
    ids: np.ndarray  # input_ids values, int32
    ioff: np.ndarray
    lm: np.ndarray  # loss_mask values, uint8
    loff: np.ndarray
    pos: np.ndarray  # position_ids values, int32 (3 x L per row)
    poff: np.ndarray
    grid: np.ndarray  # image_grid_thw values, int32 (3 per image)
    goff: np.ndarray
    xoff: np.ndarray  # pixel_patches byte offsets (values never read)
    num_targets: np.ndarray  # the num_target_tokens column, int64
    uids: pa.Array  # the sample_uid column
    L: np.ndarray  # tokens per row
    K: np.ndarray  # images per row (grid values // 3)
    ctx: _Context
    video: dict | None = None  # version 2: video_grid_thw / second_per_grid_ts (offsets, values), video_patches offsets

    @classmethod
    def of(cls, batch: pa.RecordBatch, row0: int, ctx: _Context, shard: str, log: _FaultLog) -> "_RowSlice":
        views = {}
        for col, dtype in (("input_ids", np.int32), ("loss_mask", np.uint8), ("position_ids", np.int32), ("image_grid_thw", np.int32)):
            off, vals = list_views(batch.column(col), dtype)
            off = off.astype(np.int64)
            views[col] = (off - off[0], vals[off[0] : off[-1]])
        (ioff, ids), (loff, lm), (poff, pos), (goff, grid) = (
            views[c] for c in ("input_ids", "loss_mask", "position_ids", "image_grid_thw")
        )
        return cls(
            shard=shard, row0=row0, log=log, special=ctx.special, merge_size=ctx.merge_size, patch_row_width=ctx.patch_row_width,
            ids=ids, ioff=ioff, lm=lm, loff=loff, pos=pos, poff=poff, grid=grid, goff=goff,
            xoff=_offsets(batch, "pixel_patches"),
            num_targets=batch.column("num_target_tokens").to_numpy().astype(np.int64),
            uids=batch.column("sample_uid"), L=np.diff(ioff), K=np.diff(goff) // 3, ctx=ctx,
            video=_video_views(batch) if ctx.version >= 2 else None,
        )

    def video_rows(self) -> np.ndarray:
        """Rows that hold a video (or whose video columns hold anything at all)."""
        if self.video is None:
            return np.zeros(len(self), dtype=bool)
        v = self.video
        return (np.diff(v["grid"][0]) > 0) | (np.diff(v["seconds"][0]) > 0) | (np.diff(v["patch_off"]) > 0)

    def __len__(self) -> int:
        return len(self.L)

    def uid(self, r: int) -> str:
        """sample_uid of slice row `r` (only for the few faults described)."""
        return self.uids[r].as_py()

    def add_rows(self, kind: str, rows: np.ndarray, describe) -> None:
        """One fault per slice row in `rows`; `describe(r)` for the kept ones."""
        self.log.add_rows(kind, self.shard, self.row0, rows, describe)


def _video_views(batch: pa.RecordBatch) -> dict:
    views = {}
    for key, col, dtype in (("grid", "video_grid_thw", np.int32), ("seconds", "second_per_grid_ts", np.float32)):
        off, vals = list_views(batch.column(col), dtype)
        off = off.astype(np.int64)
        views[key] = (off - off[0], vals[off[0] : off[-1]])
    views["patch_off"] = _offsets(batch, "video_patches")
    return views


def _check_video_rows(s: _RowSlice, rows: np.ndarray) -> None:
    """Rows with videos, one at a time (they are few and each is large): grids, video patch bytes
    against the grids, one second_per_grid_ts per video, image and video pad counts, and the
    positions recomputed with the videos (which also checks every pad run against its grid)."""
    ctx, m, W2 = s.ctx, s.merge_size, 2 * s.patch_row_width
    (voff, vgrid), (soff, seconds), poff_v = s.video["grid"], s.video["seconds"], s.video["patch_off"]
    for r in rows.tolist():
        uid = s.uid(r)
        glen = voff[r + 1] - voff[r]
        if glen % 3:
            s.add_rows("video_grid", np.asarray([r]), lambda _: f"video_grid_thw has {glen} values, not a multiple of 3 (sample {uid})")
            continue
        grids = vgrid[voff[r] : voff[r + 1]].reshape(-1, 3).astype(np.int64)
        if (grids < 1).any() or (m and (grids[:, 1:] % m).any()):
            s.add_rows("video_grid", np.asarray([r]), lambda _: (
                f"video grids {grids.tolist()} need t, h, w >= 1 with h, w divisible by merge_size {m} (sample {uid})"))
            continue
        xlen, need = poff_v[r + 1] - poff_v[r], int(grids.prod(axis=1).sum()) * W2
        if xlen != need:
            s.add_rows("video_patches_length", np.asarray([r]), lambda _: (
                f"video_patches has {xlen:,} bytes, the grids need {need // W2:,} patches x {W2} = {need:,} (sample {uid})"))
            continue
        spg = seconds[soff[r] : soff[r + 1]]
        if len(spg) != len(grids) or not (np.isfinite(spg) & (spg > 0)).all():
            s.add_rows("video_grid", np.asarray([r]), lambda _: (
                f"{len(spg)} second_per_grid_ts {spg.tolist()} for {len(grids)} videos: one positive value each (sample {uid})"))
            continue
        if s.special is None or not m or s.special.get("video_pad") is None:
            continue
        ids = s.ids[s.ioff[r] : s.ioff[r + 1]]
        image_grids = s.grid[s.goff[r] : s.goff[r + 1]].reshape(-1, 3)
        rules = reading_rules(ctx.family)
        videos = rules.video_positions(video_pad_id=s.special["video_pad"], video_grid_thw=grids, second_per_grid_ts=spg,
                                       tokens_per_second=ctx.tokens_per_second)
        got = s.pos[s.poff[r] : s.poff[r + 1]].reshape(3, -1)
        try:
            want = mrope_position_ids(ids, image_grids, image_pad_id=s.special["image_pad"], merge_size=m, video=videos)
        except ValueError as exc:
            reason = str(exc)
            s.add_rows("video_pad_count", np.asarray([r]), lambda _: f"vision pads do not match the grids: {reason} (sample {uid})")
            continue
        if got.shape != want.shape or not np.array_equal(got, want):
            diff = np.argwhere(got != want)[0].tolist() if got.shape == want.shape else None
            s.add_rows("position_ids", np.asarray([r]), lambda _: (
                f"position_ids{diff} = {int(got[tuple(diff)])}, HF get_rope_index (mrope_position_ids with the videos) "
                f"gives {int(want[tuple(diff)])} (sample {uid})" if diff else f"position_ids shape {got.shape} (sample {uid})"))
            continue
        decode = _bundled_decode(ctx.family) if ctx.decode_timestamps else None  # reads the layout's text
        problem = rules.video_layout_problem(ids, grids, s.special, decode)
        if problem:
            s.add_rows("video_timestamps", np.asarray([r]), lambda _: f"{problem} (sample {uid})")


@functools.lru_cache(maxsize=2)
def _bundled_tokenizer(family: str):
    from tokenizers import Tokenizer

    from .builtin import builtin_tokenizer_json

    return Tokenizer.from_str(builtin_tokenizer_json(family))


def _bundled_decode(family: str):
    """Token ids -> text with the family's bundled tokenizer (special tokens kept), which is built
    on first use: a layout that reads no text never builds it."""
    return lambda ids: _bundled_tokenizer(family).decode(ids, skip_special_tokens=False)


def _check_batch(s: _RowSlice) -> None:
    n, W, m, L, uid = len(s), s.patch_row_width, s.merge_size, s.L, s.uid
    loff, poff, goff = s.loff, s.poff, s.goff

    # --- lengths that tie the columns to the token count
    bad_lm_len = np.flatnonzero(np.diff(loff) != L)
    s.add_rows("loss_mask_length", bad_lm_len,
               lambda r: f"loss_mask has {loff[r + 1] - loff[r]} values for {L[r]} tokens (sample {uid(r)})")
    bad_pos_len = np.diff(poff) != 3 * L
    s.add_rows("position_ids_length", np.flatnonzero(bad_pos_len),
               lambda r: f"position_ids has {poff[r + 1] - poff[r]} values, expected 3 x {L[r]} tokens (sample {uid(r)})")

    # --- image grids, pixel rows, image pads, vision markers (rows with videos: _check_video_rows)
    video_rows = s.video_rows()
    structure_ok = np.ones(n, dtype=bool)
    glen = np.diff(goff)
    bad_glen = glen % 3 != 0
    s.add_rows("image_grid", np.flatnonzero(bad_glen),
               lambda r: f"image_grid_thw has {glen[r]} values, not a multiple of 3 (sample {uid(r)})")
    structure_ok &= ~bad_glen
    if bad_glen.any():
        structure_ok[:] = False  # the flat [K, 3] view is misaligned for the whole batch
    else:
        grids = s.grid.reshape(-1, 3).astype(np.int64)
        img_row = np.repeat(np.arange(n), s.K)
        bad_img = (grids < 1).any(axis=1)
        if m:
            bad_img |= (grids[:, 1:] % m != 0).any(axis=1)
        bad_grid_rows = np.unique(img_row[bad_img])
        s.add_rows("image_grid", bad_grid_rows, lambda r: (
            f"image grids {grids[goff[r] // 3 : goff[r + 1] // 3].tolist()} need t, h, w >= 1 with h, w divisible "
            f"by merge_size {m} (sample {uid(r)})"))
        structure_ok[bad_grid_rows] = False
        patches_img = grids.prod(axis=1)
        patches_row = _seg_sum(patches_img, goff // 3)
        xlen = np.diff(s.xoff)
        bad_px = xlen != patches_row * W
        s.add_rows("pixel_patches_length", np.flatnonzero(bad_px), lambda r: (
            f"pixel_patches has {xlen[r]:,} bytes, the grids need {patches_row[r]:,} patches x {W} = "
            f"{patches_row[r] * W:,} (sample {uid(r)})"))
        structure_ok &= ~bad_px
        if s.special is not None and m:
            _check_vision_tokens(s, grids, img_row, bad_img, structure_ok, video_rows)
    if s.special is None or not m:
        structure_ok[:] = False

    # --- token ids
    _check_token_ids(s)

    # --- loss mask
    if bad_lm_len.size == 0:
        _check_loss_mask(s)

    # --- positions: text-only rows vectorised, image rows through mrope_position_ids
    _check_positions(s, structure_ok & ~bad_pos_len & ~video_rows)
    if video_rows.any():
        _check_video_rows(s, np.flatnonzero(video_rows & ~bad_pos_len & ~bad_glen))


def _check_vision_tokens(s: _RowSlice, grids: np.ndarray, img_row: np.ndarray, bad_img: np.ndarray, structure_ok: np.ndarray,
                         skip: np.ndarray) -> None:
    """Image pads: count == patches / merge^2 per row, one contiguous run per image, each run
    wrapped by exactly one vision_start before and one vision_end after, no stray markers. Rows
    in `skip` (those with videos, whose markers nest) are left to `_check_video_rows`."""
    n, ids, ioff, K, m, uid = len(s), s.ids, s.ioff, s.K, s.merge_size, s.uid
    pad, vs, ve = s.special["image_pad"], s.special["vision_start"], s.special["vision_end"]
    is_pad, is_vs, is_ve = ids == pad, ids == vs, ids == ve
    tokens_img = grids.prod(axis=1) // (m * m)
    expected_pads = _seg_sum(np.where(bad_img, 0, tokens_img), np.concatenate(([0], np.cumsum(K))))
    pads = _seg_sum(is_pad, ioff)
    bad_count = (pads != expected_pads) & ~skip
    s.add_rows("image_pad_count", np.flatnonzero(bad_count), lambda r: (
        f"{pads[r]} <|image_pad|> tokens, the {K[r]} image grid(s) need {expected_pads[r]} "
        f"(patches / merge_size^2) (sample {uid(r)})"))
    structure_ok &= ~bad_count

    N = len(ids)
    row_start = np.zeros(N + 1, dtype=bool)
    row_start[ioff] = True  # also marks N: "past the end" behaves like the start of a next row
    prev_pad = np.zeros(N, dtype=bool)
    prev_pad[1:] = is_pad[:-1]
    prev_pad &= ~row_start[:N]
    next_pad = np.zeros(N, dtype=bool)
    next_pad[:-1] = is_pad[1:]
    next_pad &= ~row_start[1:]
    prev_vs = np.zeros(N, dtype=bool)
    prev_vs[1:] = is_vs[:-1]
    prev_vs &= ~row_start[:N]
    next_ve = np.zeros(N, dtype=bool)
    next_ve[:-1] = is_ve[1:]
    next_ve &= ~row_start[1:]
    run_start = is_pad & ~prev_pad
    run_end = is_pad & ~next_pad
    # every marker sits next to a run and every run between two markers; with equal counts
    # (runs == starts == ends == images) that is an exact one-to-one pairing
    misplaced = (run_start & ~prev_vs) | (run_end & ~next_ve) | (is_vs & ~next_pad) | (is_ve & ~prev_pad)
    runs, n_vs, n_ve = _seg_sum(run_start, ioff), _seg_sum(is_vs, ioff), _seg_sum(is_ve, ioff)
    bad_rows = np.zeros(n, dtype=bool)
    bad_rows[np.searchsorted(ioff, np.flatnonzero(misplaced), side="right") - 1] = True
    bad_rows |= (runs != K) | (n_vs != K) | (n_ve != K)
    bad_rows &= ~skip
    first_bad = {}
    if bad_rows.any() and s.log.wants_examples("vision_markers"):
        rows_, firsts, _ = _first_per_row(np.flatnonzero(misplaced), ioff)
        first_bad = dict(zip(rows_.tolist(), firsts.tolist()))
    s.add_rows("vision_markers", np.flatnonzero(bad_rows), lambda r: (
        f"{K[r]} image(s) but {runs[r]} image-pad runs, {n_vs[r]} <|vision_start|>, {n_ve[r]} <|vision_end|>"
        + (f"; first misplaced at token {first_bad[r]}" if r in first_bad else "")
        + f"; each image must be <|vision_start|> + its pads + <|vision_end|> (sample {uid(r)})"))
    structure_ok &= ~bad_rows

    # run lengths per image, for rows whose runs pair one-to-one with valid image grids
    pair_ok = ~bad_rows & ~bad_count & ~skip
    pair_ok[img_row[bad_img]] = False
    run_starts = np.flatnonzero(run_start)
    run_ends = np.flatnonzero(run_end) + 1
    run_row = np.searchsorted(ioff, run_starts, side="right") - 1
    keep_run = pair_ok[run_row]
    keep_img = pair_ok[img_row]
    run_len = (run_ends - run_starts)[keep_run]
    img_idx = np.flatnonzero(keep_img)
    if len(run_len) == len(img_idx):
        wrong = run_len != tokens_img[img_idx]
        wrong_img = img_idx[wrong]
        wrong_len = dict(zip(img_idx[wrong].tolist(), run_len[wrong].tolist()))
        wrong_rows, first = np.unique(img_row[wrong_img], return_index=True)
        first_img = dict(zip(wrong_rows.tolist(), wrong_img[first].tolist()))
        cum_k = np.concatenate(([0], np.cumsum(K)))
        s.add_rows("image_pad_count", wrong_rows, lambda r: (
            f"image {first_img[r] - cum_k[r]}: pad run of {wrong_len[first_img[r]]} tokens, its grid "
            f"{grids[first_img[r]].tolist()} needs {tokens_img[first_img[r]]} (sample {uid(r)})"))
        structure_ok[wrong_rows] = False


def _check_token_ids(s: _RowSlice) -> None:
    """Every token id is one the tokenizer has: >= 0, and within the bundled tokenizer's
    vocabulary where the manifest's tokenizer is the bundled one (a model's embedding table
    would index past its end, and `show` could not decode the row)."""
    ids, ioff, uid = s.ids, s.ioff, s.uid
    vocab = _bundled_tokenizer(s.ctx.family).get_vocab_size(with_added_tokens=True) \
        if s.ctx.decode_timestamps and s.ctx.family else None
    bad = (ids < 0) if vocab is None else (ids < 0) | (ids >= vocab)
    if not bad.any():
        return
    rows, first, counts = _first_per_row(np.flatnonzero(bad), ioff)
    info = {r: (f, c) for r, f, c in zip(rows.tolist(), first.tolist(), counts.tolist())}
    want = "ids are >= 0" if vocab is None else f"ids lie in 0..{vocab - 1}, the tokenizer's vocabulary"
    s.add_rows("token_id", rows, lambda r: (
        f"{info[r][1]} token id(s) out of range, first at token {info[r][0]} (id {int(ids[ioff[r] + info[r][0]])}); "
        f"{want} (sample {uid(r)})"))


def _check_loss_mask(s: _RowSlice) -> None:
    ids, lm, ioff, L, special, uid = s.ids, s.lm, s.ioff, s.L, s.special, s.uid
    bad_values = _seg_sum(lm > 1, ioff)
    s.add_rows("loss_mask_values", np.flatnonzero(bad_values), lambda r: (
        f"{bad_values[r]} loss_mask values outside {{0, 1}} (sample {uid(r)})"))
    targets = lm != 0
    n_targets = _seg_sum(targets, ioff)
    mask_sum = _seg_sum(lm, ioff)
    bad_col = np.flatnonzero(s.num_targets != mask_sum)
    s.add_rows("num_target_tokens", bad_col, lambda r: (
        f"num_target_tokens column says {s.num_targets[r]}, loss_mask sums to {mask_sum[r]} (sample {uid(r)})"))
    s.add_rows("no_targets", np.flatnonzero(n_targets == 0), lambda r: (
        f"no target token in {L[r]} tokens: the sample trains nothing (sample {uid(r)})"))
    if special is None:
        return
    N = len(ids)
    is_vision = (ids == special["image_pad"]) | (ids == special["vision_start"]) | (ids == special["vision_end"])
    if special.get("video_pad") is not None:
        is_vision |= ids == special["video_pad"]
    on_vision = targets & is_vision
    if on_vision.any():
        rows, first, counts = _first_per_row(np.flatnonzero(on_vision), ioff)
        info = {r: (f, c) for r, f, c in zip(rows.tolist(), first.tolist(), counts.tolist())}
        s.add_rows("target_on_vision_token", rows, lambda r: (
            f"{info[r][1]} target(s) on image pad / vision start / vision end tokens, first at token {info[r][0]} "
            f"(id {int(ids[ioff[r] + info[r][0]])}); image tokens are never targets (sample {uid(r)})"))

    # Allowed target positions: from the first content token after `<|im_start|>assistant\n`
    # (3 header tokens) through the turn's `<|im_end|>`; a turn cut by truncation runs to the row end.
    row_start = np.zeros(N + 1, dtype=bool)
    row_start[ioff] = True
    hdr = np.flatnonzero((ids[:-1] == special["im_start"]) & (ids[1:] == special["assistant"]) & ~row_start[1:N])
    hdr_row_end = ioff[np.searchsorted(ioff, hdr, side="right")]
    ends = np.flatnonzero(ids == special["im_end"])
    nxt = np.searchsorted(ends, hdr + 2)
    end_pos = np.append(ends, N)[nxt]
    turn_end = np.where(end_pos < hdr_row_end, end_pos + 1, hdr_row_end)
    turn_start = np.minimum(hdr + 3, turn_end)
    marks = np.bincount(turn_start, minlength=N + 1)[: N + 1] - np.bincount(turn_end, minlength=N + 1)[: N + 1]
    allowed = np.cumsum(marks[:N]) > 0
    outside = targets & ~allowed & ~is_vision  # a target on an image token is reported (once) above
    if outside.any():
        rows, first, counts = _first_per_row(np.flatnonzero(outside), ioff)
        info = {r: (f, c) for r, f, c in zip(rows.tolist(), first.tolist(), counts.tolist())}
        s.add_rows("target_outside_assistant", rows, lambda r: (
            f"{info[r][1]} target(s) outside assistant turns, first at token {info[r][0]} (id {int(ids[ioff[r] + info[r][0]])}); "
            f"targets must lie after `<|im_start|>assistant\\n` and end with its `<|im_end|>` (sample {uid(r)})"))


def _check_positions(s: _RowSlice, check: np.ndarray) -> None:
    """position_ids == mrope_position_ids(ids, grids) for every row in `check` (structurally sound rows).

    One call on the concatenation of those rows instead of one per row: the M-RoPE rule only
    advances a running position, so in the concatenation each row's positions are its own plus
    a constant (the running position where the row starts; a sound row starts with a text token,
    whose own position is 0). Rows are compared after subtracting that constant.
    """
    rows = np.flatnonzero(check)
    if rows.size == 0:
        return
    ids, pos, ioff, poff, goff, grid, K, L, m = s.ids, s.pos, s.ioff, s.poff, s.goff, s.grid, s.K, s.L, s.merge_size
    pad_id = s.special["image_pad"]
    Lr = L[rows]
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(Lr, out=starts[1:])
    T = int(starts[-1])
    tok = np.repeat(ioff[rows] - starts[:-1], Lr) + np.arange(T)  # flat token index of each concatenated token
    img_sel = np.repeat(check, K)
    try:
        want = mrope_position_ids(ids[tok], grid.reshape(-1, 3)[img_sel], image_pad_id=pad_id, merge_size=m).astype(np.int64)
    except ValueError:
        want = None  # cannot happen for sound rows; fall back to one call per row to name the row
    bad, detail = np.zeros(len(L), dtype=bool), {}
    if want is not None:
        nonempty = Lr > 0
        shift = np.zeros((3, len(rows)), dtype=np.int64)
        shift[:, nonempty] = want[:, starts[:-1][nonempty]]
        want -= np.repeat(shift, Lr, axis=1)
        # got[a, i] = pos[poff[r] + a * L[r] + j] for the i-th concatenated token = token j of row r
        base = np.repeat(poff[rows] - starts[:-1], Lr) + np.arange(T)
        step = np.repeat(Lr, Lr)
        got = np.stack([pos[base], pos[base + step], pos[base + 2 * step]])
        wrong = (got != want).any(axis=0)
        n_wrong = _seg_sum(wrong, starts)
        for i in np.flatnonzero(n_wrong).tolist():
            r = int(rows[i])
            bad[r] = True
            if len(detail) < s.log.keep:
                seg = slice(starts[i], starts[i + 1])
                a, t = np.argwhere(got[:, seg] != want[:, seg])[0].tolist()
                detail[r] = (f"position_ids[{a}, {t}] = {int(got[a, seg][t])}, HF get_rope_index (mrope_position_ids) "
                             f"gives {int(want[a, seg][t])}; {int((got[:, seg] != want[:, seg]).sum())} values differ")
    else:
        for r in rows.tolist():
            row_grid = grid[goff[r] : goff[r + 1]].reshape(-1, 3)
            got = pos[poff[r] : poff[r + 1]].reshape(3, -1)
            try:
                want = mrope_position_ids(ids[ioff[r] : ioff[r + 1]], row_grid, image_pad_id=pad_id, merge_size=m)
            except ValueError as exc:
                bad[r], detail[r] = True, f"positions cannot be recomputed: {exc}"
                continue
            if not np.array_equal(got, want):
                a, t = np.argwhere(got != want)[0].tolist()
                bad[r], detail[r] = True, (f"position_ids[{a}, {t}] = {int(got[a, t])}, HF get_rope_index gives "
                                           f"{int(want[a, t])}; {int((got != want).sum())} values differ")
    s.add_rows("position_ids", np.flatnonzero(bad), lambda r: f"{detail.get(r, 'wrong M-RoPE positions')} (sample {s.uid(r)})")


# ---------------------------------------------------------------------------------------------
# Directory
# ---------------------------------------------------------------------------------------------


def _context(directory: Path, manifest: dict, quick: bool, keep: int, log: _FaultLog) -> _Context | None:
    width = manifest.get("patch_row_width")
    if not is_count(width) or width == 0:
        return None  # reported by _check_manifest_fields; the shards cannot be checked without it
    profile = manifest.get("profile") if isinstance(manifest.get("profile"), dict) else {}
    vision = profile.get("vision") if isinstance(profile.get("vision"), dict) else {}
    if all(is_count(vision.get(k)) for k in ("channels", "patch_size")) and vision["channels"] * vision["patch_size"] ** 2 != width:
        log.add("manifest_field", f"{MANIFEST_NAME}: patch_row_width {width} != channels x patch_size^2 of profile.vision")
    merge = vision.get("merge_size")
    if not (is_count(merge) and merge >= 1):
        merge = None
    tokens = profile.get("special_tokens") if isinstance(profile.get("special_tokens"), dict) else {}
    special = {k: tokens.get(k) for k in SPECIAL_TOKEN_KEYS}
    if not all(is_count(v) for v in special.values()):
        special = None
    elif is_count(tokens.get("video_pad")):
        special["video_pad"] = tokens["video_pad"]
    if not quick and (special is None or merge is None):
        log.add("manifest_field", f"{MANIFEST_NAME}: profile.special_tokens ({', '.join(SPECIAL_TOKEN_KEYS)}) and "
                "profile.vision.merge_size are needed for the token and position checks; those were skipped")
    version = manifest["schema_version"]  # one that this vlmpack reads (`read_manifest`)
    tokens_per_second = profile.get("tokens_per_second", 2)
    return _Context(str(directory), int(width), quick, keep, special, merge, version, profile.get("family"),
                    tokens_per_second if is_count(tokens_per_second) and tokens_per_second > 0 else 2,
                    decode_timestamps=not quick and _bundled_tokenizer_sha256(profile.get("family")) == profile.get("tokenizer_sha256"))


def _bundled_tokenizer_sha256(family) -> str | None:
    from .builtin import builtin_tokenizer_json

    if find_rules(family) is None:
        return None
    return hashlib.sha256(builtin_tokenizer_json(family).encode()).hexdigest()


def _check_duplicates(column: str, values: list[tuple[str, pa.Array]], log: _FaultLog, kind: str, note: str) -> None:
    """One entry per value of `column` that occurs more than once across the directory, the first
    few located (first and second place); the rest counted."""
    import pyarrow.compute as pc

    arrays = [a for _, a in values if len(a)]
    if not arrays:
        return
    counts = pc.value_counts(pa.chunked_array(arrays, type=pa.string()))
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(dup) == 0:
        return
    examples = dup.field("values")[:DUPLICATE_EXAMPLES]
    places: dict[str, list[tuple[str, int]]] = {v.as_py(): [] for v in examples}  # at most DUPLICATE_EXAMPLES
    for shard, arr in values:  # manifest order, so places are in reading order
        hits = np.flatnonzero(pc.is_in(arr, value_set=examples).to_numpy(zero_copy_only=False))
        for r in hits.tolist():
            places[arr[r].as_py()].append((shard, r))
    for value, where in places.items():
        (first_shard, first_row), (shard, row) = where[0], where[1]
        log.add(kind, f"{column} {value!r} occurs {len(where)} times; first at {first_shard} row {first_row}{note}", shard, row)
    log.add_count(kind, len(dup) - len(places))


def verify_shards(
    directory: str | Path,
    quick: bool = False,
    progress: bool = False,
    *,
    workers: int = 1,
    keep_per_kind: int = DEFAULT_KEEP_PER_KIND,
) -> VerifyReport:
    """Check a shard directory; see the module docstring for what each mode covers.

    Raises ShardFormatError when `directory` is not a readable shard directory of this schema
    version (no manifest.json, invalid JSON, another format or schema_version).
    `workers` > 1 checks shards in that many processes (hashing dominates full checks).
    """
    started = time.perf_counter()
    directory = Path(directory)
    manifest = read_manifest(directory)  # its format and version; every other field is checked and reported here
    log = _FaultLog(keep_per_kind)
    report = VerifyReport(directory=str(directory), mode="quick" if quick else "full",
                          schema_version=manifest.get("schema_version"))

    entries = _check_manifest_fields(manifest, log)
    _check_totals(manifest, entries, log)
    acc = _check_accounting(manifest, log)
    _check_rejects(directory, acc, log)
    # a file its entry names is listed, even where the entry's other fields are faulty (reported above)
    given = manifest.get("shards") if isinstance(manifest.get("shards"), list) else []
    named = {e["file"] for e in given if isinstance(e, dict) and isinstance(e.get("file"), str)}
    _check_directory_listing(directory, named, log)
    ctx = _context(directory, manifest, quick, keep_per_kind, log)

    columns: dict[str, list[tuple[str, pa.Array]]] = {column: [] for column in UNIQUE_COLUMNS}
    if ctx is not None and entries:
        total_rows = sum(e["rows"] for e in entries)
        bar = None
        if progress and not quick:
            from tqdm import tqdm

            bar = tqdm(total=total_rows, unit="row", desc="verify", file=sys.stderr, smoothing=0.05)
        try:
            for entry, result in zip(entries, _run_shard_checks(entries, ctx, workers, bar)):
                log.merge(result.log)
                report.rows += result.rows
                for column, values in (result.columns or {}).items():
                    columns[column].append((entry["file"], values))
        finally:
            if bar is not None:
                bar.close()
        report.shards = len(entries)
        report.bytes = sum(e["bytes"] for e in entries)
    warnings = _FaultLog(keep_per_kind)
    if not quick:
        _check_duplicates("source", columns["source"], log, "duplicate_source", " (each row comes from its own input row)")
        _check_duplicates("sample_uid", columns["sample_uid"], warnings, "duplicate_sample_uid",
                          " (the input's ids repeat; fine for training, ambiguous for `vlmpack show --uid`)")
    report.faults, report.fault_counts = log.faults, dict(log.counts)
    report.warnings, report.warning_counts = warnings.faults, dict(warnings.counts)
    report.seconds = time.perf_counter() - started
    return report


def _run_shard_checks(entries: list[dict], ctx: _Context, workers: int, bar):
    if workers <= 1 or len(entries) <= 1 or ctx.quick:  # quick reads footers: processes would cost more than they save
        for entry in entries:
            yield _check_shard(entry, ctx, on_rows=bar.update if bar is not None else None)
        return
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(max_workers=min(workers, len(entries)), mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_check_shard, entry, ctx) for entry in entries]
        for fut in futures:  # in manifest order: the report is the same for any worker count
            result = fut.result()
            if bar is not None:
                bar.update(result.rows)
            yield result


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


class Verify:
    """`vlmpack verify DIR [--quick] [--json]`: exit 0 clean, 1 faults, 2 not a shard directory."""

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("directory", metavar="DIR", help="shard directory (holds manifest.json), or its s3:// / gs:// URL (every object under it copied to a temporary directory as it is, then verified there)")
        parser.add_argument("--quick", action="store_true",
                            help="manifest, file sizes, Arrow footers and schemas, row counts and per-shard sums from list "
                                 "offsets; no hashing, no row checks (seconds on terabytes)")
        parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
        parser.add_argument("--progress", action="store_true", help="progress bar on stderr even when it is not a terminal")
        parser.add_argument("--max-faults", type=int, default=DEFAULT_SHOW_PER_KIND, metavar="N",
                            help=f"faults (and warnings) printed per kind (all are counted; default {DEFAULT_SHOW_PER_KIND})")
        parser.add_argument("--workers", type=int, default=1, metavar="N", help="check shards in N processes (default 1)")

    @staticmethod
    def run(args) -> int:
        refuse_bad_location("the shard directory", args.directory, "give its path")
        if args.workers < 1:
            raise UserError(f"--workers must be at least 1, got {args.workers}")
        if args.max_faults < 0:
            raise UserError(f"--max-faults must be 0 or more, got {args.max_faults}")
        progress = bool(args.progress or sys.stderr.isatty())
        if not is_url(str(args.directory)):
            return _verify_and_report(args, args.directory, progress)
        import tempfile

        from .storage import download_tree

        # every object under the prefix as it is (no check on the way, unlike `fetch`): verify
        # then judges them all and lists every fault, under the URL's name
        with tempfile.TemporaryDirectory(prefix="vlmpack-verify-") as tmp:
            download_tree(str(args.directory), Path(tmp))
            return _verify_and_report(args, tmp, progress, shown=redact(str(args.directory)).rstrip("/"))


def _verify_and_report(args, directory, progress: bool, shown: str | None = None) -> int:
    """Verify `directory` and print the report (text or --json); `shown` names it in every line
    instead (a temporary copy of a store prefix)."""
    def named(text: str) -> str:
        return text if shown is None else text.replace(str(directory), shown)

    try:
        report = verify_shards(directory, quick=args.quick, progress=progress, workers=args.workers,
                               keep_per_kind=max(DEFAULT_KEEP_PER_KIND, args.max_faults))
    except ShardFormatError as exc:
        if args.json:
            print(named(json.dumps({"directory": str(directory), "ok": False, "error": str(exc)}, indent=2)))
        else:
            print_error("verify", named(str(exc)))
        return EXIT_USER_ERROR
    print(named(json.dumps(report.to_json(), indent=2) if args.json else report.format_text(args.max_faults)))
    return EXIT_OK if report.ok else EXIT_FAULT
