"""`--executor local`: the job's units in this process (`--workers 1`, or a single unit) or on
a pool of `--workers` spawned processes of this machine.

Workers die with the job: killed (even with SIGKILL), the parent takes its workers with it;
a stop signal ends the workers and stops the job with committed units kept, also when the
signal reached the workers first (a scheduler signals the whole process group). A worker lost
on its own is named by what ended it (`signals.WorkerLost`).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shards_schema import storage
from shards_schema.errors import UserError

from ..inputs import WorkUnit
from ..pipeline import SampleOptions
from ..profiles import Profile, resolve_profile
from .config import PreprocessConfig, profile_args
from .executor import Progress, UnitExecutor
from .identity import file_stat, input_files
from .records import remove_torn_writes
from .signals import WorkerLost, stop_if_asked, worker_death_signal
from .units import process_unit

EARLY_ROW_BYTES = 16 * 1024  # a generous row (an inline image); rows naming image files are far smaller
PARENT_WATCH_SECONDS = 0.5
WORKER_EXIT_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

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
        size = sum(file_stat(file)["size"] for spec in cfg.inputs if not storage.is_url(spec) for file in input_files(spec))
    except (OSError, UserError):
        return 0  # the scan reports the input's problem
    return min(cfg.workers, -(-size // (cfg.num_partitions * cfg.rows_per_shard * EARLY_ROW_BYTES)))


def _start_local_pool(cfg: PreprocessConfig, profile: Profile) -> _LocalPool | None:
    """Start worker processes now, before the input scan: their interpreter start-up and
    tokenizer load (about a second) then overlap the scan instead of delaying the first unit.
    None where the job runs in this process."""
    if cfg.workers <= 1:
        return None
    ctx = mp.get_context("spawn")  # no fork: tokenizers/threads in the parent must not leak into workers
    _start_resource_tracker()
    rows_done, rows_rejected = ctx.Value("q", 0), ctx.Value("q", 0)
    others = set(mp.active_children())
    executor = cf.ProcessPoolExecutor(
        max_workers=cfg.workers,
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(os.getpid(), profile_args(cfg), profile.fingerprint["id"], cfg.sample, cfg.rows_per_shard,
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


class LocalExecutor(UnitExecutor):
    """Entered, it starts the worker pool (`_start_local_pool`); its processes end with the
    block, however it ends: after their work, or at once when the block fails or is stopped."""

    def __init__(self, cfg: PreprocessConfig, profile: Profile):
        self.cfg, self.profile, self.pool = cfg, profile, None

    def __enter__(self) -> LocalExecutor:
        self.pool = _start_local_pool(self.cfg, self.profile)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _end_local_pool(self.pool, wait=exc_type is None)

    def run_units(self, units: list[WorkUnit], names: dict[str, str], out: Path, progress: Progress) -> None:
        cfg, pool = self.cfg, self.pool
        if pool is None or len(units) <= 1:
            for unit in units:
                process_unit(unit, names[unit.input.path], cfg.rows_per_shard, out, self.profile, cfg.sample,
                             on_rows=progress)
            return
        try:
            pending = {pool.executor.submit(_worker_process_unit, unit, names[unit.input.path], out) for unit in units}
            seen_done, seen_rejected = pool.rows_done.value, pool.rows_rejected.value
            while pending:
                stop_if_asked()
                finished, pending = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    fut.result()  # re-raise a worker's failure here
                done, rej = pool.rows_done.value, pool.rows_rejected.value
                progress(done - seen_done, rej - seen_rejected)
                seen_done, seen_rejected = done, rej
        except BaseException as exc:
            # Stop now: no new units, the running ones end, and their half-written shards go
            # (those units are redone on resume).
            workers = list((pool.executor._processes or {}).values())  # the shutdown forgets them
            _end_local_pool(pool, wait=False)
            remove_torn_writes(out)
            if isinstance(exc, cf.process.BrokenProcessPool):
                # A scheduler signals the whole process group: the workers die of the signal
                # the job itself was asked to stop by (recorded already: it came first).
                stop_if_asked()
                raise WorkerLost(worker_death_signal([p.exitcode for p in workers])) from None
            raise
