"""What every benchmark shares: the repository on `sys.path`, a timestamped log line, the
argument parser with `--json-out`, and `machine_info`, the provenance written with each result
(date, git commit, device, library versions, the command line).

The scripts run as `python benchmarks/X.py`, which puts `benchmarks/` on `sys.path`, so they
import this module as `common`; importing it puts the repository root there too.

Results are kept as `benchmarks/results/<benchmark>[_<setting>]_<device>_<yyyymmdd>.json`, with
the console output alongside as `.log` where it is kept; docs/benchmarks.md cites them.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

T0 = time.perf_counter()


def log(msg: str) -> None:
    """`[seconds since start] msg`, with the rank in front under torch.distributed."""
    dist = sys.modules.get("torch.distributed")
    rank = f"rank {dist.get_rank()} " if dist is not None and dist.is_available() and dist.is_initialized() else ""
    print(f"[{rank}{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def parser(doc: str, *, json_out: str | None = "the full result as JSON") -> argparse.ArgumentParser:
    """An argument parser described by `doc` (the module docstring: its first paragraph above
    the options, the rest below), with `--json-out` unless `json_out` is None."""
    description, _, epilog = doc.partition("\n\n")
    ap = argparse.ArgumentParser(description=description, epilog=epilog or None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if json_out is not None:
        ap.add_argument("--json-out", default=None, metavar="FILE",
                        help=f"write {json_out} to FILE (kept results: benchmarks/results/"
                             "<benchmark>_<device>_<yyyymmdd>.json)")
    return ap


def add_video_arguments(ap: argparse.ArgumentParser, *, seconds: float) -> None:
    """The generated video's length, frame rate and size (the video benchmarks)."""
    ap.add_argument("--seconds", type=float, default=seconds, help="length of each generated video (default %(default)s)")
    ap.add_argument("--fps", type=float, default=30.0, help="its frame rate (default %(default)s)")
    ap.add_argument("--width", type=int, default=640, help="its width (default %(default)s)")
    ap.add_argument("--height", type=int, default=360, help="its height (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default %(default)s)")


def register_fewer_layers(name: str, layers: int) -> str:
    """A built-in architecture with only `layers` decoder layers, registered in this process
    under `NAME-LAYERSl` so that the trainer (`--arch`) and HF build the same model."""
    import dataclasses

    from train.model.arch import BUILTIN_ARCHS, builtin_arch

    arch = builtin_arch(name)
    if not arch.num_deepstack <= layers <= arch.lm.num_layers:
        raise SystemExit(f"--layers {layers}: {name} has {arch.lm.num_layers} decoder layers and adds DeepStack "
                         f"features after the first {arch.num_deepstack}; use {arch.num_deepstack}..{arch.lm.num_layers}")
    short = f"{name}-{layers}l"
    lm = dataclasses.replace(arch.lm, num_layers=layers, layer_types=arch.lm.layer_types[:layers])
    BUILTIN_ARCHS[short] = dataclasses.replace(arch, lm=lm)
    return short


def write_json(path: str | Path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str | None:
    """Installed version, read from the package metadata (nothing imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# environment variables that change what torch compiles or how it rounds and communicates
NUMERICS_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_", "PYTORCH_", "NCCL_", "CUBLAS_")


def command_line() -> str:
    """How this process was started, script path relative to the repository (under torchrun:
    `torchrun --nproc-per-node N ...`, from torchrun's environment)."""
    script = os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else ""
    launcher = ["python"]
    if "LOCAL_WORLD_SIZE" in os.environ:
        launcher = ["torchrun", "--nproc-per-node", os.environ["LOCAL_WORLD_SIZE"]]
    return shlex.join([*launcher, script, *sys.argv[1:]])


def machine_info(device=None) -> dict:
    """Provenance of a result: date, commit, device (the GPU's name on CUDA, else the CPU
    model), torch / transformers / megatron-core versions, the command line and the environment
    variables that change compilation or numerics (`NUMERICS_ENV_PREFIXES`). `device` is a
    torch device or its string; None means the current CUDA device if torch has one, else CPU."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": command_line(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(NUMERICS_ENV_PREFIXES)},
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "pyarrow": _version("pyarrow"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "megatron_core": _version("megatron-core"),
        "peft": _version("peft"),
        "liger_kernel": _version("liger-kernel"),
        "flash_attn_4": _version("flash-attn-4"),
    }
    torch = sys.modules.get("torch")
    if torch is None and str(device).startswith("cuda"):
        import torch
    cuda = torch is not None and torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if cuda:
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(dev)
        info.update(device=props.name, gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                    gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info["device"] = info["cpu"]
    return info
