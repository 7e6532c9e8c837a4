"""Builds specdec's optional CPU kernels (specdec/native/*.c) at install.

Everything else is in pyproject.toml. The kernels need a C compiler with OpenMP (gcc): without
one the install stops with a message saying so; ``SPECDEC_NO_NATIVE=1`` installs without them,
and the engine then runs on its pure-torch reference path. The C file is compiled per function
for the instruction sets it uses (target attributes) and dispatches at run time, so one build
serves every x86-64 CPU; never -march=native.
"""

import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = os.environ.get("SPECDEC_NO_NATIVE", "") in ("", "0") and platform.machine() in (
    "x86_64", "AMD64")


class BuildKernels(build_ext):
    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # compiler missing or failing: say what to do, then stop
            sys.stderr.write(
                f"\nspecdec: could not compile its CPU kernels ({ext.sources[0]}): {e}\n"
                "specdec: install a C compiler with OpenMP (e.g. `apt-get install gcc`), or set "
                "SPECDEC_NO_NATIVE=1 to install without them (the engine then uses its slower "
                "pure-torch reference path).\n\n")
            raise


SOURCES = ("cpu_kernels", "linear", "linear_q8", "attention", "layer", "moe", "suffix",
           "repack")
ext_modules = [Extension(
    "specdec._cpu_kernels", [f"specdec/native/{name}.c" for name in SOURCES],
    depends=["specdec/native/kernels.h"],
    # no contraction of a * b + c into an FMA where the C code does not ask for one: the
    # rounding of every scalar expression is what the source says, on every compiler
    extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=c11"],
    extra_link_args=["-fopenmp"],
)] if NATIVE else []

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildKernels})
