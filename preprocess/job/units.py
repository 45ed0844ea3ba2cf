"""One work unit: `rows_per_shard` consecutive input rows -> one shard plus its unit record.

The record, written atomically into `_parts/`, is the unit's commit point. A unit runs the
same way in this process, in a local worker process or in a Ray task."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from shards_schema.atomic import write_json_atomic
from shards_schema.writer import ShardWriter

from ..errors import RejectError, check_reject_code
from ..formats import in_row_terms, to_openai_row
from ..inputs import WorkUnit, read_rows
from ..pipeline import SampleOptions, process_row
from ..profiles import Profile
from .identity import input_changed_error, printable
from .records import shard_name, unit_record_path
from .signals import stop_if_asked

PROGRESS_EVERY_ROWS = 8


def process_unit(unit: WorkUnit, name: str, rows_per_unit: int, out: Path, profile: Profile, options: SampleOptions,
                 on_rows=None) -> dict:
    """Turn one unit of input rows into one shard plus its unit record; returns the record.

    `name` is how the unit's input is recorded in sources and rejects (see `input_name`).
    """
    unit_started = time.perf_counter()
    writer = ShardWriter(out / shard_name(unit.index), profile.vision.patch_row_width)
    rejects, rows_read, done_since_report, rejected_since_report = [], 0, 0, 0
    try:
        for row_index, row in _reads_named(read_rows(unit, rows_per_unit, options.max_row_bytes), unit.input.path):
            stop_if_asked()
            rows_read += 1
            source = f"{name}:{row_index}"
            reject = None
            try:
                if isinstance(row, RejectError):
                    raise row
                chat = to_openai_row(row, unit.input.row_format, detected=unit.input.row_format_detected)
                try:
                    sample = process_row(chat, sample_uid=source, source=source, profile=profile, options=options)
                except RejectError as exc:
                    raise in_row_terms(exc, row, unit.input.row_format) from None
                # Arrow encodes strings only when a whole batch is written, too late to blame one row.
                sample.sample_uid.encode("utf-8")
                sample.source.encode("utf-8")
            except RejectError as exc:
                reject = (exc.code, exc.message)
            except Exception as exc:  # a bug or a library failure on odd input: record it, keep going
                reject = ("internal_error", _describe(exc))
            else:
                try:  # an OSError here (disk full) is the output's, not the row's: it stops the unit
                    writer.add(sample)
                except ValueError as exc:  # a sample the shard cannot hold, refused before it is queued
                    reject = ("internal_error", _describe(exc))
            if reject:
                rejects.append(_reject_record(name, row_index, *reject))
                rejected_since_report += 1
            done_since_report += 1
            if on_rows and done_since_report >= PROGRESS_EVERY_ROWS:
                on_rows(done_since_report, rejected_since_report)
                done_since_report = rejected_since_report = 0
        if rows_read != unit.num_rows:
            raise input_changed_error(name, f"its rows {unit.start}-{unit.stop - 1}, counted when the job started, are "
                                      f"no longer all there: {rows_read} of {unit.num_rows} read", str(out))
        shard = writer.close().to_json()
    except BaseException:
        with contextlib.suppress(Exception):  # after a failed close the file is closed already: report the first error
            writer.abort()
        raise
    if on_rows and done_since_report:
        on_rows(done_since_report, rejected_since_report)
    if shard["rows"] == 0:  # every row rejected: keep no empty shard around
        (out / shard["file"]).unlink()
        shard = None
    record = {
        "unit": unit.index,
        "input": name,
        "start": unit.start,
        "stop": unit.stop,
        "rows_read": rows_read,
        "rows_written": shard["rows"] if shard else 0,
        "rows_rejected": len(rejects),
        "shard": shard,
        "rejects": rejects,
        "seconds": round(time.perf_counter() - unit_started, 3),  # work state only: never in the manifest
    }
    write_json_atomic(unit_record_path(out, unit.index), record)
    return record


def _reads_named(rows, path: str):
    """`rows`, an OSError in reading them naming the input: the job's one-line error names the
    output otherwise (a write's), and sends the user to the wrong storage."""
    try:
        yield from rows
    except OSError as exc:
        if exc.filename is None:
            exc.filename = printable(path)
        raise


def _describe(exc: Exception) -> str:
    try:
        message = str(exc)
    except Exception:  # an exception whose own message fails must not stop the job either
        message = "(its message could not be read)"
    return f"{type(exc).__name__}: {message}"


def _reject_record(name: str, row: int, code: str, reason: str) -> dict:
    return {"source": name, "row": row, "code": check_reject_code(code), "reason": printable(reason)}


