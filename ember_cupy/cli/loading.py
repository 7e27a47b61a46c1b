"""Loading an engine from the command line: the progress bar, the dtype check before the load,
and a load started in the background."""
from __future__ import annotations

import concurrent.futures
import sys
import threading
import time

from ember_cupy.cli.flags import engine_config


class ProgressBar:
    """A one-line loading bar on stderr: (done, total) callbacks from the loader."""

    def __init__(self, label: str = "Loading model", stream=None, width: int = 30):
        stream = stream or sys.stderr
        self.label, self.stream, self.width = label, stream, width
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self._last_percent = -1

    def __call__(self, done: int, total: int) -> None:
        percent = int(100 * done / total) if total else 100
        if percent == self._last_percent or (not self.tty and percent not in (0, 100)):
            return
        self._last_percent = percent
        filled = self.width * percent // 100
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {percent:3d}% "
                f"({done}/{total}) {time.monotonic() - self.start:.1f}s")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done >= total:
            self.stream.write("\n")
        self.stream.flush()


def check_dtype(args) -> None:
    """A --dtype the backend cannot serve (float16 on NumPy) fails here, before the model loads."""
    from ember_cupy.backend import get_xp
    from ember_cupy.engine.model_runner import resolve_dtype
    resolve_dtype(args.dtype, get_xp())



def load_engine(args, model: str | None = None, progress: bool = True):
    """An LLMEngine of the flags, for `model` (default: --model); the loading bar unless --no-progress."""
    from ember_cupy.engine.llm_engine import LLMEngine
    check_dtype(args)
    bar = ProgressBar() if progress and not args.no_progress else None
    return LLMEngine(model or args.model, engine_config(args), progress=bar)


class BackgroundLoad:
    """load() run from now on a thread of its own, a daemon: a process that fails elsewhere
    meanwhile (its address taken) exits without waiting for it. result() waits for the load and
    returns what it returned, or raises what it raised."""

    def __init__(self, load):
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(load,), name="ember-load", daemon=True).start()

    def _run(self, load) -> None:
        try:
            self._future.set_result(load())
        except BaseException as exc:   # noqa: BLE001 (handed to whoever waits for the engine)
            self._future.set_exception(exc)

    def result(self):
        return self._future.result()
