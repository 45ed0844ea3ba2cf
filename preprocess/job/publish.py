"""`vlmpack preprocess ... --out s3://bucket/shards`: the job runs in a local staging directory,
then its directory is uploaded to the store, the manifest last.

Partitions (`--num-partitions`) publish their directories the same way without a manifest;
`vlmpack merge` of store prefixes brings each down into its staging directory, merges there and
publishes the merged directory (`preprocess.job.merge.merge_staged`).

The destination is checked before the job's first row (`check_destination`): a prefix holding
another dataset's manifest, another job's work state (`_parts/job.json`) or any object that no
job writes, is refused naming the URL; a prefix already holding this job's finished dataset (or
partition) is the result, nothing is redone.

The staging directory (`--stage-dir`, by default one under the system's temporary directory
named after the destination and the job: its inputs' fingerprints, settings and profile) is an
ordinary output directory: the job writes, commits and resumes there exactly as it does
locally. Publishing puts every file of it into the store (shards, `_parts/` work state,
`rejects.jsonl`) and then `manifest.json` (a partition: its summary in `_parts/`), so the
store holds a manifest only once everything it lists is there. Each upload is one object that
appears whole or not at all, so a publish cut short (a kill, a lost connection) leaves some
objects, never a torn one; the same command again finds the same stage, resumes the job from
it (every unit already committed) and uploads only what the store lacks or holds at another
size (an object written by something else). Once the upload is complete the stage is removed:
a later job to the same prefix, with other inputs or settings, gets a stage of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from shards_schema import storage
from shards_schema.errors import first_few
from shards_schema.json_object import NotAJSONObject, parse_json_object
from shards_schema.manifest import MANIFEST_NAME, PARTS_DIR
from shards_schema.outdir import LOCK_NAME

from ..errors import ConfigError
from .claim import is_job_file
from .records import JOB_FILE


def default_stage_dir(url: str, identity: dict, partition: str | None = None) -> Path:
    """The staging directory of this job's output (or partition's) to `url`: a re-run of the
    same command finds its work there, and a different job to the same destination never does."""
    key = json.dumps([storage.redact(url), identity, partition], sort_keys=True)
    return Path(tempfile.gettempdir()) / f"vlmpack-stage-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def read_json_object(url: str) -> dict | None:
    """The JSON object stored at `url`; None when there is no object there."""
    if storage.remote_size(url) is None:
        return None
    with storage.open_binary(url) as fh:
        try:
            return parse_json_object(fh.read(), storage.redact(url))
        except NotAJSONObject as exc:
            raise ConfigError(f"{exc}: it is no vlmpack file; choose another --out prefix") from None


def _differs_in(before: dict, now: dict) -> str:
    return ", ".join(sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k)))


def check_destination(url: str, identity: dict, partition: str | None = None) -> dict | None:
    """Refuse `url` before any work unless it is new, holds this job's unfinished upload, or
    holds this job's finished output, which is returned: the manifest, or for a partition
    (`partition`: its summary's name in `_parts/`) that summary. None: there is work to do.

    A manifest is this job's when it records the same profile, settings and inputs (input names
    included: they are written into every sample's `source`)."""
    where = storage.redact(url)
    storage.require_prefix(url)
    manifest = read_json_object(storage.join(url, MANIFEST_NAME))
    if manifest is not None:
        if partition is not None:
            raise ConfigError(f"--out {where} holds a finished dataset ({MANIFEST_NAME}): a partition publishes to a "
                              "prefix of its own; choose another prefix")
        published = {"profile": manifest.get("profile"), "settings": manifest.get("settings"),
                     "inputs": (manifest.get("accounting") or {}).get("inputs")}
        wanted = {k: identity[k] for k in ("profile", "settings", "inputs")}
        if published == wanted:
            return manifest
        raise ConfigError(f"--out {where} holds another dataset (its {MANIFEST_NAME} differs in: "
                          f"{_differs_in(published, wanted)}): choose another prefix")
    recorded = read_json_object(storage.join(url, f"{PARTS_DIR}/{JOB_FILE}"))
    if recorded is not None and recorded != identity:
        raise ConfigError(f"--out {where} holds the unfinished output of a different job (its {PARTS_DIR}/{JOB_FILE} "
                          f"differs in: {_differs_in(recorded, identity)}): choose another prefix")
    if recorded is not None and partition is not None:
        return read_json_object(storage.join(url, f"{PARTS_DIR}/{partition}"))
    if recorded is None:  # new, or an upload cut short: nothing but what a job writes may be there
        names = storage.list_names(url)
        foreign = [n for n in names if n != PARTS_DIR and not is_job_file(n)]
        if PARTS_DIR in names:
            foreign += [f"{PARTS_DIR}/{n}" for n in storage.list_names(storage.join(url, PARTS_DIR))
                        if not is_job_file(f"{PARTS_DIR}/{n}")]
        if foreign:
            shown = first_few(foreign)
            raise ConfigError(f"--out {where} holds objects that no vlmpack job writes ({shown}): choose a new or "
                              "empty prefix")
    return None


def publish(stage: Path, url: str, last: str, manifest: dict | None, progress: bool = True,
            stop_if_asked=None) -> dict:
    """Upload the finished directory `stage` to `url`, the file `last` (the manifest, or a
    partition's summary) after everything else; returns what was uploaded and kept. `manifest`
    None: a partition's directory, which has none. `stop_if_asked` runs between objects, so a
    stop signal ends an upload that the same command resumes."""
    from tqdm import tqdm

    existing = read_json_object(storage.join(url, MANIFEST_NAME)) if manifest is not None else None
    if existing is not None:  # published meanwhile (the destination was checked before the job)
        if existing == manifest:
            return {"uploaded": 0, "kept": "all", "bytes": 0}
        raise ConfigError(f"--out {storage.redact(url)} holds another dataset (its {MANIFEST_NAME} differs): "
                          "choose another prefix")
    files = sorted(p for p in stage.rglob("*") if p.is_file() and p.name != LOCK_NAME and not p.name.endswith(".tmp")
                   and p.relative_to(stage).as_posix() != last)
    todo = []
    for path in files:
        remote = storage.join(url, path.relative_to(stage).as_posix())
        if storage.remote_size(remote) != path.stat().st_size:
            todo.append((path, remote))
    todo.append((stage / last, storage.join(url, last)))  # last: its presence means the rest is there
    with tqdm(total=sum(p.stat().st_size for p, _ in todo), unit="B", unit_scale=True, desc="upload",
              disable=not progress) as bar:
        for path, remote in todo:
            if stop_if_asked is not None:
                stop_if_asked()
            storage.upload_file(path, remote)
            bar.update(path.stat().st_size)
    return {"uploaded": len(todo), "kept": len(files) + 1 - len(todo), "bytes": sum(p.stat().st_size for p, _ in todo)}


def empty_stage(stage: Path) -> None:
    """Remove everything the job wrote into `stage` (its upload is complete), keeping the lock
    file of the job that still holds it; `remove_stage` takes the rest once it is released."""
    for entry in os.scandir(stage):
        if entry.name == LOCK_NAME:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def remove_stage(stage: Path) -> None:
    """Remove the emptied, released `stage` (its lock file and itself). A job that took the
    directory in the meantime has written into it: then it is left to that job."""
    try:
        if os.listdir(stage) == [LOCK_NAME]:
            (stage / LOCK_NAME).unlink()
            stage.rmdir()
    except OSError:
        pass
