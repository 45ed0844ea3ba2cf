"""The output directory belongs to one job: claimed when fresh, resumed when it holds this
job's own work state (its inputs unchanged), refused otherwise, so a finished dataset or
anything else found there is never overwritten."""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

from shards_schema.atomic import TMP_SUFFIX, write_json_atomic
from shards_schema.errors import first_few, user_error_from_os_error
from shards_schema.manifest import MANIFEST_NAME, PARTS_DIR, REJECTS_NAME
from shards_schema.outdir import user_entries

from ..errors import ConfigError
from .identity import JobInput, describe_job_differences, printable_path, same_job
from .records import INPUTS_SEEN_FILE, JOB_FILE, job_identity_problem, read_json, remove_torn_writes


def is_fresh(out: Path) -> bool:
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


def is_job_file(relative: str) -> bool:
    """Whether `relative` (a path under an output directory, `/`-separated) is a file that a
    preprocess or merge job writes."""
    head, _, rest = relative.partition("/")
    if rest:
        return head == PARTS_DIR and "/" not in rest and _PARTS_FILES.fullmatch(rest) is not None
    return _JOB_FILES.fullmatch(head) is not None


def entries_not_of_a_job(out: Path) -> list[str]:
    """What `out` holds that no preprocess or merge job writes (its lock aside): before such a
    directory is removed as a job's own output, nothing else may be in it."""
    foreign = []
    for name in user_entries(out):
        path = out / name
        if name == PARTS_DIR and path.is_dir() and not path.is_symlink():
            foreign += [f"{PARTS_DIR}/{n}" for n in sorted(os.listdir(path))
                        if not (is_job_file(f"{PARTS_DIR}/{n}") and (path / n).is_file() and not (path / n).is_symlink())]
        elif not (is_job_file(name) and path.is_file() and not path.is_symlink()):
            foreign.append(name)
    return foreign


def refuse_foreign(out: Path, command: str, what: str = "--out") -> None:
    entries = user_entries(out)
    shown = first_few([printable_path(e) for e in entries])
    raise ConfigError(f"{what} {printable_path(str(out))} is not empty and holds no resumable job of `vlmpack {command}` "
                      f"(it has {shown}): choose a new or empty {what} directory")


def claim_out_dir(out: Path, identity: dict, inputs: list[JobInput], hash_mode: str, what: str = "--out") -> dict:
    """Make `out` this job's (fresh) or check it is this job's (resume); returns the identity to
    run. `what`: the flag that named `out`, for the refusals."""
    parts = out / PARTS_DIR
    job_file, seen_file = parts / JOB_FILE, parts / INPUTS_SEEN_FILE
    resumed = identity_to_resume(out, identity, inputs, hash_mode, what)
    if resumed is None:
        parts.mkdir(exist_ok=True)
        write_json_atomic(seen_file, [inp.seen() for inp in inputs])
        write_json_atomic(job_file, identity)  # the claim's commit point
        return identity
    if not _seen_recorded(read_json(seen_file), inputs):
        # a merged directory records no input locations: from now on this job's are checked
        write_json_atomic(seen_file, [inp.seen() for inp in inputs])
    remove_torn_writes(out)
    return resumed


def identity_to_resume(out: Path, identity: dict, inputs: list[JobInput], hash_mode: str,
                       what: str = "--out") -> dict | None:
    """Whether this job may run in `out`, reading only: None when `out` is fresh, else the
    identity to resume with; ConfigError when `out` is another job's or holds other files.

    On resume an input found at the same resolved path as recorded keeps its recorded name,
    so the same file spelled differently continues the same job with the same sources.
    """
    parts = out / PARTS_DIR
    recorded = read_json(parts / JOB_FILE)
    if recorded is None:
        if not is_fresh(out):
            refuse_foreign(out, "preprocess", what)
        return None
    problem = job_identity_problem(recorded)
    if problem is not None:
        raise ConfigError(f"{printable_path(str(parts / JOB_FILE))} is damaged ({problem}), so the job in "
                          f"{printable_path(str(out))} cannot be resumed: use a new {what} directory, or delete this "
                          "one to start over")
    identity = json.loads(json.dumps(identity))
    seen = read_json(parts / INPUTS_SEEN_FILE)
    seen_recorded = _seen_recorded(seen, inputs)
    if seen_recorded:
        for i, (inp, before) in enumerate(zip(inputs, seen)):
            if before.get("location") == inp.location:
                identity["inputs"][i]["path"] = before["name"]
    _check_same_job(out, recorded, identity, what)
    if seen_recorded and hash_mode == "sampled":
        for inp, before in zip(inputs, seen):
            if before.get("location") == inp.location and before.get("mtime_ns") != inp.mtime_ns:
                raise ConfigError(
                    f"input {before['name']} was modified since {printable_path(str(out))} was started (its "
                    f"modification time changed): use a new {what} directory, or delete this one to start over")
    return identity


def _seen_recorded(seen, inputs: list[JobInput]) -> bool:
    """Whether `inputs_seen.json`'s content records where each of `inputs` was found (one
    object per input); a merged directory records none, a damaged file reads as none."""
    return isinstance(seen, list) and len(seen) == len(inputs) and all(isinstance(before, dict) for before in seen)


def _check_same_job(out: Path, recorded: dict, identity: dict, what: str = "--out") -> None:
    if same_job(recorded, identity):
        return
    where = printable_path(str(out))
    fix = f"use a new {what} directory, or delete this one to start over"
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
            layout_before, layout_now = before.get("row_format", "openai"), now.get("row_format", "openai")
            if layout_before != layout_now and {**before, "row_format": None} == {**now, "row_format": None}:
                # the same bytes read in another layout: --input-format differs, the input does not
                raise ConfigError(f"{where} was started reading input {now['path']} as {layout_before} rows, this run "
                                  f"reads them as {layout_now} (--input-format): re-run with --input-format "
                                  f"{layout_before} to resume it, or {fix}")
            raise ConfigError(f"input {now['path']} changed since {where} was started (its size, rows or content "
                              f"differ): {fix}")
    changed = sorted(k for k in identity if recorded.get(k) != identity[k])
    raise ConfigError(f"{where} holds output of a different job (differs in: {', '.join(changed)}; "
                      f"{describe_job_differences(recorded, identity, where, 'this run')}): re-run with the "
                      f"settings it was started with to resume it, or {fix}")


@contextmanager
def output_errors(out: Path):
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

