"""Stop on a scheduler's signal: finish the step, save, exit cleanly.

Cluster schedulers announce preemption and time limits with a signal before they kill a job:
SLURM sends SIGTERM (`--signal=TERM@120`: two minutes ahead), Kubernetes SIGTERM with a grace
period; SIGUSR1 is the usual user-chosen early warning. On either, `vlmpack train` finishes the step in flight, saves a
checkpoint (a stop asked for mid-step costs no work) and exits 0, so a requeued job continues
with `--resume` from exactly that step. The ranks agree on the stop through the step's loss
all-reduce (`train.trainer.reduce_loss`): a signal that reaches one rank stops them all after
the same step, with no extra collective.

DataLoader workers ignore these signals: a scheduler signals every process of the job, and a
worker that died on it would fail the step the main process is finishing. Workers still end
with the main process (torch's loader shuts them down, and they watch their parent).
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records a stop signal instead of dying on it, while installed (`with StopRequest() as stop:`)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals only there
            self._previous = {s: signal.signal(s, self._record) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _record(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        return self.received is not None


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: the main process decides when to stop (see the module doc)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
