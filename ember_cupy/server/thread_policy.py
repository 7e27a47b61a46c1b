"""How the server's threads share the CPU and the GIL, set once for the process when a server
starts (as mallopt's policy is by the first engine).

The engine's step thread calls ~100 host kernels a step, each releasing the GIL and taking it
back after. Beside it run threads that hold the GIL in short C calls one after the other (the ids
of a 4 MB text, a large JSON answer built in slices): each time the step thread wants the GIL back
it waits out CPython's switch interval, 5 ms by default, and a 25 ms step took 0.2-0.5 s. At
0.5 ms that wait is bounded by a tenth; the extra switches cost nothing measurable on a step.

`tokenizers` runs even a one-text batch on its own rayon threads, at normal priority: the
server's large texts are tokenized on niced worker threads so that the engine keeps the cores,
and TOKENIZERS_PARALLELISM=false keeps that work on them. A value the user set is kept."""
from __future__ import annotations

import os
import sys

SWITCH_INTERVAL_S = 0.0005


def apply_server_thread_policy() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
