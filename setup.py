"""The package build (metadata in setup.cfg): the host kernels are compiled here, for every ISA path
of the machine's architecture, into ember_cupy/ops/prebuilt/, so an installed package needs no C
compiler at run time (ops/host_build.py). An editable install skips this: a source checkout
compiles on first use. EMBER_PREBUILT_ISAS=avx2,portable limits the paths built; a build machine
without a compiler (or one that fails on a path) leaves those paths to the first-use compile."""
import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:                    # setuptools < 70: the wheel package's, when it is there
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

ROOT = Path(__file__).resolve().parent


def _host_build():
    spec = importlib.util.spec_from_file_location("_ember_host_build", ROOT / "ember_cupy" / "ops" / "host_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithHostKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        host_build = _host_build()
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if not cc:
            self.warn("no C compiler: the package carries no host kernels (compiled at first use)")
            return
        wanted = os.environ.get("EMBER_PREBUILT_ISAS")
        isas = tuple(wanted.split(",")) if wanted else host_build.machine_isas()
        out_dir = Path(self.build_lib) / "ember_cupy" / "ops" / "prebuilt"
        built = host_build.prebuild(cc, ROOT / "cpu", out_dir, isas)
        self.announce(f"host kernels prebuilt: {', '.join(p.name for p in built) or 'none'}", level=2)


class BinaryDistribution(Distribution):
    """The wheel holds compiled libraries, so it is tagged for this platform."""

    def has_ext_modules(self):
        return True


def _commands():
    commands = {"build_py": BuildWithHostKernels}
    if bdist_wheel is not None:
        class PlatformWheel(bdist_wheel):
            """Any Python 3 on this platform: the libraries are plain C loaded by ctypes."""

            def get_tag(self):
                return "py3", "none", super().get_tag()[2]
        commands["bdist_wheel"] = PlatformWheel
    return commands


setup(cmdclass=_commands(), distclass=BinaryDistribution)
