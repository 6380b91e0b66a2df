#!/usr/bin/env bash
# ctest's runner of the Python tests: `scripts/run_pytest.sh PYTHON TESTS_DIR [pytest args...]`.
# pytest's exit status 5 means it collected no test at all: a renamed directory, a broken conftest or
# a filter that matches nothing. That is a failure here, said in words, never a silent pass; skipped
# tests (no GPU, no torch) are collected, so they do not trigger it and report their reasons (-rs).
set -uo pipefail
python=$1
tests=$2
shift 2
"$python" -m pytest -q -rs -p no:cacheprovider "$tests" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "run_pytest: pytest collected no test from $tests (exit status 5): failing, since an empty suite tests nothing" >&2
    exit 1
fi
exit "$rc"
