"""An installed package needs no C compiler: the wheel carries the host kernels prebuilt for the
paths of its architecture (setup.py, ops/host_build.py), and a fresh venv with no compiler on
PATH and an empty kernel cache still generates on this CPU's fast path, with the same tokens as
the source checkout's first-use compile."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember_cupy.ops import _host

REPO = Path(__file__).resolve().parents[1]
PACKAGE_FILES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "ember_cupy", "cpu", "cuda")
PROMPT = "The capital of France is"


def _run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{cmd} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv (seeing this interpreter's dependencies, not its ember_cupy) holding the wheel built
    from a copy of the checkout, with this CPU's best path and `portable` prebuilt."""
    if _host.compiler() is None:
        pytest.skip("no C compiler to build the package's host kernels with")
    pytest.importorskip("wheel", reason="pip wheel --no-build-isolation needs the wheel package")
    root = tmp_path_factory.mktemp("prebuilt")
    source = root / "src"
    source.mkdir()
    for name in PACKAGE_FILES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "prebuilt"))
        else:
            shutil.copy(REPO / name, source / name)
    isas = f"{_host.best_isa()},portable"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
          str(source)], env={**os.environ, "EMBER_PREBUILT_ISAS": isas})
    wheel, = (root / "dist").glob("ember_cupy-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    _run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    home = root / "home"
    (home / "kernels").mkdir(parents=True)
    env = {"PATH": str(venv / "bin"), "HOME": str(home), "EMBER_KERNEL_CACHE": str(home / "kernels"),
           "EMBER_BACKEND": "numpy"}
    return venv, home, env


def _in_venv(installed, *args):
    venv, home, env = installed
    return _run([str(venv / "bin" / args[0]), *args[1:]], env=env, cwd=home)


def test_the_wheel_is_platform_tagged_for_any_python_3(installed):
    venv, home, _ = installed
    wheel, = (home.parent / "dist").glob("*.whl")
    assert wheel.name.startswith("ember_cupy-") and "-py3-none-linux_" in wheel.name, wheel.name


def test_without_a_compiler_the_installed_package_takes_the_fast_path(installed):
    venv, home, _ = installed
    assert not any(shutil.which(cc, path=str(venv / "bin")) for cc in ("cc", "gcc", "clang"))
    info = json.loads(_in_venv(installed, "ember-cupy", "info"))
    host = info["host_kernels"]
    assert host["active"] and host["prebuilt"], host
    assert host["isa"] == _host.best_isa() and host["compiler"] is None, host
    assert str(venv) in host["library"], host
    assert not list((home / "kernels").iterdir()), "nothing is compiled at run time"


def test_the_prebuilt_kernels_generate_the_checkouts_tokens(installed, make_llm):
    from ember_cupy import SamplingParams
    script = ("import json, ember_cupy; from ember_cupy import LLM, SamplingParams\n"
              "assert '/venv/' in ember_cupy.__file__, ember_cupy.__file__\n"
              f"out = LLM().generate([{PROMPT!r}], SamplingParams(max_tokens=12, temperature=0))[0]\n"
              "print(json.dumps(out.outputs[0].token_ids))")
    venv_tokens = json.loads(_in_venv(installed, "python", "-c", script).strip().splitlines()[-1])
    here = make_llm().generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].token_ids
    assert venv_tokens == list(here)


def test_a_prebuilt_library_of_other_sources_is_not_loaded(tmp_path):
    """A checkout edited after the build compiles again instead of loading stale kernels."""
    from ember_cupy.ops import host_build
    if _host.compiler() is None:
        pytest.skip("no C compiler")
    sources = tmp_path / "cpu"
    shutil.copytree(_host.HOST_SOURCE_DIR, sources)
    built, = host_build.prebuild(_host.compiler(), sources, tmp_path / "prebuilt", ("portable",))
    assert host_build.prebuilt_library(sources, "portable", tmp_path / "prebuilt") == built
    assert host_build.prebuilt_library(sources, "avx2", tmp_path / "prebuilt") is None
    with open(sources / "common.h", "a") as f:
        f.write("\n/* edited */\n")
    assert host_build.prebuilt_library(sources, "portable", tmp_path / "prebuilt") is None


def test_a_compiler_without_an_optional_flag_builds_the_library_without_it(tmp_path):
    """GCC < 10 does not know -mavx512bf16: the avx512vnni build is retried without it (the bf16
    prompt path then compiled out) rather than the whole path lost to the avx2 one."""
    from ember_cupy.ops import host_build
    calls = tmp_path / "calls.txt"
    cc = tmp_path / "old-cc"
    cc.write_text(f"""#!/bin/sh
echo "$*" >> {calls}
for arg in "$@"; do [ "$arg" = "-mavx512bf16" ] && {{ echo "unrecognized option '$arg'" >&2; exit 1; }}; done
while [ "$1" != "-o" ]; do shift; done
touch "$2"
""")
    cc.chmod(0o755)
    target = host_build.compile_library(str(cc), "avx512vnni", Path(_host.HOST_SOURCE_DIR),
                                        tmp_path / "lib.so")
    assert target.is_file()
    tries = calls.read_text().splitlines()
    assert [("-mavx512bf16" in t.split(), "-fopenmp" in t.split()) for t in tries] == [(True, True), (True, False),
                                                                                    (False, True)]
