"""runtime/exclusive.py's OneAtATime driven directly (mutation round 4): a release wakes a waiter at once, a stream
that resumed computing is not idle, and a taken-over stream's late release does not free its successor's turn."""

import threading

import pytest

from clover_lite.errors import GenerationError
from clover_lite.runtime.exclusive import EngineBusyError, OneAtATime

WAIT = 10.0  # bound on joins: reached only when the behaviour is broken


class SpyCondition(threading.Condition):
    """A Condition that says when someone first waits on it (so a test knows a caller is blocked)."""

    def __init__(self):
        super().__init__()
        self.someone_waits = threading.Event()

    def wait(self, timeout=None):
        self.someone_waits.set()
        return super().wait(timeout)


def acquire_in_a_thread(turns: OneAtATime, wait: float) -> dict:
    """turns.acquire(wait) in a thread of its own: {"turn": ...}, or {"error": ...} for a GenerationError."""
    out = {}

    def take():
        try:
            out["turn"] = turns.acquire(wait)
        except GenerationError as e:
            out["error"] = e
    t = threading.Thread(target=take, daemon=True)
    t.start()
    t.join(WAIT)
    return out


def test_a_release_hands_the_engine_to_a_waiter_without_waiting_out_its_timeout():
    """A caller blocked in acquire (no wait limit, abandon_after 60 s) gets the engine as soon as the holder
    releases it: release wakes waiters rather than leaving them to their timeouts."""
    turns = OneAtATime(abandon_after=60.0)
    spy = SpyCondition()
    turns._cond = spy
    held = turns.acquire()
    turns.advancing(held)
    got = {}
    t = threading.Thread(target=lambda: got.update(turn=turns.acquire(None)), daemon=True)
    t.start()
    assert spy.someone_waits.wait(WAIT)  # the second caller is blocked on the engine
    turns.release(held)
    t.join(WAIT)
    assert not t.is_alive() and got["turn"] is not held and not held.taken_over


def test_a_stream_that_resumed_computing_is_not_idle():
    """A stream paused past abandon_after that its caller then advances again is computing: a waiter cannot
    take it over and gives up after its own `wait` with EngineBusyError, and the stream goes on."""
    turns = OneAtATime(abandon_after=0.01)
    turn = turns.acquire()
    turns.paused(turn)
    threading.Event().wait(0.03)  # idle past abandon_after, but nobody waited yet
    turns.advancing(turn)  # its caller came back: computing again
    out = acquire_in_a_thread(turns, 0.2)
    assert isinstance(out.get("error"), EngineBusyError) and not turn.taken_over
    turns.advancing(turn)  # not refused
    turns.release(turn)


def test_a_taken_over_streams_late_release_keeps_the_new_holders_turn():
    """After a paused stream is taken over, its own release (its caller closing it late) must not free the engine
    the new holder runs on: a third caller still finds it busy, and the stale stream is refused."""
    turns = OneAtATime(abandon_after=0.01)
    stale = turns.acquire()
    turns.paused(stale)
    threading.Event().wait(0.03)
    got, acquired, finish = {}, threading.Event(), threading.Event()

    def holder():  # stays alive while it holds the engine
        got["turn"] = turns.acquire(WAIT)
        acquired.set()
        finish.wait(WAIT)
    holder_thread = threading.Thread(target=holder, daemon=True)
    holder_thread.start()
    assert acquired.wait(WAIT)
    new = got["turn"]
    assert stale.taken_over and new is not stale
    turns.advancing(new)  # the new holder computes
    turns.release(stale)  # the stale stream is closed late
    out = acquire_in_a_thread(turns, 0.05)
    assert isinstance(out.get("error"), EngineBusyError), "the engine was handed out while its holder was computing"
    with pytest.raises(GenerationError, match="left unadvanced"):
        turns.advancing(stale)
    turns.release(new)
    finish.set()
    holder_thread.join(WAIT)
    assert turns.acquire(0) is not new  # free again once its real holder releases


def test_a_new_thread_is_not_taken_for_a_finished_one_that_left_a_paused_stream():
    """A thread starts a stream, leaves it paused and ends; Python often gives the next thread the same id. The
    next thread must wait like any other caller (EngineBusyError after its wait), not be told it is "already
    generating in this thread" (the owner was a thread id: 45 of 50 tries failed so)."""
    def starter(turns, left):
        left["turn"] = turns.acquire()
        turns.paused(left["turn"])

    for _ in range(20):
        turns, left = OneAtATime(abandon_after=WAIT), {}
        first = threading.Thread(target=starter, args=(turns, left))
        first.start()
        first.join(WAIT)
        out = acquire_in_a_thread(turns, 0.01)  # after the first thread ended
        assert isinstance(out.get("error"), EngineBusyError), out
        turns.release(left["turn"])
