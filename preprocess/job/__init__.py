"""The batch preprocessing job: inputs -> shard directory, on many cores and many machines.

Work is cut into units of `rows_per_shard` consecutive input rows (see inputs.py). Each unit
is processed by one worker into one shard file, then a small unit record (stats, rejects,
checksum) is written atomically into `_parts/`. The record is the unit's commit point:

* killed and re-run, the job skips units whose record exists and whose shard still matches
  it (present, same size, same sha256), and redoes the rest;
* `--num-partitions K --partition-index i` takes units with index % K == i, so K machines
  share one input; `vlmpack merge` joins their outputs;
* output bytes depend on inputs and settings only, never on the worker count or timing.

When all units of the job are done, `rejects.jsonl` and finally `manifest.json` are written.

The output directory belongs to one job at a time (`shards_schema.outdir`): a second job on
the same directory stops at once, and a directory that holds anything but this job's own
resumable state is refused, so a finished dataset is never overwritten. A resumed job checks
its inputs against the fingerprints recorded when it started (size, modification time and a
hash of sampled blocks, or of the whole content with `--input-hash full`): a changed input is
refused instead of mixing old and new rows.

Workers die with the job: killed (even with SIGKILL), the parent takes its workers with it;
SIGTERM, SIGINT or SIGHUP end the workers and stop the job with committed units kept, exit
128 + the signal, also when the signal reached the workers first (a scheduler signals the
whole process group). A worker lost on its own is named by what ended it: a stop signal sent
to it, or SIGKILL (the out-of-memory killer) or a crash.

One module per concern:
  config    PreprocessConfig and the checks made before any work
  identity  inputs' names and fingerprints, the job's identity
  records   the output directory's files: shards, unit records, rejects and manifest
  claim     the output directory claimed, resumed or refused
  units     one unit of rows -> one shard and its record
  signals   stop signals, lost workers
  executor  the interface the executors share (local: local.py; Ray: preprocess/ray_executor.py)
  local     this machine's worker processes
  run       run_preprocess, with the job's context (JobContext) passed between its steps
  merge     joining a partitioned job's outputs (`vlmpack merge`)
  publish   a finished directory uploaded to an object store (`--out s3://...`)
"""

from .claim import entries_not_of_a_job
from .config import (DEFAULT_ROWS_PER_SHARD, EXECUTORS, INPUT_HASH_MODES, MAX_RAY_RETRIES, MAX_WORKERS, PreprocessConfig,
                     check_config, profile_args)
from .executor import Progress, UnitExecutor
from .identity import JobInput, describe_job_input, input_fingerprint, input_name, job_identity, printable, printable_path
from .local import LocalExecutor
from .merge import merge_partitions, merge_staged, partitions_identity
from .records import (INPUTS_SEEN_FILE, JOB_FILE, load_unit_records, partition_summary_name, shard_matches_record,
                      shard_name, unit_record_path, write_final_outputs)
from .run import JobContext, executor_for, idle_workers_note, run_preprocess
from .signals import STOP_SIGNALS, Interrupted, WorkerLost, worker_death_signal
from .units import process_unit

__all__ = [
    "DEFAULT_ROWS_PER_SHARD", "EXECUTORS", "INPUTS_SEEN_FILE", "INPUT_HASH_MODES", "JOB_FILE", "MAX_RAY_RETRIES",
    "MAX_WORKERS", "STOP_SIGNALS", "Interrupted", "JobContext", "JobInput", "LocalExecutor", "PreprocessConfig",
    "Progress", "UnitExecutor", "WorkerLost", "check_config", "describe_job_input", "entries_not_of_a_job",
    "executor_for", "idle_workers_note", "input_fingerprint", "input_name", "job_identity", "load_unit_records",
    "merge_partitions", "merge_staged", "partition_summary_name", "partitions_identity", "printable", "printable_path",
    "process_unit", "profile_args", "run_preprocess", "shard_matches_record", "shard_name", "unit_record_path",
    "worker_death_signal", "write_final_outputs",
]
