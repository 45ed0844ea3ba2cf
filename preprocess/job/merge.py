"""`vlmpack merge`: the outputs of a partitioned job (one directory or several, local or on an
object store) joined into one shard directory, which may itself be published to a store."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shards_schema import storage
from shards_schema.atomic import TMP_SUFFIX, write_json_atomic
from shards_schema.manifest import MANIFEST_NAME, PARTS_DIR
from shards_schema.outdir import exclusive_output_dir

from ..errors import ConfigError
from .publish import check_destination, default_stage_dir, empty_stage, publish, read_json_object, remove_stage
from .claim import is_fresh, output_errors, refuse_foreign
from .identity import describe_job_differences, printable_path, same_job
from .records import (JOB_FILE, job_identity_problem, read_json, remove_torn_writes, shard_matches_record, unit_record,
                      unit_record_path, write_final_outputs)
from .signals import stop_if_asked, stop_on_signals


def _refuse_a_partition_named_twice(directories: list[str]) -> None:
    """ConfigError naming both spellings where one partition directory or store prefix is named
    twice, however spelled (`p0`, `./p0/`, a link; `s3a://` for `s3://`): another partition was
    meant, and the units it holds would only show as not done. A copy of a partition is another
    directory and may stand beside it (merge takes the intact one)."""
    named: dict[tuple, str] = {}
    for d in directories:
        if storage.is_url(d):
            key = ("url", storage.object_identity(d.rstrip("/")))
        else:
            try:
                st = os.stat(d)
            except OSError:
                continue  # partitions_identity names a directory that is not there
            key = ("local", st.st_dev, st.st_ino)
        if key in named:
            first = named[key]
            what = "prefix" if storage.is_url(d) else "directory"
            same = "named twice" if d == first else f"the same {what} as {_dir_name(first)}"
            raise ConfigError(f"partition {_dir_name(d)} is {same}: name each partition's --out once, all of them")
        named[key] = d


def partitions_identity(directories: list[str]) -> dict:
    """The job the partition directories (or store prefixes) belong to: ConfigError unless they
    all hold one job's output, each named once."""
    _refuse_a_partition_named_twice(directories)
    identities = []
    for d in directories:
        if storage.is_url(d):
            identity = read_json_object(storage.join(d, f"{PARTS_DIR}/{JOB_FILE}"))
            if identity is None:
                if not storage.list_tree(d):
                    raise ConfigError(f"{storage.redact(d)} holds nothing: name the --out prefixes of the partitions")
                raise ConfigError(f"{storage.redact(d)}: no {PARTS_DIR}/{JOB_FILE}; not the output of `vlmpack preprocess`")
        else:
            job_file = Path(d) / PARTS_DIR / JOB_FILE
            if not Path(d).is_dir():
                raise ConfigError(f"{printable_path(str(d))} does not exist or is not a directory: "
                                  "name the --out directories of the partitions")
            if not job_file.is_file():
                raise ConfigError(f"{printable_path(str(d))}: no {PARTS_DIR}/{JOB_FILE}; not the output of "
                                  "`vlmpack preprocess`")
            identity = read_json(job_file)
        problem = "not JSON" if identity is None else job_identity_problem(identity)
        if problem is not None:
            raise ConfigError(f"{_dir_name(d)}: its {PARTS_DIR}/{JOB_FILE} is damaged ({problem}): re-run that "
                              "partition's `vlmpack preprocess` command into a new --out, then merge again")
        identities.append(identity)
    for d, ident in zip(directories[1:], identities[1:]):
        if not same_job(ident, identities[0]):
            first, other = _dir_name(directories[0]), _dir_name(d)
            raise ConfigError(
                f"{first} and {other} hold the output of different jobs, which merge cannot join: "
                f"{describe_job_differences(identities[0], ident, first, other)}. Merge only the partitions of "
                "one job (`vlmpack preprocess` with the same inputs, profile and settings, only --partition-index "
                f"differing): re-run {other}'s partition with the settings of {first} into a new --out, or keep "
                "both and give both directories to `vlmpack pack` (or `vlmpack train --data`) as sources")
    # a partition recorded before profiles held the chat template's text: another's has it
    return next((ident for ident in identities if "chat_template" in ident.get("profile", {})), identities[0])


def _dir_name(directory: str) -> str:
    return storage.redact(directory) if storage.is_url(directory) else printable_path(str(directory))


def merge_partitions(directories: list[str], out: str, publish_to: str | None = None) -> dict:
    """Join the outputs of a partitioned job (one directory or several) into one shard directory.
    With `publish_to` (a store URL) `out` is a stage: the merged directory is uploaded there
    while still held, then emptied (preprocess/job/publish.py); the manifest then carries what was
    uploaded under "_upload"."""
    dirs = [Path(d) for d in directories]
    identity = partitions_identity(directories)
    rows_per_unit = identity["settings"]["rows_per_shard"]
    total_units = sum(-(-inp["rows"] // rows_per_unit) for inp in identity["inputs"])  # same cut as plan_units
    found: dict[int, list[Path]] = {}  # unit -> the directories holding it, in the order given
    for d in dict.fromkeys(dirs):
        for path in sorted((d / PARTS_DIR).glob("unit-*.json")):
            found.setdefault(int(path.stem.split("-")[1]), []).append(d)
    missing = sorted(set(range(total_units)) - set(found))
    if missing:
        raise ConfigError(
            f"{len(missing)} of {total_units} work units are not done (first: {missing[:5]}); "
            "run the missing partitions (or re-run them to finish) before merging"
        )
    sources = {d.resolve() for d in dirs}

    def needs_claim(out_dir: Path) -> bool:
        """True where `out_dir` is fresh; ConfigError where it holds anything but this merge's work."""
        if out_dir.resolve() in sources or same_job(read_json(out_dir / PARTS_DIR / JOB_FILE), identity):
            return False
        if not is_fresh(out_dir):
            refuse_foreign(out_dir, "merge")
        return True

    with stop_on_signals(), exclusive_output_dir(out, "merge", check=needs_claim) as out_dir, output_errors(out_dir):
        if needs_claim(out_dir):
            (out_dir / PARTS_DIR).mkdir(exist_ok=True)
            write_json_atomic(out_dir / PARTS_DIR / JOB_FILE, identity)
        remove_torn_writes(out_dir)
        records = []
        for index in range(total_units):
            stop_if_asked()
            src, record = _intact_copy(found[index], index)
            if src.resolve() != out_dir.resolve():
                if record["shard"]:
                    _link_or_copy(src / record["shard"]["file"], out_dir / record["shard"]["file"], record)
                write_json_atomic(unit_record_path(out_dir, index), record)
            records.append(record)
        manifest = write_final_outputs(out_dir, identity, records, _patch_row_width(identity))
        if publish_to is not None:
            upload = publish(out_dir, publish_to, MANIFEST_NAME, manifest, stop_if_asked=stop_if_asked)
            empty_stage(out_dir)
            manifest = {**manifest, "_upload": upload}
        return manifest


def _intact_copy(holders: list[Path], index: int) -> tuple[Path, dict]:
    """The first directory whose shard of unit `index` is as its record says, and that record:
    directories that overlap (a copy of a partition, or one re-run elsewhere) hold the same
    unit, so the merge does not depend on their order while one copy is intact."""
    for src in holders:
        record = unit_record(unit_record_path(src, index), index)
        if record is not None and shard_matches_record(src, record):
            return src, record
    where = " and ".join(printable_path(str(src)) for src in holders)
    raise ConfigError(f"{where}: the shard of unit {index} is missing or damaged: re-run that partition's "
                      "`vlmpack preprocess` command (it redoes the unit), then merge again")


def _patch_row_width(identity: dict) -> int:
    vision = identity["profile"]["vision"]
    return vision["channels"] * vision["patch_size"] ** 2


def _link_or_copy(src: Path, dst: Path, record: dict) -> None:
    if dst.exists():
        if shard_matches_record(dst.parent, record):
            return
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        tmp = dst.with_name(dst.name + TMP_SUFFIX)
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


def stage_sources(directories: list[str], progress: bool = True) -> list[str]:
    """Partition directories for `merge`: a store prefix is brought down (all its files, those
    already there at the same size kept) into a staging directory named after the prefix and
    the job its `_parts/job.json` records; paths stay as they are."""
    local = []
    for directory in directories:
        if not storage.is_url(directory):
            local.append(directory)
            continue
        stage = default_stage_dir(directory, partitions_identity([directory]))
        stage.mkdir(parents=True, exist_ok=True)
        storage.download_tree(directory, stage)
        local.append(str(stage))
    return local


def merge_staged(directories: list[str], out: str, progress: bool = True) -> dict:
    """`vlmpack merge DIR... --out OUT`, where a partition directory or OUT may be a store prefix.
    An OUT in the store is checked first (another job's output there is refused; this job's
    dataset there is the result). Partitions in the store are brought down into stages; with
    OUT in the store the merge runs in a staging directory named after OUT and the job and is
    published from there (the manifest then carries what was uploaded under "_upload"). Every
    stage goes once the merge (and its upload) is complete."""
    identity = partitions_identity(directories)
    if storage.is_url(out):
        published = check_destination(out, identity)
        if published is not None:
            return {**published, "_upload": {"uploaded": 0, "kept": "all", "bytes": 0}}
    sources = stage_sources(directories, progress)
    if storage.is_url(out):
        stage = default_stage_dir(out, identity)
        manifest = merge_partitions(sources, str(stage), publish_to=out)
        remove_stage(stage)
    else:
        manifest = merge_partitions(sources, out)
    for source, directory in zip(sources, directories):
        if storage.is_url(directory):
            shutil.rmtree(source, ignore_errors=True)
    return manifest
