"""The trainer's profiling options: torch.profiler over a window of steps and a CUDA memory
snapshot, written under OUT/profile/ (docs/training.md, "Profiling a run").

    --profile-start N [--profile-steps K]  steps N .. N+K-1 each under torch.profiler (host and
                                           CUDA activity): one Chrome trace per step and rank,
                                           OUT/profile/step_0000000N_rank_00000.json (Perfetto,
                                           chrome://tracing)
    --memory-snapshot                      every CUDA allocation recorded from the first step; the
                                           snapshot written after the last profiled step (step 1
                                           without --profile-start) as
                                           OUT/profile/memory_snapshot_step_..._rank_....pickle
                                           (pytorch.org/memory_viz); --memory-snapshot-stacks
                                           all|python|none: the stack kept with each allocation

The per-step timings (data wait, forward+backward, optimizer, the whole step after a CUDA
synchronize) are in every metrics.jsonl record, profiled or not.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch

PROFILE_DIR = "profile"
MEMORY_HISTORY_ENTRIES = 100_000  # allocations the snapshot keeps, newest last (torch's own default)


class Profiling:
    """What the profiling settings ask of each step (`step(n)` around it)."""

    def __init__(self, settings, out: Path, info):
        self.start, self.count = settings.profile_start, settings.profile_steps or 1
        self.dir = Path(out) / PROFILE_DIR
        self.rank = info.rank
        self.profiler = None  # the last profiled step's torch.profiler.profile, for callers that summarise it
        self.traces: list[Path] = []
        self.cuda = info.device.type == "cuda"
        self.snapshot_step = None
        if settings.memory_snapshot and not self.cuda:
            if info.is_main:
                print("vlmpack train: --memory-snapshot records CUDA allocations; this CPU run writes none",
                      file=sys.stderr, flush=True)
        elif settings.memory_snapshot:
            self.snapshot_step = self.start + self.count - 1 if self.start else 1
            stacks = settings.memory_snapshot_stacks
            torch.cuda.memory._record_memory_history(context=None if stacks == "none" else "all",
                                                     stacks="all" if stacks == "none" else stacks,
                                                     max_entries=MEMORY_HISTORY_ENTRIES)

    def profiled(self, number: int) -> bool:
        return bool(self.start) and self.start <= number < self.start + self.count

    @contextmanager
    def step(self, number: int):
        """Step `number` (1-based) under the profiler if it is in the window; the memory
        snapshot written after its step."""
        if self.profiled(number):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as profiler:
                yield
            self.profiler = profiler
            self.traces.append(self._write_trace(profiler, number))
        else:
            yield
        if number == self.snapshot_step:
            self._write_memory_snapshot(number)

    def _write_trace(self, profiler, number: int) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{number:08d}_rank_{self.rank:05d}.json"
        profiler.export_chrome_trace(str(path))
        return path

    def _write_memory_snapshot(self, number: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_snapshot_step_{number:08d}_rank_{self.rank:05d}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)  # the recording costs host time every allocation
