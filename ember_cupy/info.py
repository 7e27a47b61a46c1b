"""What this process runs on: backend, host-kernel path, and (once loaded) the engine's weights
and memory. Reported by `ember-cupy info`, `GET /version` and the start-up log."""
from __future__ import annotations

import resource
import sys

from ember_cupy.version import __version__


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def host_kernel_info() -> dict:
    from ember_cupy.ops import _host
    library = _host.active()
    info = {"active": library is not None, "cpu_supports": _host.supported_isas(),
            "compiler": _host.compiler()}
    if library is not None:
        info.update(isa=library.isa, threads=library.threads, library=str(library.path),
                    prebuilt=library.prebuilt)
    return info


INVARIANT_ACROSS = ["batch", "prefix_cache", "chunked_prefill", "preemption", "thread_count"]
_FLOAT_GEMMS = "float matrices: cuBLAS's GEMMs round by batch shape"


def determinism_info(engine=None) -> dict:
    """What a request's bits do not depend on here (docs/determinism.md): on the host kernels and
    on the NumPy twins each reduction runs in an order fixed per token (float matrices too:
    ops/linear.py float_matmul); on CUDA the same with --deterministic and quantized matrices
    (cuBLAS rounds by shape)."""
    from ember_cupy.backend import get_backend_name
    from ember_cupy.ops import _host
    model = None if engine is None else engine.runner.model
    if get_backend_name() != "numpy":
        if engine is None or not model.deterministic:
            return {"bit_identical_across": [], "why_not": "without --deterministic the device's decode and "
                    "prefill kernels, and its GEMV and cuBLAS matmuls, round a row differently"}
        if not model.every_matmul_quantized():
            return {"bit_identical_across": [], "why_not": _FLOAT_GEMMS}
        return {"bit_identical_across": INVARIANT_ACROSS[:-1]}
    if _host.active() is None:   # the NumPy twins: OpenBLAS's thread count is not checked
        return {"bit_identical_across": INVARIANT_ACROSS[:-1], "on": "NumPy's OpenBLAS"}
    return {"bit_identical_across": INVARIANT_ACROSS}


def runtime_info(engine=None) -> dict:
    """Facts about the runtime; with an `LLMEngine`, its serving format and memory too."""
    from ember_cupy.backend import get_backend_name
    info = {"version": __version__, "backend": get_backend_name()}
    if info["backend"] == "numpy":
        info["host_kernels"] = host_kernel_info()
    if engine is not None:
        runner = engine.runner
        info.update(quantization=runner.quantization, weight_bytes=runner.model.weight_bytes(),
                    kv_cache_blocks=runner.num_blocks, peak_rss_bytes=peak_rss_bytes(),
                    prompt_activations="bf16" if getattr(runner.model, "prompt_rows_in_bf16", False) else "int8")
    info["determinism"] = determinism_info(engine)
    return info


def describe(engine=None) -> str:
    """One line for the start-up log."""
    info = runtime_info(engine)
    parts = [f"ember-cupy {info['version']}", f"backend {info['backend']}"]
    host = info.get("host_kernels")
    if host is not None:
        parts.append(f"host kernels {host['isa']} x{host['threads']} threads" if host["active"]
                     else "host kernels off (NumPy twins)")
    if engine is not None:
        parts.append(f"weights {info['quantization']} {info['weight_bytes'] / 2**20:.1f} MiB")
        if info["prompt_activations"] == "bf16":
            parts.append("prompt rows in bf16")
        parts.append(f"peak RSS {info['peak_rss_bytes'] / 2**20:.0f} MiB")
    return ", ".join(parts)
