"""The host kernels' thread pool (cpu/threadpool.c) under concurrent callers and across fork():
two Python threads calling kernels at once (two LLM objects in one process, or a user thread
beside a running engine) each get their own right answer; a forked child's first parallel kernel
returns (gunicorn --preload, multiprocessing's fork start method)."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from ember_cupy.ops import _host
from ember_cupy.ops.linear import matmul_q
from ember_cupy.packed_weight import to_kernel_format
from ember_cupy.quant import QuantizedTensor

RUNNABLE = [isa for isa in _host.ISA_FLAGS if isa == "portable" or isa in _host.supported_isas()]
CALLS_PER_THREAD = 300


@pytest.fixture(scope="module", params=RUNNABLE)
def library(request):
    library = _host.load_library(request.param)
    if library.threads < 2:
        library.lib.ember_set_num_threads(4)   # a pool with workers even on a 1-CPU runner
    yield library
    library.lib.ember_set_num_threads(library.threads)


def _q8_weight(rng, rows, cols):
    data = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, QT.Q8_0)
    return to_kernel_format(QuantizedTensor("Q8_0", data, (rows, cols)))


def _problems(seed, count=4):
    """(x, weight) pairs of different shapes, each matmul big enough to run on several threads."""
    rng = np.random.default_rng(seed)
    shapes = [(16, 256, 96), (9, 128, 300), (32, 512, 64), (12, 96, 200)][:count]
    return [(rng.standard_normal((rows, cols)).astype(np.float32), _q8_weight(rng, outputs, cols))
            for rows, cols, outputs in shapes]


def test_two_threads_calling_kernels_at_once_each_get_their_own_result(library):
    per_thread = [_problems(seed) for seed in (1, 2)]
    expected = [[matmul_q(x, w, library) for x, w in problems] for problems in per_thread]   # one caller
    wrong = [0, 0]
    start = threading.Barrier(2)

    def run(index):
        start.wait()
        problems = per_thread[index]
        for call in range(CALLS_PER_THREAD):
            x, weight = problems[call % len(problems)]
            got = matmul_q(x, weight, library)
            wrong[index] += not np.array_equal(got, expected[index][call % len(problems)])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a caller never returned"
    assert wrong == [0, 0], f"wrong results out of {CALLS_PER_THREAD} calls per thread"


def _exit_status_within(pid, seconds):
    """The child's exit code, or None (the child killed) when it runs past `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _fork_and_check(x, weight, expected, library):
    """Fork; the child runs the kernel (a parallel one) three times and exits 0 if right."""
    pid = os.fork()
    if pid == 0:
        try:
            right = all(np.array_equal(matmul_q(x, weight, library), expected) for _ in range(3))
            os._exit(0 if right else 1)
        except BaseException:
            os._exit(2)
    return _exit_status_within(pid, 30)


def test_a_forked_child_runs_parallel_kernels(library):
    x, weight = _problems(3, count=1)[0]
    expected = matmul_q(x, weight, library)      # the parent's pool has its workers running
    assert _fork_and_check(x, weight, expected, library) == 0, "the child hung or got a wrong result"
    np.testing.assert_array_equal(matmul_q(x, weight, library), expected)   # the parent's pool still works


def test_fork_while_another_thread_runs_kernels(library):
    """fork() waits for the job in flight, so the child never inherits a pool in mid-job."""
    x, weight = _problems(4, count=1)[0]
    expected = matmul_q(x, weight, library)
    stop = threading.Event()

    def keep_calling():
        while not stop.is_set():
            matmul_q(x, weight, library)

    caller = threading.Thread(target=keep_calling)
    caller.start()
    try:
        statuses = [_fork_and_check(x, weight, expected, library) for _ in range(10)]
    finally:
        stop.set()
        caller.join(timeout=60)
    assert statuses == [0] * 10



_SLEEPY_POOL = """
import numpy as np
from ember_cupy.ops import _host
from ember_cupy.ops.linear import matmul_q
import tests.test_host_threadpool as t
library = _host.load_library({isa!r})
library.lib.ember_set_num_threads(4)
problems = t._problems(5)
expected = [matmul_q(x, w, library) for x, w in problems]
for call in range(1500):
    x, w = problems[call % len(problems)]
    assert np.array_equal(matmul_q(x, w, library), expected[call % len(problems)]), call
print("ok")
"""


def test_a_caller_and_workers_that_sleep_at_every_wait_lose_no_wakeup(library):
    """EMBER_SPIN_US=0: the caller sleeps at every join until the last worker signals it, and the
    workers between jobs: a lost wakeup is a hang, a missed join a wrong result."""
    code = _SLEEPY_POOL.format(isa=library.isa)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "EMBER_SPIN_US": "0", "PYTHONPATH": repo}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_LATE_WORKER = """
import ctypes, threading
from ember_cupy.ops import _host
library = _host.load_library({isa!r})
library.lib.ember_set_num_threads(2)
caller = threading.get_ident()
jobs = []
run_range = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(
    lambda _ctx, begin, end: jobs[-1].append((threading.get_ident() == caller, begin, end)))
for _ in range(50):
    jobs.append([])
    library.lib.ember_parallel_for(64, run_range, None)
print(repr(jobs))
"""


def test_a_worker_late_to_a_job_leaves_its_range_to_the_caller(library):
    """EMBER_SPIN_US=0: the worker sleeps between jobs, so each job starts before it wakes. Its
    range goes to the caller once the caller's own is done (a thread the OS did not run when the
    job began holds nothing up); with a fixed range per thread the caller always waited for it.
    Every job's ranges cover [0, 64) once."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "EMBER_SPIN_US": "0", "PYTHONPATH": repo}
    done = subprocess.run([sys.executable, "-c", _LATE_WORKER.format(isa=library.isa)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    jobs = eval(done.stdout)    # noqa: S307 (our own child's repr of a list of tuples)
    for ranges in jobs:
        assert sorted((begin, end) for _, begin, end in ranges) == [(0, 32), (32, 64)], ranges
    taken_by_caller = sum((True, 32, 64) in ranges for ranges in jobs)
    assert taken_by_caller >= 1, f"the caller never ran the worker's range in {len(jobs)} jobs"
