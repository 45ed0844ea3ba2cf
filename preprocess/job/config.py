"""`PreprocessConfig`: every setting of a preprocess job, and the checks made before any work."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from shards_schema.flags import nested, refuse_bad_location, refuse_empty, setting
from shards_schema.storage import MAX_FETCH_RETRIES, FetchPolicy, is_url, redact

from ..errors import ConfigError
from ..formats import INPUT_FORMATS
from ..media import MAX_OPTION_INTEGER
from ..pipeline import SampleOptions
from ..profiles import both_profile_sources

DEFAULT_ROWS_PER_SHARD = 1024
INPUT_HASH_MODES = ("sampled", "full")
EXECUTORS = ("local", "ray")
MAX_WORKERS = 4096  # processes on one machine; a larger number is a typo (and overflows the pool's C ints)
MAX_RAY_RETRIES = 1000
DEFAULT_RAY_RETRIES = 3


@dataclass(kw_only=True)
class PreprocessConfig:
    """Everything `vlmpack preprocess` takes: each field is its flag (shards_schema.flags), the
    fields in the order of `--help`."""

    inputs: list[str] = setting(name="inputs", nargs="+",
                                help=".jsonl / .json / .parquet files (local, or s3:// / gs:// / other fsspec URLs), `datasets` "
                                     "save_to_disk directories, or Hub datasets as hf://datasets/ORG/NAME?split=SPLIT")
    # the rows' layout (preprocess.formats): detected per input, or named
    input_format: str = setting(
        "auto", choices=INPUT_FORMATS,
        help="the rows' layout: openai (messages with content parts), sharegpt (conversations "
             "with from/value and <image>/<video> placeholders, as LLaMA-Factory and LLaVA write), "
             "swift (messages with <image> tags or bare image parts plus images/videos lists, as "
             "ms-swift and TRL write); auto (default) detects it per input from its first row")
    out: str = setting(required=True,
                       help="output shard directory (or an s3:// / gs:// prefix: staged locally, then uploaded): new "
                            "or empty (a directory holding anything else is refused); "
                            "re-running the same job into it resumes")
    profile: str | None = setting(
        None, group="model profile",
        help="built-in profile: qwen3-vl (default), qwen3-vl-thinking (the Thinking checkpoints' template: "
             "reasoning_content / <think> blocks), qwen2.5-vl, qwen3.5 or qwen3.6 (Qwen3.5 / Qwen3.6 "
             "checkpoints: thinking, XML tool calls)")
    model: str | None = setting(None, group="model profile",
                                help="Hugging Face model directory (tokenizer, preprocessor config, chat template) "
                                     "as the profile, instead of --profile")
    min_pixels: int | None = setting(None, group="model profile", type=int,
                                     help="override the profile's minimum image area")
    max_pixels: int | None = setting(None, group="model profile", type=int,
                                     help="override the profile's maximum image area")
    sample: SampleOptions = nested(default_factory=SampleOptions)
    # the command line's default is every core; a config built in code runs in this process
    workers: int = setting(1, group="job", type=int, flag_default=min(os.cpu_count() or 1, MAX_WORKERS),
                           help=f"worker processes, 1 to {MAX_WORKERS} (default: all cores, %(default)s)")
    rows_per_shard: int = setting(DEFAULT_ROWS_PER_SHARD, group="job", type=int,
                                  help="input rows per shard file / work unit (default %(default)s)")
    # the command line's default None tells a flag left out from one given (`partition_from_flags`)
    num_partitions: int = setting(1, group="job", type=int, flag_default=None,
                                  help="split the job across this many machines (K); each runs it with its own "
                                       "--partition-index, then `vlmpack merge` joins their outputs")
    partition_index: int = setting(0, group="job", type=int, flag_default=None,
                                   help="which partition this machine runs, 0 to K-1; needed with --num-partitions "
                                        "K > 1, and only with it")
    input_hash: str = setting(
        "sampled", group="job", choices=INPUT_HASH_MODES,
        help="how a resumed job checks that its inputs did not change: 'sampled' (default) compares "
             "size, modification time and a hash of sampled blocks; 'full' hashes whole inputs "
             "(slower; timestamps then do not matter). A job resumes with the mode it started with")
    # with --out on an object store: where the job runs before the upload
    stage_dir: str | None = setting(
        None, group="job",
        help="with --out on an object store (s3://, gs://): the local directory the job runs in before "
             "its upload (default: one per output URL and job under the temporary directory); removed "
             "once the upload is complete, kept when it is cut short: the same command resumes from it")
    # "local": worker processes on this machine; "ray": Ray tasks (preprocess/ray_executor.py)
    executor: str = setting(
        "local", group="job", choices=EXECUTORS,
        help="local (default): --workers processes on this machine; ray: the work units as Ray tasks "
             "(output byte-identical; --out must be storage every Ray node sees at the same path)")
    # a running Ray cluster to join (None: RAY_ADDRESS, else a local instance)
    ray_address: str | None = setting(
        None, group="job", metavar="ADDR",
        help="with --executor ray: the Ray cluster to join (default: RAY_ADDRESS, else a local Ray "
             "instance with --workers CPUs)")
    # times Ray re-runs a unit whose worker died; the command line's default None tells a flag left
    # out from one given (`flags_acting_only_with`)
    ray_max_retries: int = setting(DEFAULT_RAY_RETRIES, group="job", type=int, flag_default=None,
                                   help=f"with --executor ray: times a unit whose worker died is re-run, 0 to "
                                        f"{MAX_RAY_RETRIES} (default {DEFAULT_RAY_RETRIES})")
    progress: bool = setting(True, group="job", name="--no-progress", action="store_false", dest="progress",
                             help="no progress bar")

    @property
    def ray_cluster_address(self) -> str | None:
        """The Ray cluster `--executor ray` joins; None: it starts a local instance of `workers` CPUs."""
        return self.ray_address or os.environ.get("RAY_ADDRESS")


def profile_args(cfg: PreprocessConfig) -> dict:
    """The small spec every worker loads the job's profile from (`resolve_profile` arguments)."""
    return {"name": cfg.profile, "model_dir": cfg.model, "min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}


def partition_from_flags(num_partitions: int | None, partition_index: int | None) -> tuple[int, int]:
    """(num_partitions, partition_index) of the command line, None where a flag was left out:
    both or neither, since a partitioned job run without its index would silently run partition
    0 on every machine. `--num-partitions 1` alone is the one partition there is."""
    if partition_index is None:
        if num_partitions is not None and num_partitions > 1:
            raise ConfigError(f"--num-partitions {num_partitions} needs --partition-index: give each machine its own "
                              f"--partition-index, 0 to {num_partitions - 1}")
        return (1 if num_partitions is None else num_partitions), 0
    if num_partitions is None:
        raise ConfigError(f"--partition-index {partition_index} needs --num-partitions: give the number of partitions "
                          "the job is split into, K, with --num-partitions K (the index runs from 0 to K-1)")
    return num_partitions, partition_index


# flags that act only with another setting: (the flag's destination, the flag, the setting's
# destination, the value it needs, how to give it, the flag's default, what the flag does)
_ACTING_ONLY_WITH = (
    ("remote_timeout", "--remote-timeout", "allow_remote_media", True, "--allow-remote-media", FetchPolicy.timeout,
     "times fetches of media URLs, which only --allow-remote-media makes"),
    ("remote_retries", "--remote-retries", "allow_remote_media", True, "--allow-remote-media", FetchPolicy.retries,
     "retries fetches of media URLs, which only --allow-remote-media makes"),
    ("ray_max_retries", "--ray-max-retries", "executor", "ray", "--executor ray", DEFAULT_RAY_RETRIES,
     "sets how often Ray re-runs a task of --executor ray"),
)


def flags_acting_only_with(args) -> None:
    """Fill in, on the parsed command line `args`, the flags that act only with another setting
    (None where left out: their defaults). One given without that setting would be silently
    ignored, so it is refused, as --ray-address is without --executor ray."""
    for dest, flag, needs, needed, fix, default, what in _ACTING_ONLY_WITH:
        value = getattr(args, dest)
        if value is None:
            setattr(args, dest, default)
        elif getattr(args, needs) != needed:
            raise ConfigError(f"{flag} {value} {what}: add {fix}, or drop {flag}")


MAX_SEQ_LEN = 2**31 - 1  # a sample's token positions are int32


def _at_least(flag: str, value, minimum: int) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"{flag} must be an integer >= {minimum}, got {value}")


def _in_range(flag: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{flag} must be an integer from {low} to {high}, got {value}")


def check_config(cfg: PreprocessConfig) -> None:
    """Every setting checked before any work: one message naming the flag and its valid range."""
    for flag, value in (("--profile", cfg.profile), ("--ray-address", cfg.ray_address)):
        refuse_empty(flag, value)
    for flag, value in (("--out", cfg.out), ("--model", cfg.model), ("--media-root", cfg.sample.media_root),
                        ("--stage-dir", cfg.stage_dir)):
        refuse_bad_location(flag, value)
    for path in cfg.inputs:
        refuse_bad_location("an input", path, "give its path")
    _in_range("--workers", cfg.workers, 1, MAX_WORKERS)
    _at_least("--rows-per-shard", cfg.rows_per_shard, 1)
    _at_least("--num-partitions", cfg.num_partitions, 1)
    if not 0 <= cfg.partition_index < cfg.num_partitions:
        raise ConfigError(f"--partition-index must be in 0..{cfg.num_partitions - 1} (--num-partitions "
                          f"{cfg.num_partitions}), got {cfg.partition_index}")
    if refusal := both_profile_sources(cfg.profile, cfg.model):
        raise ConfigError(refusal)
    _in_range("--max-seq-len", cfg.sample.max_seq_len, 1, MAX_SEQ_LEN)
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
    if cfg.ray_address is not None and cfg.executor != "ray":
        raise ConfigError(f"--ray-address {cfg.ray_address} joins a Ray cluster for --executor ray: add --executor ray, "
                          "or drop --ray-address to run on this machine")
    video = cfg.sample.video
    if video.cap_pixels_per_frame and video.sampling == "qwen-vl-utils":
        raise ConfigError("--video-pixel-cap caps frames of --video-sampling hf; qwen-vl-utils sampling always caps "
                          "each frame's pixels itself, so the flag would change nothing: drop --video-pixel-cap")
    if cfg.stage_dir and is_url(cfg.stage_dir):  # Path() would fold it into a local directory `s3:/...`
        raise ConfigError(f"--stage-dir {redact(cfg.stage_dir)} is a URL: the job runs in a local directory before its "
                          "upload to --out; give a local path (on storage every node mounts, with --executor ray)")
    if cfg.stage_dir and not is_url(cfg.out):
        raise ConfigError(f"--stage-dir {cfg.stage_dir} is where a job whose --out is on an object store runs before "
                          f"its upload; --out {cfg.out} is local, so the job runs there: drop --stage-dir")
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

