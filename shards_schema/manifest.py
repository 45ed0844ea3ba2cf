"""`manifest.json`: the index of a shard directory, written last so its presence means complete.

It records the schema version, the profile fingerprint, the job settings that decide the
bytes, per-shard stats and checksums, totals, and the input accounting
(rows read = rows written + rows rejected).
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError
from .schema import FORMAT_NAME, READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION

MANIFEST_NAME = "manifest.json"
REJECTS_NAME = "rejects.jsonl"
PARTS_DIR = "_parts"  # the preprocessing job's work area (unit commit records): resume/merge state
TOTAL_KEYS_V1 = ("rows", "tokens", "target_tokens", "images", "patches", "bytes")
TOTAL_KEYS = TOTAL_KEYS_V1 + ("videos", "video_patches")


def total_keys(manifest: dict) -> tuple[str, ...]:
    """The totals (and per-shard stats) a manifest of its schema version carries."""
    return TOTAL_KEYS if manifest.get("schema_version", SCHEMA_VERSION) >= 2 else TOTAL_KEYS_V1


class ShardFormatError(UserError):
    """A shard directory that is missing, incomplete, or from an incompatible version."""


def profile_name(profile: dict) -> str:
    """The profile a manifest records, as `--profile` names it (`qwen3-vl-thinking`); manifests
    written before the name was recorded give their rendering family."""
    return str(profile.get("name") or profile.get("family"))


def build_manifest(*, profile: dict, settings: dict, shards: list[dict], accounting: dict, patch_row_width: int,
                   schema_version: int = SCHEMA_VERSION) -> dict:
    keys = TOTAL_KEYS if schema_version >= 2 else TOTAL_KEYS_V1
    totals = {key: sum(int(s[key]) for s in shards) for key in keys}
    totals["shards"] = len(shards)
    if accounting["rows_read"] != accounting["rows_written"] + accounting["rows_rejected"]:
        raise AssertionError(f"row accounting does not add up: {accounting}")
    if accounting["rows_written"] != totals["rows"]:
        raise AssertionError(f"rows written {accounting['rows_written']} != rows in shards {totals['rows']}")
    return {
        "format": FORMAT_NAME,
        "schema_version": schema_version,
        "patch_row_width": patch_row_width,
        "profile": profile,
        "settings": settings,
        "totals": totals,
        "accounting": accounting,
        "shards": shards,
    }


def require_directory(directory: Path, what: str) -> None:
    """A clear error when `directory` (the input of a command) is missing or is a file."""
    if not directory.exists():
        raise ShardFormatError(f"{directory}: no such directory: pass the {what}")
    if not directory.is_dir():
        raise ShardFormatError(f"{directory} is a file, not a directory: pass the {what}")


def load_manifest(directory: str | Path) -> dict:
    directory = Path(directory)
    require_directory(directory, "shard directory (the one holding manifest.json)")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        hint = " (a preprocessing job that has not finished, or a partition not yet merged?)" if directory.is_dir() else ""
        raise ShardFormatError(f"{directory}: no {MANIFEST_NAME}{hint}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardFormatError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise ShardFormatError(f"{path}: not a vlmpack manifest (a JSON {type(manifest).__name__}, not an object)")
    if manifest.get("format") != FORMAT_NAME:
        raise ShardFormatError(f"{path}: not a vlmpack manifest (format {manifest.get('format')!r})")
    version = manifest.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS:
        raise ShardFormatError(
            f"{path}: schema version {version}, this vlmpack reads versions "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}; "
            "re-run `vlmpack preprocess` with this version"
        )
    return manifest
