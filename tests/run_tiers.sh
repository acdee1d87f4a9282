#!/usr/bin/env bash
# The test tiers in order, as `make test` runs them (PYTHON: the venv's python).
# 1. the unit tier, stopping at its first failure (and then stopping here);
# 2. parity, deploy and gpu (the gpu tests skip themselves without a CUDA device);
# 3. the mesh tier in 2 parallel workers, a module's tests in one worker, leaving out
#    the modules tests/mesh/conftest.py keeps serial;
# 4. those serial mesh modules, alone.
# Each run prints its 15 slowest tests; pytest's exit code 5 (nothing selected) passes.
# The last line adds up every run: "N passed, N failed, N skipped" (errors count as failed).
set -uo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0

run() {
    "$PYTHON" -m pytest -q --durations=15 "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
    return 0
}

run -x -m unit tests/unit
if [ "$status" -eq 0 ]; then
    run -m "parity or deploy or gpu" tests/parity tests/deploy tests/gpu
    run -m "mesh and not serial" -n 2 --dist loadfile tests/mesh
    run -m "mesh and serial" tests/mesh
fi

# Every run's final summary line ("3 passed, 1 skipped in 2.0s"), added up.
summaries=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$log")
total() { echo "$summaries" | grep -oE "[0-9]+ $1" | awk '{n += $1} END {print n + 0}'; }
echo "$(total passed) passed, $(( $(total failed) + $(total 'errors?') )) failed, $(total skipped) skipped"
exit "$status"
