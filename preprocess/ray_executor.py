"""`vlmpack preprocess --executor ray`: the job's work units as Ray tasks.

The units are the local executor's (same inputs, same `--rows-per-shard`), and a task runs
the same `process_unit`, so the shards are byte for byte a local run's. Each task writes its
shard and its unit record into the output directory (shared storage every node mounts at the
same path) with the same atomic renames; the driver holds the directory's lock, watches the
tasks, and writes `rejects.jsonl` and the manifest when all are done, as locally.

Faults: a task whose worker dies (killed, out of memory, a lost node) is retried by Ray
(`--ray-max-retries`, default 3) and redoes its unit from the start (its torn temporary file
is overwritten); a task that fails with an error is not retried, and the job stops naming it.
A restarted driver resumes from the committed units like a local job. Without
`--ray-address` a local Ray instance is started with `--workers` CPUs; with one (or
`RAY_ADDRESS`), the job joins that cluster and uses all of its CPUs.
"""

from __future__ import annotations

import dataclasses
import os
from functools import lru_cache
from pathlib import Path

from shards_schema.errors import EXIT_FAULT, UserError

from .errors import ConfigError
from .job.config import PreprocessConfig, profile_args
from .job.executor import Progress, UnitExecutor
from .job.records import remove_torn_writes
from .job.signals import stop_if_asked
from .job.units import process_unit
from .profiles import Profile, resolve_profile

TASK_NAME = "vlmpack_preprocess_unit"  # Ray shows it as the worker's process title: ray::<name>


@lru_cache(maxsize=2)
def _worker_profile(profile_args: tuple, fingerprint_id: str):
    """A worker loads the profile once (from its small spec) for all the units it runs."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    profile = resolve_profile(**dict(profile_args), check_template=False)
    if profile.fingerprint["id"] != fingerprint_id:
        raise RuntimeError(f"a Ray worker loaded profile {profile.fingerprint['id']}, the job runs {fingerprint_id}: "
                           "do all nodes see the same model files?")
    return profile


def _unit_task(unit, name: str, rows_per_unit: int, out: str, profile_args: tuple, fingerprint_id: str, options) -> dict:
    return process_unit(unit, name, rows_per_unit, Path(out), _worker_profile(profile_args, fingerprint_id), options)


def _absolute(unit):
    """Paths as every node sees them: absolute (a Ray worker's working directory is its own)."""
    from shards_schema.storage import is_url

    if is_url(unit.input.path):  # hf://, s3://, ...: the same everywhere
        return unit
    return dataclasses.replace(unit, input=dataclasses.replace(unit.input, path=os.path.abspath(unit.input.path)))


class RayExecutor(UnitExecutor):
    """The units as Ray tasks: Ray is started (or joined) for the units and shut down after them."""

    def __init__(self, cfg: PreprocessConfig, profile: Profile):
        self.cfg, self.profile = cfg, profile
        if cfg.ray_cluster_address:  # before the output directory is claimed
            _check_address(cfg.ray_cluster_address)

    @property
    def parallelism_is_workers(self) -> bool:
        return not self.cfg.ray_cluster_address  # a cluster's CPUs are not --workers

    def run_units(self, units, names: dict[str, str], out: Path, progress: Progress) -> None:
        try:
            _run_units_on_ray(units, names, self.cfg, out, self.profile, progress)
        except BaseException:
            remove_torn_writes(out)
            raise


class RayWorkerLost(UserError):
    """A unit's Ray worker died more often than --ray-max-retries retries it: exit 1, as a local
    job that lost a worker (`job.signals.WorkerLost`)."""

    exit_code = EXIT_FAULT


ADDRESS_FORM = "HOST:PORT (its GCS port, 6379 unless `ray start --head --port` set another), ray://HOST:PORT or auto"
# How long the head node's port may take to accept a connection before the cluster counts as
# unreachable: Ray itself waits minutes for a GCS that never answers.
CONNECT_TIMEOUT = 10.0


def _check_address(address: str) -> None:
    """Refuse in one line an address Ray could not read, or one where nothing accepts a
    connection (ray.init would wait for it for minutes)."""
    import socket

    if address in ("auto", "local"):
        return
    where = address.split("://", 1)[1] if address.startswith("ray://") else address
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--ray-address {address}: not a Ray address; give the head node's {ADDRESS_FORM}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"--ray-address {address}: nothing answers there ({reason}); start the cluster "
                          "(`ray start --head`) or give its head node's address") from None


def _run_units_on_ray(units, names: dict[str, str], cfg: PreprocessConfig, out: Path, profile: Profile,
                      show: Progress) -> None:
    """Run `units` as Ray tasks; `show(rows, rejected)` advances the progress bar as units finish."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install 'vlmpack[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        address = cfg.ray_cluster_address
        try:
            if address:
                ray.init(address=address, log_to_driver=False, include_dashboard=False)
            else:
                ray.init(num_cpus=cfg.workers, log_to_driver=False, include_dashboard=False)
        except (ConnectionError, ValueError) as exc:
            raise ConfigError(f"--ray-address {address}: cannot join the Ray cluster ({exc}); give the head node's "
                              f"{ADDRESS_FORM}") from None
    options = cfg.sample
    if options.media_root is not None:
        options = dataclasses.replace(options, media_root=os.path.abspath(options.media_root))
    task = ray.remote(num_cpus=1, max_retries=cfg.ray_max_retries, retry_exceptions=False)(_unit_task).options(
        name=TASK_NAME)
    profile_spec = tuple(sorted(profile_args(cfg).items()))
    pending = {task.remote(_absolute(unit), names[unit.input.path], cfg.rows_per_shard, str(out.resolve()),
                           profile_spec, profile.fingerprint["id"], options): unit for unit in units}
    try:
        while pending:
            stop_if_asked()
            finished, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.25)
            for ref in finished:
                unit = pending.pop(ref)
                try:
                    record = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    if isinstance(exc.cause, (OSError, UserError)):  # the output's (a full disk) or the user's:
                        raise exc.cause from None  # one line, as when a local worker raises it
                    raise RuntimeError(f"unit {unit.index} ({unit.input.path} rows {unit.start}-{unit.stop - 1}) "
                                       f"failed on Ray: {exc.cause!r}") from None
                except ray.exceptions.WorkerCrashedError:
                    tries = cfg.ray_max_retries + 1
                    died = "once" if tries == 1 else f"{tries} times"
                    raise RayWorkerLost(f"unit {unit.index} ({unit.input.path} rows {unit.start}-{unit.stop - 1}): its "
                                        f"Ray worker died {died} (killed by the system, e.g. "
                                        "out of memory? see the Ray logs); finished shards are kept: re-run the same "
                                        "command to resume") from None
                show(record["rows_read"], record["rows_rejected"])
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    finally:
        if started_here:
            ray.shutdown()
