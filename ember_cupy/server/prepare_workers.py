"""Worker threads for a request's work before admission (tokenizing, chat templates, grammar
compiles), one pool per kind of work, counting the jobs they hold for backpressure."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

PREPARE_THREADS = 2   # per kind of work: small texts, large texts, grammar compiles
# Seconds the work before admission (tokenizing, a chat template, a grammar compile) may take,
# its wait for a worker thread included: then the request is refused (408), not left hanging.
DEFAULT_PREPARE_TIMEOUT = 30.0


class PrepareTimeoutError(TimeoutError):
    """A request's work before admission took longer than its prepare timeout."""


class PrepareWorkers:
    """The worker threads of one kind of pre-admission work, counting the jobs they hold: those
    beyond the threads wait, and (`slow` work: large texts, grammar compiles) count as waiting
    requests against max_waiting; small texts take milliseconds, so a burst of them is no load to
    shed. A job keeps counting until it ends, even after its caller gave up on it (a thread
    cannot be stopped)."""

    def __init__(self, name: str, slow: bool, threads: int = PREPARE_THREADS):
        self.slow = slow
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._held = 0

    @property
    def num_queued(self) -> int:
        return max(0, self._held - self.threads)

    def submit(self, job: Callable[[], object]) -> concurrent.futures.Future:
        with self._lock:
            self._held += 1
        future = self._pool.submit(job)
        future.add_done_callback(self._release)   # also when cancelled before it ran
        return future

    async def run(self, job: Callable[[], object], timeout: float):
        """job() on these threads, awaited for at most `timeout` seconds (its wait for a thread
        included), then PrepareTimeoutError."""
        future = self.submit(job)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:   # wait_for cancelled the job if it had not started
            raise PrepareTimeoutError(f"the request's preparation (tokenizing, chat template or grammar "
                                      f"compile) took more than {timeout:g} s") from None

    def _release(self, _future) -> None:
        with self._lock:
            self._held -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
