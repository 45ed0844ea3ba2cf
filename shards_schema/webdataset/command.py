"""`vlmpack export` and `vlmpack import`: the command-line faces of `convert`."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ..flags import refuse_bad_location
from .convert import export_webdataset, import_webdataset
from .format import DEFAULT_MAX_TAR_BYTES


def _parse_bytes(text: str) -> int:
    """`1073741824`, `512M`, `1G`, `1.5GB` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1073741824, 512M, 1G)")
    scale = 1 << (10 * " KMGT".index(match.group(2).upper() or " "))
    return int(float(match.group(1)) * scale)


def _bars(args) -> bool:
    """A bar of the samples written, on a terminal only: in a log it is a line of carriage
    returns, and an error's one line would come after it."""
    return not args.no_progress and sys.stderr.isatty()


class Export:
    """`vlmpack export DIR --format webdataset --out TARDIR`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("directory", help="shard directory (with manifest.json)")
        parser.add_argument("--format", choices=["webdataset"], default="webdataset", help="output format (default: webdataset)")
        parser.add_argument("--out", required=True, help="directory for the tars, index.json and rejects.jsonl")
        parser.add_argument("--samples-per-tar", type=int, default=None, help="at most this many samples per tar (default: no limit)")
        parser.add_argument(
            "--max-tar-bytes",
            type=_parse_bytes,
            default=DEFAULT_MAX_TAR_BYTES,
            help="start a new tar before this size (default: 1G; K/M/G/T suffixes)",
        )
        parser.add_argument("--overwrite", action="store_true", help="replace a previous export (finished or not) in --out; a directory holding other files, or another command's output, is refused")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar (shown on a terminal only)")

    @staticmethod
    def run(args) -> int:
        refuse_bad_location("the shard directory", args.directory, "give a directory's path")
        refuse_bad_location("--out", args.out, "give a directory's path")
        index = export_webdataset(
            args.directory,
            args.out,
            samples_per_tar=args.samples_per_tar,
            max_tar_bytes=args.max_tar_bytes,
            overwrite=args.overwrite,
            progress=_bars(args),
        )
        print(f"exported {index['samples']} samples into {len(index['tars'])} tars ({index['tar_bytes'] / 1e6:.1f} MB) -> {args.out}")
        if index["url_pattern"]:
            print(f"WebDataset urls: {Path(args.out) / index['url_pattern']}")
        return 0


class Import:
    """`vlmpack import TARDIR --out DIR`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("tardir", help="directory written by `vlmpack export --format webdataset` (with index.json)")
        parser.add_argument("--out", required=True, help="shard directory to create")
        parser.add_argument("--overwrite", action="store_true", help="replace a previous import (finished or not) in --out; a directory holding other files, or another command's output, is refused")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar (shown on a terminal only)")

    @staticmethod
    def run(args) -> int:
        refuse_bad_location("the export directory", args.tardir, "give a directory's path")
        refuse_bad_location("--out", args.out, "give a directory's path")
        manifest = import_webdataset(args.tardir, args.out, overwrite=args.overwrite, progress=_bars(args))
        totals = manifest["totals"]
        print(f"imported {totals['rows']} samples into {totals['shards']} shards ({totals['bytes'] / 1e6:.1f} MB) -> {args.out}")
        return 0
