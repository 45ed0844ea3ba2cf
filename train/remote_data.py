"""Training sources on object stores: `--data s3://...` is fetched into a local cache first.

The trainer memory-maps its shards, so a shard directory on s3:// / gs:// / hf:// is copied
to local disk with `vlmpack fetch`'s checks (every shard's size and sha256 against the
manifest, the manifest written last) before any rank reads it. One process per node fetches
(LOCAL_RANK 0); on a cache that several nodes share, a blocking lock per source lets the
first fetch and the others find it up to date. A cache that already holds the source is
re-checked (each shard's size and sha256), not downloaded again; a shard that fails the
check is fetched again. A failed fetch stops every rank with that fetch's message: no rank
waits for data that will not come.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import torch.distributed as dist

from shards_schema.errors import UserError
from shards_schema.fetch import describe, fetch
from shards_schema.storage import is_url, redact
from train.pack_plan import parse_source

SOURCE_KEYS = ("data", "eval_data")


def cache_path(url: str, cache: Path) -> Path:
    """Where `url`'s copy lives under `cache`: scheme/bucket/prefix, one directory per source."""
    parts = urlsplit(redact(url))
    names = [parts.scheme, parts.netloc, *(p for p in parts.path.split("/") if p)]
    safe = [re.sub(r"[^A-Za-z0-9._=-]", "_", n) for n in names]
    if any(n in (".", "..") for n in safe) or len(safe) < 2:
        raise UserError(f"--data {redact(url)}: not a shard directory URL (write s3://BUCKET/PREFIX)")
    return cache.joinpath(*safe)


@contextmanager
def _held(directory: Path):
    """A blocking lock beside `directory`, so nodes sharing a cache fetch each source once."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory.parent / f".{directory.name}.fetch-lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _fetch_all(urls: list[str], local: dict[str, Path], announce: bool) -> None:
    for url in urls:
        try:
            with _held(local[url]):
                done = fetch(url, local[url], progress=announce)
        except OSError as exc:  # not the store's refusal (that is a StorageError): the link or the local disk
            raise UserError(f"--data {redact(url)} -> {local[url]}: {exc.strerror or exc}: check the connection, "
                            "and that --data-cache is a writable local directory with room for the shards") from None
        if announce:
            print(f"--data {redact(url)}: {describe(done)} -> {local[url]}", flush=True)


def localize_sources(config, out: Path, info):
    """The data section `config` (`train.config.DataConfig`) with every object-store source of
    --data / --eval-data replaced by its checked local copy (weights kept), fetched into
    --data-cache (default: the run directory `out`'s data_cache/); `config` itself where every
    source is local."""
    specs = {key: [parse_source(s) for s in getattr(config, key)] for key in SOURCE_KEYS}
    urls = sorted({d for sources in specs.values() for d, _ in sources if is_url(d)})
    if not urls:
        return config
    cache = Path(config.data_cache) if config.data_cache else Path(out) / "data_cache"
    error = None
    try:
        local = {url: cache_path(url, cache) for url in urls}
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            _fetch_all(urls, local, announce=info.rank == 0)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before anyone raises
        error = exc
    errors = [None] * dist.get_world_size() if dist.is_initialized() else [None]
    if dist.is_initialized():
        dist.all_gather_object(errors, None if error is None else str(error))
    if error is not None:
        raise error
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        raise UserError(f"another process of this job could not fetch the training data: {failed}")

    def spec(directory: str, weight: float | None) -> str:
        directory = str(local.get(directory, directory))
        return directory if weight is None else f"{directory}:{weight}"

    return dataclasses.replace(config, **{key: [spec(*s) for s in specs[key]] for key in SOURCE_KEYS})
