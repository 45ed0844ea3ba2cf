"""Running `vlmpack train` in a process of its own, as a real launch does, and reading what the
run wrote: the tiny model's flags, the run itself, its metrics and checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.cli import REPO_ROOT, process_env

SEQ_LEN = 1024
BASE = ["--arch", "tiny", "--seq-len", str(SEQ_LEN), "--global-batch-packs", "2", "--lr", "3e-3",
        "--warmup-steps", "1", "--num-workers", "0", "--tensorboard", "false", "--log-every", "1"]

# `vlmpack train ...`, then the list of every module the process has loaded.
REPORT_MODULES = ("import json, sys; from shards_schema.cli import main; rc = main(['train', *sys.argv[2:]]); "
                  "open(sys.argv[1], 'w').write(json.dumps(sorted(sys.modules))); sys.exit(rc)")


def run_train(args: list[str], *, nproc: int = 1, timeout: int = 600, modules_to: Path | None = None,
              code: str | None = None):
    """A training process of its own (fresh sys.modules and process groups), like a real launch;
    `code` runs in place of `python -m train.trainer` (same arguments)."""
    # the suite runs one test at a time on 2 cores: a lone process takes both, each of two takes one
    env = {**process_env(), "OMP_NUM_THREADS": "2" if nproc == 1 else "1"}
    if modules_to is not None:
        cmd = [sys.executable, "-c", REPORT_MODULES, str(modules_to), *args]
    elif nproc == 1:
        cmd = [sys.executable, *(["-c", code] if code else ["-m", "train.trainer"]), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(29600 + os.getpid() % 300),
               *(["--no-python", sys.executable, "-c", code] if code else ["-m", "train.trainer"]), *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def start_run_from(checkpoint: Path, out: Path) -> None:
    """A new run directory whose latest checkpoint is a copy of `checkpoint` (for --resume)."""
    shutil.copytree(checkpoint, out / "checkpoints" / checkpoint.name)
    (out / "checkpoints" / "latest").write_text(checkpoint.name)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def stopped_and_resumed(args: list[str], tmp: Path, stop_at: int) -> tuple[Path, Path, list[float]]:
    """`args` trained through into tmp/full, and into tmp/part stopped after step `stop_at`
    (--exit-interval) then resumed; the two runs' losses must be equal bitwise. Returns
    (full, part, losses)."""
    full, part = tmp / "full", tmp / "part"
    ok(run_train([*args, "--out", str(full)]))
    ok(run_train([*args, "--out", str(part), "--exit-interval", str(stop_at)]))
    ok(run_train([*args, "--out", str(part), "--resume"]))
    losses = [m["loss"] for m in metrics(full)]
    assert [m["loss"] for m in metrics(part)] == losses
    return full, part, losses


# the GPU tests' device and precision
GPU = ["--device", "cuda", "--bf16", "true"]

# Before each save: the DistributedOptimizer's parameter state as a background save assembles
# it from host copies, and as megatron gathers it, must be the same, tensor for tensor.
COMPARE_PARAMETER_STATE = """
import sys, torch, train.checkpoint as ckpt, train.trainer as trainer
def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
real = ckpt.CheckpointSaver.save
def save(self, step, model, optimizer, *args, **kwargs):
    self.wait()  # the save before is complete: its host buffers are spare
    snapshot = ckpt.ParameterStateSnapshot(optimizer, ckpt.HostCopies(torch.device("cuda")))
    torch.cuda.synchronize()
    reference = ckpt._gather_parameter_state(optimizer)
    assert same(snapshot.assemble(), reference), f"step {step}: parameter states differ"
    print(f"parameter state of step {step}: same, {'written' if reference is not None else 'none on this rank'}",
          flush=True)
    spare = [t for buffers in self.host._spare.values() for t in buffers]
    print(f"host buffers before step {step}: {len(spare)}, pinned: {all(t.is_pinned() for t in spare)}", flush=True)
    return real(self, step, model, optimizer, *args, **kwargs)
ckpt.CheckpointSaver.save = save
sys.exit(trainer.main(sys.argv[1:]))
"""
