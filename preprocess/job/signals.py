"""Stopping a job: SIGTERM, SIGINT or SIGHUP ask it to stop at the next row or unit boundary,
keeping committed units (exit 128 + the signal); a worker lost on its own is named by what
ended it."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from shards_schema.errors import EXIT_FAULT, UserError, signal_exit_code

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # a request to stop, not a crash


class Interrupted(UserError):
    """The job was stopped by SIGTERM, SIGINT or SIGHUP; exit status 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}; finished shards are kept: "
                         "re-run the same command to resume")
        self.exit_code = signal_exit_code(signum)


class WorkerLost(UserError):
    """A worker process ended without a result. Stopped by a stop signal sent to it alone: exit
    128 + the signal, like the job's own stop; killed otherwise (SIGKILL: the out-of-memory
    killer, or by hand; a crash): exit 1."""

    exit_code = EXIT_FAULT

    def __init__(self, signum: int | None):
        kept = "finished shards are kept: re-run the same command to resume"
        if signum in STOP_SIGNALS:
            name = signal.Signals(signum).name
            super().__init__(f"a worker process was stopped by {name} (sent to the worker, not to the job); {kept}")
            self.exit_code = signal_exit_code(signum)
        elif signum == signal.SIGKILL:
            super().__init__(f"a worker process ended unexpectedly: killed by SIGKILL (by the system when memory ran "
                             f"out, or by hand); {kept}, with fewer --workers if memory is short")
        elif signum is not None:
            super().__init__(f"a worker process ended unexpectedly: killed by {signal.Signals(signum).name}; {kept}")
        else:
            super().__init__(f"a worker process ended unexpectedly (killed by the system, e.g. out of memory?); {kept}, "
                             "with fewer --workers if memory is short")


def worker_death_signal(exit_codes: list[int | None]) -> int | None:
    """The signal that broke the pool, from its workers' exit codes (-N: killed by signal N).

    When one worker dies the pool ends the others with SIGTERM, so a SIGTERM among other
    deaths is the pool's own doing: any other signal is the cause; SIGTERM only when every
    worker that died got SIGTERM. None when no worker died of a signal."""
    signals = {-code for code in exit_codes if code is not None and code < 0}
    others = signals - {signal.SIGTERM}
    if others:
        return signal.SIGKILL if signal.SIGKILL in others else min(others)
    return signal.SIGTERM if signals else None


@contextmanager
def stop_on_signals():
    """SIGTERM, SIGINT and SIGHUP ask the job to stop: it ends its workers and raises `Interrupted` at
    the next row or unit boundary (`stop_if_asked`), keeping committed units. The handler only
    records the request: an exception raised at an arbitrary point could be taken by a row's
    error handling for that row's failure. A second signal ends the process at once."""
    if threading.current_thread() is not threading.main_thread() or _STOP_REQUEST["held"]:
        yield  # another thread's job, or a block inside one that holds the signals already
        return
    signals = STOP_SIGNALS

    def stop(signum, frame):
        for s in signals:
            signal.signal(s, signal.SIG_DFL)
        _STOP_REQUEST["signal"] = signum

    previous = {s: signal.signal(s, stop) for s in signals}
    _STOP_REQUEST["held"] = True
    try:
        yield
    finally:
        _STOP_REQUEST.update(signal=None, held=False)
        for s, handler in previous.items():
            signal.signal(s, handler)


_STOP_REQUEST: dict = {"signal": None, "held": False}


def stop_if_asked() -> None:
    """Raise `Interrupted` if a stop signal came (see `stop_on_signals`)."""
    if _STOP_REQUEST["signal"] is not None:
        raise Interrupted(_STOP_REQUEST["signal"])
