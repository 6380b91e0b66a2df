#!/usr/bin/env bash
# Installs what the build needs, idempotently: a C++20 compiler, CMake >= 3.24 and GoogleTest; and for
# the Python package and its tests, Debian's python3 with pybind11, numpy and pytest (apt); in CI,
# clang-format.
# Nothing is installed when everything is already there. The CUDA toolkit is optional: where
# /usr/local/cuda/bin/nvcc exists the CUDA backend is built too.
set -euo pipefail

need=()
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v make >/dev/null 2>&1 || need+=(make)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then need+=(libgtest-dev); fi
# The Python package is built for /usr/bin/python3 (CMakeLists.txt, MOEFORGE_PYTHON_EXECUTABLE).
[ -x /usr/bin/python3 ] || need+=(python3)
[ -f /usr/lib/cmake/pybind11/pybind11Config.cmake ] || need+=(pybind11-dev python3-dev)
/usr/bin/python3 -c "import numpy" >/dev/null 2>&1 || need+=(python3-numpy)
/usr/bin/python3 -c "import pytest" >/dev/null 2>&1 || need+=(python3-pytest)
# CI checks the sources' format (make format-check).
if [ "${CI:-}" = true ]; then command -v clang-format >/dev/null 2>&1 || need+=(clang-format); fi

if [ ${#need[@]} -eq 0 ]; then exit 0; fi
echo "install-deps: installing ${need[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
