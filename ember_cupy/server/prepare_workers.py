"""Worker threads for a request's work before admission (tokenizing, chat templates, grammar
compiles), one pool per kind of work, counting the jobs they hold for backpressure."""
from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

PREPARE_THREADS = 2   # per kind of work: small texts, large texts, grammar compiles


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

    def _release(self, _future) -> None:
        with self._lock:
            self._held -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
