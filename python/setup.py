"""Builds the moeforge package with CMake: configures the moeforge tree (MOEFORGE_SOURCE_DIR, default
the directory above this one) for the running interpreter, builds the target
moeforge_python_package and copies the assembled package (Python sources, the _native extension,
bin/moeforge) into the wheel. MOEFORGE_BUILD_DIR reuses a build directory (default: build-pip here);
MOEFORGE_CMAKE_ARGS adds CMake options (e.g. -DMOEFORGE_CUDA=OFF); MOEFORGE_JOBS sets the build
parallelism."""

import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("MOEFORGE_SOURCE_DIR", os.path.dirname(HERE))


def pybind11_cmake_dir():
    try:
        import pybind11

        return pybind11.get_cmake_dir()
    except ImportError:
        return None  # CMake looks for a system pybind11 (Debian's pybind11-dev)


class BuildWithCMake(build_py):
    def run(self):
        if not os.path.isfile(os.path.join(SOURCE, "CMakeLists.txt")):
            sys.exit(f"moeforge: no CMakeLists.txt in {SOURCE} (set MOEFORGE_SOURCE_DIR to the moeforge tree)")
        build = os.environ.get("MOEFORGE_BUILD_DIR", os.path.join(HERE, "build-pip"))
        args = ["-DCMAKE_BUILD_TYPE=Release", "-DMOEFORGE_TESTS=OFF", "-DMOEFORGE_BENCH=OFF", "-DMOEFORGE_PYTHON=ON",
                f"-DMOEFORGE_PYTHON_EXECUTABLE={sys.executable}"]
        if pybind11_cmake_dir():
            args.append(f"-Dpybind11_DIR={pybind11_cmake_dir()}")
        args += shlex.split(os.environ.get("MOEFORGE_CMAKE_ARGS", ""))
        subprocess.check_call(["cmake", "-S", SOURCE, "-B", build] + args)
        jobs = os.environ.get("MOEFORGE_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", build, "--target", "moeforge_python_package", "-j", jobs])
        target = os.path.join(self.build_lib, "moeforge")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(build, "python", "moeforge"), target, symlinks=False)


class BinaryDistribution(Distribution):
    """The wheel holds a compiled extension and binary: a platform wheel, not a pure one."""

    def has_ext_modules(self):
        return True


setup(packages=["moeforge"], cmdclass={"build_py": BuildWithCMake}, distclass=BinaryDistribution,
      package_data={"moeforge": ["*.so", "bin/moeforge"]}, zip_safe=False)
