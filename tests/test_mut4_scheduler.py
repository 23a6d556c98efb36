"""serve/scheduler.py driven directly (mutation round 4): one worker, a FIFO queue of at most max_queue waiting
jobs, QueueFull's Retry-After from the recent mean generation time, cancellation, shutdown. Jobs' work blocks on
events the test sets, so every state is reached without sleeps; a fake clock gives generation times."""

import asyncio
import threading
import time

import pytest

from clover_lite.serve import scheduler as sched_mod
from clover_lite.serve.scheduler import DONE, ERROR, Job, QueueFull, Scheduler, ShuttingDown

WAIT = 10.0  # upper bound on any wait; reached only when the behaviour is broken


class Gate:
    """A job's work that says when it started and returns only when let go (or when its job is cancelled)."""

    def __init__(self, log: list, name: str, result=None):
        self.log, self.name, self.result = log, name, result
        self.started, self.go = threading.Event(), threading.Event()
        self.saw_cancel = False

    def __call__(self, job):
        self.log.append(self.name)
        self.started.set()
        deadline = time.monotonic() + WAIT
        while not self.go.is_set() and time.monotonic() < deadline:
            if job.cancelled:
                self.saw_cancel = True
                return None
            self.go.wait(0.005)
        return self.result


async def take(job):
    return await asyncio.wait_for(job.items.get(), WAIT)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_the_queue_holds_max_queue_jobs_and_serves_them_in_arrival_order():
    """With one job running and max_queue=2: two more wait, a third is refused at once (QueueFull, counted
    as refused, naming the 2 waiting); the waiting ones then run first come, first served."""
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(max_queue=2)
        log = []
        gates = {n: Gate(log, n, result=n) for n in "abc"}
        jobs = {n: Job(gates[n], loop, n) for n in "abc"}
        s.submit(jobs["a"])
        assert await asyncio.to_thread(gates["a"].started.wait, WAIT)
        s.submit(jobs["b"])
        s.submit(jobs["c"])
        with pytest.raises(QueueFull) as err:
            s.submit(Job(Gate(log, "d"), loop, "d"))
        assert err.value.waiting == 2 and err.value.retry_after >= 1
        st = s.status()
        assert st["busy"] and st["waiting"] == 2 and st["refused"] == 1 and st["max_queue"] == 2
        for g in gates.values():
            g.go.set()
        got = [await take(jobs[n]) for n in "abc"]
        assert got == [(DONE, "a"), (DONE, "b"), (DONE, "c")]
        assert log == ["a", "b", "c"]
        assert s.close(WAIT)
        assert s.status()["served"] == 3 and s.status()["refused"] == 1

    run(main())


def test_max_queue_zero_serves_an_idle_engine_and_refuses_only_while_busy():
    """max_queue=0 means nothing waits: a request to an idle server runs, one while a job runs is refused."""
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(max_queue=0)
        g = Gate([], "a", result=1)
        job = Job(g, loop)
        s.submit(job)  # idle: accepted
        assert await asyncio.to_thread(g.started.wait, WAIT)
        with pytest.raises(QueueFull):
            s.submit(Job(Gate([], "b"), loop))
        g.go.set()
        assert await take(job) == (DONE, 1)
        assert s.close(WAIT)
        assert s.status()["busy"] is False  # the finished job no longer counts as running

    run(main())


def test_retry_after_is_the_mean_generation_time_times_the_jobs_ahead(monkeypatch):
    """Two finished jobs took 6 s and 8 s (a fake clock): mean 7 s; with one job running and one waiting (max_queue
    1), a refused request is told ceil(7 * (1 waiting + 1)) = 14 s."""
    now = [1000.0]
    monkeypatch.setattr(sched_mod, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))

    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(max_queue=1)
        for took in (6.0, 8.0):
            def work(job, took=took):
                now[0] += took
                return took
            job = Job(work, loop)
            s.submit(job)
            assert await take(job) == (DONE, took)
        g = Gate([], "run")
        running = Job(g, loop)
        s.submit(running)
        assert await asyncio.to_thread(g.started.wait, WAIT)  # so both earlier durations are recorded
        s.submit(Job(lambda job: None, loop))
        with pytest.raises(QueueFull) as err:
            s.submit(Job(lambda job: None, loop))
        assert err.value.retry_after == 14
        g.go.set()
        assert s.close(WAIT)

    run(main())


def test_a_job_cancelled_while_waiting_never_runs_and_one_cancelled_running_counts_cancelled():
    """A waiting job whose client left is skipped (its work never runs; it ends DONE with None) and counted
    cancelled; a running job cancelled mid-work also counts as cancelled, not served."""
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(max_queue=4)
        log = []
        first, second = Gate(log, "first"), Gate(log, "second")
        j1, j2 = Job(first, loop), Job(second, loop)
        s.submit(j1)
        assert await asyncio.to_thread(first.started.wait, WAIT)
        s.submit(j2)
        j2.cancel()
        j1.cancel()
        assert await take(j1) == (DONE, None) and first.saw_cancel
        assert await take(j2) == (DONE, None)
        assert log == ["first"]  # the cancelled waiting job's work never ran
        assert s.close(WAIT)
        st = s.status()
        assert st["cancelled"] == 2 and st["served"] == 0 and st["failed"] == 0

    run(main())


def test_shutdown_refuses_the_waiting_jobs_and_new_ones_and_lets_the_running_one_finish():
    """begin_shutdown: each waiting job gets ShuttingDown (its work never runs), a new submit raises
    ShuttingDown, and the running job still completes with its result."""
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(max_queue=4)
        log = []
        g = Gate(log, "running", result="finished")
        running, waiting = Job(g, loop), Job(Gate(log, "waiting"), loop)
        s.submit(running)
        assert await asyncio.to_thread(g.started.wait, WAIT)
        s.submit(waiting)
        s.begin_shutdown()
        kind, err = await take(waiting)
        assert kind == ERROR and isinstance(err, ShuttingDown)
        with pytest.raises(ShuttingDown):
            s.submit(Job(lambda job: None, loop))
        g.go.set()
        assert await take(running) == (DONE, "finished")
        assert s.close(WAIT)
        assert log == ["running"]

    run(main())


def test_close_cancels_a_running_job_that_outlasts_its_timeout():
    """close(timeout): a job still running when the timeout passes is cancelled, so the worker ends and close
    returns True (the job saw the cancellation and stopped)."""
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(max_queue=1)
        g = Gate([], "long")
        job = Job(g, loop)
        s.submit(job)
        assert await asyncio.to_thread(g.started.wait, WAIT)
        assert await asyncio.to_thread(s.close, 0.05)
        assert g.saw_cancel and not g.go.is_set()
        assert s.status()["cancelled"] == 1

    run(main())


def test_an_error_in_one_job_is_reported_to_it_and_the_next_job_runs():
    """A job whose work raises gets (ERROR, the exception), is counted failed, and the worker serves the next."""
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(max_queue=2)

        def boom(job):
            raise RuntimeError("boom")
        bad, good = Job(boom, loop), Job(lambda job: 42, loop)
        s.submit(bad)
        s.submit(good)
        kind, err = await take(bad)
        assert kind == ERROR and isinstance(err, RuntimeError) and str(err) == "boom"
        assert await take(good) == (DONE, 42)
        assert s.close(WAIT)
        assert s.status()["failed"] == 1 and s.status()["served"] == 1

    run(main())
