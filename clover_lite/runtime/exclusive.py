"""One generation at a time on an engine, with a bounded wait and a way past an abandoned stream.

A caller may wait at most `wait` seconds for the running generation (EngineBusyError after that). A
stream that its caller stopped advancing for `abandon_after` seconds while someone else waits is taken
over: the waiter runs, and the stale stream raises GenerationError at its next advance instead of touching
the cache again. A stream that is closed or garbage-collected releases the engine at once.
"""

from __future__ import annotations

import threading
import time

from clover_lite.errors import GenerationError


class EngineBusyError(GenerationError):
    """The engine stayed busy with another generation for longer than the caller would wait."""


class Turn:
    """One generation's hold on the engine."""

    def __init__(self, owner: threading.Thread) -> None:
        self.owner = owner
        self.taken_over = False
        self.paused_since: float | None = None  # None while it computes: only a paused stream can be idle


class OneAtATime:
    def __init__(self, abandon_after: float = 60.0) -> None:
        self.abandon_after = abandon_after
        self._cond = threading.Condition()
        self._turn: Turn | None = None

    def acquire(self, wait: float | None = None) -> Turn:
        """Wait (at most `wait` seconds; None: as long as it takes) for the engine and take it."""
        # The thread object, not its id: Python gives a finished thread's id to the next one, which would
        # then be told it is already generating when it meets a paused stream the finished thread left.
        me = threading.current_thread()
        deadline = None if wait is None else time.monotonic() + wait
        with self._cond:
            while self._turn is not None:
                turn = self._turn
                if turn.owner is me:
                    raise GenerationError("this engine is already generating in this thread; finish or close the "
                                          "running stream first")
                idle = 0.0 if turn.paused_since is None else time.monotonic() - turn.paused_since
                if idle >= self.abandon_after:
                    turn.taken_over = True  # its caller stopped advancing it: the engine is ours
                    break
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise EngineBusyError(
                        f"the engine is busy with another generation (waited {wait:g} s); retry later, or pass a "
                        "longer wait= (None waits until it is free)")
                timeout = self.abandon_after - idle
                if deadline is not None:
                    timeout = min(timeout, deadline - now)
                self._cond.wait(max(timeout, 0.001))
            self._turn = Turn(me)
            return self._turn

    def advancing(self, turn: Turn) -> None:
        """Called before each advance of a stream: refuses a stream that was taken over."""
        with self._cond:
            if turn.taken_over:
                raise GenerationError(
                    f"this stream was left unadvanced for over {self.abandon_after:g} s while another caller "
                    "waited, and the engine was given to it; start a new generation")
            turn.paused_since = None

    def paused(self, turn: Turn) -> None:
        """Called when a stream hands an event to its caller: from now on its idle time counts."""
        with self._cond:
            turn.paused_since = time.monotonic()

    def release(self, turn: Turn) -> None:
        with self._cond:
            if self._turn is turn:
                self._turn = None
                self._cond.notify_all()
