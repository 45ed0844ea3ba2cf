"""`manifest.json`: the index of a shard directory, written last so its presence means complete.

It records the schema version, the profile fingerprint, the job settings that decide the
bytes, per-shard stats and checksums, totals, and the input accounting
(rows read = rows written + rows rejected).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from .errors import UserError, first_few
from .json_object import NotAJSONObject, parse_json_object
from .storage import NotARegularFile, open_local, redact
from .schema import FORMAT_NAME, READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION

MANIFEST_NAME = "manifest.json"
REJECTS_NAME = "rejects.jsonl"
PARTS_DIR = "_parts"  # the preprocessing job's work area (unit commit records): resume/merge state
TOTAL_KEYS_V1 = ("rows", "tokens", "target_tokens", "images", "patches", "bytes")
TOTAL_KEYS = TOTAL_KEYS_V1 + ("videos", "video_patches")
SHARD_STAT_KEYS = ("tokens", "target_tokens", "images", "patches")
VIDEO_STAT_KEYS = ("videos", "video_patches")
# The largest count a manifest may hold: JSON integers past 2^53 are not exact in most parsers,
# and no shard, row or byte count comes near it. Bigger, negative or fractional numbers, NaN and
# infinities are damage, refused before any of them sizes an array or a read.
MAX_COUNT = 2**53
VISION_SIZE_KEYS = ("patch_size", "merge_size", "temporal_patch_size")


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


SHARD_DIRECTORY = "shard directory (the one holding manifest.json)"  # what a shard command's input is


# `s3://bucket/x` as Path() leaves it (`s3:/bucket/x`), or as given
_FOLDED_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):/+(.+)$")


def require_directory(directory: Path, what: str) -> None:
    """A clear error when `directory` (the input of a command) is missing or is a file."""
    if not directory.exists() and (url := _FOLDED_URL.match(str(directory))):
        # a URL: Path() folded its `//`
        if url[1].lower() == "file":
            raise ShardFormatError(f"{url[1]}:///{url[2]}: give a local directory as itself (/{url[2]}), without "
                                   "file://")
        where = redact(f"{url[1]}://{url[2]}")
        fetch = f"`vlmpack fetch {where} DIR`" if what == SHARD_DIRECTORY else "a copy to local disk"
        raise ShardFormatError(f"{where} is an object-store URL: this command reads a local {what.split(' (')[0]}; "
                               f"bring it down first ({fetch}) and pass that directory")
    if not directory.exists():
        raise ShardFormatError(f"{directory}: no such directory: pass the {what}")
    if not directory.is_dir():
        raise ShardFormatError(f"{directory} is a file, not a directory: pass the {what}")


def is_count(value) -> bool:
    """A whole number a manifest may hold as a count or an id: 0 <= value <= MAX_COUNT."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _is_positive(value) -> bool:
    return is_count(value) and value > 0


def _finite_numbers(value, length: int | None) -> bool:
    return (isinstance(value, list) and len(value) > 0 and (length is None or len(value) == length)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))


def shard_entry_keys(manifest: dict) -> tuple[str, ...]:
    """The counts each `shards` entry of a manifest of its schema version carries."""
    video = VIDEO_STAT_KEYS if manifest.get("schema_version", SCHEMA_VERSION) >= 2 else ()
    return ("rows", "bytes", *SHARD_STAT_KEYS, *video)


def _got(mapping: dict, key: str) -> str:
    """What stands at `key` instead of the value a reader needs, for a message."""
    return "and it is missing" if key not in mapping else f"got {type(mapping[key]).__name__}"


def shard_entries(manifest: dict) -> tuple[list[dict], list[tuple[str, str | None]]]:
    """The well-formed `shards` entries (a plain file name in the directory, listed once, every
    count in 0..MAX_COUNT, a sha256), and (problem, file name or None) for each other one."""
    entries = manifest.get("shards")
    if not isinstance(entries, list):
        return [], [(f"`shards` must be a list, {_got(manifest, 'shards')}", None)]
    good, problems, seen = [], [], set()
    keys = shard_entry_keys(manifest)
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            problems.append((f"shards[{i}] is not an object", None))
            continue
        name = entry.get("file")
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", "..") or "\\x00" in name:
            problems.append((f"shards[{i}].file {name!r} is not a plain file name in DIR", None))
            continue
        bad = [k for k in keys if not is_count(entry.get(k))]
        if not isinstance(entry.get("sha256"), str):
            bad.append("sha256")
        if bad:
            shown = ", ".join(f"{k} {entry.get(k)!r}" for k in bad)
            problems.append((f"shards[{i}] ({name}) has missing or invalid {shown} (counts are "
                             f"integers 0..2^53, sha256 a string)", name))
            continue
        if name in seen:
            problems.append((f"{name} is listed twice (shards[{i}])", name))
            continue
        seen.add(name)
        good.append(entry)
    if len(good) == len(entries) and sum(e["rows"] for e in good) > MAX_COUNT:
        problems.append(("the shards' rows add up past 2^53", None))
    return good, problems


def layout_problems(manifest: dict) -> list[str]:
    """What a reader needs besides the shard entries, missing or out of range: patch_row_width,
    the profile's vision sizes, pixel normalisation and token ids, and the shapes of settings
    and accounting (totals' values are checked against the entries by `vlmpack verify`)."""
    problems = []
    width = manifest.get("patch_row_width")
    if not _is_positive(width):
        problems.append(f"patch_row_width {width!r} is not a positive integer")
    profile = manifest.get("profile")
    if not isinstance(profile, dict):
        return problems + [f"`profile` must be an object, {_got(manifest, 'profile')}"]
    for key in ("id", "family"):
        if not isinstance(profile.get(key), str):
            problems.append(f"profile.{key} {profile.get(key)!r} is not a string")
    for key in ("chat_template", "chat_template_sha256"):  # absent from an earlier vlmpack's profile
        if profile.get(key) is not None and not isinstance(profile[key], str):
            problems.append(f"profile.{key} is not a string but a {type(profile[key]).__name__}")
    vision = profile.get("vision")
    if not isinstance(vision, dict):
        problems.append(f"profile.vision must be an object, {_got(profile, 'vision')}")
        vision = {}
    for key in VISION_SIZE_KEYS:
        if not _is_positive(vision.get(key)):
            problems.append(f"profile.vision.{key} {vision.get(key)!r} is not a positive integer")
    channels = vision.get("channels", 3)
    if not _is_positive(channels):
        problems.append(f"profile.vision.channels {channels!r} is not a positive integer")
        channels = None
    for section in ("vision", "video"):
        values = profile.get(section)
        if section == "video" and values is None:
            continue  # written by every version that has videos; older manifests have none
        if not isinstance(values, dict):
            problems.append(f"profile.{section} must be an object, {_got(profile, section)}")
            continue
        for key in ("image_mean", "image_std"):
            value = values.get(key)
            if not _finite_numbers(value, channels) or (key == "image_std" and 0 in value):
                problems.append(f"profile.{section}.{key} {value!r} is not a list of {channels or 'the'} "
                                f"finite numbers{' (none 0)' if key == 'image_std' else ''}")
    tokens = profile.get("special_tokens")
    if not isinstance(tokens, dict):
        problems.append(f"profile.special_tokens must be an object, {_got(profile, 'special_tokens')}")
    else:
        bad = [f"{k} {v!r}" for k, v in tokens.items() if not is_count(v)]
        if "image_pad" not in tokens:
            bad.insert(0, "image_pad missing")
        if bad:
            problems.append(f"profile.special_tokens need token ids (integers >= 0): {', '.join(bad)}")
    if "tokens_per_second" in profile and not _is_positive(profile["tokens_per_second"]):
        problems.append(f"profile.tokens_per_second {profile['tokens_per_second']!r} is not a positive integer")
    for key in ("settings", "accounting"):
        if key in manifest and not isinstance(manifest[key], dict):
            problems.append(f"`{key}` must be an object, got {type(manifest[key]).__name__}")
    inputs = manifest.get("accounting", {}).get("inputs", []) if isinstance(manifest.get("accounting"), dict) else []
    if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        problems.append("accounting.inputs must be a list of objects")
    else:
        bad = [f"inputs[{k}].{key} {entry[key]!r}" for k, entry in enumerate(inputs) for key in ("rows", "bytes")
               if key in entry and not is_count(entry[key])
               and (key == "rows" or entry[key] is not None)]  # a store may not tell a file's size
        if bad:
            problems.append(f"accounting needs integers 0..2^53: {first_few(bad)}")
    return problems


def count_problems(manifest: dict) -> list[str]:
    """totals and accounting numbers that are not counts (`vlmpack verify` checks their sums)."""
    problems = []
    totals = manifest.get("totals")
    if not isinstance(totals, dict):
        return [f"`totals` must be an object, {_got(manifest, 'totals')}"]
    bad = [f"{k} {totals.get(k, 'missing')!r}" for k in (*total_keys(manifest), "shards") if not is_count(totals.get(k))]
    if bad:
        problems.append(f"totals need integers 0..2^53: {', '.join(bad)}")
    acc = manifest.get("accounting")
    if isinstance(acc, dict):
        bad = [f"{k} {acc[k]!r}" for k in ("rows_read", "rows_written", "rows_rejected") if k in acc and not is_count(acc[k])]
        by_reason = acc.get("rejects_by_reason", {})
        if not isinstance(by_reason, dict):
            bad.append(f"rejects_by_reason {by_reason!r}")
        else:
            bad += [f"rejects_by_reason.{k} {v!r}" for k, v in by_reason.items() if not is_count(v)]
        if bad:
            problems.append(f"accounting needs integers 0..2^53: {', '.join(bad)}")
    return problems


def manifest_problems(manifest: dict) -> list[str]:
    """Everything in a manifest of a readable format and version that a reader cannot rely on."""
    return [problem for problem, _ in shard_entries(manifest)[1]] + layout_problems(manifest) + count_problems(manifest)


def check_manifest(manifest: dict, where: str, directory: str) -> dict:
    """`manifest` when every field a reader relies on holds; else ShardFormatError naming `where`
    (the manifest's path or URL), the first bad field and the fix."""
    problems = manifest_problems(manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ShardFormatError(f"{where}: {problems[0]}{more}: the manifest is damaged or was edited by hand; restore "
                               f"it or re-run the job that wrote it (`vlmpack verify {directory}` lists every fault)")
    return manifest


def read_manifest(directory: str | Path) -> dict:
    """manifest.json of `directory`, checked for its format and schema version only (`vlmpack
    verify` reports every other field itself); readers use `load_manifest`."""
    directory = Path(directory)
    require_directory(directory, SHARD_DIRECTORY)
    path = directory / MANIFEST_NAME
    try:
        with open_local(path) as f:  # a FIFO is refused, not waited on
            data = f.read()
    except FileNotFoundError:
        hint = " (a preprocessing job that has not finished, or a partition not yet merged?)" if directory.is_dir() else ""
        if (directory / "index.json").is_file():  # the WebDataset index (shards_schema/webdataset/format.py)
            hint = f" but an index.json: a `vlmpack export` directory? `vlmpack import {directory} --out DIR` makes shards of it"
        raise ShardFormatError(f"{directory}: no {MANIFEST_NAME}{hint}") from None
    except IsADirectoryError:
        raise ShardFormatError(f"{path} is a directory, not the manifest file: restore the file, or re-run the job "
                               "that wrote the shards") from None
    except NotARegularFile as exc:
        raise ShardFormatError(str(exc)) from None
    except OSError as exc:
        raise ShardFormatError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    return parse_manifest(data, path)


def load_manifest(directory: str | Path) -> dict:
    """manifest.json of a shard directory, every field a reader relies on checked (ShardFormatError
    naming the directory, the field and the fix)."""
    directory = Path(directory)
    return check_manifest(read_manifest(directory), str(directory / MANIFEST_NAME), str(directory))


def parse_manifest(text: str | bytes, path) -> dict:
    """A manifest's JSON text -> the manifest, checked for its format and schema version."""
    damaged = "the manifest is damaged or was edited by hand; restore it or re-run the job that wrote it"
    try:
        manifest = parse_json_object(text, path)
    except NotAJSONObject as exc:
        raise ShardFormatError(f"{exc}: {damaged}") from None
    if manifest.get("format") != FORMAT_NAME:
        found = "no `format`" if "format" not in manifest else f"format {manifest['format']!r}"
        raise ShardFormatError(f"{path}: not a vlmpack manifest ({found}, where `vlmpack preprocess` writes "
                               f"{FORMAT_NAME!r}): pass a directory `vlmpack preprocess` wrote, or if it is one, {damaged}")
    version = manifest.get("schema_version")
    if not is_count(version):
        raise ShardFormatError(f"{path}: schema_version {version!r} is not an integer: {damaged}")
    if version not in READABLE_SCHEMA_VERSIONS:
        readable = ", ".join(map(str, READABLE_SCHEMA_VERSIONS))
        if version > max(READABLE_SCHEMA_VERSIONS):
            fix = ("a newer vlmpack wrote it: upgrade vlmpack to read it, or re-run `vlmpack preprocess` "
                   "with this version")
        else:  # below every version vlmpack has written: the number was changed
            fix = f"no vlmpack writes schema version {version}: {damaged}"
        raise ShardFormatError(f"{path}: schema version {version}, this vlmpack reads versions {readable}; {fix}")
    return manifest
