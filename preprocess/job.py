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
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from shards_schema import storage
from shards_schema.atomic import TMP_SUFFIX, write_json_atomic, write_jsonl_atomic
from shards_schema.errors import EXIT_FAULT, UserError, signal_exit_code, user_error_from_os_error
from shards_schema.manifest import MANIFEST_NAME, PARTS_DIR, REJECTS_NAME, build_manifest
from shards_schema.outdir import exclusive_output_dir, user_entries
from shards_schema.storage import MAX_FETCH_RETRIES
from shards_schema.writer import ShardWriter, file_sha256

from .errors import ConfigError, RejectError, check_reject_code
from .formats import INPUT_FORMATS, to_openai_row
from .inputs import (InputFile, WorkUnit, check_inputs, describe_input, hub_dataset_files, is_hub_dataset, plan_units,
                     read_rows)
from .media import MAX_OPTION_INTEGER
from .pipeline import SampleOptions, process_row
from .profiles import Profile, resolve_profile

JOB_FILE = "job.json"
INPUTS_SEEN_FILE = "inputs_seen.json"  # where each input was found and its mtime: resume checks only
DEFAULT_ROWS_PER_SHARD = 1024
EARLY_ROW_BYTES = 16 * 1024  # a generous row (an inline image); rows naming image files are far smaller
PROGRESS_EVERY_ROWS = 8
INPUT_HASH_MODES = ("sampled", "full")
EXECUTORS = ("local", "ray")
SAMPLE_BLOCK_BYTES = 64 << 10
SAMPLE_BLOCKS = 16  # files up to SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES (1 MiB) are hashed whole
MAX_WORKERS = 4096  # processes on one machine; a larger number is a typo (and overflows the pool's C ints)
MAX_RAY_RETRIES = 1000
PARENT_WATCH_SECONDS = 0.5
WORKER_EXIT_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
    input_hash: str = "sampled"
    input_format: str = "auto"  # the rows' layout (preprocess.formats): detected per input, or named
    executor: str = "local"  # "local": worker processes on this machine; "ray": Ray tasks (preprocess/ray_executor.py)
    ray_address: str | None = None  # a running Ray cluster to join (None: RAY_ADDRESS, else a local instance)
    ray_max_retries: int = 3  # times Ray re-runs a unit whose worker died
    stage_dir: str | None = None  # with --out on an object store: where the job runs before the upload
    progress: bool = True

    @property
    def ray_cluster_address(self) -> str | None:
        """The Ray cluster `--executor ray` joins; None: it starts a local instance of `workers` CPUs."""
        return self.ray_address or os.environ.get("RAY_ADDRESS")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # a request to stop, not a crash


class Interrupted(UserError):
    """The job was stopped by SIGTERM, SIGINT or SIGHUP; exit status 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}; finished shards are kept: "
                         "re-run the same command to resume")
        self.exit_code = signal_exit_code(signum)


class WorkerLost(UserError):
    """A worker process ended without a result. Stopped by a stop signal sent to it alone: exit
    128 + the signal, like the job's own stop; killed otherwise (SIGKILL: the out-of-memory
    killer, or by hand; a crash): exit 1."""

    exit_code = EXIT_FAULT

    def __init__(self, signum: int | None):
        kept = "finished shards are kept: re-run the same command to resume"
        if signum in STOP_SIGNALS:
            name = signal.Signals(signum).name
            super().__init__(f"a worker process was stopped by {name} (sent to the worker, not to the job); {kept}")
            self.exit_code = signal_exit_code(signum)
        elif signum == signal.SIGKILL:
            super().__init__(f"a worker process ended unexpectedly: killed by SIGKILL (by the system when memory ran "
                             f"out, or by hand); {kept}, with fewer --workers if memory is short")
        elif signum is not None:
            super().__init__(f"a worker process ended unexpectedly: killed by {signal.Signals(signum).name}; {kept}")
        else:
            super().__init__(f"a worker process ended unexpectedly (killed by the system, e.g. out of memory?); {kept}, "
                             "with fewer --workers if memory is short")


def worker_death_signal(exit_codes: list[int | None]) -> int | None:
    """The signal that broke the pool, from its workers' exit codes (-N: killed by signal N).

    When one worker dies the pool ends the others with SIGTERM, so a SIGTERM among other
    deaths is the pool's own doing: any other signal is the cause; SIGTERM only when every
    worker that died got SIGTERM. None when no worker died of a signal."""
    signals = {-code for code in exit_codes if code is not None and code < 0}
    others = signals - {signal.SIGTERM}
    if others:
        return signal.SIGKILL if signal.SIGKILL in others else min(others)
    return signal.SIGTERM if signals else None


def shard_name(unit_index: int) -> str:
    return f"shard-{unit_index:06d}.arrow"


def unit_record_path(out: Path, unit_index: int) -> Path:
    return out / PARTS_DIR / f"unit-{unit_index:06d}.json"


def printable(text: str) -> str:
    """`text` with what UTF-8 cannot hold (lone surrogates from JSON escapes or from undecodable
    file names) written as backslash escapes: every string the job writes goes through here."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def printable_path(path: str) -> str:
    """A file name as text: bytes the file system name holds that are not UTF-8 become \\xNN."""
    try:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no file-name byte decodes to
        return printable(path)


# ---------------------------------------------------------------- one unit (runs in a worker)


def process_unit(unit: WorkUnit, name: str, rows_per_unit: int, out: Path, profile: Profile, options: SampleOptions,
                 on_rows=None) -> dict:
    """Turn one unit of input rows into one shard plus its unit record; returns the record.

    `name` is how the unit's input is recorded in sources and rejects (see `input_name`).
    """
    unit_started = time.perf_counter()
    writer = ShardWriter(out / shard_name(unit.index), profile.vision.patch_row_width)
    rejects, rows_read, done_since_report, rejected_since_report = [], 0, 0, 0
    try:
        for row_index, row in read_rows(unit, rows_per_unit, options.max_row_bytes):
            _stop_if_asked()
            rows_read += 1
            source = f"{name}:{row_index}"
            reject = None
            try:
                if isinstance(row, RejectError):
                    raise row
                sample = process_row(to_openai_row(row, unit.input.row_format), sample_uid=source, source=source,
                                     profile=profile, options=options)
                # Arrow encodes strings only when a whole batch is written, too late to blame one row.
                sample.sample_uid.encode("utf-8")
                sample.source.encode("utf-8")
            except RejectError as exc:
                reject = (exc.code, exc.message)
            except Exception as exc:  # a bug or a library failure on odd input: record it, keep going
                reject = ("internal_error", _describe(exc))
            else:
                try:  # an OSError here (disk full) is the output's, not the row's: it stops the unit
                    writer.add(sample)
                except ValueError as exc:  # a sample the shard cannot hold, refused before it is queued
                    reject = ("internal_error", _describe(exc))
            if reject:
                rejects.append(_reject_record(name, row_index, *reject))
                rejected_since_report += 1
            done_since_report += 1
            if on_rows and done_since_report >= PROGRESS_EVERY_ROWS:
                on_rows(done_since_report, rejected_since_report)
                done_since_report = rejected_since_report = 0
        if rows_read != unit.num_rows:
            raise RuntimeError(f"{name}: read {rows_read} rows of unit {unit.index}, expected {unit.num_rows} (input changed?)")
        shard = writer.close().to_json()
    except BaseException:
        with contextlib.suppress(Exception):  # after a failed close the file is closed already: report the first error
            writer.abort()
        raise
    if on_rows and done_since_report:
        on_rows(done_since_report, rejected_since_report)
    if shard["rows"] == 0:  # every row rejected: keep no empty shard around
        (out / shard["file"]).unlink()
        shard = None
    record = {
        "unit": unit.index,
        "input": name,
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


def _describe(exc: Exception) -> str:
    try:
        message = str(exc)
    except Exception:  # an exception whose own message fails must not stop the job either
        message = "(its message could not be read)"
    return f"{type(exc).__name__}: {message}"


def _reject_record(name: str, row: int, code: str, reason: str) -> dict:
    return {"source": name, "row": row, "code": check_reject_code(code), "reason": printable(reason)}


_WORKER: dict = {}


def _die_with_parent(parent_pid: int) -> None:
    """A worker must not outlive the job, however the job ends (kill -9 included).

    Linux kills the worker when its parent dies (PR_SET_PDEATHSIG); a watchdog thread that
    notices the parent is gone covers other systems and the moment before prctl took effect.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_WATCH_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _init_worker(parent_pid: int, profile_args: dict, fingerprint_id: str, options: SampleOptions,
                 rows_per_unit: int, rows_done, rows_rejected) -> None:
    """Each worker loads the profile itself from its small spec: shipping the 11 MB tokenizer
    through the spawn pipe would make the parent start workers one after another."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent ends the workers
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    profile = resolve_profile(**profile_args, check_template=False)  # the parent checked the template
    if profile.fingerprint["id"] != fingerprint_id:
        raise RuntimeError(f"worker loaded profile {profile.fingerprint['id']}, the job runs {fingerprint_id}: files changed?")
    _ = profile.tokenizer  # build it now, while the pool starts, not inside the first unit
    _WORKER.update(profile=profile, options=options, rows_per_unit=rows_per_unit, done=rows_done, rejected=rows_rejected)


def _worker_on_rows(done: int, rejected: int) -> None:
    with _WORKER["done"].get_lock():
        _WORKER["done"].value += done
    if rejected:
        with _WORKER["rejected"].get_lock():
            _WORKER["rejected"].value += rejected


def _worker_process_unit(unit: WorkUnit, name: str, out: Path) -> dict:
    w = _WORKER
    return process_unit(unit, name, w["rows_per_unit"], out, w["profile"], w["options"], on_rows=_worker_on_rows)


# ---------------------------------------------------------------- inputs: names and fingerprints


def input_name(given: str) -> str:
    """How an input is recorded in sources, rejects and the manifest.

    The same file spelled differently (`rows.jsonl`, `./rows.jsonl`, its absolute path) gets
    one name: relative to the working directory when the file lies under it, otherwise the
    spelling given, normalized. Undecodable file-name bytes are written as \\xNN.
    """
    absolute = os.path.abspath(given)
    relative = os.path.relpath(absolute)
    if relative != os.pardir and not relative.startswith(os.pardir + os.sep):
        name = relative
    else:
        name = absolute if os.path.isabs(given) else os.path.normpath(given)
    return printable_path(name)


def _input_files(spec: str) -> list[str]:
    """The files an input consists of (a `datasets` directory: its data and metadata files; a
    Hub dataset: its prepared Arrow files in the `datasets` cache; a URL: itself)."""
    if is_hub_dataset(spec):
        return [str(p) for p in hub_dataset_files(spec)]
    if not storage.is_url(spec) and Path(spec).is_dir():
        return sorted(str(p) for p in Path(spec).iterdir() if p.is_file())
    return [spec]


def _stat(spec: str) -> dict:
    """{"size", "mtime_ns"} of a local file or a URL."""
    if storage.is_url(spec):
        return storage.info(spec)
    st = os.stat(spec)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _hash_file(spec: str, size: int, mode: str, digest) -> None:
    name = spec.rsplit("/", 1)[-1] if storage.is_url(spec) else os.path.basename(spec)
    digest.update(os.fsencode(name) + b"\0" + str(size).encode() + b"\0")
    with storage.open_binary(spec) as fh:
        if mode == "full" or size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
            return
        for k in range(SAMPLE_BLOCKS):  # first and last block included, the rest evenly between
            fh.seek((size - SAMPLE_BLOCK_BYTES) * k // (SAMPLE_BLOCKS - 1))
            digest.update(fh.read(SAMPLE_BLOCK_BYTES))


def input_fingerprint(path: str, mode: str) -> tuple[dict, int]:
    """(content fingerprint, newest modification time in ns) of one input.

    The fingerprint depends on content only (it is part of the job identity, which partitions
    on other machines must share); the modification time is checked on resume in "sampled"
    mode, where an edit between sampled blocks would otherwise go unseen.
    """
    digest = hashlib.sha256()
    stats = [(file, _stat(file)) for file in _input_files(path)]
    for file, stat in stats:
        _hash_file(file, stat["size"], mode, digest)
    mtime_ns = max((stat["mtime_ns"] for _, stat in stats), default=0)
    return {"mode": mode, "sha256": digest.hexdigest()}, mtime_ns


@dataclass(frozen=True)
class JobInput:
    file: InputFile  # what workers read (`file.path` is the spelling given)
    name: str
    location: str  # the resolved path: the same file however spelled
    fingerprint: dict
    mtime_ns: int

    def identity(self) -> dict:
        return {**self.file.identity(), "path": self.name, "fingerprint": self.fingerprint}

    def seen(self) -> dict:
        return {"name": self.name, "location": self.location, "mtime_ns": self.mtime_ns}


def describe_job_input(given: str, rows_per_unit: int, hash_mode: str, input_format: str = "auto",
                       max_row_bytes: int = SampleOptions.max_row_bytes) -> JobInput:
    file = describe_input(given, rows_per_unit, input_format, max_row_bytes)
    fingerprint, mtime_ns = input_fingerprint(given, hash_mode)
    if is_hub_dataset(given) or storage.is_url(given):  # a name, not a path; recorded without credentials
        return JobInput(file, storage.redact(given), storage.redact(given), fingerprint, mtime_ns)
    return JobInput(file, input_name(given), printable_path(os.path.realpath(given)), fingerprint, mtime_ns)


# ---------------------------------------------------------------- the job


def job_identity(cfg: PreprocessConfig, profile: Profile, inputs: list[JobInput]) -> dict:
    """What must match for outputs to be resumed or merged: never the worker count or partition index.

    Round-tripped through JSON so it compares equal to the copy read back from disk; paths in
    it (a --model or --media-root directory) are recorded in their printable form.
    """
    return _printable_strings(json.loads(json.dumps({
        "profile": profile.fingerprint,
        "settings": {**_sample_settings(cfg.sample), "rows_per_shard": cfg.rows_per_shard},
        "inputs": [inp.identity() for inp in inputs],
        "num_partitions": cfg.num_partitions,
    })))


def _sample_settings(options: SampleOptions) -> dict:
    """The sample options that decide output bytes: all but how patiently remote media are fetched."""
    settings = dataclasses.asdict(options)
    del settings["remote_fetch"]
    return settings


def _printable_strings(obj):
    if isinstance(obj, str):
        return printable_path(obj)
    if isinstance(obj, dict):
        return {printable_path(k): _printable_strings(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_printable_strings(v) for v in obj]
    return obj


def _read_json(path: Path):
    """A JSON file's content, or None when it is absent or damaged."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None


def _is_fresh(out: Path) -> bool:
    """Empty, or holding only the start of a claim that a killed job left (no job file yet)."""
    entries = user_entries(out)
    if not entries:
        return True
    claim_files = {JOB_FILE + TMP_SUFFIX, INPUTS_SEEN_FILE, INPUTS_SEEN_FILE + TMP_SUFFIX}
    parts = out / PARTS_DIR
    return entries == [PARTS_DIR] and parts.is_dir() and set(os.listdir(parts)) <= claim_files


_JOB_FILES = re.compile(rf"(shard-\d+\.arrow|{re.escape(MANIFEST_NAME)}|{re.escape(REJECTS_NAME)})({re.escape(TMP_SUFFIX)})?")
_PARTS_FILES = re.compile(rf"({re.escape(JOB_FILE)}|{re.escape(INPUTS_SEEN_FILE)}|unit-\d+\.json|partition-\d+-of-\d+\.json)"
                          rf"({re.escape(TMP_SUFFIX)})?")


def entries_not_of_a_job(out: Path) -> list[str]:
    """What `out` holds that no preprocess or merge job writes (its lock aside): before such a
    directory is removed as a job's own output, nothing else may be in it."""
    foreign = []
    for name in user_entries(out):
        path = out / name
        if name == PARTS_DIR and path.is_dir() and not path.is_symlink():
            foreign += [f"{PARTS_DIR}/{n}" for n in sorted(os.listdir(path))
                        if not (_PARTS_FILES.fullmatch(n) and (path / n).is_file() and not (path / n).is_symlink())]
        elif not (_JOB_FILES.fullmatch(name) and path.is_file() and not path.is_symlink()):
            foreign.append(name)
    return foreign


def _refuse_foreign(out: Path, command: str) -> None:
    entries = user_entries(out)
    shown = ", ".join(printable_path(e) for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
    raise ConfigError(f"--out {printable_path(str(out))} is not empty and holds no resumable job of `vlmpack {command}` "
                      f"(it has {shown}): choose a new or empty --out directory")


def _remove_torn_writes(out: Path) -> None:
    for stale in list(out.glob("*" + TMP_SUFFIX)) + list((out / PARTS_DIR).glob("*" + TMP_SUFFIX)):
        stale.unlink()


def _claim_out_dir(out: Path, identity: dict, inputs: list[JobInput], hash_mode: str) -> dict:
    """Make `out` this job's (fresh) or check it is this job's (resume); returns the identity to run."""
    parts = out / PARTS_DIR
    job_file, seen_file = parts / JOB_FILE, parts / INPUTS_SEEN_FILE
    resumed = _identity_to_resume(out, identity, inputs, hash_mode)
    if resumed is None:
        parts.mkdir(exist_ok=True)
        write_json_atomic(seen_file, [inp.seen() for inp in inputs])
        write_json_atomic(job_file, identity)  # the claim's commit point
        return identity
    seen = _read_json(seen_file)
    if not (isinstance(seen, list) and len(seen) == len(inputs)):
        # a merged directory records no input locations: from now on this job's are checked
        write_json_atomic(seen_file, [inp.seen() for inp in inputs])
    _remove_torn_writes(out)
    return resumed


def _identity_to_resume(out: Path, identity: dict, inputs: list[JobInput], hash_mode: str) -> dict | None:
    """Whether this job may run in `out`, reading only: None when `out` is fresh, else the
    identity to resume with; ConfigError when `out` is another job's or holds other files.

    On resume an input found at the same resolved path as recorded keeps its recorded name,
    so the same file spelled differently continues the same job with the same sources.
    """
    parts = out / PARTS_DIR
    recorded = _read_json(parts / JOB_FILE)
    if recorded is None:
        if not _is_fresh(out):
            _refuse_foreign(out, "preprocess")
        return None
    identity = json.loads(json.dumps(identity))
    seen = _read_json(parts / INPUTS_SEEN_FILE)
    seen_recorded = isinstance(seen, list) and len(seen) == len(inputs)
    if seen_recorded:
        for i, (inp, before) in enumerate(zip(inputs, seen)):
            if before.get("location") == inp.location:
                identity["inputs"][i]["path"] = before["name"]
    _check_same_job(out, recorded, identity)
    if seen_recorded and hash_mode == "sampled":
        for inp, before in zip(inputs, seen):
            if before.get("location") == inp.location and before.get("mtime_ns") != inp.mtime_ns:
                raise ConfigError(
                    f"input {before['name']} was modified since {printable_path(str(out))} was started (its "
                    "modification time changed): use a new --out directory, or delete this one to start over")
    return identity


def _same_job(recorded, identity: dict) -> bool:
    """Whether a recorded job identity is `identity`. The profile's chat template text and its
    name are left out: the template's sha256 is compared with the rest of the profile, and a job
    recorded by a vlmpack that kept neither in the profile is the same job (resuming it records
    them)."""
    def without_text(ident):
        if not isinstance(ident, dict) or not isinstance(ident.get("profile"), dict):
            return ident
        return {**ident, "profile": {k: v for k, v in ident["profile"].items() if k not in ("chat_template", "name")}}

    return without_text(recorded) == without_text(identity)


def _check_same_job(out: Path, recorded: dict, identity: dict) -> None:
    if _same_job(recorded, identity):
        return
    where = printable_path(str(out))
    fix = "use a new --out directory, or delete this one to start over"
    before_inputs, now_inputs = recorded.get("inputs", []), identity["inputs"]
    if len(before_inputs) == len(now_inputs) and all(a.get("path") == b["path"] for a, b in zip(before_inputs, now_inputs)):
        for before, now in zip(before_inputs, now_inputs):
            if before == now:
                continue
            if "fingerprint" not in before:
                raise ConfigError(f"{where} was made by an earlier vlmpack that recorded no input fingerprints, so "
                                  f"it cannot be resumed safely: {fix}")
            mode_before = before["fingerprint"].get("mode")
            if mode_before != now["fingerprint"]["mode"]:
                raise ConfigError(f"{where} was started with --input-hash {mode_before}, this run uses "
                                  f"--input-hash {now['fingerprint']['mode']}: re-run with --input-hash {mode_before}")
            raise ConfigError(f"input {now['path']} changed since {where} was started (its size, rows or content "
                              f"differ): {fix}")
    changed = sorted(k for k in identity if recorded.get(k) != identity[k])
    raise ConfigError(f"{where} holds output of a different job (differs in: {', '.join(changed)}); {fix}")


def _profile_args(cfg: PreprocessConfig) -> dict:
    return {"name": cfg.profile, "model_dir": cfg.model, "min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}


def _at_least(flag: str, value, minimum: int) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"{flag} must be an integer >= {minimum}, got {value}")


def _in_range(flag: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{flag} must be an integer from {low} to {high}, got {value}")


def check_config(cfg: PreprocessConfig) -> None:
    """Every setting checked before any work: one message naming the flag and its valid range."""
    _in_range("--workers", cfg.workers, 1, MAX_WORKERS)
    _at_least("--rows-per-shard", cfg.rows_per_shard, 1)
    _at_least("--num-partitions", cfg.num_partitions, 1)
    if not 0 <= cfg.partition_index < cfg.num_partitions:
        raise ConfigError(f"--partition-index must be in 0..{cfg.num_partitions - 1} (--num-partitions "
                          f"{cfg.num_partitions}), got {cfg.partition_index}")
    _at_least("--max-seq-len", cfg.sample.max_seq_len, 1)
    _at_least("--max-image-pixels", cfg.sample.max_image_pixels, 1)
    _at_least("--max-row-bytes", cfg.sample.max_row_bytes, 1)
    _at_least("--min-pixels", cfg.min_pixels, 1)
    _at_least("--max-pixels", cfg.max_pixels, 1)
    for flag, value in (("--min-pixels", cfg.min_pixels), ("--max-pixels", cfg.max_pixels)):
        if value is not None and value > MAX_OPTION_INTEGER:  # as for a part's own bounds: floats hold them exactly
            raise ConfigError(f"{flag} must be at most 2**53 ({MAX_OPTION_INTEGER}), got {value}")
    from .render import LOSS_POLICIES, REASONING_LOSSES

    if cfg.sample.loss_policy not in LOSS_POLICIES:
        raise ConfigError(f"--loss-policy must be one of {', '.join(LOSS_POLICIES)}, got {cfg.sample.loss_policy!r}")
    if cfg.sample.reasoning_loss not in REASONING_LOSSES:
        raise ConfigError(f"--reasoning-loss must be one of {', '.join(REASONING_LOSSES)}, got {cfg.sample.reasoning_loss!r}")
    if cfg.executor not in EXECUTORS:
        raise ConfigError(f"--executor must be one of {', '.join(EXECUTORS)}, got {cfg.executor!r}")
    _in_range("--ray-max-retries", cfg.ray_max_retries, 0, MAX_RAY_RETRIES)
    if cfg.input_format not in INPUT_FORMATS:
        raise ConfigError(f"--input-format must be one of {', '.join(INPUT_FORMATS)}, got {cfg.input_format!r}")
    if cfg.input_hash not in INPUT_HASH_MODES:
        raise ConfigError(f"--input-hash must be one of {', '.join(INPUT_HASH_MODES)}, got {cfg.input_hash!r}")
    remote = cfg.sample.remote_fetch
    if not 0 < remote.timeout < math.inf:
        raise ConfigError(f"--remote-timeout must be a positive, finite number of seconds, got {remote.timeout}")
    if not 0 <= remote.retries <= MAX_FETCH_RETRIES:
        raise ConfigError(f"--remote-retries must be an integer from 0 to {MAX_FETCH_RETRIES}, got {remote.retries}")
    if cfg.sample.media_root is not None and not Path(cfg.sample.media_root).is_dir():
        raise ConfigError(f"--media-root {cfg.sample.media_root} is not a directory")
    if not cfg.inputs:
        raise ConfigError("no inputs given: name at least one input file or directory")


@contextmanager
def _stop_on_signals():
    """SIGTERM, SIGINT and SIGHUP ask the job to stop: it ends its workers and raises `Interrupted` at
    the next row or unit boundary (`_stop_if_asked`), keeping committed units. The handler only
    records the request: an exception raised at an arbitrary point could be taken by a row's
    error handling for that row's failure. A second signal ends the process at once."""
    if threading.current_thread() is not threading.main_thread() or _STOP_REQUEST["held"]:
        yield  # another thread's job, or a block inside one that holds the signals already
        return
    signals = STOP_SIGNALS

    def stop(signum, frame):
        for s in signals:
            signal.signal(s, signal.SIG_DFL)
        _STOP_REQUEST["signal"] = signum

    previous = {s: signal.signal(s, stop) for s in signals}
    _STOP_REQUEST["held"] = True
    try:
        yield
    finally:
        _STOP_REQUEST.update(signal=None, held=False)
        for s, handler in previous.items():
            signal.signal(s, handler)


_STOP_REQUEST: dict = {"signal": None, "held": False}


def _stop_if_asked() -> None:
    """Raise `Interrupted` if a stop signal came (see `_stop_on_signals`)."""
    if _STOP_REQUEST["signal"] is not None:
        raise Interrupted(_STOP_REQUEST["signal"])


@contextmanager
def _output_errors(out: Path):
    """An OSError writing the output becomes the one-line error it means (disk full: exit 4)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = printable_path(str(out))
        mapped = user_error_from_os_error(exc)
        if mapped is None:
            raise
        raise mapped from None


@contextmanager
def _main_thread_stderr_only():
    """While a stop kills the workers under the pool, the pool's own threads may trip over the
    closed pipes (the queue feeder prints an EBADF traceback): expected then, and not the
    user's concern. Until those threads have ended, only the main thread writes to stderr."""
    real = sys.stderr

    class MainThreadOnly:
        def write(self, text):
            return real.write(text) if threading.current_thread() is threading.main_thread() else len(text)

        def __getattr__(self, name):
            return getattr(real, name)

    sys.stderr = MainThreadOnly()
    try:
        yield
    finally:
        sys.stderr = real


def _end_workers(workers: list) -> None:
    for p in workers:
        p.terminate()
    deadline = time.monotonic() + WORKER_EXIT_SECONDS
    for p in workers:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


@dataclass
class _LocalPool:
    """The local executor's worker processes and the row counters they share."""

    executor: cf.ProcessPoolExecutor
    rows_done: object  # multiprocessing Values
    rows_rejected: object
    others: set  # child processes alive before the pool: not the pool's to end


def _early_workers(cfg: PreprocessConfig) -> int:
    """Workers worth starting before the scan has counted the rows: as many as the inputs' bytes
    could fill with units of EARLY_ROW_BYTES rows (a small job starts few or none early); the
    pool starts the others as their units are submitted. Object-store inputs count nothing here:
    their size would cost a round trip to the store before the scan makes its own."""
    try:
        size = sum(_stat(file)["size"] for spec in cfg.inputs if not storage.is_url(spec) for file in _input_files(spec))
    except (OSError, UserError):
        return 0  # the scan reports the input's problem
    return min(cfg.workers, -(-size // (cfg.num_partitions * cfg.rows_per_shard * EARLY_ROW_BYTES)))


def _start_local_pool(cfg: PreprocessConfig, profile: Profile) -> _LocalPool | None:
    """Start worker processes now, before the input scan: their interpreter start-up and
    tokenizer load (about a second) then overlap the scan instead of delaying the first unit.
    None where the job runs in this process or on Ray."""
    if cfg.executor == "ray" or cfg.workers <= 1:
        return None
    ctx = mp.get_context("spawn")  # no fork: tokenizers/threads in the parent must not leak into workers
    _start_resource_tracker()
    rows_done, rows_rejected = ctx.Value("q", 0), ctx.Value("q", 0)
    others = set(mp.active_children())
    executor = cf.ProcessPoolExecutor(
        max_workers=cfg.workers,
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(os.getpid(), _profile_args(cfg), profile.fingerprint["id"], cfg.sample, cfg.rows_per_shard,
                  rows_done, rows_rejected),
    )
    for _ in range(_early_workers(cfg)):  # a spawn pool starts a process per task waiting while none is idle
        executor.submit(int)
    return _LocalPool(executor, rows_done, rows_rejected, others)


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (it tracks the shared counters) ignoring SIGHUP,
    as it ignores SIGTERM and SIGINT itself: a hangup sent to the job's process group must stop
    the job, not kill the tracker, whose successor would print tracebacks as the job ends. The
    disposition is inherited through its exec."""
    from multiprocessing import resource_tracker

    if threading.current_thread() is not threading.main_thread():
        resource_tracker.ensure_running()
        return
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)


def _end_local_pool(pool: _LocalPool | None, wait: bool) -> None:
    """Shut the pool down: after its work (`wait`), or now, ending its processes."""
    if pool is None:
        return
    if wait:
        pool.executor.shutdown()
        return
    manager = pool.executor._executor_manager_thread
    with _main_thread_stderr_only():
        pool.executor.shutdown(wait=False, cancel_futures=True)
        _end_workers([p for p in mp.active_children() if p not in pool.others])
        if manager is not None:
            manager.join(WORKER_EXIT_SECONDS)


@contextmanager
def _local_pool(cfg: PreprocessConfig, profile: Profile):
    """`_start_local_pool` for the block; its processes end with it, however it ends."""
    pool = _start_local_pool(cfg, profile)
    try:
        yield pool
    except BaseException:
        _end_local_pool(pool, wait=False)
        raise
    _end_local_pool(pool, wait=True)


def _run_units(units: list[WorkUnit], names: dict[str, str], cfg: PreprocessConfig, out: Path, profile: Profile,
               pool: _LocalPool | None) -> None:
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
        if cfg.executor == "ray":
            from .ray_executor import run_units_on_ray

            try:
                run_units_on_ray(units, names, cfg, out, profile, show, _stop_if_asked)
            except BaseException:
                _remove_torn_writes(out)
                raise
            return
        if pool is None or len(units) <= 1:
            for unit in units:
                process_unit(unit, names[unit.input.path], cfg.rows_per_shard, out, profile, cfg.sample, on_rows=show)
            return
        try:
            pending = {pool.executor.submit(_worker_process_unit, unit, names[unit.input.path], out) for unit in units}
            seen_done, seen_rejected = pool.rows_done.value, pool.rows_rejected.value
            while pending:
                _stop_if_asked()
                finished, pending = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    fut.result()  # re-raise a worker's failure here
                done, rej = pool.rows_done.value, pool.rows_rejected.value
                show(done - seen_done, rej - seen_rejected)
                seen_done, seen_rejected = done, rej
        except BaseException as exc:
            # Stop now: no new units, the running ones end, and their half-written shards go
            # (those units are redone on resume).
            workers = list((pool.executor._processes or {}).values())  # the shutdown forgets them
            _end_local_pool(pool, wait=False)
            _remove_torn_writes(out)
            if isinstance(exc, cf.process.BrokenProcessPool):
                # A scheduler signals the whole process group: the workers die of the signal
                # the job itself was asked to stop by (recorded already: it came first).
                _stop_if_asked()
                raise WorkerLost(worker_death_signal([p.exitcode for p in workers])) from None
            raise
    finally:
        bar.close()


def load_unit_records(out: Path, unit_indices) -> list[dict]:
    return [json.loads(unit_record_path(out, i).read_text(encoding="utf-8")) for i in unit_indices]


def shard_matches_record(directory: Path, record: dict) -> bool:
    """The unit's shard is there as committed: same size and sha256 (no shard: all rows rejected)."""
    shard = record.get("shard")
    if not shard:
        return True
    path = directory / shard["file"]
    try:
        return path.stat().st_size == shard["bytes"] and file_sha256(path) == shard["sha256"]
    except FileNotFoundError:
        return False


def _committed_units(out: Path, units: list[WorkUnit], progress: bool) -> tuple[set[int], list[int]]:
    """(units whose record and shard are intact, units whose record was there but the shard
    missing or damaged); the records of the second kind are removed, so those units are redone."""
    from tqdm import tqdm

    done, damaged = set(), []
    recorded = [u for u in units if unit_record_path(out, u.index).exists()]
    for unit in tqdm(recorded, unit="shard", desc="check finished shards", disable=not progress or not recorded):
        _stop_if_asked()
        path = unit_record_path(out, unit.index)
        record = _read_json(path)
        if record is not None and record.get("unit") == unit.index and shard_matches_record(out, record):
            done.add(unit.index)
        else:
            damaged.append(unit.index)
            path.unlink()
    return done, damaged


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
    check_config(cfg)
    check_inputs(cfg.inputs)  # each there, readable, of a kind that cannot block, and named once
    profile = resolve_profile(**_profile_args(cfg))
    _ = profile.special  # fail now, not in a worker
    # held from before the workers start: a stop signal to the process group during the setup
    # reaches them and this process alike, and must end the job as a stop, not kill it outright
    with _stop_on_signals(), _local_pool(cfg, profile) as pool:
        inputs = [describe_job_input(p, cfg.rows_per_shard, cfg.input_hash, cfg.input_format, cfg.sample.max_row_bytes)
                  for p in cfg.inputs]
        identity = job_identity(cfg, profile, inputs)
        if storage.is_url(cfg.out):
            return _run_to_store(cfg, profile, pool, inputs, identity, setup_started)
        return _run_job(cfg, Path(cfg.out), profile, pool, inputs, identity, setup_started)


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


def _partition_units(cfg: PreprocessConfig, inputs: list[JobInput]) -> list[WorkUnit]:
    """The work units this machine runs (all of them unless the job is partitioned)."""
    units = plan_units([inp.file for inp in inputs], cfg.rows_per_shard)
    return [u for u in units if u.index % cfg.num_partitions == cfg.partition_index]


def _run_job(cfg: PreprocessConfig, out: Path, profile: Profile, pool: _LocalPool | None, inputs: list[JobInput],
             identity: dict, setup_started: float, publish_to: str | None = None) -> dict:
    """The job in the local directory `out`; with `publish_to` (a store URL) its finished
    directory is uploaded there while `out` is still held, then emptied (the stage)."""
    mine = _partition_units(cfg, inputs)
    refuse_other = functools.partial(_identity_to_resume, identity=identity, inputs=inputs, hash_mode=cfg.input_hash)
    with _stop_on_signals(), exclusive_output_dir(out, "preprocess", check=refuse_other) as out, _output_errors(out):
        identity = _claim_out_dir(out, identity, inputs, cfg.input_hash)
        names = {inp.file.path: entry["path"] for inp, entry in zip(inputs, identity["inputs"])}
        committed, damaged = _committed_units(out, mine, cfg.progress)
        todo = [u for u in mine if u.index not in committed]
        note = idle_workers_note(len(mine), sum(u.num_rows for u in mine), cfg.workers, cfg.rows_per_shard)
        if note and todo and not (cfg.executor == "ray" and cfg.ray_cluster_address):  # a cluster's CPUs are not --workers
            print(note, file=sys.stderr)
        started = time.perf_counter()
        _run_units(todo, names, cfg, out, profile, pool)
        _stop_if_asked()
        elapsed = time.perf_counter() - started
        records = load_unit_records(out, (u.index for u in mine))
        run = {
            "units_done_now": len(todo),
            "units_resumed": len(mine) - len(todo),
            "units_redone": damaged,  # committed before, but the shard was missing or damaged
            "setup_seconds": started - setup_started,  # profile, input scan, out dir claim
            "seconds": elapsed,  # the units phase (the pool started during the setup)
            "unit_seconds": sum(r["seconds"] for r in records if r["unit"] in {u.index for u in todo}),
        }
        if cfg.num_partitions == 1:
            result = write_final_outputs(out, identity, records, profile.vision.patch_row_width)
        else:
            result = {
                "partition": f"{cfg.partition_index}/{cfg.num_partitions}",
                "units": len(mine),
                "rows_read": sum(r["rows_read"] for r in records),
                "rows_written": sum(r["rows_written"] for r in records),
                "rows_rejected": sum(r["rows_rejected"] for r in records),
                "_run": run,
            }
            write_json_atomic(out / PARTS_DIR / partition_summary_name(cfg.partition_index, cfg.num_partitions), result)
        if publish_to is not None:
            from .publish import empty_stage, publish

            last = (MANIFEST_NAME if cfg.num_partitions == 1
                    else f"{PARTS_DIR}/{partition_summary_name(cfg.partition_index, cfg.num_partitions)}")
            run["upload"] = publish(out, publish_to, last, result if "totals" in result else None, cfg.progress,
                                    stop_if_asked=_stop_if_asked)
            empty_stage(out)
        result["_run"] = run
    return result


def _run_to_store(cfg: PreprocessConfig, profile: Profile, pool: _LocalPool | None, inputs: list[JobInput],
                  identity: dict, setup_started: float) -> dict:
    """`--out URL`: the destination is checked before the first row (another job's output there
    is refused, this job's finished dataset is the result); the job then runs in its staging
    directory, named after the destination and the job, and is published to the store
    (preprocess/publish.py). The stage goes once its upload is complete; an upload cut short
    leaves it for the same command to resume from."""
    from .publish import check_destination, default_stage_dir, remove_stage

    partition = partition_summary_name(cfg.partition_index, cfg.num_partitions) if cfg.num_partitions > 1 else None
    published = check_destination(cfg.out, identity, partition=partition)
    if published is not None:
        units = len(_partition_units(cfg, inputs))
        return {**{k: v for k, v in published.items() if k != "_run"},
                "_run": {"units_done_now": 0, "units_resumed": units, "units_redone": [],
                         "setup_seconds": time.perf_counter() - setup_started, "seconds": 0.0, "unit_seconds": 0.0,
                         "stage": None, "upload": {"uploaded": 0, "kept": "all", "bytes": 0}}}
    stage = Path(cfg.stage_dir) if cfg.stage_dir else default_stage_dir(cfg.out, identity, partition)
    result = _run_job(dataclasses.replace(cfg, out=str(stage)), stage, profile, pool, inputs, identity, setup_started,
                      publish_to=cfg.out)
    remove_stage(stage)
    result["_run"]["stage"] = str(stage)
    return result


def partitions_identity(directories: list[str]) -> dict:
    """The job the partition directories (or store prefixes) belong to: ConfigError unless they
    all hold one job's output."""
    identities = []
    for d in directories:
        if storage.is_url(d):
            from .publish import read_json_object

            identity = read_json_object(storage.join(d, f"{PARTS_DIR}/{JOB_FILE}"))
            if identity is None:
                if not storage.list_tree(d):
                    raise ConfigError(f"{storage.redact(d)} holds nothing: name the --out prefixes of the partitions")
                raise ConfigError(f"{storage.redact(d)}: no {PARTS_DIR}/{JOB_FILE}; not the output of `vlmpack preprocess`")
            identities.append(identity)
            continue
        job_file = Path(d) / PARTS_DIR / JOB_FILE
        if not Path(d).is_dir():
            raise ConfigError(f"{printable_path(str(d))} does not exist or is not a directory: "
                              "name the --out directories of the partitions")
        if not job_file.is_file():
            raise ConfigError(f"{printable_path(str(d))}: no {PARTS_DIR}/{JOB_FILE}; not the output of `vlmpack preprocess`")
        identities.append(json.loads(job_file.read_text(encoding="utf-8")))
    if any(not _same_job(ident, identities[0]) for ident in identities):
        raise ConfigError("the directories hold different jobs (inputs, settings or profile differ); cannot merge")
    # a partition recorded before profiles held the chat template's text: another's has it
    return next((ident for ident in identities if "chat_template" in ident.get("profile", {})), identities[0])


def partition_summary_name(index: int, count: int) -> str:
    """A partition's summary in `_parts/`, written when its units are done (published last)."""
    return f"partition-{index}-of-{count}.json"


def merge_partitions(directories: list[str], out: str, publish_to: str | None = None) -> dict:
    """Join the outputs of a partitioned job (one directory or several) into one shard directory.
    With `publish_to` (a store URL) `out` is a stage: the merged directory is uploaded there
    while still held, then emptied (preprocess/publish.py); the manifest then carries what was
    uploaded under "_upload"."""
    dirs = [Path(d) for d in directories]
    identity = partitions_identity(directories)
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
    sources = {d.resolve() for d in dirs}

    def needs_claim(out_dir: Path) -> bool:
        """True where `out_dir` is fresh; ConfigError where it holds anything but this merge's work."""
        if out_dir.resolve() in sources or _same_job(_read_json(out_dir / PARTS_DIR / JOB_FILE), identity):
            return False
        if not _is_fresh(out_dir):
            _refuse_foreign(out_dir, "merge")
        return True

    with _stop_on_signals(), exclusive_output_dir(out, "merge", check=needs_claim) as out_dir, _output_errors(out_dir):
        if needs_claim(out_dir):
            (out_dir / PARTS_DIR).mkdir(exist_ok=True)
            write_json_atomic(out_dir / PARTS_DIR / JOB_FILE, identity)
        _remove_torn_writes(out_dir)
        records = []
        for index in range(total_units):
            _stop_if_asked()
            src = found[index]
            record = json.loads(unit_record_path(src, index).read_text(encoding="utf-8"))
            if not shard_matches_record(src, record):
                raise ConfigError(f"{printable_path(str(src))}: the shard of unit {index} is missing or damaged: re-run "
                                  "that partition's `vlmpack preprocess` command (it redoes the unit), then merge again")
            if src.resolve() != out_dir.resolve():
                if record["shard"]:
                    _link_or_copy(src / record["shard"]["file"], out_dir / record["shard"]["file"], record)
                write_json_atomic(unit_record_path(out_dir, index), record)
            records.append(record)
        manifest = write_final_outputs(out_dir, identity, records, _patch_row_width(identity))
        if publish_to is not None:
            from .publish import empty_stage, publish

            upload = publish(out_dir, publish_to, MANIFEST_NAME, manifest, stop_if_asked=_stop_if_asked)
            empty_stage(out_dir)
            manifest = {**manifest, "_upload": upload}
        return manifest


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
