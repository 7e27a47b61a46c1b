"""Host memory: the KV pool costs resident memory only for the blocks written, also when the
engine is loaded in a worker thread the way the server loads it (AsyncEngine's factory); what the
load built and dropped is given back to the OS (the engine keeps glibc from trimming its heap)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import asyncio, json
    from ember_cupy import SamplingParams
    from ember_cupy.config import EngineConfig
    from ember_cupy.engine.llm_engine import LLMEngine
    from ember_cupy.server.async_engine import AsyncEngine

    def rss_mib():
        return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024

    async def main():
        before = rss_mib()
        engine = AsyncEngine(factory=lambda: LLMEngine(None, EngineConfig(kv_cache_memory=1 << 30)))
        await engine.start()
        loaded = rss_mib()
        async for _ in engine.generate("Hello there", SamplingParams(max_tokens=4)):
            pass
        pool = sum(k.nbytes + v.nbytes for k, v in engine.engine.runner.kv_caches) / 2**20
        print(json.dumps({"before": before, "loaded": loaded, "served": rss_mib(), "pool": pool}))
        await engine.shutdown()

    asyncio.run(main())
""")


def test_kv_pool_is_not_resident_after_a_threaded_load():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "EMBER_BACKEND": "numpy"})
    assert done.returncode == 0, done.stderr[-2000:]
    mib = json.loads(done.stdout.strip().splitlines()[-1])
    assert mib["pool"] >= 1000   # 60 arrays of ~18 MB: under glibc's largest mmap threshold
    # weights (~92 MiB) and the interpreter's own growth, never the 1 GiB pool
    assert mib["loaded"] - mib["before"] < 350, mib
    assert mib["served"] - mib["before"] < 350, mib


TRIM_PROBE = textwrap.dedent("""
    import ctypes, json
    from ember_cupy import LLM

    def anon_kib():
        return int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0])

    llm = LLM()
    loaded = anon_kib()
    ctypes.CDLL(None).malloc_trim(0)
    print(json.dumps({"freed_by_a_later_trim_kib": loaded - anon_kib()}))
""")


def test_the_heap_that_the_load_freed_is_given_back():
    """Without the engine's own trim after loading, a later malloc_trim frees ~7.9 MB here (the
    tokenizer's build on SmolLM2; 44 MB on Gemma 3)."""
    done = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "EMBER_BACKEND": "numpy"})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["freed_by_a_later_trim_kib"] < 2048, report
