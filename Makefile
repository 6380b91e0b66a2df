# Newcomer entry points: `make demo` and `make test`. Both install what is missing first.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
ifeq ($(CI),true)
# CI builds the Python package too: a missing pybind11 fails the configure instead of skipping its tests.
CMAKE_FLAGS += -DMOEFORGE_WERROR=ON -DMOEFORGE_PYTHON=ON
endif

.PHONY: deps configure build demo python test test-gpu format format-check clean

deps:
	@bash scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) > $(BUILD).cmake.log 2>&1 || (cat $(BUILD).cmake.log; exit 1)

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# The demo needs the binary alone (no tests, no benchmarks).
demo: configure
	@cmake --build $(BUILD) -j $(JOBS) --target moeforge
	@bash scripts/demo.sh $(BUILD)

# The Python package in $(BUILD)/python (PYTHONPATH=$(BUILD)/python; README, Python).
python: configure
	@cmake --build $(BUILD) -j $(JOBS) --target moeforge_python_package

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-gpu: build
	@cd $(BUILD) && ctest --output-on-failure -L gpu

# C++ and CUDA sources in .clang-format's style; CI checks it (format-check, Debian 12's clang-format 14).
FORMAT_FILES = $(shell find src tests bench -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
format:
	@clang-format -i $(FORMAT_FILES)

format-check: deps
	@clang-format --dry-run -Werror $(FORMAT_FILES)

clean:
	rm -rf $(BUILD) $(BUILD).cmake.log
