"""How long a step of n tokens takes here: measured, for the speculation gate.

Seeded at start-up by timing forward passes of a few sizes (ModelRunner.time_forward: this
machine, this model, these threads, before any request), then refined online by every real step
(its forward pass and sampling), each measurement moving its size's estimate by an exponential
average, so the table follows the load (other processes, longer contexts). A size never measured
is interpolated between its measured neighbours, or extrapolated along the last two.

Why measured and not a constant: what verification costs is what decides whether it pays, and it
differs by orders of magnitude: on the AMX path 16 rows of a matmul cost little more than one,
while on two cores of a plain AVX2 machine, or past the point where a batch is compute bound,
each row costs its share; a guessed constant is wrong on one of them.
"""
from __future__ import annotations

import bisect

SMOOTHING = 0.2            # weight of a new measurement
CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)   # larger steps: extrapolated, then measured
EXACT_SIZES = 64           # sizes up to this are kept apart; above, geometric buckets
BUCKET_GROWTH = 1.0625


def bucket(num_tokens: int) -> int:
    """The table's key for a step of num_tokens: itself up to EXACT_SIZES, then the lower end of
    its geometric bucket."""
    if num_tokens <= EXACT_SIZES:
        return num_tokens
    size = EXACT_SIZES
    while size * BUCKET_GROWTH < num_tokens:
        size = int(size * BUCKET_GROWTH) + 1
    return size


class StepCosts:
    def __init__(self):
        self._seconds: dict[int, float] = {}

    def calibrate(self, time_forward, max_tokens: int) -> None:
        """Seed the table: time_forward(n) -> seconds of a forward pass of n tokens, for the
        calibration sizes up to max_tokens (after one pass to warm up)."""
        time_forward(1)
        for size in CALIBRATION_SIZES:
            if size > max(1, max_tokens):
                break
            self.record(size, time_forward(size))

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        key = bucket(num_tokens)
        old = self._seconds.get(key)
        self._seconds[key] = seconds if old is None else old + SMOOTHING * (seconds - old)

    @property
    def measured(self) -> bool:
        return bool(self._seconds)

    def seconds(self, num_tokens: int) -> float:
        """The estimated time of a step of num_tokens (> 0); needs one measurement at least."""
        key = bucket(num_tokens)
        if key in self._seconds:
            return self._seconds[key]
        sizes = sorted(self._seconds)
        at = bisect.bisect_left(sizes, key)
        if 0 < at < len(sizes):
            low, high = sizes[at - 1], sizes[at]
        elif len(sizes) == 1:
            return self._seconds[sizes[0]] * max(1.0, key / sizes[0])
        else:   # outside the measured range: along the two nearest sizes
            low, high = (sizes[0], sizes[1]) if at == 0 else (sizes[-2], sizes[-1])
        slope = (self._seconds[high] - self._seconds[low]) / (high - low)
        return max(self._seconds[low] + slope * (key - low), min(self._seconds.values()))
