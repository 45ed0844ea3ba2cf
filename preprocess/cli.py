"""`vlmpack quickstart | preprocess | merge`.

Exit status: 0 when shards were written; 1 when the job finished but wrote no sample (an
empty input, or every row rejected: the rows are still accounted for in manifest.json and
rejects.jsonl), or when a worker process was killed (SIGKILL, e.g. by the system when memory
ran out, or a crash; re-run to resume); 2 for a mistake in the command (one line naming the
flag or input and the fix); 4 when the disk is full (free space and re-run: finished shards
are kept); 128 + the signal number when the job or one of its workers was stopped by SIGTERM,
SIGINT or SIGHUP (re-run to resume).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

from shards_schema import storage
from shards_schema.atomic import atomic_open, write_json_atomic
from shards_schema.errors import EXIT_FAULT, first_few
from shards_schema.flags import add_flags, config_from_args, refuse_bad_location
from shards_schema.inspect import format_storage_per_visual_token, storage_per_visual_token
from shards_schema.manifest import profile_name
from shards_schema.outdir import exclusive_output_dir, user_entries
from shards_schema.writer import file_sha256

from .errors import ConfigError
from .job import MAX_WORKERS, PreprocessConfig, check_config, run_preprocess
from .job.config import flags_acting_only_with, partition_from_flags


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def format_summary(manifest: dict, out: Path) -> str:
    t, acc = manifest["totals"], manifest["accounting"]
    vision = manifest["profile"]["vision"]
    visual_tokens = t["patches"] // vision["merge_size"] ** 2
    lines = [
        f"shards:         {out}/ ({t['shards']} shard files, {_human_bytes(t['bytes'])})",
        f"profile:        {profile_name(manifest['profile'])} (fingerprint {manifest['profile']['id']}, {manifest['profile']['source']})",
        f"rows:           read {acc['rows_read']} = written {acc['rows_written']} + rejected {acc['rows_rejected']}",
        f"tokens:         {t['tokens']:,} ({t['target_tokens']:,} targets, {t['target_tokens'] / max(t['tokens'], 1):.1%})",
        f"images:         {t['images']:,} ({visual_tokens:,} visual tokens, {t['patches']:,} patches)",
    ]
    video_tokens = t.get("video_patches", 0) // vision["merge_size"] ** 2
    if t.get("videos"):
        lines.append(f"videos:         {t['videos']:,} ({video_tokens:,} visual tokens, {t['video_patches']:,} patches)")
    if visual_tokens + video_tokens:
        storage = storage_per_visual_token(t["bytes"], t["patches"], t.get("video_patches", 0), vision,
                                           manifest["patch_row_width"])
        lines.append(f"bytes/visual token: {format_storage_per_visual_token(storage)}")
    if acc["rejects_by_reason"]:
        reasons = ", ".join(f"{code} {n}" for code, n in acc["rejects_by_reason"].items())
        lines.append(f"rejects:        {reasons} (details: {out}/rejects.jsonl)")
    return "\n".join(lines)


def _upload_line(upload: dict, where: str, stage: str | None = None) -> str:
    if upload["kept"] == "all":
        return f"upload:         nothing to do: {where} holds this job's dataset already"
    staged = f"; staged in {stage} (removed)" if stage else ""
    return (f"upload:         {upload['uploaded']} objects ({upload['bytes'] / 2**20:,.1f} MiB) to {where}, "
            f"{upload['kept']} already there{staged}")


EXIT_NOTHING_WRITTEN = EXIT_FAULT


def _nothing_written(command: str, manifest: dict, out: Path) -> int:
    """The job finished but no sample came out: worth a non-zero exit, not a silent success."""
    acc = manifest["accounting"]
    why = "the inputs hold no rows" if acc["rows_read"] == 0 else f"all rejected (see {out}/rejects.jsonl)"
    print(f"vlmpack {command}: warning: nothing written: {acc['rows_read']} rows read, {why}", file=sys.stderr)
    return EXIT_NOTHING_WRITTEN


class Preprocess:
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, PreprocessConfig)

    @staticmethod
    def run(args) -> int:
        args.num_partitions, args.partition_index = partition_from_flags(args.num_partitions, args.partition_index)
        flags_acting_only_with(args)
        cfg = config_from_args(PreprocessConfig, args)
        result = run_preprocess(cfg)
        run = result.pop("_run")
        for unit in run["units_redone"]:
            print(f"vlmpack preprocess: note: the shard of unit {unit} was missing or damaged; it was redone", file=sys.stderr)
        if "totals" not in result:
            if not result["units"] and "job_units" in result:  # older published summaries lack it
                total = result["job_units"]
                print(f"vlmpack preprocess: note: --num-partitions {cfg.num_partitions} is more than the job's {total} "
                      f"work unit{'s' if total != 1 else ''}, so partition {cfg.partition_index} has none: partitions "
                      f"{total} to {cfg.num_partitions - 1} write nothing (fewer partitions, or a smaller "
                      "--rows-per-shard, keep every machine busy)", file=sys.stderr)
            print(f"partition {result['partition']} done: {result['units']} units, {result['rows_read']} rows read, "
                  f"{result['rows_rejected']} rejected. When all partitions are done: vlmpack merge {args.out} --out DIR")
            return 0
        where = storage.redact(args.out) if storage.is_url(args.out) else Path(args.out)
        print(format_summary(result, where))
        if "upload" in run:
            print(_upload_line(run["upload"], where, run["stage"]))
        print(f"time:           {run['seconds']:.1f} s ({run['units_done_now']} units processed, {run['units_resumed']} already done)")
        if result["accounting"]["rows_written"] == 0:
            return _nothing_written("preprocess", result, where)
        return 0


class Merge:
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dirs", nargs="+", help="output directories of the partitions (may be one shared directory), "
                                                    "or their s3:// / gs:// prefixes")
        parser.add_argument("--out", required=True,
                            help="merged shard directory: new or empty, or one of the inputs (re-running the merge resumes); or an s3:// / gs:// prefix (merged in a staging directory, then uploaded, manifest last)")

    @staticmethod
    def run(args) -> int:
        from .job import merge_staged

        for directory in args.dirs:
            refuse_bad_location("a partition directory", directory, "give its path")
        refuse_bad_location("--out", args.out)

        manifest = merge_staged(args.dirs, args.out)
        where = storage.redact(args.out) if storage.is_url(args.out) else Path(args.out)
        if "_upload" in manifest:
            print(_upload_line(manifest.pop("_upload"), where))
        print(format_summary(manifest, where))
        if manifest["accounting"]["rows_written"] == 0:
            return _nothing_written("merge", manifest, where)
        return 0


QUICKSTART_MAX_ROWS = 1000  # the examples are built in memory, base64 images and all
QUICKSTART_MAX_VIDEOS = 100
QUICKSTART_MARKER = ".vlmpack-quickstart.json"  # what quickstart wrote into its --out, so a re-run knows its own
QUICKSTART_EXAMPLE, QUICKSTART_SHARDS = "example.jsonl", "shards"


def _quickstart_marker(out: Path) -> dict | None:
    """What an earlier quickstart recorded in `out`: None when `out` is empty. UserError when
    `out` holds anything quickstart did not write there (judged by its marker and the
    example's sha256, never by a name alone), so a re-run replaces only its own files."""
    from .job import entries_not_of_a_job

    entries = user_entries(out)
    if not entries:
        return None
    fix = "choose a new or empty --out directory (quickstart writes example.jsonl and shards/ into it)"
    try:
        marker = json.loads((out / QUICKSTART_MARKER).read_text(encoding="utf-8"))
        known = set(marker["example_sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"--out {out} holds files quickstart did not write ({first_few(entries)}): {fix}") from None
    foreign = [e for e in entries if e not in (QUICKSTART_MARKER, QUICKSTART_EXAMPLE, QUICKSTART_SHARDS)]
    if foreign:
        raise ConfigError(f"--out {out} holds files quickstart did not write ({first_few(foreign)}): {fix}")
    example = out / QUICKSTART_EXAMPLE
    if example.exists() and not (example.is_file() and file_sha256(example) in known):
        raise ConfigError(f"--out {out}: {QUICKSTART_EXAMPLE} is not the file quickstart wrote there (it was changed "
                          f"since): {fix}, or move it away")
    shards = out / QUICKSTART_SHARDS
    if shards.exists():
        foreign = entries_not_of_a_job(shards) if shards.is_dir() and not shards.is_symlink() else ["itself"]
        if foreign:
            raise ConfigError(f"--out {out}: {QUICKSTART_SHARDS}/ holds files quickstart did not write "
                              f"({first_few(foreign)}): {fix}")
    return marker


class Quickstart:
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", default="vlmpack-quickstart",
                            help="working directory (default %(default)s): new or empty, or an earlier quickstart's, "
                                 "whose files it replaces; a directory holding anything else is refused")
        parser.add_argument("--rows", type=int, default=64,
                            help=f"example conversations to generate, 1 to {QUICKSTART_MAX_ROWS} (default %(default)s)")
        parser.add_argument("--videos", type=int, default=4,
                            help=f"further conversations around short generated videos, 0 to {QUICKSTART_MAX_VIDEOS} "
                                 "(default %(default)s; needs the video extra, pip install -e '.[video]')")
        parser.add_argument("--profile", default="qwen3-vl", help="built-in profile (default %(default)s)")
        parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                            help="worker processes (default %(default)s)")

    @staticmethod
    def run(args) -> int:
        from shards_schema import open_shards

        from .examples import example_rows, jsonl_bytes, video_example_rows
        from .profiles import builtin_profile

        refuse_bad_location("--out", args.out)
        if not 1 <= args.rows <= QUICKSTART_MAX_ROWS:
            raise ConfigError(f"--rows must be an integer from 1 to {QUICKSTART_MAX_ROWS}, got {args.rows}")
        if not 0 <= args.videos <= QUICKSTART_MAX_VIDEOS:
            raise ConfigError(f"--videos must be an integer from 0 to {QUICKSTART_MAX_VIDEOS}, got {args.videos}")
        if not 1 <= args.workers <= MAX_WORKERS:  # checked as given: fewer than asked may run (two units)
            raise ConfigError(f"--workers must be an integer from 1 to {MAX_WORKERS}, got {args.workers}")
        builtin_profile(args.profile)  # an unknown name stops here, before anything is written
        videos = args.videos
        if videos and not all(importlib.util.find_spec(m) for m in ("av", "torch")):
            print(f"videos:         none generated: the video extra (PyAV, torch) is not installed "
                  f"(pip install -e '.[video]'), so the {videos} video conversations are left out")
            videos = 0
        out = Path(args.out)
        data, shards_dir = out / QUICKSTART_EXAMPLE, out / QUICKSTART_SHARDS
        total = args.rows + videos + 2
        units = 2  # two shards, so the example shows a multi-shard dataset; more workers would idle
        cfg = PreprocessConfig(inputs=[str(data)], out=str(shards_dir), profile=args.profile,
                               workers=min(args.workers, units), rows_per_shard=max(1, -(-total // units)))
        check_config(cfg)
        with exclusive_output_dir(out, "quickstart", check=_quickstart_marker) as out:
            marker = _quickstart_marker(out) or {}
            rows = example_rows(args.rows, seed=0, family=args.profile, include_bad_rows=True)
            rows[args.rows:args.rows] = video_example_rows(videos, seed=0)  # before the 2 broken rows
            example = jsonl_bytes(rows)
            job = {"example_sha256": hashlib.sha256(example).hexdigest(), "profile": args.profile,
                   "rows_per_shard": cfg.rows_per_shard}
            if marker.get("job") != job and shards_dir.exists():
                shutil.rmtree(shards_dir)  # this quickstart's own shards, of other examples or settings
            written = [job["example_sha256"]] + ([file_sha256(data)] if data.exists() else [])
            write_json_atomic(out / QUICKSTART_MARKER, {"job": job, "example_sha256": sorted(set(written))})
            # Unchanged content keeps the file's timestamp, so a re-run resumes instead of seeing a changed input.
            if not (data.is_file() and data.read_bytes() == example):
                with atomic_open(data) as fh:
                    fh.write(example)
            print(f"example dataset: {data} ({args.rows} conversations with base64 images, {videos} with short "
                  "videos, + 2 deliberately broken rows)")
            started = time.perf_counter()
            manifest = run_preprocess(cfg)  # under the lock: no other quickstart replaces these shards meanwhile
        manifest.pop("_run")
        print(format_summary(manifest, shards_dir))
        print(f"time:           {time.perf_counter() - started:.1f} s")
        sample = open_shards(shards_dir)[0]
        print(f"\nsample 0 ({sample['sample_uid']}): input_ids {sample['input_ids'].shape} {sample['input_ids'].dtype}, "
              f"loss_mask {sample['loss_mask'].shape}, position_ids {sample['position_ids'].shape}, "
              f"pixel_patches {sample['pixel_patches'].shape} {sample['pixel_patches'].dtype}, "
              f"image_grid_thw {sample['image_grid_thw'].tolist()}")
        print(f"\nnext:  vlmpack inspect {shards_dir}      # distributions, rejects (--plots DIR for charts)")
        print(f"       vlmpack show {shards_dir} --index 1   # a conversation decoded, targets marked")
        if videos:
            print(f"       vlmpack show {shards_dir} --index {args.rows} --save-images frames/   # a video row; "
                  "its frames as a contact sheet")
        print(f"       vlmpack verify {shards_dir}       # full integrity check")
        print(f"       python -c \"import shards_schema; s = shards_schema.open_shards('{shards_dir}'); print(len(s), s[0].keys())\"")
        return 0
