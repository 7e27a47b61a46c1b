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

The load level: under load (a server's event loop sharing the cores, other processes, longer
contexts) every step runs slower, but only the sizes the engine keeps running are measured again;
the others kept their quiet start-up times, and a draft that moves a step to one of those sizes
looked cheap (a server with 4 streams measured its 4-token steps at 14 ms against 9.5 at start-up,
still read 8 tokens at 16 ms, and drafted at a loss). So the table also keeps a load level, the
exponential average of measured / start-up time over every step, and each size's estimate moves
with the level since it was measured: estimate = its seconds x (level now / level then). A draft
model's table shares the target's level (LoadLevel): both run on the same cores in the same
thread, and the draft runs only when the gate drafts, so its own steps would seldom tell it.
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


def along(sizes: list[int], key: int, value) -> float:
    """The value at key of a curve known at sizes (sorted; value(size) reads it): its own,
    interpolated between its measured neighbours, or extrapolated along the nearest two."""
    at = bisect.bisect_left(sizes, key)
    if at < len(sizes) and sizes[at] == key:
        return value(key)
    if len(sizes) == 1:
        return value(sizes[0]) * max(1.0, key / sizes[0])
    if 0 < at < len(sizes):
        low, high = sizes[at - 1], sizes[at]
    else:
        low, high = (sizes[0], sizes[1]) if at == 0 else (sizes[-2], sizes[-1])
    slope = (value(high) - value(low)) / (high - low)
    return max(value(low) + slope * (key - low), min(value(size) for size in (low, high)))


class LoadLevel:
    """How much slower steps run now than at start-up: an exponential average of the ratio."""

    def __init__(self):
        self.value = 1.0

    def observe(self, ratio: float) -> None:
        self.value += SMOOTHING * (ratio - self.value)


class StepCosts:
    def __init__(self, level: LoadLevel | None = None):
        self._seconds: dict[int, tuple[float, float]] = {}   # size -> (seconds, load level then)
        self._sizes: list[int] = []                         # the keys of _seconds, sorted
        self._start_up: dict[int, float] = {}               # size -> seconds when calibrated
        self._start_up_sizes: list[int] = []
        self.level = level or LoadLevel()

    def calibrate(self, time_forward, max_tokens: int) -> None:
        """Seed the table: time_forward(n) -> seconds of a forward pass of n tokens, for the
        calibration sizes up to max_tokens (after one pass to warm up); the load level's reference."""
        time_forward(1)
        for size in CALIBRATION_SIZES:
            if size > max(1, max_tokens):
                break
            seconds = time_forward(size)
            if seconds > 0:
                self._start_up[size] = seconds
                self._set(size, seconds)
        self._start_up_sizes = sorted(self._start_up)

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        key = bucket(num_tokens)
        if self._start_up:
            quiet = along(self._start_up_sizes, key, self._start_up.__getitem__)
            self.level.observe(seconds / quiet)
        old = self._estimate(key) if key in self._seconds else None
        self._set(key, seconds if old is None else old + SMOOTHING * (seconds - old))

    @property
    def measured(self) -> bool:
        return bool(self._seconds)

    def seconds(self, num_tokens: int) -> float:
        """The estimated time of a step of num_tokens (> 0) now; needs one measurement at least."""
        return along(self._sizes, bucket(num_tokens), self._estimate)

    def _estimate(self, key: int) -> float:
        seconds, load_then = self._seconds[key]
        return seconds * self.level.value / load_then

    def _set(self, key: int, seconds: float) -> None:
        if key not in self._seconds:
            bisect.insort(self._sizes, key)
        self._seconds[key] = (seconds, self.level.value)
