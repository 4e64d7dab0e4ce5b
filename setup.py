"""Builds torchq's native CPU kernels (csrc/) into torchq/_native*.so at install time.

The library is plain C++ with a C ABI (no torch headers), so the build needs only the machine's
C++ compiler and setuptools. Where Python.h is found it is also a CPython extension module with
one function, the per-call entry of the linear (csrc/python_entry.cpp); without Python.h that
file compiles to nothing and calls go through ctypes. The library is optional: without a
compiler the install still succeeds, and torchq runs the pure-PyTorch references
(torchq.native.status() says why).
"""

import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("csrc")
SOURCES = sorted(str(p) for p in CSRC.glob("*.cpp"))
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


class BuildNative(build_ext):
    """Compiles the kernels as a plain shared library and says so in the install log."""

    def get_export_symbols(self, ext):  # PyInit__native is exported by its own attribute (visibility)
        return []

    def build_extension(self, ext):
        print(f"torchq: building native CPU kernels {ext.name} from {len(ext.sources)} sources ({', '.join(ext.sources)})")
        # The build is optional: were it to fail, a library left by an earlier build (an editable
        # install's, in the source tree) would load with the old kernels. Remove it first.
        target = Path(self.get_ext_fullpath(ext.name))
        for old in {target, Path(__file__).resolve().parent / "torchq" / target.name}:
            if old.is_file():
                old.unlink()
                print(f"torchq: removed the earlier build {old}")
        if self._openmp_works():  # parallel ranges on PyTorch's own OpenMP threads (csrc/threadpool.cpp)
            ext.extra_compile_args = [*ext.extra_compile_args, "-fopenmp"]
            ext.extra_link_args = [*ext.extra_link_args, "-fopenmp"]
        else:
            print("torchq: the compiler has no OpenMP; the native kernels use their own thread pool")
        super().build_extension(ext)
        print(f"torchq: built {self.get_ext_fullpath(ext.name)}")

    def _openmp_works(self) -> bool:
        """Whether the compiler builds and links an OpenMP program (gcc: libgomp)."""
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "omp_probe.cpp")
            with open(src, "w") as f:
                f.write("#include <omp.h>\nint main() { int n = 0;\n#pragma omp parallel\n{ n = omp_get_num_threads(); }\nreturn n > 0 ? 0 : 1; }\n")
            try:
                objects = self.compiler.compile([src], output_dir=tmp, extra_postargs=["-fopenmp"])
                self.compiler.link_executable(objects, "omp_probe", output_dir=tmp, extra_postargs=["-fopenmp"])
            except Exception:  # noqa: BLE001 - any failure means: no OpenMP
                return False
        return True


flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-ffp-contract=off", "-Wall", "-Wno-uninitialized", "-Wno-maybe-uninitialized"]
native = Extension(
    "torchq._native",
    sources=SOURCES,
    depends=[str(p) for p in CSRC.glob("*.h")],
    language="c++",
    extra_compile_args=flags,
    extra_link_args=["-pthread"],
    optional=True,  # a failed build warns and installs the pure-PyTorch paths
)

setup(ext_modules=[native] if SOURCES and X86 and sys.platform.startswith("linux") else [], cmdclass={"build_ext": BuildNative})
