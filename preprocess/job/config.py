"""`PreprocessConfig`: every setting of a preprocess job, and the checks made before any work."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from shards_schema.storage import MAX_FETCH_RETRIES

from ..errors import ConfigError
from ..formats import INPUT_FORMATS
from ..media import MAX_OPTION_INTEGER
from ..pipeline import SampleOptions

DEFAULT_ROWS_PER_SHARD = 1024
INPUT_HASH_MODES = ("sampled", "full")
EXECUTORS = ("local", "ray")
MAX_WORKERS = 4096  # processes on one machine; a larger number is a typo (and overflows the pool's C ints)
MAX_RAY_RETRIES = 1000


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


def profile_args(cfg: PreprocessConfig) -> dict:
    """The small spec every worker loads the job's profile from (`resolve_profile` arguments)."""
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
    from ..render import LOSS_POLICIES, REASONING_LOSSES

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

