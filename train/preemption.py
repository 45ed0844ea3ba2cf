"""Stop on a scheduler's signal: finish the step, save, exit cleanly.

Cluster schedulers announce preemption and time limits with a signal before they kill a job:
SLURM sends SIGTERM (`--signal=TERM@120`: two minutes ahead), Kubernetes SIGTERM with a grace
period; SIGUSR1 is the usual user-chosen early warning. While the training loop runs, either
one makes `vlmpack train` finish the step in flight, save a checkpoint and exit 0, so a
requeued job continues with `--resume` from exactly that step. The ranks agree on the stop
through the step's loss all-reduce (`train.trainer.reduce_loss`): a signal that reaches one
rank stops them all after the same step, with no extra collective. A second signal acts as
it would without this module (SIGTERM ends the process at once).

A scheduler signals every process of the job, DataLoader workers included, and a worker that
died on it would fail the step being finished. So workers ignore SIGUSR1, and SIGTERM from
anyone but their parent process; the parent's SIGTERM (how torch and multiprocessing end a
worker that does not stop on request) still ends a worker at once, as torch's own worker
handler does.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records a stop signal instead of dying on it, while installed (`with StopRequest() as stop:`)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("training outside the main thread: Python delivers signals only to the main thread, "
                          "so SIGTERM/SIGUSR1 will not save a checkpoint before the process ends", stacklevel=2)
            return self
        self._previous = {s: signal.signal(s, self._record) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _record(self, signum: int, frame) -> None:
        if self.received is not None:  # asked twice: stop waiting for the step
            self.__exit__()
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        return self.received is not None


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: only the parent's SIGTERM ends the worker (see the module doc).

    Python handlers do not see a signal's sender, so SIGTERM is blocked and a thread takes it
    with `sigwaitinfo`, which does (threads the worker starts later inherit the block)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def end_on_parents_sigterm() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=end_on_parents_sigterm, name="sigterm-from-parent", daemon=True).start()
