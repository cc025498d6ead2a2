"""Streams and events: work submitted to a stream runs in order on the stream's own worker
thread, so a zero-pad requested at set_data_handle time need not block the caller (seed 001,
option B; seed 000, option 5)."""

from __future__ import annotations

import queue
import threading

from . import counters


class Event:
    """Completion of one piece of work submitted to a stream."""

    def __init__(self):
        self._done = threading.Event()
        self._error = None

    def wait(self, timeout=None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError("stream work did not finish in time")
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self, error=None):
        self._error = error
        self._done.set()


class Stream:
    """An in-order queue with one worker thread."""

    def __init__(self, name: str = "stream"):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"blockpad-{name}", daemon=True)
        self._worker.start()
        self._last = None

    def submit(self, fn, *args) -> Event:
        event = Event()
        self._last = event
        self._queue.put((counters.carry(fn), args, event))
        return event

    def wait(self) -> None:
        """Block until everything submitted so far has run; re-raise its first error."""
        done = self.submit(lambda: None)
        done.wait()

    def _run(self):
        while True:
            fn, args, event = self._queue.get()
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - delivered to whoever waits on the event
                event._finish(e)
            else:
                event._finish()

    def __repr__(self):
        return f"<blockpad Stream {self.name}>"
