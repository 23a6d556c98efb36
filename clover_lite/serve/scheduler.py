"""One generation at a time, in arrival order, with a bounded queue.

The engine runs one generation at a time, so the server gives it one worker thread and a FIFO queue of
at most `max_queue` waiting jobs: a request that finds the queue full is refused at once (HTTP 503 with
Retry-After) instead of waiting without bound. A job's work runs in the worker thread and hands its items
(events, then a result or an error) to the request's asyncio queue; a job whose client left is marked
cancelled, and its work stops at the next denoising step, which frees the engine for the next job.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from collections.abc import Callable
from typing import Any

DONE, ERROR, ITEM = "done", "error", "item"


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: {waiting} request(s) already wait for the model")
        self.waiting, self.retry_after = waiting, retry_after


class ShuttingDown(Exception):
    pass


class Job:
    """One request's generation: `work(job)` runs in the worker thread and reports through `emit`."""

    def __init__(self, work: Callable[[Job], Any], loop: asyncio.AbstractEventLoop, label: str = ""):
        self.work = work
        self.label = label
        self.items: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self.cancelled = False  # set from the event loop; read by the worker between steps
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.finished: float | None = None

    @property
    def queue_seconds(self) -> float:
        return (self.started or time.monotonic()) - self.submitted

    def emit(self, kind: str, value: Any = None) -> None:
        """Hand an item to the waiting request (thread-safe; a closed loop means nobody waits any more)."""
        try:
            self._loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))
        except RuntimeError:
            self.cancelled = True

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    def __init__(self, max_queue: int = 16):
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._closing = False
        self._durations: collections.deque[float] = collections.deque(maxlen=20)
        self.counts = {"served": 0, "failed": 0, "cancelled": 0, "refused": 0}
        self.last_cancelled: dict | None = None  # what the last cancelled job had done (see /health)
        self._thread = threading.Thread(target=self._loop, name="clover-engine", daemon=True)
        self._thread.start()

    # ---- requests' side -----------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job`, or raise QueueFull / ShuttingDown at once."""
        with self._cond:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue and (self._running is not None or self._waiting):
                self.counts["refused"] += 1
                raise QueueFull(len(self._waiting), self._retry_after())
            self._waiting.append(job)
            self._cond.notify_all()

    def _retry_after(self) -> int:
        """Seconds until a place is likely free: the recent mean generation time times the jobs ahead."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, math.ceil(mean * (len(self._waiting) + 1)))

    @property
    def closing(self) -> bool:
        """Shutting down: new jobs are refused, and what is still open will be cancelled."""
        return self._closing

    def status(self) -> dict:
        with self._cond:
            return {"busy": self._running is not None, "waiting": len(self._waiting), "max_queue": self.max_queue,
                    **self.counts, "last_cancelled": self.last_cancelled}

    # ---- the worker ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running = job
            job.started = time.monotonic()
            try:
                if job.cancelled:
                    result = None
                else:
                    result = job.work(job)
                kind = "cancelled" if job.cancelled else "served"
                job.emit(DONE, result)
            except BaseException as e:  # reported to its request; the worker goes on with the next job
                kind = "cancelled" if job.cancelled else "failed"
                job.emit(ERROR, e)
            job.finished = time.monotonic()
            with self._cond:
                self.counts[kind] += 1
                self._durations.append(job.finished - job.started)
                self._running = None
                self._cond.notify_all()

    def record_cancel(self, info: dict) -> None:
        with self._cond:
            self.last_cancelled = info

    # ---- shutdown -----------------------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Refuse new jobs and the waiting ones (each gets ShuttingDown); the running one goes on."""
        with self._cond:
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cond.notify_all()
        for job in waiting:
            job.emit(ERROR, ShuttingDown("the server is shutting down; this request was not started"))

    def close(self, timeout: float | None = None) -> bool:
        """Shut down and wait for the worker (the running job cancelled after `timeout`); True if it ended."""
        self.begin_shutdown()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                if self._running is not None:
                    self._running.cancel()
            self._thread.join(5.0)
        return not self._thread.is_alive()
