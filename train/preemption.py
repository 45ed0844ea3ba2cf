"""Stop on a scheduler's signal or Ctrl-C: finish the step, save, exit cleanly.

Cluster schedulers announce preemption and time limits with a signal before they kill a job:
SLURM sends SIGTERM (`--signal=TERM@120`: two minutes ahead), Kubernetes SIGTERM with a grace
period; SIGUSR1 is the usual user-chosen early warning. While the training loop runs, either
one makes `vlmpack train` finish the step in flight, save a checkpoint and exit 0, so a
requeued job continues with `--resume` from exactly that step. Ctrl-C (SIGINT) does the same
and exits 130 (128 + SIGINT), as an interrupted command does. The ranks agree on the stop
through the step's loss all-reduce (`train.trainer.reduce_loss`): a signal that reaches one
rank stops them all after the same step, with no extra collective. A second signal ends the
process at once with one line and exit status 128 + the signal: a checkpoint being written
then stays an unfinished `step_N.tmp` (removed by the next run), and the previous one, which
a save never touches before the new one is complete, stays the latest.

A scheduler signals every process of the job, DataLoader workers included, and so does Ctrl-C
in a terminal (the whole foreground process group); a worker that died on it would fail the
step being finished. So workers ignore SIGINT and SIGUSR1, and SIGTERM from anyone but their
parent process; the parent's SIGTERM (how torch and multiprocessing end a worker that does not
stop on request) still ends a worker at once, as torch's own worker handler does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from contextlib import contextmanager
from typing import Callable

from shards_schema.errors import signal_exit_code

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPT = signal.SIGINT  # a person's Ctrl-C: the run stops as an interrupted command, not as a preemption


class StopRequest:
    """Records a stop signal instead of dying on it, while installed (`with StopRequest() as stop:`).

    A second signal prints `repeat_line(signal)` (one line on stderr) and ends the process at once
    with status 128 + the signal."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                 repeat_line: Callable[[signal.Signals], str] | None = None):
        self.signals = signals
        self.received: signal.Signals | None = None
        self.repeat_line = repeat_line or (lambda sig: f"{sig.name} again: exiting at once")
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
        if self.received is not None:  # asked twice: stop waiting for the step or the save
            print(self.repeat_line(signal.Signals(signum)), file=sys.stderr, flush=True)
            os._exit(signal_exit_code(signum))  # no cleanup that could wait: the background writer is left as it is
        self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def interrupted(self) -> bool:
        """Ctrl-C rather than a scheduler's notice."""
        return self.received == INTERRUPT


@contextmanager
def stop_signals_blocked():
    """The calling thread's stop signals blocked while the block runs. Processes it forks (the
    DataLoader's workers) start with them blocked, so a job-wide signal that arrives before a
    worker's `ignore_stop_signals` has run stays pending there, to be ignored (or judged by its
    sender) once it has, instead of ending the worker; here it is delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: only the parent's SIGTERM ends the worker (see the module doc).

    Python handlers do not see a signal's sender, so SIGTERM is blocked and a thread takes it
    with `sigwaitinfo`, which does (threads the worker starts later inherit the block)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def end_on_parents_sigterm() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=end_on_parents_sigterm, name="sigterm-from-parent", daemon=True).start()
