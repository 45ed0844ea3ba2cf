"""The batch preprocessing job: inputs -> shard directory, on many cores and many machines.

Work is cut into units of `rows_per_shard` consecutive input rows (see inputs.py). Each unit
is processed by one worker into one shard file, then a small unit record (stats, rejects,
checksum) is written atomically into `_parts/`. The record is the unit's commit point:

* killed and re-run, the job skips units whose record exists and redoes the rest;
* `--num-partitions K --partition-index i` takes units with index % K == i, so K machines
  share one input; `vlmpack merge` joins their outputs;
* output bytes depend on inputs and settings only, never on the worker count or timing.

When all units of the job are done, `rejects.jsonl` and finally `manifest.json` are written.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from shards_schema.atomic import TMP_SUFFIX, write_json_atomic, write_jsonl_atomic
from shards_schema.manifest import MANIFEST_NAME, PARTS_DIR, REJECTS_NAME, build_manifest
from shards_schema.writer import ShardWriter

from .errors import ConfigError, RejectError
from .inputs import InputFile, WorkUnit, describe_input, plan_units, read_rows
from .pipeline import SampleOptions, process_row
from .profiles import Profile, resolve_profile

JOB_FILE = "job.json"
DEFAULT_ROWS_PER_SHARD = 1024
PROGRESS_EVERY_ROWS = 8


@dataclass
class PreprocessConfig:
    """Everything `vlmpack preprocess` takes (CLI flags map 1:1)."""

    inputs: list[str]
    out: str
    profile: str | None = None
    model: str | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    sample: SampleOptions = field(default_factory=SampleOptions)
    workers: int = 1
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD
    num_partitions: int = 1
    partition_index: int = 0
    progress: bool = True


def shard_name(unit_index: int) -> str:
    return f"shard-{unit_index:06d}.arrow"


def unit_record_path(out: Path, unit_index: int) -> Path:
    return out / PARTS_DIR / f"unit-{unit_index:06d}.json"


# ---------------------------------------------------------------- one unit (runs in a worker)


def process_unit(unit: WorkUnit, rows_per_unit: int, out: Path, profile: Profile, options: SampleOptions, on_rows=None) -> dict:
    """Turn one unit of input rows into one shard plus its unit record; returns the record."""
    unit_started = time.perf_counter()
    writer = ShardWriter(out / shard_name(unit.index), profile.vision.patch_row_width)
    rejects, rows_read, done_since_report, rejected_since_report = [], 0, 0, 0
    try:
        for row_index, row in read_rows(unit, rows_per_unit):
            rows_read += 1
            source = f"{unit.input.path}:{row_index}"
            try:
                if isinstance(row, RejectError):
                    raise row
                writer.add(process_row(row, sample_uid=source, source=source, profile=profile, options=options))
            except RejectError as exc:
                rejects.append(_reject_record(unit, row_index, exc.code, exc.message))
                rejected_since_report += 1
            except Exception as exc:  # a bug or a library failure on odd input: record it, keep going
                rejects.append(_reject_record(unit, row_index, "internal_error", f"{type(exc).__name__}: {exc}"))
                rejected_since_report += 1
            done_since_report += 1
            if on_rows and done_since_report >= PROGRESS_EVERY_ROWS:
                on_rows(done_since_report, rejected_since_report)
                done_since_report = rejected_since_report = 0
    except BaseException:
        writer.abort()
        raise
    if on_rows and done_since_report:
        on_rows(done_since_report, rejected_since_report)
    if rows_read != unit.num_rows:
        raise RuntimeError(f"{unit.input.path}: read {rows_read} rows of unit {unit.index}, expected {unit.num_rows} (input changed?)")
    shard = writer.close().to_json()
    if shard["rows"] == 0:  # every row rejected: keep no empty shard around
        (out / shard["file"]).unlink()
        shard = None
    record = {
        "unit": unit.index,
        "input": unit.input.path,
        "start": unit.start,
        "stop": unit.stop,
        "rows_read": rows_read,
        "rows_written": shard["rows"] if shard else 0,
        "rows_rejected": len(rejects),
        "shard": shard,
        "rejects": rejects,
        "seconds": round(time.perf_counter() - unit_started, 3),  # work state only: never in the manifest
    }
    write_json_atomic(unit_record_path(out, unit.index), record)
    return record


def _reject_record(unit: WorkUnit, row: int, code: str, reason: str) -> dict:
    return {"source": unit.input.path, "row": row, "code": code, "reason": reason}


_WORKER: dict = {}


def _init_worker(profile_args: dict, fingerprint_id: str, options: SampleOptions, out: Path, rows_per_unit: int,
                 rows_done, rows_rejected) -> None:
    """Each worker loads the profile itself from its small spec: shipping the 11 MB tokenizer
    through the spawn pipe would make the parent start workers one after another."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    profile = resolve_profile(**profile_args, check_template=False)  # the parent checked the template
    if profile.fingerprint["id"] != fingerprint_id:
        raise RuntimeError(f"worker loaded profile {profile.fingerprint['id']}, the job runs {fingerprint_id}: files changed?")
    _ = profile.tokenizer  # build it now, while the pool starts, not inside the first unit
    _WORKER.update(profile=profile, options=options, out=out, rows_per_unit=rows_per_unit, done=rows_done, rejected=rows_rejected)


def _worker_on_rows(done: int, rejected: int) -> None:
    with _WORKER["done"].get_lock():
        _WORKER["done"].value += done
    if rejected:
        with _WORKER["rejected"].get_lock():
            _WORKER["rejected"].value += rejected


def _worker_process_unit(unit: WorkUnit) -> dict:
    w = _WORKER
    return process_unit(unit, w["rows_per_unit"], w["out"], w["profile"], w["options"], on_rows=_worker_on_rows)


# ---------------------------------------------------------------- the job


def job_identity(cfg: PreprocessConfig, profile: Profile, inputs: list[InputFile]) -> dict:
    """What must match for outputs to be resumed or merged: never the worker count or partition index.

    Round-tripped through JSON so it compares equal to the copy read back from disk.
    """
    return json.loads(json.dumps({
        "profile": profile.fingerprint,
        "settings": {**dataclasses.asdict(cfg.sample), "rows_per_shard": cfg.rows_per_shard},
        "inputs": [inp.identity() for inp in inputs],
        "num_partitions": cfg.num_partitions,
    }))


def _claim_out_dir(out: Path, identity: dict) -> None:
    parts = out / PARTS_DIR
    parts.mkdir(parents=True, exist_ok=True)
    job_file = parts / JOB_FILE
    if job_file.is_file():
        existing = json.loads(job_file.read_text(encoding="utf-8"))
        if existing != identity:
            changed = sorted(k for k in identity if existing.get(k) != identity[k])
            raise ConfigError(
                f"{out} holds output of a different job (differs in: {', '.join(changed)}); "
                "use a new --out directory, or delete this one to start over"
            )
    else:
        write_json_atomic(job_file, identity)
    for stale in list(out.glob("*" + TMP_SUFFIX)) + list(parts.glob("*" + TMP_SUFFIX)):
        stale.unlink()  # torn writes of a killed run


def _profile_args(cfg: PreprocessConfig) -> dict:
    return {"name": cfg.profile, "model_dir": cfg.model, "min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}


def _run_units(units: list[WorkUnit], cfg: PreprocessConfig, out: Path, profile: Profile) -> None:
    from tqdm import tqdm

    total_rows = sum(u.num_rows for u in units)
    bar = tqdm(total=total_rows, unit="row", desc="preprocess", disable=not cfg.progress, smoothing=0.05)
    rejected = 0

    def show(done: int, rej: int) -> None:
        nonlocal rejected
        rejected += rej
        bar.update(done)
        bar.set_postfix(rejected=rejected, refresh=False)

    try:
        if cfg.workers <= 1 or len(units) <= 1:
            for unit in units:
                process_unit(unit, cfg.rows_per_shard, out, profile, cfg.sample, on_rows=show)
            return
        ctx = mp.get_context("spawn")  # no fork: tokenizers/threads in the parent must not leak into workers
        done_counter, rejected_counter = ctx.Value("q", 0), ctx.Value("q", 0)
        with cf.ProcessPoolExecutor(
            max_workers=min(cfg.workers, len(units)),
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(_profile_args(cfg), profile.fingerprint["id"], cfg.sample, out, cfg.rows_per_shard,
                      done_counter, rejected_counter),
        ) as pool:
            pending = {pool.submit(_worker_process_unit, unit) for unit in units}
            seen_done = seen_rejected = 0
            while pending:
                finished, pending = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    fut.result()  # re-raise a worker's failure here
                done, rej = done_counter.value, rejected_counter.value
                show(done - seen_done, rej - seen_rejected)
                seen_done, seen_rejected = done, rej
    finally:
        bar.close()


def load_unit_records(out: Path, unit_indices) -> list[dict]:
    return [json.loads(unit_record_path(out, i).read_text(encoding="utf-8")) for i in unit_indices]


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


def run_preprocess(cfg: PreprocessConfig) -> dict:
    """Run (or resume) the job; returns the manifest, or a partition summary when partitioned."""
    setup_started = time.perf_counter()
    if cfg.num_partitions < 1 or not 0 <= cfg.partition_index < cfg.num_partitions:
        raise ConfigError(f"--partition-index must be in [0, {cfg.num_partitions}), got {cfg.partition_index}")
    if cfg.rows_per_shard < 1:
        raise ConfigError("--rows-per-shard must be at least 1")
    if cfg.sample.media_root is not None and not Path(cfg.sample.media_root).is_dir():
        raise ConfigError(f"--media-root {cfg.sample.media_root} is not a directory")
    profile = resolve_profile(**_profile_args(cfg))
    _ = profile.special  # fail now, not in a worker
    if not cfg.inputs:
        raise ConfigError("no inputs given")
    inputs = [describe_input(p, cfg.rows_per_shard) for p in cfg.inputs]
    units = plan_units(inputs, cfg.rows_per_shard)
    mine = [u for u in units if u.index % cfg.num_partitions == cfg.partition_index]
    out = Path(cfg.out)
    identity = job_identity(cfg, profile, inputs)
    _claim_out_dir(out, identity)

    todo = [u for u in mine if not unit_record_path(out, u.index).is_file()]
    started = time.perf_counter()
    _run_units(todo, cfg, out, profile)
    elapsed = time.perf_counter() - started
    records = load_unit_records(out, (u.index for u in mine))
    run = {
        "units_done_now": len(todo),
        "units_resumed": len(mine) - len(todo),
        "setup_seconds": started - setup_started,  # profile, input scan, out dir claim
        "seconds": elapsed,  # the units phase (pool start included)
        "unit_seconds": sum(r["seconds"] for r in records if r["unit"] in {u.index for u in todo}),
    }
    if cfg.num_partitions == 1:
        manifest = write_final_outputs(out, identity, records, profile.vision.patch_row_width)
        manifest["_run"] = run
        return manifest
    summary = {
        "partition": f"{cfg.partition_index}/{cfg.num_partitions}",
        "units": len(mine),
        "rows_read": sum(r["rows_read"] for r in records),
        "rows_rejected": sum(r["rows_rejected"] for r in records),
        "_run": run,
    }
    write_json_atomic(out / PARTS_DIR / f"partition-{cfg.partition_index}-of-{cfg.num_partitions}.json", summary)
    return summary


def merge_partitions(directories: list[str], out: str) -> dict:
    """Join the outputs of a partitioned job (one directory or several) into one shard directory."""
    dirs = [Path(d) for d in directories]
    identities = []
    for d in dirs:
        job_file = d / PARTS_DIR / JOB_FILE
        if not job_file.is_file():
            raise ConfigError(f"{d}: no {PARTS_DIR}/{JOB_FILE}; not the output of `vlmpack preprocess`")
        identities.append(json.loads(job_file.read_text(encoding="utf-8")))
    if any(ident != identities[0] for ident in identities):
        raise ConfigError("the directories hold different jobs (inputs, settings or profile differ); cannot merge")
    identity = identities[0]
    rows_per_unit = identity["settings"]["rows_per_shard"]
    total_units = sum(-(-inp["rows"] // rows_per_unit) for inp in identity["inputs"])  # same cut as plan_units
    found: dict[int, Path] = {}
    for d in dirs:
        for path in sorted((d / PARTS_DIR).glob("unit-*.json")):
            found.setdefault(int(path.stem.split("-")[1]), d)
    missing = sorted(set(range(total_units)) - set(found))
    if missing:
        raise ConfigError(
            f"{len(missing)} of {total_units} work units are not done (first: {missing[:5]}); "
            "run the missing partitions (or re-run them to finish) before merging"
        )
    out_dir = Path(out)
    (out_dir / PARTS_DIR).mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / PARTS_DIR / JOB_FILE, identity)
    records = []
    for index in range(total_units):
        src = found[index]
        record = json.loads(unit_record_path(src, index).read_text(encoding="utf-8"))
        if src.resolve() != out_dir.resolve():
            if record["shard"]:
                _link_or_copy(src / record["shard"]["file"], out_dir / record["shard"]["file"])
            write_json_atomic(unit_record_path(out_dir, index), record)
        records.append(record)
    patch_row_width = _patch_row_width(identity)
    return write_final_outputs(out_dir, identity, records, patch_row_width)


def _patch_row_width(identity: dict) -> int:
    vision = identity["profile"]["vision"]
    return vision["channels"] * vision["patch_size"] ** 2


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        return
    try:
        os.link(src, dst)
    except OSError:
        tmp = dst.with_name(dst.name + TMP_SUFFIX)
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
