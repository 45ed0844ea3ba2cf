"""`vlmpack preprocess ... --out s3://bucket/shards`: the job runs in a local staging directory,
then its directory is uploaded to the store, the manifest last.

Partitions (`--num-partitions`) publish their directories the same way without a manifest;
`vlmpack merge` of store prefixes brings each down into its staging directory, merges there and
publishes the merged directory (`stage_sources`).

The staging directory (`--stage-dir`, by default one per output URL under the system's
temporary directory) is an ordinary output directory: the job writes, commits and resumes
there exactly as it does locally. Publishing puts every file of it into the store (shards,
`_parts/` work state, `rejects.jsonl`) and then `manifest.json`: the store holds a manifest
only once everything it lists is there. Each upload is one object that appears whole or not at
all, so a publish cut short (a kill, a lost connection) leaves some objects, never a torn one;
the same command again resumes the job from its stage (every unit already committed) and
uploads only what the store lacks or holds at another size (an object written by something
else). A store prefix that already holds another dataset's manifest is refused before the job
starts.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from shards_schema import storage
from shards_schema.manifest import MANIFEST_NAME

from .errors import ConfigError


def default_stage_dir(url: str) -> Path:
    """One staging directory per output URL, so a re-run of the same command finds its work."""
    digest = hashlib.sha256(storage.redact(url).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"vlmpack-stage-{digest}"


def check_destination(url: str) -> dict | None:
    """The manifest already published at `url` (None when there is none yet)."""
    manifest_url = storage.join(url, MANIFEST_NAME)
    if storage.remote_size(manifest_url) is None:
        return None
    with storage.open_binary(manifest_url) as fh:
        return json.loads(fh.read().decode("utf-8"))


def publish(stage: Path, url: str, manifest: dict | None, progress: bool = True) -> dict:
    """Upload the finished directory `stage` to `url`; returns what was uploaded and kept.
    `manifest` None: a partition's directory, which has none (its files only)."""
    from tqdm import tqdm

    existing = check_destination(url) if manifest is not None else None
    if existing is not None:
        if existing == manifest:
            return {"uploaded": 0, "kept": "all", "bytes": 0}
        raise ConfigError(f"--out {storage.redact(url)} holds another dataset (its {MANIFEST_NAME} differs): "
                          "choose another prefix")
    files = sorted(p for p in stage.rglob("*") if p.is_file() and p.name != ".vlmpack.lock"
                   and p.name != MANIFEST_NAME and not p.name.endswith(".tmp"))
    todo = []
    for path in files:
        remote = storage.join(url, path.relative_to(stage).as_posix())
        if storage.remote_size(remote) != path.stat().st_size:
            todo.append((path, remote))
    with tqdm(total=sum(p.stat().st_size for p, _ in todo), unit="B", unit_scale=True, desc="upload",
              disable=not progress) as bar:
        for path, remote in todo:
            storage.upload_file(path, remote)
            bar.update(path.stat().st_size)
    if manifest is not None:
        storage.upload_file(stage / MANIFEST_NAME, storage.join(url, MANIFEST_NAME))  # last
    return {"uploaded": len(todo) + (manifest is not None), "kept": len(files) - len(todo),
            "bytes": sum(p.stat().st_size for p, _ in todo)}


def stage_sources(directories: list[str], progress: bool = True) -> list[str]:
    """Partition directories for `merge`: a store prefix is brought down (all its files, those
    already there at the same size kept) into its own staging directory; paths stay as they are."""
    local = []
    for directory in directories:
        if not storage.is_url(directory):
            local.append(directory)
            continue
        stage = default_stage_dir(directory)
        stage.mkdir(parents=True, exist_ok=True)
        if not storage.list_tree(directory):
            raise ConfigError(f"{storage.redact(directory)} holds nothing: name the --out prefixes of the partitions")
        storage.download_tree(directory, stage)
        local.append(str(stage))
    return local
