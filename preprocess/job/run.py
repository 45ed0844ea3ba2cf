"""`run_preprocess`: the job from its config to its manifest (or a partition's summary).

Work is cut into units of `rows_per_shard` consecutive input rows (see inputs.py); the
executor (`--executor`) runs the units still to do, each committing its shard and unit record;
when all units of the job are done, `rejects.jsonl` and finally `manifest.json` are written.
With `--out` on an object store the job runs in a staging directory and is published from it
(preprocess/job/publish.py)."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shards_schema import storage
from shards_schema.atomic import write_json_atomic
from shards_schema.manifest import MANIFEST_NAME, PARTS_DIR
from shards_schema.outdir import exclusive_output_dir

from ..errors import ConfigError
from ..inputs import WorkUnit, check_inputs, plan_units
from ..profiles import OFFICIAL_TEMPLATE_SHA256, Profile, resolve_profile
from ..render import check_template_matches, preserve_thinking_refusal, reasoning_loss_refusal
from .publish import check_destination, default_stage_dir, empty_stage, publish, remove_stage
from .claim import claim_out_dir, identity_to_resume, output_errors
from .config import PreprocessConfig, check_config, profile_args
from .executor import Progress, UnitExecutor
from .identity import JobInput, changed_while_read, describe_job_input, input_changed_error, job_identity
from .local import LocalExecutor
from .records import committed_units, load_unit_records, partition_summary_name, write_final_outputs
from .signals import stop_if_asked, stop_on_signals


@dataclass
class JobContext:
    """What every step of one `run_preprocess` call reads: the config, the profile it resolved,
    the executor running the units, the described inputs and the job's identity."""

    cfg: PreprocessConfig
    profile: Profile
    executor: UnitExecutor
    inputs: list[JobInput]
    identity: dict
    setup_started: float  # perf_counter when the call began: the setup is timed from here

    @property
    def partition(self) -> str | None:
        """The partition's summary name in `_parts/`; None when the job is not partitioned."""
        cfg = self.cfg
        return partition_summary_name(cfg.partition_index, cfg.num_partitions) if cfg.num_partitions > 1 else None

    def all_units(self) -> list[WorkUnit]:
        """The job's work units, over all its partitions."""
        return plan_units([inp.file for inp in self.inputs], self.cfg.rows_per_shard)

    def units(self) -> list[WorkUnit]:
        """The work units this machine runs (all of them unless the job is partitioned)."""
        return [u for u in self.all_units() if u.index % self.cfg.num_partitions == self.cfg.partition_index]


def executor_for(cfg: PreprocessConfig, profile: Profile) -> UnitExecutor:
    """The executor `cfg.executor` names."""
    if cfg.executor == "ray":
        from ..ray_executor import RayExecutor

        return RayExecutor(cfg, profile)
    return LocalExecutor(cfg, profile)


def run_preprocess(cfg: PreprocessConfig) -> dict:
    """Run (or resume) the job; returns the manifest, or a partition summary when partitioned."""
    setup_started = time.perf_counter()
    check_config(cfg)
    check_inputs(cfg.inputs)  # each there, readable, of a kind that cannot block, and named once
    profile = resolve_profile(**profile_args(cfg))
    _ = profile.special  # fail now, not in a worker
    if cfg.sample.preserve_thinking and (refusal := preserve_thinking_refusal(profile.family_rules, profile.template)):
        raise ConfigError(refusal)
    if refusal := reasoning_loss_refusal(profile.family_rules, profile.template, cfg.sample.reasoning_loss):
        raise ConfigError(refusal)
    variables = cfg.sample.template_variables
    if variables and profile.template_sha256 not in OFFICIAL_TEMPLATE_SHA256.values():
        check_template_matches(profile, profile.chat_template, **variables)  # a template's own branches for them
    # held from before the workers start: a stop signal to the process group during the setup
    # reaches them and this process alike, and must end the job as a stop, not kill it outright
    with stop_on_signals(), executor_for(cfg, profile) as executor:
        inputs = [describe_job_input(p, cfg.rows_per_shard, cfg.input_hash, cfg.input_format, cfg.sample.max_row_bytes)
                  for p in cfg.inputs]
        job = JobContext(cfg, profile, executor, inputs, job_identity(cfg, profile, inputs), setup_started)
        if storage.is_url(cfg.out):
            return _run_to_store(job)
        return _run_job(job, Path(cfg.out))


def idle_workers_note(units: int, rows: int, workers: int, rows_per_shard: int) -> str | None:
    """A note when a parallel job has fewer work units than workers: a unit is one shard, so
    the others would wait the whole job. The shard size stays the user's choice (the output
    depends on it, and must not on the worker count), so the note suggests one."""
    if workers <= 1 or units >= workers or rows < workers:
        return None
    suggested = -(-rows // (4 * workers))  # about 4 units per worker, so the last ones end close together
    return (f"vlmpack preprocess: note: {units} work unit{'s' if units > 1 else ''} for {workers} workers, so at most "
            f"{units} run at once (a unit is one shard of --rows-per-shard {rows_per_shard} rows); "
            f"--rows-per-shard {suggested} gives every worker about 4")


def _run_job(job: JobContext, out: Path, publish_to: str | None = None) -> dict:
    """The job in the local directory `out`; with `publish_to` (a store URL) its finished
    directory is uploaded there while `out` is still held, then emptied (the stage)."""
    cfg = job.cfg
    mine = job.units()
    what = "--out" if publish_to is None else "--stage-dir"  # the flag that names `out`, for its refusals
    refuse_other = functools.partial(identity_to_resume, identity=job.identity, inputs=job.inputs,
                                     hash_mode=cfg.input_hash, what=what)
    with stop_on_signals(), exclusive_output_dir(out, "preprocess", what=what, check=refuse_other) as out, \
            output_errors(out):
        identity = claim_out_dir(out, job.identity, job.inputs, cfg.input_hash, what)
        names = {inp.file.path: entry["path"] for inp, entry in zip(job.inputs, identity["inputs"])}
        committed, damaged = committed_units(out, mine, cfg.progress)
        todo = [u for u in mine if u.index not in committed]
        note = idle_workers_note(len(mine), sum(u.num_rows for u in mine), cfg.workers, cfg.rows_per_shard)
        if note and todo and job.executor.parallelism_is_workers:
            print(note, file=sys.stderr)
        started = time.perf_counter()
        progress = Progress(sum(u.num_rows for u in todo), cfg.progress)
        try:
            job.executor.run_units(todo, names, out, progress)
        finally:
            progress.close()
        stop_if_asked()
        for inp in job.inputs:  # the units read it in place: a write meanwhile went into some of them
            if changed_while_read(inp):
                raise input_changed_error(names[inp.file.path], "written to, replaced or removed while its units "
                                          "were read", str(out))
        elapsed = time.perf_counter() - started
        records = load_unit_records(out, (u.index for u in mine))
        run = {
            "units_done_now": len(todo),
            "units_resumed": len(mine) - len(todo),
            "units_redone": damaged,  # committed before, but the shard was missing or damaged
            "setup_seconds": started - job.setup_started,  # profile, input scan, out dir claim
            "seconds": elapsed,  # the units phase (the pool started during the setup)
            "unit_seconds": sum(r["seconds"] for r in records if r["unit"] in {u.index for u in todo}),
        }
        if job.partition is None:
            result = write_final_outputs(out, identity, records, job.profile.vision.patch_row_width)
        else:
            result = {
                "partition": f"{cfg.partition_index}/{cfg.num_partitions}",
                "units": len(mine),
                "job_units": len(job.all_units()),
                "rows_read": sum(r["rows_read"] for r in records),
                "rows_written": sum(r["rows_written"] for r in records),
                "rows_rejected": sum(r["rows_rejected"] for r in records),
                "_run": run,
            }
            write_json_atomic(out / PARTS_DIR / job.partition, result)
        if publish_to is not None:
            last = MANIFEST_NAME if job.partition is None else f"{PARTS_DIR}/{job.partition}"
            run["upload"] = publish(out, publish_to, last, result if "totals" in result else None, cfg.progress,
                                    stop_if_asked=stop_if_asked)
            empty_stage(out)
        result["_run"] = run
    return result


def _run_to_store(job: JobContext) -> dict:
    """`--out URL`: the destination is checked before the first row (another job's output there
    is refused, this job's finished dataset is the result); the job then runs in its staging
    directory, named after the destination and the job, and is published to the store
    (preprocess/job/publish.py). The stage goes once its upload is complete; an upload cut short
    leaves it for the same command to resume from."""
    cfg = job.cfg
    published = check_destination(cfg.out, job.identity, partition=job.partition)
    if published is not None:
        return {**{k: v for k, v in published.items() if k != "_run"},
                "_run": {"units_done_now": 0, "units_resumed": len(job.units()), "units_redone": [],
                         "setup_seconds": time.perf_counter() - job.setup_started, "seconds": 0.0,
                         "unit_seconds": 0.0, "stage": None, "upload": {"uploaded": 0, "kept": "all", "bytes": 0}}}
    stage = Path(cfg.stage_dir) if cfg.stage_dir else default_stage_dir(cfg.out, job.identity, job.partition)
    staged = dataclasses.replace(job, cfg=dataclasses.replace(cfg, out=str(stage)))
    result = _run_job(staged, stage, publish_to=cfg.out)
    remove_stage(stage)
    result["_run"]["stage"] = str(stage)
    return result
