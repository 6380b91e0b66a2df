#!/usr/bin/env bash
# Installs what the build needs, idempotently: a C++20 compiler, CMake >= 3.24 and GoogleTest.
# Nothing is installed when everything is already there. The CUDA toolkit is optional: where
# /usr/local/cuda/bin/nvcc exists the CUDA backend is built too.
set -euo pipefail

need=()
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v make >/dev/null 2>&1 || need+=(make)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then need+=(libgtest-dev); fi

if [ ${#need[@]} -eq 0 ]; then exit 0; fi
echo "install-deps: installing ${need[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
