"""Worker threads for a request's work before admission (tokenizing, chat templates, grammar
compiles), one pool per kind of work, counting the jobs they hold for backpressure."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable

PREPARE_THREADS = 2   # per kind of work: small texts, large texts, grammar compiles
# Seconds the work before admission (tokenizing, a chat template, a grammar compile) may take,
# its wait for a worker thread included: then the request is refused (408), not left hanging.
DEFAULT_PREPARE_TIMEOUT = 30.0
# What the slow kinds' threads add to their nice value (and of the threads they start: a grammar build's):
# on a machine of few cores their work (megabytes tokenized, grammars compiled) took the CPU from
# the engine's step at the same priority, so every running request slowed with it. At 10 the step
# gets ~90% of a contended core, and slow work still runs whenever the engine leaves a core idle.
SLOW_WORK_NICE = 10


def _lower_priority() -> None:
    """Raise this thread's nice value by SLOW_WORK_NICE (at most 19; Linux: a thread has its own);
    elsewhere nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + SLOW_WORK_NICE))
    except (AttributeError, OSError):
        pass


class PrepareTimeoutError(TimeoutError):
    """A request's work before admission took longer than its prepare timeout."""


class PrepareWorkers:
    """The worker threads of one kind of pre-admission work, counting the jobs they hold: those
    beyond the threads wait, and (`slow` work: large texts, grammar compiles) count as waiting
    requests against max_waiting; small texts take milliseconds, so a burst of them is no load to
    shed.

    A job its caller gives up on (`abandon`: a timeout, a disconnected client) never starts if it
    has not; one already running cannot be stopped, so it goes on counting as a waiting request
    until it really ends: clients are refused (503) rather than queued behind abandoned work, and
    a client that keeps abandoning slow work holds at most the threads, never more."""

    def __init__(self, name: str, slow: bool, threads: int = PREPARE_THREADS):
        self.slow = slow
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name,
                                                           initializer=_lower_priority if slow else None)
        self._lock = threading.Lock()
        self._held = 0
        self._abandon_flags: dict[concurrent.futures.Future, threading.Event] = {}
        self._abandoned_running: set[concurrent.futures.Future] = set()

    @property
    def num_waiting(self) -> int:
        """Jobs that hold up a new one: queued beyond the threads, and abandoned ones still running."""
        with self._lock:
            return max(0, self._held - self.threads) + len(self._abandoned_running)

    def submit(self, job: Callable[[threading.Event], object]) -> concurrent.futures.Future:
        """Run job(abandoned) on a worker thread: `abandoned` is set once its caller gave up, for
        a job that waits on something (a lock) before its costly part, and should then not do it."""
        abandoned = threading.Event()
        with self._lock:
            self._held += 1
            future = self._pool.submit(job, abandoned)
            self._abandon_flags[future] = abandoned
        future.add_done_callback(self._release)   # also when cancelled before it ran
        return future

    async def run(self, job: Callable[[threading.Event], object], timeout: float):
        """job(abandoned) on these threads, awaited for at most `timeout` seconds (its wait for a
        thread included), then PrepareTimeoutError; a caller that gives up (the timeout, a
        cancelled task: its client left) abandons the job."""
        future = self.submit(job)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            self.abandon(future)
            raise PrepareTimeoutError(f"the request's preparation (tokenizing, chat template or grammar "
                                      f"compile) took more than {timeout:g} s") from None
        except asyncio.CancelledError:
            self.abandon(future)
            raise

    def abandon(self, future: concurrent.futures.Future) -> None:
        """Its caller gave up: a job not started never starts; a running one is told so, and
        counted until it ends."""
        if future.cancel():
            return
        with self._lock:
            flag = self._abandon_flags.get(future)
            if flag is not None and not future.done():
                flag.set()
                self._abandoned_running.add(future)

    def _release(self, future) -> None:
        with self._lock:
            self._held -= 1
            self._abandon_flags.pop(future, None)
            self._abandoned_running.discard(future)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
