"""What a run reports: a live progress line, metrics.jsonl, TensorBoard scalars and, with
--wandb-project, the same scalars in Weights & Biases.

Only the main rank writes. Each step's time is split into data wait (the next global batch
from the loader, on the host), forward+backward, optimizer step and checkpoint stall; on a
GPU the middle two are CUDA-event times read after the step's closing synchronize, so
measuring them adds no synchronization. MFU is the language model's: 6 * N_lm flops per real token
(N_lm = decoder + output projection parameters; attention score flops and the vision tower
are not counted, so it is a lower bound on hardware use) over the GPUs' dense bf16 peak.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from shards_schema.errors import UserError

METRICS_FILE = "metrics.jsonl"  # one JSON record per logged step, in --out
DENSE_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}


def lm_flops_per_token(arch) -> float:
    return 6.0 * arch.lm.num_non_embedding_params()


def peak_tflops(device: torch.device) -> float:
    """Dense bf16 peak of one GPU, 0 when unknown (then MFU is not reported)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DENSE_BF16_TFLOPS.items() if k in name), 0.0)


def wandb_run_id(out: Path) -> str:
    """A W&B run id that is the same for every start of the run in `out` (kept in `out`)."""
    path = out / "wandb_run_id"
    if not path.exists():
        import secrets

        path.write_text(secrets.token_hex(8) + "\n")
    return path.read_text().strip()


def _fmt_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StepTimer:
    """Marks between a step's phases; `seconds()` after the step has synchronized. CUDA events on
    a GPU (no added synchronization), the host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """The time between consecutive marks, then forgets them."""
        marks, self.marks = self.marks, []
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


class MetricsLogger:
    def __init__(self, out: Path, config, info, enabled: bool, *, total_steps: int, run_config: dict):
        """`config`: the logging section (`train.config.LoggingConfig`); `run_config`: every
        setting of the run (flat), which a Weights & Biases run records."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.start = time.perf_counter()
        self.first_step = None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / METRICS_FILE, "a")
        self.tb = self.wandb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out / "tensorboard"))
        if config.wandb_project:
            import wandb

            # resume="allow" with a run id from --out: a resumed run continues the same W&B run
            try:
                self.wandb = wandb.init(project=config.wandb_project, name=config.wandb_run_name or out.resolve().name,
                                        id=wandb_run_id(out), resume="allow", dir=str(out),
                                        config={k: v for k, v in run_config.items() if v is not None})
            except Exception as exc:  # noqa: BLE001 - wandb's own errors vary (login, network, settings)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise UserError(f"--wandb-project {config.wandb_project}: Weights & Biases did not start ({first}); "
                                "run `wandb login`, or set WANDB_MODE=offline to log under --out only") from None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if self.first_step is None:
            self.first_step, self.start = step - 1, time.perf_counter() - record["step_seconds"]
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        scalars = {f"train/{key}": value for key, value in record.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        elapsed = time.perf_counter() - self.start
        done = step - self.first_step
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}", f"loss {record['loss']:.4f}",
                 f"lr {record['lr']:.2e}", f"{record['tokens_per_s']:,.0f} tok/s"]
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        if record.get("peak_memory_gib") is not None:
            parts.append(f"mem {record['peak_memory_gib']:.1f} GiB")
        if "eval_loss" in record:
            parts.append(f"eval {record['eval_loss']:.4f}")
        parts.append(f"ETA {_fmt_seconds(eta)}")
        print(" | ".join(parts), flush=True)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()
