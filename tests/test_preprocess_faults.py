"""Faults around a real `vlmpack preprocess` / `vlmpack merge`: kill -9 at random moments,
then the same command again gives byte-identical output; two jobs on one directory; a full
disk; a read-only output; signals to the job and what happens to its worker processes.

Jobs run as real processes (`python -m shards_schema.cli`); small inputs keep the file fast.
The tmpfs variants need permission to mount and are skipped where it is not given; the
injected variants of the same faults always run.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

import preprocess.job as job
from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, merge_partitions, run_preprocess
from shards_schema.atomic import TMP_SUFFIX
from shards_schema.cli import main as cli_main
from shards_schema.errors import EXIT_DISK_FULL, EXIT_USER_ERROR, UserError
from shards_schema.outdir import LOCK_NAME, exclusive_output_dir
from tests.helpers.damage import refuse_reads

ROWS_PER_SHARD = 2
PROCESS_GONE_SECONDS = 5.0


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    rows = example_rows(12, seed=11, size_range=(32, 96), include_bad_rows=True)
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", rows)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """An uninterrupted run: what every interrupted-then-resumed run must equal, byte for byte."""
    out = tmp_path_factory.mktemp("reference")
    _run_inprocess(data, out)
    return out


def _run_inprocess(data: Path, out: Path, **kw) -> dict:
    kw.setdefault("rows_per_shard", ROWS_PER_SHARD)
    return run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), progress=False, workers=kw.pop("workers", 1), **kw))


def _cli_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "shards_schema.cli", *(str(a) for a in args)]


def _preprocess_cmd(data: Path, out: Path, workers: int = 2, rows_per_shard: int = ROWS_PER_SHARD) -> list[str]:
    return _cli_cmd("preprocess", data, "--out", out, "--workers", workers, "--rows-per-shard", rows_per_shard, "--no-progress")


def _outputs(directory: Path) -> dict[str, object]:
    """Every file of a shard directory: bytes, except the unit records' timings and the lock
    file (which names the process that held it)."""
    files = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if not path.is_file() or name == LOCK_NAME:
            continue
        assert not name.endswith(TMP_SUFFIX), f"torn write left behind: {name}"
        if path.parent.name == "_parts" and path.name.startswith("unit-"):
            record = json.loads(path.read_text(encoding="utf-8"))
            record.pop("seconds")
            files[name] = record
        else:
            files[name] = path.read_bytes()
    return files


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _state(pid: int) -> str:
    """The process's state letter from /proc ("Z": a zombie, "T": stopped), "" when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2]


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z")  # a zombie has ended; only its exit status is left


def _wait_gone(pids: set[int], seconds: float = PROCESS_GONE_SECONDS) -> set[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return {p for p in pids if _alive(p)}


def _wait_for(condition, seconds: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _units_committed(out: Path) -> int:
    return len(list((out / "_parts").glob("unit-*.json")))


# ---------------------------------------------------------------- kill -9 at random moments, then resume


def _kill_at_a_random_moment(cmd: list[str], out: Path, rng: random.Random, units: int, jitter: float) -> bool:
    """Start `cmd`, SIGKILL it (the parent only) after a random number of committed units plus a
    random delay; True if that interrupted it. Its workers must end with it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = rng.randrange(units)
    _wait_for(lambda: (out / "_parts").is_dir() and _units_committed(out) >= after or proc.poll() is not None,
              what=f"{after} committed units")
    time.sleep(rng.uniform(0.0, jitter))
    children = _children(proc.pid)
    proc.kill()
    proc.wait()
    assert not _wait_gone(children), "workers outlived the killed job"
    return not (out / "manifest.json").exists()


def test_preprocess_killed_at_random_moments_then_rerun_is_byte_identical(data, reference, tmp_path):
    interrupted = 0
    for seed, workers in ((0, 2), (1, 1), (2, 1)):
        out = tmp_path / f"out{seed}"
        interrupted += _kill_at_a_random_moment(_preprocess_cmd(data, out, workers=workers), out, random.Random(seed),
                                                units=6, jitter=0.05)
        manifest = _run_inprocess(data, out)
        assert manifest["_run"]["units_done_now"] + manifest["_run"]["units_resumed"] == 7
        assert _outputs(out) == _outputs(reference), seed
    assert interrupted >= 2, "the kills all came too late to interrupt anything"


@pytest.fixture(scope="module")
def partitions(data, tmp_path_factory) -> list[Path]:
    """Two partitions of one shard per row: a merge of many small steps to interrupt."""
    dirs = [tmp_path_factory.mktemp(f"part{i}") for i in range(2)]
    for i, d in enumerate(dirs):
        _run_inprocess(data, d, num_partitions=2, partition_index=i, rows_per_shard=1)
    return dirs


_MERGE_STOPPING_AFTER_UNITS = """
import os, runpy, signal, sys
import preprocess.job.merge as merge
after, write = int(sys.argv.pop(1)), merge.write_json_atomic
def write_then_stop(path, obj):
    write(path, obj)
    if path.name == "job.json" and after == 0 or path.name == f"unit-{after - 1:06d}.json":
        os.kill(os.getpid(), signal.SIGSTOP)
merge.write_json_atomic = write_then_stop
runpy.run_module("shards_schema.cli", run_name="__main__")
"""


def test_merge_killed_at_random_moments_then_rerun_is_byte_identical(partitions, data, tmp_path):
    """A merge of hard links runs faster than a poll can catch it, so the job stops itself
    (SIGSTOP) right after its `after`-th unit commit; it is killed there, or let go on for a
    random moment first (then it may tear a write, or finish)."""
    merge_partitions([str(p) for p in partitions], str(tmp_path / "uninterrupted"))
    expected = _outputs(tmp_path / "uninterrupted")
    _run_inprocess(data, tmp_path / "one_job", rows_per_shard=1)
    assert {k: v for k, v in expected.items() if not k.startswith("_parts/")} == {
        k: v for k, v in _outputs(tmp_path / "one_job").items() if not k.startswith("_parts/")}
    units = sum(1 for name in expected if name.startswith("_parts/unit-"))
    interrupted = 0
    for seed in range(6):
        rng, out = random.Random(seed), tmp_path / f"merged{seed}"
        proc = subprocess.Popen([sys.executable, "-c", _MERGE_STOPPING_AFTER_UNITS, str(rng.randrange(units)), "merge",
                                 *map(str, partitions), "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait_for(lambda: proc.poll() is not None or _state(proc.pid) in ("T", "t"), what="the merge to stop itself")
        assert proc.poll() is None, proc.stderr.read()
        if seed % 2:
            proc.send_signal(signal.SIGCONT)
            time.sleep(rng.uniform(0.0, 0.002))
        proc.kill()
        proc.wait()
        proc.stderr.close()
        interrupted += not (out / "manifest.json").exists()
        merge_partitions([str(p) for p in partitions], str(out))
        assert _outputs(out) == expected, seed
    assert interrupted >= 3, "a merge killed while stopped was not interrupted"


# ---------------------------------------------------------------- two jobs, one directory


def test_a_second_identical_job_on_the_same_directory_stops_at_once(data, tmp_path):
    out = tmp_path / "out"
    procs = [subprocess.Popen(_preprocess_cmd(data, out, rows_per_shard=1), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = {p.pid: (p.communicate(timeout=120)[1], p.returncode) for p in procs}
    (winner, (err, code)), (_, (lost_err, lost_code)) = sorted(results.items(), key=lambda kv: kv[1][1])
    assert code == 0, err
    assert lost_code == EXIT_USER_ERROR and lost_err.count("\n") == 1, lost_err
    assert f"is in use by another job (vlmpack preprocess, pid {winner} " in lost_err
    _run_inprocess(data, tmp_path / "one", rows_per_shard=1)
    assert _outputs(out) == _outputs(tmp_path / "one")


def test_merge_into_a_directory_another_job_holds_stops_at_once(partitions, tmp_path):
    out = tmp_path / "merged"
    with exclusive_output_dir(out, "preprocess"):
        result = subprocess.run(_cli_cmd("merge", *partitions, "--out", out), capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_USER_ERROR and result.stderr.count("\n") == 1
    assert f"in use by another job (vlmpack preprocess, pid {os.getpid()}" in result.stderr
    assert os.listdir(out) == [LOCK_NAME]


def test_a_job_that_loses_the_lock_race_waits_for_the_holders_record(tmp_path):
    """The holder takes the flock before it writes who it is; the loser polls for the record."""
    import fcntl
    import threading
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, record not yet written
        record = json.dumps({"pid": 4242, "host": "h", "command": "train", "started": "t"}) + "\n"
        writer = threading.Timer(0.3, lambda: os.pwrite(fd, record.encode(), 0))
        writer.start()
        with pytest.raises(UserError, match=r"in use by another job \(vlmpack train, pid 4242 on h, since t\)"):
            with exclusive_output_dir(out, "preprocess"):
                pass
        writer.join()
        os.ftruncate(fd, 0)  # a holder that never writes its record is named as unknown, after the wait
        with pytest.raises(UserError, match=r"in use by another job \(holder not recorded\)"):
            with exclusive_output_dir(out, "preprocess"):
                pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- signals and worker processes


def _start_and_wait_for_workers(data: Path, out: Path, stderr: Path, own_group: bool = False) -> tuple[subprocess.Popen, set[int]]:
    """A 2-worker job that has committed a unit (`own_group`: in a process group of its own, as
    a scheduler starts it). Its stderr goes to a file: a pipe would also be held open by
    workers that outlive it."""
    with open(stderr, "w") as err:
        proc = subprocess.Popen(_preprocess_cmd(data, out, rows_per_shard=1), stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=own_group)
    _wait_for(lambda: _units_committed(out) >= 1 or proc.poll() is not None, what="a first committed unit")
    assert proc.poll() is None, "the job ended before it could be signalled: the input is too small"
    children = _children(proc.pid)
    assert len(children) >= 2  # two workers (and multiprocessing's resource tracker)
    return proc, children


def test_workers_die_with_a_killed_parent(data, tmp_path):
    proc, children = _start_and_wait_for_workers(data, tmp_path / "out", tmp_path / "stderr")
    os.kill(proc.pid, signal.SIGKILL)  # the parent only, as an OOM killer or a scheduler would
    proc.wait()
    assert not _wait_gone(children), "processes of the killed job still run"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_sigint_stops_the_job_and_its_workers_keeping_finished_units(signum, data, tmp_path):
    out = tmp_path / "out"
    proc, children = _start_and_wait_for_workers(data, out, tmp_path / "stderr")
    committed = _units_committed(out)
    sent = time.monotonic()
    os.kill(proc.pid, signum)
    proc.wait(timeout=30)
    assert time.monotonic() - sent < PROCESS_GONE_SECONDS + 2
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 128 + signum
    assert err.strip().splitlines()[-1] == (f"vlmpack preprocess: error: stopped by {signal.Signals(signum).name}; finished "
                                           "shards are kept: re-run the same command to resume")
    assert "Traceback" not in err
    assert not _wait_gone(children), "workers outlived the stopped job"
    assert _units_committed(out) >= committed >= 1
    assert not list(out.glob("*" + TMP_SUFFIX))


@pytest.fixture(scope="module")
def longer_data(tmp_path_factory) -> Path:
    """Enough units that a signal sent within 0.2 s of the first commit finds the job running,
    however loaded the machine is."""
    rows = example_rows(400, seed=12, size_range=(32, 96))  # about 2 s of work on a fast machine
    return write_jsonl(tmp_path_factory.mktemp("longer") / "chats.jsonl", rows)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_whole_process_group_is_a_stop_not_a_lost_worker(signum, longer_data, tmp_path):
    """`kill -TERM -PGID`, as a scheduler stops a job: the workers die of the signal too, often
    before the job has looked at its own; it is still a stop by that signal (exit 128 + N), never
    "a worker ended unexpectedly". Twice, at random moments: which death is seen first varies."""
    rng = random.Random(signum)
    for attempt in range(2):
        out = tmp_path / f"out{attempt}"
        proc, children = _start_and_wait_for_workers(longer_data, out, tmp_path / "stderr", own_group=True)
        time.sleep(rng.uniform(0.0, 0.2))
        os.killpg(proc.pid, signum)
        assert proc.wait(timeout=30) == 128 + signum
        err = (tmp_path / "stderr").read_text()
        assert err.strip().splitlines()[-1] == (f"vlmpack preprocess: error: stopped by {signal.Signals(signum).name}; "
                                                "finished shards are kept: re-run the same command to resume"), err
        assert "Traceback" not in err and not _wait_gone(children)
        assert _units_committed(out) >= 1 and not list(out.glob("*" + TMP_SUFFIX))


def test_sigterm_stops_a_single_process_job_keeping_finished_units(data, tmp_path):
    """--workers 1 works in the job's own process: the signal lands inside a unit."""
    out = tmp_path / "out"
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(_preprocess_cmd(data, out, workers=1, rows_per_shard=1), stdout=subprocess.DEVNULL, stderr=err)
    _wait_for(lambda: _units_committed(out) >= 1 or proc.poll() is not None, what="a first committed unit")
    assert proc.poll() is None, "the job ended before it could be signalled"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    lines = (tmp_path / "stderr").read_text().strip().splitlines()
    assert lines == ["vlmpack preprocess: error: stopped by SIGTERM; finished shards are kept: re-run the same command "
                     "to resume"], lines
    assert _units_committed(out) >= 1 and not list(out.glob("*" + TMP_SUFFIX)) and not (out / "manifest.json").exists()


@pytest.mark.parametrize("signum, code, message", [
    (signal.SIGKILL, 1, "a worker process ended unexpectedly: killed by SIGKILL (by the system when memory ran out, "
                        "or by hand); finished shards are kept: re-run the same command to resume, with fewer --workers"),
    (signal.SIGTERM, 128 + signal.SIGTERM, "a worker process was stopped by SIGTERM (sent to the worker, not to the "
                                           "job); finished shards are kept: re-run the same command to resume"),
], ids=["SIGKILL", "SIGTERM"])
def test_a_lost_worker_stops_the_job_with_one_line_naming_what_ended_it(signum, code, message, data, tmp_path):
    """A worker killed alone: SIGKILL is what the out-of-memory killer sends (exit 1); SIGTERM is
    a stop (exit 128 + 15). Either way the finished units are kept and the re-run completes."""
    out = tmp_path / "out"
    proc, children = _start_and_wait_for_workers(data, out, tmp_path / "stderr")
    worker = next(p for p in children if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text())
    os.kill(worker, signum)
    assert proc.wait(timeout=60) == code
    err = (tmp_path / "stderr").read_text()
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"vlmpack preprocess: error: {message}"), err
    assert not _wait_gone(children), "the other worker outlived the stopped job"
    _run_inprocess(data, out, rows_per_shard=1)
    _run_inprocess(data, tmp_path / "one", rows_per_shard=1)
    assert _outputs(out) == _outputs(tmp_path / "one")


@pytest.mark.parametrize("exit_codes, cause", [
    ([-signal.SIGKILL, -signal.SIGTERM], signal.SIGKILL),  # the pool ends the others with SIGTERM
    ([-signal.SIGTERM, -signal.SIGTERM], signal.SIGTERM),
    ([-signal.SIGHUP, -signal.SIGTERM, None], signal.SIGHUP),
    ([-signal.SIGSEGV, -signal.SIGTERM], signal.SIGSEGV),
    ([1, None], None),
    ([], None),
])
def test_the_signal_that_broke_the_pool_is_read_from_the_workers_exit_codes(exit_codes, cause):
    assert job.worker_death_signal(exit_codes) == cause


# ---------------------------------------------------------------- full disk, read-only output


@contextmanager
def _tmpfs(directory: Path, options: str):
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def _assert_disk_full_with_finished_units_kept(code: int, err: str, out: Path) -> None:
    assert code == EXIT_DISK_FULL, err
    assert err.count("\n") == 1 and err.startswith("vlmpack preprocess: error: no space left on the device"), err
    kept = _units_committed(out)
    assert 1 <= kept < 7 and not list(out.glob("*" + TMP_SUFFIX)) and not (out / "manifest.json").exists()


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO], ids=["disk-full", "input-output-error"])
def test_a_storage_error_writing_a_shard_keeps_finished_units_and_resumes_injected(data, reference, tmp_path,
                                                                                    monkeypatch, capsys, error):
    """A full disk exits 4; EIO from the storage (a failing disk, a network file system gone) is
    a fault, exit 1, not a crash. Either way one line, the finished units kept for the re-run."""
    real_writer = job.units.ShardWriter

    class FailingDisk(real_writer):
        def add(self, sample):
            if self.path.name == "shard-000003.arrow":
                raise OSError(error, os.strerror(error))
            super().add(sample)

    monkeypatch.setattr(job.units, "ShardWriter", FailingDisk)
    out = tmp_path / "out"
    code = cli_main([str(a) for a in ("preprocess", data, "--out", out, "--workers", 1, "--rows-per-shard", ROWS_PER_SHARD,
                                      "--no-progress")])
    err = capsys.readouterr().err
    if error == errno.ENOSPC:
        _assert_disk_full_with_finished_units_kept(code, err, out)
    else:
        assert code == 1 and err.count("\n") == 1, err
        assert err.startswith(f"vlmpack preprocess: error: input/output error at {out}: the storage failed") and \
            "re-run the same command" in err
        assert not list(out.glob("*" + TMP_SUFFIX)) and not (out / "manifest.json").exists()
    assert _units_committed(out) == 3
    monkeypatch.setattr(job.units, "ShardWriter", real_writer)
    assert _run_inprocess(data, out)["_run"]["units_resumed"] == 3
    assert _outputs(out) == _outputs(reference)


def test_full_disk_exits_4_keeps_finished_units_and_resumes_tmpfs(data, reference, tmp_path):
    total = sum(p.stat().st_size for p in reference.iterdir() if p.is_file())
    with _tmpfs(tmp_path / "disk", f"size={total // 2}") as disk:
        out = disk / "out"
        result = subprocess.run(_preprocess_cmd(data, out, workers=1), capture_output=True, text=True, timeout=120)
        _assert_disk_full_with_finished_units_kept(result.returncode, result.stderr, out)
        subprocess.run(["mount", "-o", f"remount,size={total * 4}", str(disk)], check=True)
        result = subprocess.run(_preprocess_cmd(data, out, workers=1), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert _outputs(out) == _outputs(reference)


def test_an_input_output_error_reading_an_input_names_the_input_not_the_output(data, tmp_path, monkeypatch, capsys):
    real_read_rows = job.units.read_rows

    def failing_read(unit, *args):
        rows = real_read_rows(unit, *args)
        if unit.index == 3:
            yield next(rows)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        yield from rows

    monkeypatch.setattr(job.units, "read_rows", failing_read)
    out = tmp_path / "out"
    code = cli_main([str(a) for a in ("preprocess", data, "--out", out, "--workers", 1, "--rows-per-shard", ROWS_PER_SHARD,
                                      "--no-progress")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"vlmpack preprocess: error: input/output error at {data}: the storage failed"), err


def test_a_shard_over_the_file_size_limit_is_one_line_and_resumes_under_a_higher_one(data, reference, tmp_path):
    """`ulimit -f` (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails with EFBIG)."""
    import resource

    largest = max(p.stat().st_size for p in reference.glob("*.arrow"))
    out = tmp_path / "out"

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (largest - 1, resource.RLIM_INFINITY))

    result = subprocess.run(_preprocess_cmd(data, out, workers=1), capture_output=True, text=True, timeout=120,
                            preexec_fn=limit_file_size)
    assert result.returncode == EXIT_USER_ERROR and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"vlmpack preprocess: error: file too large: {out}: ") and "ulimit -f" in result.stderr
    assert not (out / "manifest.json").exists() and not list(out.glob("*" + TMP_SUFFIX))
    result = subprocess.run(_preprocess_cmd(data, out, workers=1), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert _outputs(out) == _outputs(reference)


@pytest.mark.parametrize("err_no", [errno.EROFS, errno.EACCES])
def test_unwritable_output_is_one_line_injected(err_no, data, tmp_path, monkeypatch, capsys):
    def refuse(path, obj):
        raise OSError(err_no, os.strerror(err_no), str(path))

    monkeypatch.setattr(job.claim, "write_json_atomic", refuse)  # the claim writes first
    out = tmp_path / "out"
    code = cli_main([str(a) for a in ("preprocess", data, "--out", out, "--workers", 1, "--no-progress")])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR and err.count("\n") == 1, err
    expected = "read-only file system" if err_no == errno.EROFS else "permission denied"
    assert err.startswith(f"vlmpack preprocess: error: {expected}: {out}/_parts/") and "writable" in err


def test_read_only_output_is_one_line_tmpfs(data, tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        for out in (ro, ro / "sub"):
            result = subprocess.run(_preprocess_cmd(data, out, workers=1), capture_output=True, text=True, timeout=120)
            assert result.returncode == EXIT_USER_ERROR and result.stderr.count("\n") == 1, result.stderr
            assert f"--out {out}" in result.stderr and ("not writable" in result.stderr or "Read-only" in result.stderr)


# ---------------------------------------------------------------- inputs that cannot be read, or are named twice


def _one_line_refusal(capsys, *argv) -> str:
    """Run `vlmpack ARGV`: it must exit 2 with one line and no traceback; returns the line."""
    capsys.readouterr()
    code = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_fifo_as_input_is_refused_without_opening_it(tmp_path):
    """A FIFO named .jsonl: opening it would wait for a writer forever, so it is refused from its
    kind alone, at once (a real process, so a regression fails the timeout, not the suite)."""
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    result = subprocess.run(_cli_cmd("preprocess", fifo, "--out", tmp_path / "out", "--no-progress"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_USER_ERROR and result.stderr.count("\n") == 1, result.stderr
    assert f"input {fifo} is a named pipe (FIFO)" in result.stderr and not (tmp_path / "out").exists()


def test_devices_directories_and_unreadable_inputs_stop_the_job_with_one_line(data, tmp_path, capsys, monkeypatch):
    """/dev/zero and /dev/urandom behind symbolic links named .jsonl / .json (endless: read, they
    exhaust memory), a FIFO inside a `datasets` directory, a directory that is not a `datasets`
    directory, a broken symbolic link and an input that cannot be read (chmod 000; where the
    tests run as root, which reads it anyway, EACCES injected): exit 2 before the job starts,
    one line naming the input and the fix; no output directory is made."""
    import datasets

    import preprocess.inputs as inputs

    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    (tmp_path / "random.json").symlink_to("/dev/urandom")
    (tmp_path / "broken.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    (tmp_path / "plain").mkdir()
    datasets.Dataset.from_list([{"messages": []}]).save_to_disk(str(tmp_path / "saved"))
    os.mkfifo(tmp_path / "saved" / "extra.arrow")
    locked = tmp_path / "locked.jsonl"
    locked.write_bytes(data.read_bytes())
    refuse_reads(monkeypatch, [locked], [inputs])
    cases = {
        "zero.jsonl": "(a symbolic link to /dev/zero) is a character device",
        "random.json": "(a symbolic link to /dev/urandom) is a character device",
        "saved": f"input {tmp_path / 'saved'}: file {tmp_path / 'saved' / 'extra.arrow'} is a named pipe (FIFO)",
        "plain": "not a `datasets` save_to_disk directory",
        "broken.jsonl": f"is a broken symbolic link (to {tmp_path / 'nowhere.jsonl'})",
        "locked.jsonl": "cannot be read (Permission denied): check its permissions",
    }
    for name, words in cases.items():
        out = tmp_path / f"out-{name}"
        err = _one_line_refusal(capsys, "preprocess", data, tmp_path / name, "--out", out, "--workers", 1, "--no-progress")
        assert str(tmp_path / name) in err and words in err, (name, err)
        assert not out.exists()


def test_an_input_named_twice_is_refused_naming_both_spellings(data, tmp_path, capsys, monkeypatch):
    """The same input named twice would train on its rows twice: the same spelling, another
    relative spelling, a symbolic link, a hard link, a `datasets` directory with and without its
    trailing slash, a Hub split with and without its default `split=train` are each refused
    before the job starts (exit 2, one line naming both); a copy of the file is another input."""
    import datasets

    monkeypatch.chdir(data.parent)
    (tmp_path / "link.jsonl").symlink_to(data)
    os.link(data, tmp_path / "hard.jsonl")
    shutil.copyfile(data, tmp_path / "copy.jsonl")
    datasets.Dataset.from_list([{"messages": []}]).save_to_disk(str(tmp_path / "saved"))
    cases = [
        ([data, data], f"input {data} is named twice"),
        ([data.name, f"./{data.name}"], f"input ./{data.name} is the same input as {data.name} (both are {data})"),
        ([data, tmp_path / "link.jsonl"], f"input {tmp_path / 'link.jsonl'} is the same input as {data} (both are"),
        ([data, tmp_path / "hard.jsonl"], f"input {tmp_path / 'hard.jsonl'} is the same input as {data} (a hard link"),
        ([tmp_path / "saved", f"{tmp_path / 'saved'}/"], f"input {tmp_path / 'saved'}/ is the same input as"),
        (["hf://datasets/acme/charts", "hf://datasets/acme/charts?split=train"],
         "input hf://datasets/acme/charts?split=train is the same input as hf://datasets/acme/charts"),
    ]
    for inputs, words in cases:
        out = tmp_path / "out"
        err = _one_line_refusal(capsys, "preprocess", *inputs, "--out", out, "--workers", 1, "--no-progress")
        assert words in err and "name each input once" in err, err
        assert not out.exists()
    manifest = run_preprocess(PreprocessConfig(inputs=[str(data), str(tmp_path / "copy.jsonl")],
                                               out=str(tmp_path / "copies"), progress=False, workers=1))
    assert len(manifest["accounting"]["inputs"]) == 2
