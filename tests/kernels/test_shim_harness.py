"""The CPU shim catches each class of kernel bug once (tests/kernels/seeded/bugs.cu), and the
launcher checks arguments as strictly as a RawKernel call needs."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from .shim.launcher import ShimError, ShimModule
from .shim.sanitize import sanitized_python

BUGS = Path(__file__).parent / "seeded" / "bugs.cu"


@pytest.fixture(scope="module")
def bugs():
    return ShimModule(BUGS, sanitize="")


def launch(bugs, name, mode, grid, block, args, shared_mem=0):
    previous = os.environ.get("EMBER_SHIM_MODE")
    os.environ["EMBER_SHIM_MODE"] = mode
    try:
        bugs.get_function(name)(grid, block, args, shared_mem=shared_mem)
    finally:
        os.environ.pop("EMBER_SHIM_MODE") if previous is None else os.environ.update(EMBER_SHIM_MODE=previous)


def test_missing_sync_is_caught_by_running_both_thread_orders(bugs):
    expected = np.concatenate([[0], np.arange(63) + 7.0, [0], np.arange(63) + 1007.0]).astype(np.float32)
    results = {}
    for mode in ("fibers", "fibers-reverse"):
        for name in ("missing_sync", "fixed_sync"):
            out = np.full(128, -1.0, np.float32)
            launch(bugs, name, mode, (2,), (64,), (out, np.float32(7)))
            results[name, mode] = np.array_equal(out, expected)
    assert results["fixed_sync", "fibers"] and results["fixed_sync", "fibers-reverse"]
    assert results["missing_sync", "fibers"], "forward order alone hides the bug"
    assert not results["missing_sync", "fibers-reverse"], "reverse order exposes it"


@pytest.mark.parametrize("mode", ["fibers", "fibers-reverse", "threads"])
@pytest.mark.parametrize("name,message", [
    ("divergent_sync", "divergent __syncthreads"),
    ("divergent_sites", "different barriers"),
    ("shuffle_after_exit", "exited or missing lane"),
    ("deadlock", "deadlock"),
])
def test_rule_violations_are_reported_not_hung(bugs, mode, name, message):
    with pytest.raises(ShimError, match=message):
        launch(bugs, name, mode, (1,), (64,), (np.zeros(64, np.float32),))


@pytest.mark.parametrize("mode", ["fibers", "threads"])
def test_dynamic_shared_memory_is_nan_poisoned(bugs, mode):
    out = np.zeros(64, np.float32)
    launch(bugs, "read_before_write", mode, (1,), (64,), (out,), shared_mem=64 * 4)
    assert np.isnan(out[0]) and (out[1:] == 1).all()


def test_launcher_checks_dtypes_and_scalar_widths(bugs):
    fn = bugs.get_function("scale")
    x = np.ones(5, np.float32)
    with pytest.raises(TypeError, match="64-bit"):
        fn((1,), (32,), (x, np.float32(2), 5))
    with pytest.raises(TypeError, match="expected a i32 scalar"):
        fn((1,), (32,), (x, np.float32(2), np.int64(5)))
    with pytest.raises(TypeError, match="expected f32 data"):
        fn((1,), (32,), (x.astype(np.float64), np.float32(2), np.int32(5)))
    with pytest.raises(TypeError, match="takes 3 arguments"):
        fn((1,), (32,), (x, np.float32(2)))
    with pytest.raises(ValueError, match="threads per block"):
        fn((1,), (2048,), (x, np.float32(2), np.int32(5)))
    fn((1,), (32,), (x, np.float32(2), np.int32(5)))
    assert (x == 2).all()


SANITIZER_SCRIPT = """
import numpy as np
from kernels.shim.launcher import ShimModule
bugs = ShimModule({path!r})
if {kind!r} == "address":
    x = np.ones(64, np.float32); out = np.zeros(64, np.float32)
    bugs.get_function("out_of_bounds")((1,), (64,), (out, x, np.int32(64)))
else:
    out = np.zeros(1, np.int32)
    bugs.get_function("racy_count")((1,), (32,), (out, np.int32({use_atomic})))
    assert {use_atomic} == 0 or out[0] == 32
print("finished")
"""


@pytest.mark.parametrize("kind,use_atomic,report", [
    ("address", 0, "heap-buffer-overflow"), ("thread", 0, "data race"), ("thread", 1, None)])
def test_sanitizers_catch_what_fibers_cannot(kind, use_atomic, report):
    runner = sanitized_python(kind)
    if runner is None:
        pytest.skip(f"no Python runs with the {kind} sanitizer runtime here")
    argv, env = runner
    env = dict(env, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), env["PYTHONPATH"]]))
    script = SANITIZER_SCRIPT.format(path=str(BUGS), kind=kind, use_atomic=use_atomic)
    result = subprocess.run([*argv, "-c", script], env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    if report is None:
        assert "ThreadSanitizer" not in result.stderr and "finished" in result.stdout, result.stderr[-2000:]
    else:
        assert report in result.stderr, result.stderr[-2000:]
