"""How a job's work units run: one interface for the executors `--executor` names.

`LocalExecutor` (preprocess/job/local.py) runs them in this process or on worker processes of
this machine, `RayExecutor` (preprocess/ray_executor.py) as Ray tasks. Either runs the same
`process_unit`, so the shards are byte for byte the same. `run_preprocess` enters the executor
for the whole job (a local pool starts while the inputs are scanned) and hands it the units
still to do."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from ..inputs import WorkUnit


class Progress:
    """The job's progress bar: `progress(rows, rejected)` as rows are done."""

    def __init__(self, total_rows: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total_rows, unit="row", desc="preprocess", disable=not enabled, smoothing=0.05)
        self.rejected = 0

    def __call__(self, rows: int, rejected: int) -> None:
        self.rejected += rejected
        self.bar.update(rows)
        self.bar.set_postfix(rejected=self.rejected, refresh=False)

    def close(self) -> None:
        self.bar.close()


class UnitExecutor(ABC):
    """Runs a job's work units. Used as a context manager around the whole job: whatever it
    starts (worker processes) ends with the block, however the block ends."""

    def __enter__(self) -> UnitExecutor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        return None

    @property
    def parallelism_is_workers(self) -> bool:
        """Whether `--workers` is how many units run at once (a Ray cluster's CPUs are not)."""
        return True

    @abstractmethod
    def run_units(self, units: list[WorkUnit], names: dict[str, str], out: Path, progress: Progress) -> None:
        """Run `units` into the output directory `out`, each committing its shard and unit record;
        `names[unit.input.path]` is how a unit's input is recorded. `progress(rows, rejected)`
        reports rows as they are done. A stop signal (`signals.stop_if_asked`, checked while
        waiting) or a failure ends the running units and leaves no torn writes in `out`."""
