"""The files of a job's output directory: shards, unit records (the units' commit points),
the job's identity, and the final `rejects.jsonl` and `manifest.json`."""

from __future__ import annotations

import json
from pathlib import Path

from shards_schema.atomic import TMP_SUFFIX, write_json_atomic, write_jsonl_atomic
from shards_schema.manifest import MANIFEST_NAME, PARTS_DIR, REJECTS_NAME, TOTAL_KEYS, build_manifest
from shards_schema.storage import NotARegularFile, open_local
from shards_schema.writer import file_sha256

from ..inputs import WorkUnit
from .signals import stop_if_asked

JOB_FILE = "job.json"
INPUTS_SEEN_FILE = "inputs_seen.json"  # where each input was found and its mtime: resume checks only


def shard_name(unit_index: int) -> str:
    return f"shard-{unit_index:06d}.arrow"


def unit_record_path(out: Path, unit_index: int) -> Path:
    return out / PARTS_DIR / f"unit-{unit_index:06d}.json"


def partition_summary_name(index: int, count: int) -> str:
    """A partition's summary in `_parts/`, written when its units are done (published last)."""
    return f"partition-{index}-of-{count}.json"


def read_json(path: Path):
    """A JSON file's content, or None when it is absent or damaged (not JSON, or no regular
    file: a FIFO in its place is never waited on)."""
    try:
        with open_local(path) as fh:
            return json.loads(fh.read().decode("utf-8"))
    except (FileNotFoundError, IsADirectoryError, NotARegularFile, ValueError):
        return None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def job_identity_problem(identity) -> str | None:
    """What makes a recorded job identity (`_parts/job.json`) other than one vlmpack wrote, as
    far as resuming and merging read it; None when it reads as one."""
    if not isinstance(identity, dict):
        return f"a JSON {type(identity).__name__}, not an object"
    inputs = identity.get("inputs")
    if not isinstance(inputs, list) or not all(isinstance(inp, dict) and isinstance(inp.get("path"), str)
                                               and _is_count(inp.get("rows")) for inp in inputs):
        return "its inputs are not a list of {path, rows, ...} objects"
    settings, profile = identity.get("settings"), identity.get("profile")
    if not isinstance(settings, dict) or not _is_count(settings.get("rows_per_shard")) \
            or not settings["rows_per_shard"]:
        return "its settings hold no rows_per_shard count"
    if not isinstance(profile, dict) or not isinstance(profile.get("vision"), dict):
        return "it holds no profile with a vision section"
    return None


def unit_record(path: Path, unit_index: int) -> dict | None:
    """Unit `unit_index`'s record, or None when it is absent or damaged: not JSON, or not what
    vlmpack writes, as far as the manifest is built from it (its row counts adding up, its
    rejects with their codes, its shard entry, if any, with the shard's counts)."""
    record = read_json(path)
    if not isinstance(record, dict) or record.get("unit") != unit_index:
        return None
    rejects, shard = record.get("rejects"), record.get("shard")
    read, written = record.get("rows_read"), record.get("rows_written")
    if not isinstance(rejects, list) or not all(isinstance(r, dict) and isinstance(r.get("code"), str) for r in rejects):
        return None
    if not (_is_count(read) and _is_count(written)) or read != written + len(rejects):
        return None
    if not shard:
        return record if not written else None
    if not (isinstance(shard, dict) and isinstance(shard.get("file"), str) and isinstance(shard.get("sha256"), str)
            and all(_is_count(shard.get(key)) for key in TOTAL_KEYS)):
        return None
    return record if shard["rows"] == written else None


def remove_torn_writes(out: Path) -> None:
    """Remove the temporary files of writes a stopped or failed job left unfinished."""
    for stale in list(out.glob("*" + TMP_SUFFIX)) + list((out / PARTS_DIR).glob("*" + TMP_SUFFIX)):
        stale.unlink()


def load_unit_records(out: Path, unit_indices) -> list[dict]:
    return [json.loads(unit_record_path(out, i).read_text(encoding="utf-8")) for i in unit_indices]


def shard_matches_record(directory: Path, record: dict) -> bool:
    """The unit's shard is there as committed: same size and sha256 (no shard: all rows rejected)."""
    shard = record.get("shard")
    if not shard:
        return True
    path = directory / shard["file"]
    try:
        return path.stat().st_size == shard["bytes"] and file_sha256(path) == shard["sha256"]
    except FileNotFoundError:
        return False


def committed_units(out: Path, units: list[WorkUnit], progress: bool) -> tuple[set[int], list[int]]:
    """(units whose record and shard are intact, units whose record was there but the shard
    missing or damaged); the records of the second kind are removed, so those units are redone."""
    from tqdm import tqdm

    done, damaged = set(), []
    recorded = [u for u in units if unit_record_path(out, u.index).exists()]
    for unit in tqdm(recorded, unit="shard", desc="check finished shards", disable=not progress or not recorded):
        stop_if_asked()
        path = unit_record_path(out, unit.index)
        record = unit_record(path, unit.index)
        if record is not None and shard_matches_record(out, record):
            done.add(unit.index)
        else:
            damaged.append(unit.index)
            path.unlink()
    return done, damaged


def write_final_outputs(out: Path, identity: dict, records: list[dict], patch_row_width: int) -> dict:
    """rejects.jsonl, then manifest.json (last: its presence means the directory is complete)."""
    records = sorted(records, key=lambda r: r["unit"])
    rejects = [rej for r in records for rej in r["rejects"]]
    by_reason: dict[str, int] = {}
    for rej in rejects:
        by_reason[rej["code"]] = by_reason.get(rej["code"], 0) + 1
    write_jsonl_atomic(out / REJECTS_NAME, rejects)
    accounting = {
        "rows_read": sum(r["rows_read"] for r in records),
        "rows_written": sum(r["rows_written"] for r in records),
        "rows_rejected": len(rejects),
        "rejects_by_reason": dict(sorted(by_reason.items())),
        "inputs": identity["inputs"],
    }
    manifest = build_manifest(
        profile=identity["profile"],
        settings=identity["settings"],
        shards=[r["shard"] for r in records if r["shard"]],
        accounting=accounting,
        patch_row_width=patch_row_width,
    )
    write_json_atomic(out / MANIFEST_NAME, manifest)
    return manifest

