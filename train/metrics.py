"""What a run reports: a live progress line, metrics.jsonl, TensorBoard scalars.

Only the main rank writes. MFU is the language model's: 6 * N_lm flops per real token
(N_lm = decoder + output projection parameters; attention score flops and the vision tower
are not counted, so it is a lower bound on hardware use) over the GPUs' dense bf16 peak.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

DENSE_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}


def lm_flops_per_token(arch) -> float:
    return 6.0 * arch.lm.num_non_embedding_params()


def peak_tflops(device: torch.device) -> float:
    """Dense bf16 peak of one GPU, 0 when unknown (then MFU is not reported)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DENSE_BF16_TFLOPS.items() if k in name), 0.0)


def _fmt_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class MetricsLogger:
    def __init__(self, out: Path, config, info, enabled: bool):
        self.enabled = enabled
        self.total_steps = config.train_steps
        self.start = time.perf_counter()
        self.first_step = None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / "metrics.jsonl", "a")
        self.tb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out / "tensorboard"))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if self.first_step is None:
            self.first_step, self.start = step - 1, time.perf_counter() - record["step_seconds"]
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.tb.add_scalar(f"train/{key}", value, step)
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
