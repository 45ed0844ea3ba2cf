"""`vlmpack preprocess --executor ray` on a local Ray instance: the same bytes as the local
executor, also after a Ray worker is killed in the middle of a unit and after the driver
itself is killed and the job re-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from preprocess.ray_executor import TASK_NAME

pytest.importorskip("ray", reason="the ray extra: pip install -e '.[ray]'")

ROWS_PER_SHARD = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("ray-data") / "rows.jsonl",
                       example_rows(48, seed=17, size_range=(32, 200), include_bad_rows=True, video_rows=0.1))


@pytest.fixture(scope="module")
def local(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "out"
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), workers=2, rows_per_shard=ROWS_PER_SHARD,
                                    progress=False))
    return out


def _outputs(directory: Path) -> dict[str, bytes]:
    """Shards, rejects and manifest (the work state in _parts/ records timings)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != ".vlmpack.lock"}


def _cli(data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "shards_schema.cli", "preprocess", str(data), "--out", str(out), "--executor", "ray",
            "--workers", "2", "--rows-per-shard", str(ROWS_PER_SHARD), "--no-progress"]


def _task_pids() -> list[int]:
    """Ray workers running a unit: Ray titles the process `ray::<task name>` while it runs a task."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(f"ray::{TASK_NAME}".encode()):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _units_committed(out: Path) -> int:
    return len(list((out / "_parts").glob("unit-*.json"))) if (out / "_parts").is_dir() else 0


def test_ray_output_is_the_local_executors_byte_for_byte(data, local, tmp_path):
    manifest = run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(tmp_path / "ray"), workers=2,
                                               rows_per_shard=ROWS_PER_SHARD, progress=False, executor="ray"))
    assert manifest["accounting"]["rows_read"] == 50 and manifest["accounting"]["rows_rejected"] >= 2
    assert _outputs(tmp_path / "ray") == _outputs(local)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the Ray workers through /proc")
def test_a_ray_worker_killed_mid_unit_is_retried_and_the_bytes_do_not_change(data, local, tmp_path):
    out = tmp_path / "ray"
    job = subprocess.Popen(_cli(data, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    killed, deadline = None, time.time() + 180
    while killed is None and job.poll() is None and time.time() < deadline:
        pids = _task_pids()
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed = pids[0]
        time.sleep(0.01)
    stdout, stderr = job.communicate(timeout=300)
    assert killed is not None, "no Ray task was seen running: the job ended too soon to test"
    assert job.returncode == 0, stderr
    assert "rows:           read 50" in stdout
    assert _outputs(out) == _outputs(local)


def test_a_killed_driver_resumes_from_the_committed_units(data, local, tmp_path):
    out = tmp_path / "ray"
    job = subprocess.Popen(_cli(data, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 180
    while _units_committed(out) < 2 and job.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert job.poll() is None, "the job ended before it could be killed"
    os.killpg(job.pid, signal.SIGKILL)  # the driver: Ray then ends the instance it started
    job.wait()
    deadline = time.time() + 60
    while _task_pids() and time.time() < deadline:  # a unit in flight may still commit
        time.sleep(0.1)
    assert not _task_pids()
    committed = _units_committed(out)
    assert 2 <= committed < 13 and not (out / "manifest.json").exists()
    done = subprocess.run(_cli(data, out), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{committed} already done" in done.stdout
    assert _outputs(out) == _outputs(local)


@pytest.mark.parametrize("address, says", [
    ("closed", "nothing answers there"),
    ("nonsense", "not a Ray address; give the head node's HOST:PORT"),
    ("ray://closed", "nothing answers there")])
def test_a_ray_address_that_cannot_be_joined_is_one_line_exit_2_within_seconds(address, says, data, tmp_path):
    """Ray waits minutes for a head node that does not answer, and raises a ValueError with a
    traceback for an address it cannot read: both are refused before the output is claimed."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{sock.getsockname()[1]}"
    address = address.replace("closed", closed)
    out = tmp_path / "out"
    started = time.perf_counter()
    done = subprocess.run([*_cli(data, out), "--ray-address", address], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"vlmpack preprocess: error: --ray-address {address}: {says}"), done.stderr
    assert time.perf_counter() - started < 60 and not out.exists()


def _run_with_unit_1_replaced(data: Path, tmp_path: Path, action: str, *flags: str) -> subprocess.CompletedProcess:
    """The Ray job with unit 1's work replaced in every worker by `action` (one Python statement),
    through a sitecustomize module on the workers' path; the other units run as they are."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os, signal\n"
        "import preprocess.job.units as units\n"
        "real = units.process_unit\n"
        "def replaced(unit, *a, **k):\n"
        "    if unit.index == 1:\n"
        f"        {action}\n"
        "    return real(unit, *a, **k)\n"
        "units.process_unit = replaced\n")
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(inject), repo, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*_cli(data, tmp_path / "ray"), *flags], capture_output=True, text=True, timeout=300, env=env)


def test_a_unit_failing_on_ray_with_a_full_disk_is_the_local_executors_one_line(data, tmp_path):
    """A Ray task's OSError (here a full disk, raised in the worker) ends the job as a local
    worker's does: exit 4 and one line naming the file, no driver traceback."""
    done = _run_with_unit_1_replaced(data, tmp_path, "raise OSError(28, 'No space left on device', "
                                                     "'/full/shard-000001.arrow')")
    assert done.returncode == 4, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("vlmpack preprocess: error: ")]
    assert errors == ["vlmpack preprocess: error: no space left on the device writing /full/shard-000001.arrow: free "
                      "space (or use another --out) and re-run the same command; finished work is kept"], done.stderr
    assert "Traceback" not in done.stderr


def test_a_unit_whose_ray_worker_dies_past_its_retries_ends_the_job_in_one_line(data, tmp_path):
    """A Ray worker that dies on a unit more often than --ray-max-retries retries it (here killed
    by SIGKILL each time, as the out-of-memory killer does): exit 1 and one line naming the unit
    and the way to resume, no driver traceback."""
    done = _run_with_unit_1_replaced(data, tmp_path, "os.kill(os.getpid(), signal.SIGKILL)", "--ray-max-retries", "0")
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("vlmpack preprocess: error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"vlmpack preprocess: error: unit 1 ({data} rows "), done.stderr
    assert "its Ray worker died once (killed by the system" in errors[0] and "re-run the same command to resume" in errors[0]
    assert "Traceback" not in done.stderr
