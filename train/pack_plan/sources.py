"""What the planner reads of a source: per-sample token and visual-token counts.

A source is a shard directory (manifest.json) or a WebDataset export of one (index.json,
`vlmpack export --format webdataset`). An export keeps its source's manifest in index.json,
so both have the same fingerprint: plans, plan caches and loader states carry over between
a directory and its export (same data, same packs, bit for bit). The counts come from Arrow
list offsets or tar headers; never a token or pixel value is read.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from shards_schema import MANIFEST_NAME, ShardFormatError, ShardSet, load_manifest, open_shards
from shards_schema.webdataset import INDEX_NAME, WebDatasetShards, load_index

from .errors import PackingError


@dataclass
class SourceStats:
    """What the planner knows about one source: per-sample sizes and an identity."""

    name: str  # the shard directory (or a label for synthetic stats)
    num_tokens: np.ndarray  # int64 [n]
    visual_tokens: np.ndarray  # int64 [n] ((image + video patches) / merge_size^2)
    fingerprint: dict  # identity of the data (manifest profile id + shard checksums)
    describe: Callable[[int], str] | None = None  # sample index -> "uid ..." for error messages

    def __len__(self) -> int:
        return len(self.num_tokens)


def source_fingerprint(manifest: dict) -> dict:
    """The parts of a manifest that identify the data (cheap: no shard is read)."""
    return {
        "profile_id": manifest["profile"]["id"],
        "schema_version": manifest["schema_version"],
        "patch_row_width": manifest["patch_row_width"],
        "shards_sha256": [s["sha256"] for s in manifest["shards"]],
    }


def is_webdataset_export(directory: str | Path) -> bool:
    directory = Path(directory)
    # lexists: an index.json that is a directory or a FIFO is named by load_index, not taken for no source
    return not os.path.lexists(directory / MANIFEST_NAME) and os.path.lexists(directory / INDEX_NAME)


def source_manifest(directory: str | Path) -> dict:
    """The shard manifest of a source (for an export: the one recorded in its index.json)."""
    directory = Path(directory)
    if is_webdataset_export(directory):
        return load_index(directory)["manifest"]
    if directory.is_dir() and not (directory / MANIFEST_NAME).exists():
        raise ShardFormatError(
            f"{directory}: neither {MANIFEST_NAME} nor {INDEX_NAME}; a training source is a shard directory written by "
            "`vlmpack preprocess` (one whose job has not finished, or whose partitions are not merged yet, has no "
            f"{MANIFEST_NAME}) or its WebDataset export (`vlmpack export --format webdataset`)"
        )
    return load_manifest(directory)


def open_source(directory: str | Path) -> ShardSet | WebDatasetShards:
    """A source as an indexable dataset: `len`, `[i]` (the reader's sample dict), `.manifest`,
    `.directory`, `.sample_stats()`; both kinds pickle by path (DataLoader workers)."""
    return WebDatasetShards(directory) if is_webdataset_export(directory) else open_shards(directory)


def load_source_stats(directory: str | Path) -> SourceStats:
    """Per-sample token and visual-token counts of a source, from Arrow offsets or tar headers."""
    shards = open_source(directory)
    stats = shards.sample_stats()
    merge = int(shards.manifest["profile"]["vision"]["merge_size"])

    def describe(i: int) -> str:
        return f"uid {shards[i]['sample_uid']!r}"

    return SourceStats(
        name=str(Path(directory).resolve()),
        num_tokens=stats["num_tokens"].astype(np.int64),
        visual_tokens=(stats["num_patches"] + stats.get("num_video_patches", 0)).astype(np.int64) // (merge * merge),
        fingerprint=source_fingerprint(shards.manifest),
        describe=describe,
    )


def parse_source(spec) -> tuple[str, float | None]:
    """'DIR', 'DIR:0.7', Path or (DIR, weight) -> (DIR, weight or None).

    A ':' suffix is a weight only when DIR itself does not exist (so directories whose names
    contain ':' still work). PackingError for a weight that is not a finite number >= 0, and
    for 'DIR:TEXT' where DIR exists but TEXT is not a number."""
    if isinstance(spec, (tuple, list)):
        directory, weight = spec
        return str(directory), None if weight is None else _weight(str(directory), weight, spec)
    text = str(spec)
    if ":" in text and not Path(text).exists():
        head, tail = text.rsplit(":", 1)
        try:
            _decimal(tail)
        except ValueError:
            if Path(head).is_dir():
                raise PackingError(f"{text}: the weight {tail!r} is not a number: write DIR:WEIGHT, e.g. {head}:0.5") from None
            return text, None
        return head, _weight(head, tail, text)
    return text, None


# a weight as written in decimal: Python's float() also takes '1_0' (10) and ' 1 ', which a
# mistyped weight should not pass as
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _decimal(text: str) -> float:
    if not _DECIMAL.fullmatch(text):
        raise ValueError(f"not a decimal number: {text!r}")
    return float(text)


def _weight(directory: str, weight, spec) -> float:
    value = float(weight)
    if not (math.isfinite(value) and value >= 0):
        raise PackingError(f"{spec}: the mixing weight of {directory} must be a finite number >= 0, got {weight}")
    return value


def normalize_sources(sources) -> list[tuple[str, float | None]]:
    """One source spec or a list of them -> [(DIR, weight or None), ...]."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    return [parse_source(s) for s in sources]
