"""Crash-safe file writes: write to a temporary name, fsync, rename, fsync the directory.

A reader (or a resumed job) therefore sees either the old file, no file, or the complete
new one; never a torn write.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from .errors import first_few
from .manifest import ShardFormatError

TMP_SUFFIX = ".tmp"


def refuse_leftover_tmp(directory: Path, what: str) -> None:
    """Raise ShardFormatError when `directory` holds a torn write (`*.tmp`): a job was killed
    while writing it, or one is writing it now, so its complete-looking files cannot be trusted."""
    leftover = sorted(name for name in os.listdir(directory) if name.endswith(TMP_SUFFIX))
    if leftover:
        raise ShardFormatError(
            f"{directory}: leftover {first_few(leftover)} from an interrupted write (or a job still writing {what}): "
            "wait for that job, or delete the .tmp files and re-run the job that wrote them"
        )


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: Path, mode: str = "wb"):
    """Open `path + .tmp` for writing; on success fsync and rename over `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj) -> None:
    with atomic_open(path, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True, ensure_ascii=False)
        fh.write("\n")


def write_jsonl_atomic(path: Path, records) -> None:
    with atomic_open(path, "w") as fh:
        for record in records:
            fh.write(json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n")
